"""`plan()`: trace, run the passes, and collect what they decided into a `Plan`.

A Plan needs no process group: it holds the `Program` (the planned graph — placements on every
node, inserted collectives — and its stage graphs), each stage's gradient buckets and ZeRO
units, the communication ledger, builds the memory ledger (`memory`), and can emit any rank's
graph of any of its stages (`rank_graph`), shard a parameter or a global batch for a rank
(`shard`, `local_inputs`), and print the placement table and ledger (`report`). Under pipeline
parallelism the model is traced at one micro-batch (the global batch's first 1/m along the
batch dimension): every shape in the graphs and ledgers is a micro-batch's.

Before tracing, `plan()` refuses what is wrong whatever the model: something other than an
`nn.Module` (`require_module`), a mesh axis no strategy claims or claimed by two that conflict
(`autopar.compiler.strategies.check_axes`). Any exception raised while planning that is not
autopar's own becomes a `PlanError` (`autopar/compiler/planning_errors.py`).
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.fx
from tabulate import tabulate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

from autopar.compiler.check_rank_graphs import check_rank_graphs
from autopar.compiler.context import CompileContext
from autopar.compiler.explain import strategy_summary
from autopar.compiler.ledger.comm import CommLedger, build_comm_ledger
from autopar.compiler.ledger.memory import build_memory_ledger
from autopar.compiler.passes import PassRecord, default_passes, run_passes
from autopar.compiler.passes.emit_rank_graph import emit_rank_graph
from autopar.compiler.passes.insert_grad_reductions import GRAD_SYNC
from autopar.compiler.paused_collection import paused_collection
from autopar.compiler.plan_file import PlanDocument, plan_document
from autopar.compiler.planning_errors import planning_error
from autopar.compiler.strategies import ResolvedStrategy, check_axes, resolve_strategies
from autopar.compiler.strategies.mixed_precision import MixedPrecisionDeclaration
from autopar.compiler.trace import TracedProgram, trace_model
from autopar.core.buckets import Bucket, plan_buckets
from autopar.core.errors import PlanError
from autopar.core.ir import SPEC, local_shape
from autopar.core.mesh import Mesh, release_planning_caches
from autopar.core.program import PipelineLayout, Program, Stage
from autopar.core.shards import shard
from autopar.core.zero_units import ShardUnit

if TYPE_CHECKING:
    from autopar.compiler.ledger.memory import MemoryLedger
    from autopar.compiler.plan_file import PlanDocument


@dataclass
class Plan:
    mesh: Mesh
    strategy: ResolvedStrategy
    traced: TracedProgram
    program: Program
    context: CompileContext
    pass_records: list[PassRecord]
    comm: CommLedger
    # wall seconds of each planning phase (trace, layout search, each pass, ledger, check), in order
    phase_seconds: dict[str, float] = field(default_factory=dict, compare=False)
    _document: "PlanDocument | None" = field(default=None, repr=False, compare=False)
    # the fake runs the activation and op ledgers read, per (rank, stage, device, recompute)
    # (autopar/compiler/ledger/fake_run.py); never encoded
    _fake_runs: dict = field(default_factory=dict, repr=False, compare=False)
    # the planner's ranking when the plan was chosen by `plan(model, cluster=...)` (autopar/planner/search.py)
    search: Any = field(default=None, repr=False, compare=False)
    # the fake runs price attention as an accelerator's fused kernel runs it whatever its head sizes
    # (`ledger/fake_tensors.padded_attention`) and FP8 products as its scaled matmul, not as PyTorch's
    # CPU kernels: set by the planner for a cluster that fuses attention (`Cluster.fuses_attention`)
    fused_attention: bool = field(default=False, repr=False, compare=False)

    def fuse_attention(self) -> None:
        """Price attention as an accelerator's fused kernel from now on (`fused_attention`): the
        fake runs made so far are dropped."""
        self.fused_attention, self._fake_runs = True, {}

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The whole planned graph (all stages): placements and inserted collectives."""
        return self.program.graph_module

    @property
    def stages(self) -> list[Stage]:
        return self.program.stages

    @property
    def pipeline(self) -> PipelineLayout | None:
        return self.program.pipeline

    @property
    def buckets(self) -> list[Bucket]:
        """Every stage's gradient buckets, in stage order."""
        return [bucket for stage in self.stages for bucket in stage.buckets]

    @property
    def units(self) -> list["ShardUnit"]:
        """ZeRO/FSDP units (empty without a sharded-state strategy), by index, over all stages."""
        return self.context.units

    def stages_of_rank(self, rank: int) -> list[Stage]:
        """The stages `rank` runs: one without a pipeline, `virtual_stages` with one."""
        coordinate = self.mesh.coordinate(rank, self.pipeline.axis) if self.pipeline is not None else None
        return self.program.stages_of_rank(coordinate)

    def memory(self, *, rank: int = 0, optimizer: str = "adamw") -> "MemoryLedger":
        """The per-rank memory ledger (autopar.compiler.ledger.memory)."""
        return build_memory_ledger(self, rank=rank, optimizer=optimizer)

    def rank_graph(self, rank: int, groups: dict[str, str] | None = None, *, stage: int | None = None,
                   recompute: bool = True) -> torch.fx.GraphModule:
        """The graph `rank` runs for `stage` (default: the rank's first stage); `recompute=False`
        with the recomputed regions inline."""
        chosen = self.stages[stage] if stage is not None else self.stages_of_rank(rank)[0]
        return emit_rank_graph(chosen.graph_module, self.context, rank=rank, groups=groups, recompute=recompute)

    def placeholder_nodes(self, kind: str) -> list[torch.fx.Node]:
        return [n for n in self.graph_module.graph.nodes
                if n.op == "placeholder" and self.context.placeholders[n.name].kind == kind]

    def parameter_placements(self) -> dict[str, tuple[Placement, ...]]:
        return {self.context.placeholders[n.name].target: n.meta[SPEC].placements
                for n in self.placeholder_nodes("parameter")}

    def grad_sync_axes(self) -> dict[str, tuple[str, ...]]:
        return {self.context.placeholders[n.name].target: tuple(n.meta.get(GRAD_SYNC, ()))
                for n in self.placeholder_nodes("parameter")}

    def local_inputs(self, inputs: Sequence[Any], rank: int) -> list[Any]:
        """A rank's slice of a global batch (flattened user inputs, in order)."""
        nodes = self.placeholder_nodes("input")
        if len(inputs) != len(nodes):
            raise PlanError(f"expected {len(nodes)} inputs (as traced), got {len(inputs)}")
        # cloned: a slice would keep the whole global batch alive (and saved for backward)
        layouts = {axis: self.context.strategy.sequence_layout(axis) for axis in self.mesh.names}
        return [shard(value, node.meta[SPEC].placements, self.mesh, rank, layouts=layouts).clone()
                if isinstance(value, torch.Tensor)
                else value for value, node in zip(inputs, nodes)]

    def document(self) -> "PlanDocument":
        """The plan as data (built once: it runs the activation ledger's fake execution)."""
        if self._document is None:
            data = plan_document(self)
            data["strategy_summary"] = self.strategy_summary()  # saved with the plan, for its report
            self._document = PlanDocument(data)
        return self._document

    def placement_table(self, *, activations: bool = True) -> str:
        return self.document().placement_table(activations=activations)

    def strategy_summary(self) -> str:
        """One line per strategy: parameters sharded / total (counts and bytes), and each module it
        left replicated with the reason (`autopar/compiler/explain.py`)."""
        return strategy_summary(self)

    def report(self, *, activations: bool = True) -> str:
        """The strategy summary, then the rest rendered from the plan's document (a saved and
        reloaded plan reports the same from there on)."""
        document = self.document()
        rest = document.report(activations=activations)
        if rest.startswith("Strategies\n"):  # a document that renders the summary itself
            return rest
        return f"Strategies\n{document.data['strategy_summary']}\n\n{rest}"

    def pass_timings(self) -> str:
        return tabulate([[r.name, f"{r.seconds * 1000:.0f} ms", r.nodes_before, r.nodes_after]
                         for r in self.pass_records], headers=["pass", "time", "nodes in", "nodes out"])


@contextmanager
def _timed(seconds: dict[str, float], phase: str, *, strategies: str = "the declared strategies") -> Iterator[None]:
    """Time `phase`; an exception in it that is not autopar's own becomes a `PlanError` naming it."""
    start = time.perf_counter()
    try:
        yield
    except PlanError:
        raise
    except Exception as error:
        raise planning_error(error, phase=phase, strategies=strategies) from error
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


def _flat(strategies: Sequence[Any]) -> list[Any]:
    return [s for item in strategies for s in (item if isinstance(item, (tuple, list)) else (item,))]


def _named(strategies: Sequence[Any]) -> str:
    return " + ".join(s.name for s in _flat(strategies) if hasattr(s, "name")) or "the declared strategies"


def _declared_param_dtype(strategies: Sequence[Any], mesh: Mesh) -> torch.dtype | None:
    """The mixed-precision compute dtype declared by `mixed_precision()` or by a ZeRO strategy (on an
    axis of size > 1); the two must agree where both are declared."""
    flat = _flat(strategies)
    declared = next((s for s in flat if isinstance(s, MixedPrecisionDeclaration)), None)
    for strategy in flat:
        state = getattr(strategy, "sharded_state", None)
        if state is None or state.param_dtype is None or mesh.size(strategy.axis) == 1:
            continue
        if declared is not None and (declared.param_dtype, declared.reduce_dtype) != (
                state.param_dtype, state.reduce_dtype):
            raise PlanError(f"{strategy.name}(param_dtype={state.param_dtype}, reduce_dtype={state.reduce_dtype}) and "
                            f"mixed_precision(param_dtype={declared.param_dtype}, reduce_dtype="
                            f"{declared.reduce_dtype}) declare different dtypes\n  fix: declare the dtypes once, in "
                            f"mixed_precision() (it applies to ZeRO's units too)")
        return state.param_dtype
    return declared.param_dtype if declared is not None else None


def _declared_pipeline(strategies: Sequence[Any], mesh: Mesh) -> Any:
    """The pipeline declaration (autopar/compiler/strategies/pipeline.py) on an axis of size > 1, if any."""
    for strategy in _flat(strategies):
        declared = getattr(strategy, "pipeline", None)
        if declared is not None and strategy.axis in mesh.names and mesh.size(strategy.axis) > 1:
            return declared
    return None


def _one_microbatch(args: tuple, kwargs: dict, declared: Any) -> tuple[tuple, dict]:
    """The example inputs cut to their first micro-batch: the pipeline traces one micro-batch."""
    dim, count = declared.batch_dim, declared.microbatches
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > dim]
    if not tensors:
        raise PlanError("pipeline parallelism splits the batch into micro-batches, and no input is a tensor with a "
                        f"batch dimension {dim}; fix: pass the batch as tensors, or set batch_dim=")
    batch = tensors[0].shape[dim]
    if batch % count:
        raise PlanError(f"a global batch of {batch} (dimension {dim} of the first input) cannot be split into "
                        f"{count} micro-batches; fix: make the global batch a multiple of microbatches x the "
                        f"data-parallel degree")
    cut = lambda t: t.narrow(dim, 0, batch // count) if (  # noqa: E731
        isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == batch) else t
    return pytree.tree_map(cut, (tuple(args), kwargs))


def _check_microbatch_divides(strategy: ResolvedStrategy, mesh: Mesh, declared: Any, rows: int) -> None:
    """The micro-batch must split over every axis that shards the batch (dp, ZeRO, ...)."""
    placements = strategy.input_placements(0)
    degree = math.prod(mesh.size(axis) for axis, p in zip(mesh.names, placements)
                       if isinstance(p, Shard) and p.dim == declared.batch_dim)
    if rows % degree:
        raise PlanError(f"the global batch gives micro-batches of {rows} rows ({declared.microbatches} micro-batches), "
                        f"which do not split over the {degree} data-parallel ranks; fix: make the global batch a "
                        f"multiple of microbatches x {degree}")


def _stage_buckets(stage: Stage, context: CompileContext, mesh: Mesh, cap_bytes: int) -> list[Bucket]:
    """The stage's gradient buckets."""
    params = []
    for node in stage.graph_module.graph.nodes:
        info = context.placeholders.get(node.name)
        if node.op == "placeholder" and info.kind == "parameter":
            spec = node.meta[SPEC]
            numel = math.prod(local_shape(spec.tensor_meta.shape, spec.placements, mesh.shape))
            params.append((info.target, numel, spec.tensor_meta.dtype, mesh.sync_keys(node.meta.get(GRAD_SYNC, ()))))
    return plan_buckets(params, cap_bytes=cap_bytes)


def _with_param_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """Mixed precision is traced as it runs: a copy whose floating-point parameters are `dtype`
    (buffers keep theirs, as FSDP2's MixedPrecisionPolicy does), so dtype-dependent code such as
    an RMSNorm's `.to(input_dtype)` records the compute dtype."""
    if dtype is None:
        return model
    copy = deepcopy(model)
    for parameter in copy.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
    return copy


def _keep_master_weights(traced: TracedProgram, model: torch.nn.Module) -> dict[str, torch.dtype]:
    """The traced state holds the original (fp32) trainable parameters, the masters the optimizer
    updates (frozen ones stay in the compute dtype: nothing updates them)."""
    originals = dict(model.named_parameters(remove_duplicate=False))
    masters = {}
    for info in traced.placeholders.values():
        if info.kind == "parameter" and info.requires_grad and info.target in originals:
            traced.state[info.target] = originals[info.target].detach()
            masters[info.target] = originals[info.target].dtype
    return masters


def plan(model: torch.nn.Module, mesh: "Mesh | str | dict[str, int] | None" = None, *,
         strategies: Sequence[Any] | None = None, example_inputs: Sequence[Any], example_kwargs: dict | None = None,
         dynamic_dims: dict[str, int] | None = None, ranks_per_node: int | None = None, bucket_cap_mb: float = 25.0,
         explain: bool = False, reuse_blocks: bool = True, backend: str | None = None, _measured_only: bool = False) -> Plan:
    """Plan `model` for `mesh` in this process; no process group is needed. See module docstring.

    `explain=True` also records, for every op DTensor decided, the alternatives it weighed.
    `reuse_blocks=False` exports every repeated block instead of copying the traced one
    (`autopar/compiler/repeated_blocks.py`; the plan is the same, only slower). Letting the planner
    choose the mesh and strategies (`cluster=`) is `autopar.plan` (`autopar/api.py`), which calls
    this with the winner's. `backend="gloo"` (or "nccl") plans as a job on that process
    group's backend would: ZeRO's "auto" reduce and gather kinds resolve as there
    (`comm_kinds.gradient_exchange_kind`, `parameter_gather_kind`; default: the initialised group's
    backend, and without one the reduce-scatter and all-gather).
    (`_measured_only`, internal: the planner's per-layout
    plans, `autopar/planner/block_ledgers.py`, are read for their ledgers and never run, so they skip
    running every rank graph on fake tensors, `check_rank_graphs`; every plan a user gets is
    checked.)"""
    require_module(model)
    if mesh is None or strategies is None:
        raise PlanError("plan needs a mesh and strategies, or neither of them and cluster= to let the planner "
                        "choose (autopar.plan(model, cluster='h100x8', example_inputs=...))")
    mesh = Mesh.parse(mesh, ranks_per_node=ranks_per_node)
    check_axes(mesh, strategies)
    options = dict(example_inputs=example_inputs, example_kwargs=example_kwargs, dynamic_dims=dynamic_dims,
                   bucket_cap_mb=bucket_cap_mb, explain=explain, reuse_blocks=reuse_blocks, backend=backend,
                   measured_only=_measured_only)
    try:
        return _plan(model, mesh, strategies, **options)
    except PlanError as error:
        raise _located(error, model)
    except Exception as error:
        raise planning_error(error, phase="planning", module=type(model).__name__,
                             strategies=_named(strategies)) from error


def _located(error: PlanError, model: torch.nn.Module) -> PlanError:
    """`error`, with a "module:" line naming the whole model where it names no module (a refusal about
    the model as a whole, e.g. no tensor-parallel pattern in it): every refusal says where."""
    if not any(line.strip().startswith("module:") for line in str(error).splitlines()):
        error.args = (f"{error}\n  module: the whole model ({type(model).__name__})", *error.args[1:])
    return error


def require_module(model: Any) -> None:
    """autopar plans an `nn.Module`: its parameters are what the strategies shard."""
    if not isinstance(model, torch.nn.Module):
        what = getattr(model, "__name__", type(model).__name__)
        raise PlanError(f"autopar plans a torch.nn.Module, and {what!r} is a {type(model).__name__}: autopar reads "
                        f"the parameters and submodules of what it is given\n"
                        f"  fix: wrap it in an nn.Module whose forward calls it (parameters as nn.Parameter "
                        f"attributes of the module), and pass that module")


def _plan(model: torch.nn.Module, mesh: Mesh, strategies: Sequence[Any], *, example_inputs: Sequence[Any],
          example_kwargs: dict | None, dynamic_dims: dict[str, int] | None, bucket_cap_mb: float, explain: bool,
          reuse_blocks: bool, backend: str | None, measured_only: bool) -> Plan:
    """`plan()` once its arguments are checked."""
    with paused_collection():  # the cyclic collector would walk every live object again and again
        param_dtype = _declared_param_dtype(strategies, mesh)
        pipelined = _declared_pipeline(strategies, mesh)
        args, kwargs = tuple(example_inputs), example_kwargs or {}
        if pipelined is not None:
            args, kwargs = _one_microbatch(args, kwargs, pipelined)
        seconds: dict[str, float] = {}
        traced = trace_model(_with_param_dtype(model, param_dtype), args, kwargs, dynamic_dims=dynamic_dims,
                             reuse_blocks=reuse_blocks)
        seconds.update(traced.seconds)
        masters = _keep_master_weights(traced, model) if param_dtype is not None else {}
        named = _named(strategies)
        with _timed(seconds, "resolve_strategies", strategies=named):  # binds tensor_parallel() to the graph
            strategy = resolve_strategies(mesh, list(strategies), traced.graph_module, traced.placeholders,
                                          backend=backend)
        if pipelined is not None:
            first = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            _check_microbatch_divides(strategy, mesh, pipelined, first.shape[pipelined.batch_dim])
        context = CompileContext(mesh=mesh, device_mesh=mesh.device_mesh(plan_rank=0), strategy=strategy,
                                 placeholders=traced.placeholders, symbols=traced.symbols, explain=explain,
                                 master_dtypes=masters)
        program, records = run_passes(Program(graph_module=traced.graph_module), context, default_passes())
        seconds.update((record.name, record.seconds) for record in records)
        with _timed(seconds, "comm_ledger", strategies=named):
            for stage in program.stages:
                stage.buckets = _stage_buckets(stage, context, mesh, int(bucket_cap_mb * 2**20))
            comm = build_comm_ledger(program, mesh, traced.symbols, traced.symbol_values)
        planned = Plan(mesh=mesh, strategy=strategy, traced=traced, program=program, context=context,
                       pass_records=records, comm=comm, phase_seconds=seconds)
        if not measured_only:
            with _timed(seconds, "check_rank_graphs", strategies=named):
                check_rank_graphs(planned)  # every accepted plan runs: forward and backward on fake tensors
        release_planning_caches()  # DTensor's caches would keep every planning mesh alive
        return planned
