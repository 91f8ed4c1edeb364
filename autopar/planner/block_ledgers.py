"""One block's ledgers and the rest of the model's, for one in-node layout, read off one real plan.

The planner at scale (`autopar/planner/composed_cost.py`) prices thousands of candidates for a model of
a hundred layers on thousands of ranks; planning each is out of reach (a plan of a 405B-wide
model is seconds, not milliseconds). What differs between most candidates is arithmetic the
ledger formulas already state — data parallelism's gradient collectives, ZeRO's shards, a
pipeline's micro-batches and stage depth — while what a block costs under tensor, sequence,
context and expert parallelism is the compiler's to say. So per in-node `Layout` (tp, sp, cp, ep,
recompute) `measure_layout` plans the model cut to its first block (`repeated_blocks.truncated`;
on the mesh of the layout's axes alone, one sequence per rank of the batch-sharding axes, i.e.
`ep` sequences; without the fake-tensor run check, as it is only measured; its trace is the
exported two-block model's less its last block, `trace.reuse_shortened`, which also tells
whether the blocks are a chain) and tells the block (`block`) from the rest (`rest`) on rank 0:

- what the placements state (`_attributed_state`) — parameter and buffer bytes, parameter
  tensors, the collectives (communication ledger entries by phase, axis, kind and bytes per call,
  with their call counts) and the gradient synchronisation per axis in bytes: the block's
  parameters by name, the buffers only its nodes read, the collectives its nodes make
  (`CommEntry.module`), its parameters' share of each gradient bucket;
- what the fake run says — forward and backward op totals (op ledger: calls, FLOPs, bytes,
  matched as a multiset of calls), the bytes autograd saved, the transient — from one run: the
  block's calls told apart in forward by module and in backward by autograd node
  (`fake_run.ops_run(..., block=)`), its saved bytes those its nodes allocated (read off the
  autograd graph, `RankOps.saved`; where a recomputed region saves through hooks, the activation
  ledger's saving run) and, of them, those its attention cores' nodes allocated (the most
  selective recomputation can free: `layout_pricer.BlockPricer.cannot_fit`); the rest is the run
  less the block;
- `first_params`: the rest's parameters that come before the blocks (the embedding; a
  pipeline's first stage holds them, the last stage the rest);
- `boundary_bytes`: the value the block hands on (a pipeline's send per micro-batch);
- for the peak's moments (`autopar/compiler/ledger/peak.py`): the rest's backward working memory (the loss's
  gradient over the vocabulary) and the largest parameter the optimizer updates.

`tests/test_composed_cost.py` checks all of it against the difference of the two-block and
one-block plans (`_difference`, what an earlier version measured, planning and running both) to
the call and the byte. Where something outside the blocks reads each block (the example MoE's
auxiliary loss sums every block's), a block's calls are not all inside it: both plans are made
and run and differenced instead.

The cost of `search` therefore grows with the distinct layouts (one plan and one run each), not
with the layers or the ranks. The batch's first dimension of every tensor input is taken as the
batch.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from autopar.compiler.ledger.activations import recomputed_region_bytes, saved_activations
from autopar.compiler.ledger.fake_run import ops_run, received_rows, saving_run
from autopar.compiler.ledger.memory import _rank_placeholders, build_memory_ledger
from autopar.compiler.ledger.op_cost import OpTotals
from autopar.compiler.ledger.peak import largest_optimized
from autopar.compiler.plan import plan as make_plan
from autopar.compiler.repeated_blocks import truncated
from autopar.compiler.strategies.mixed_precision import Float8Declaration
from autopar.compiler.trace import reuse_shortened, reused_trace, trace_model
from autopar.core.errors import PlanError
from autopar.core.ir import SPEC, local_numel, module_stack
from autopar.core.ops import moe
from autopar.planner.float8_pricing import data_axis_scales, fp8_gathered_weights
from autopar.planner.search_space import Candidate
from autopar.planner.split_backward import split_backward_holds


@dataclass(frozen=True)
class Layout:
    """The part of a candidate that lives inside a node and changes what one block computes."""
    tp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    recompute: str | None = None
    regather: bool = False
    fold_experts: bool = False  # experts over ep × tp (`Candidate.fold_experts`)
    float8: "Float8Declaration | None" = None  # the linears in FP8 (`Candidate.float8`)

    @property
    def degrees(self) -> tuple[tuple[str, int], ...]:
        return tuple((a, n) for a, n in (("cp", self.cp), ("ep", self.ep), ("tp", self.tp)) if n > 1)

    @property
    def mesh_spec(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.degrees) or "dp=1"


@dataclass(frozen=True)
class CommUse:
    phase: str
    axis: str
    kind: str
    logical_bytes: int  # per call
    behind: str = ""  # the compute it is in flight behind (`CommEntry.behind`)


@dataclass
class Part:
    """What a block (or the rest of the model) holds, computes and moves on one rank."""
    param_bytes: int = 0
    param_tensors: int = 0
    buffer_bytes: int = 0
    activation_bytes: int = 0
    transient_bytes: int = 0
    forward: OpTotals = field(default_factory=OpTotals)
    backward: OpTotals = field(default_factory=OpTotals)
    taps: OpTotals = field(default_factory=OpTotals)  # of backward's calls, the weight-gradient taps'
    comm: Counter = field(default_factory=Counter)  # CommUse -> calls per micro-batch (not gradient sync)
    grad_sync: Counter = field(default_factory=Counter)  # axis -> bytes of gradients synchronised over it
    working_bytes: int = 0  # backward's working memory beyond the saved activations (the rest: the loss's)
    working_weights: int = 0  # of which a parameter's gradient, alive for a moment (does not scale with the batch)
    largest_param: int = 0  # bytes of the largest parameter tensor the optimizer updates
    # of `activation_bytes`, those its attention cores allocated: the most selective recomputation
    # can free (0 where not told apart: `_measured`'s saving run)
    core_activation_bytes: int = 0
    # of `activation_bytes`, those made from the token rows the rank received for its experts
    # (`fake_run.received_rows`): what routing skew grows on the busiest rank (`routing_skew.py`)
    received_activation_bytes: int = 0
    # of `transient_bytes`, what a recomputed region made from received rows saves again in backward
    received_transient_bytes: int = 0
    # per micro-batch from a split backward's B to its W (`split_backward_holds`: the block's as a
    # stage of blocks holds it, the rest's the head's on the last stage); measured for searches
    # with split-backward schedules only
    hold_bytes: int = 0
    # ZeRO-3's FP8-gathered weights (`float8_pricing.fp8_gathered_weights`): "bytes" (compute dtype), "elements"
    fp8_gathered: Counter = field(default_factory=Counter)


@dataclass
class BlockLedgers:
    layout: Layout
    blocks: int  # the model's repeated blocks
    batch: int  # sequences per rank per micro-batch the two plans ran (1: the plans ran `layout.ep`)
    block: Part
    rest: Part
    first_params: int  # bytes of the rest's parameters before the blocks
    first_tensors: int  # and how many tensors they are
    boundary_bytes: int  # per micro-batch, on one rank
    # the block's experts (0: none), how many each token picks, and over how many ranks they are
    # split (the expert-parallel group; 1 without): what routing skew is priced from (`routing_skew.py`)
    experts: int = 0
    top_k: int = 0
    expert_ranks: int = 1


def _blocks_path(model: torch.nn.Module) -> tuple[str, int]:
    lists = [(path, len(m)) for path, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not lists:
        raise PlanError(f"{type(model).__name__} has no list of repeated blocks: the planner at scale prices one "
                        f"block and composes the layers; plan it with autopar.search(..., method='plans')")
    return max(lists, key=lambda item: item[1])


def check_blocks_alike(model: torch.nn.Module) -> None:
    """Refuse a model whose repeated blocks differ: the composed search prices one block for all
    (once per search: `layout_pricer.BlockPricer`)."""
    path, count = _blocks_path(model)
    blocks = list(model.get_submodule(path))
    first = _signature(blocks[0])
    unlike = [index for index, block in enumerate(blocks) if _signature(block) != first]
    if unlike:
        raise PlanError(f"the blocks of {type(model).__name__}.{path} are not all alike: {len(unlike)} of {count} "
                        f"(first: {path}.{unlike[0]}, {type(blocks[unlike[0]]).__name__}) hold other modules or "
                        f"parameters than {path}.0; the planner at scale prices one block and composes the layers, "
                        f"so it would price every block as the first; fix: plan candidates whole with "
                        f"autopar.search(..., method='plans'), or search a model whose blocks are alike")


def _signature(block: torch.nn.Module) -> tuple:
    """What two blocks must share to be priced as one: their modules' types and their parameters'
    names, shapes and dtypes."""
    return (tuple((name, type(module).__name__) for name, module in block.named_modules()),
            tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters()))


def _ops_difference(two: OpTotals, one: OpTotals) -> tuple[OpTotals, OpTotals]:
    """(block, rest): the calls the second block adds, and the one-block plan's calls less those.
    Calls are matched as a multiset of (FLOPs, bytes, dtype)."""
    two_calls, one_calls = Counter(two.per_call), Counter(one.per_call)
    block_calls = two_calls - one_calls
    rest_calls = one_calls - block_calls
    return _totals(block_calls), _totals(rest_calls)


def _totals(calls: Counter) -> OpTotals:
    totals = OpTotals()
    for (flops, nbytes, dtype), count in calls.items():
        for _ in range(count):
            totals.add(flops, nbytes, dtype)
    return totals


def _comm(plan: Any) -> tuple[Counter, Counter]:
    """The rank's collectives by (phase, axis, kind, bytes); gradient synchronisation (bucketed by
    size, not by block) as bytes per axis."""
    ledger, uses, synced = plan.comm, Counter(), Counter()
    for entry in ledger.for_rank(0):
        nbytes = int(ledger.number(entry.logical_bytes))
        if entry.phase == "grad_sync":
            synced[entry.axis] += nbytes * entry.times
        else:
            uses[CommUse(entry.phase, entry.axis, entry.kind, nbytes, entry.behind)] += entry.times
    return uses, synced


def _state(plan: Any) -> Part:
    """What the plan's placements state on rank 0, without a fake run: parameters, buffers, the
    collectives, the gradient synchronisation."""
    memory = build_memory_ledger(plan, rank=0, fake_runs=False)
    categories = {name: int(value) for name, value in memory.by_category().items()}
    tensors = sum(1 for e in memory.entries if e.category == "optimizer state")
    uses, synced = _comm(plan)
    uses.update({CommUse(p, "dp", "all_reduce", n): c for (p, n), c in data_axis_scales(plan).items()})  # FP8's
    return Part(param_bytes=categories["parameters"], param_tensors=tensors, buffer_bytes=categories["model buffers"],
                comm=uses, grad_sync=synced, fp8_gathered=fp8_gathered_weights(plan))


def _attributed_state(plan: Any, block: str) -> tuple[Part, Part]:
    """(block, rest) of what one plan's placements state on rank 0, told apart by name and module:
    the parameters and buffers under `block` (their local bytes; a buffer registered outside the
    blocks is one tensor however many blocks read it), the constants only its nodes read, the
    collectives its nodes make (`CommEntry.module`), and its parameters' share of each gradient
    bucket (their local elements at the bucket's dtype). The same as the difference of the one-
    and two-block plans (`tests/test_composed_cost.py`), with one plan instead of two."""
    whole = _state(plan)
    stages = plan.stages_of_rank(0)

    def inside(path: str) -> bool:
        return path == block or path.startswith(block + ".")

    part = Part()
    numels: dict[str, int] = {}
    for node in _rank_placeholders(plan, stages):
        info = plan.context.placeholders[node.name]
        meta = node.meta[SPEC].tensor_meta
        numel = int(plan.comm.number(local_numel(meta.shape, node.meta[SPEC].placements, plan.mesh.shape)))
        if info.kind == "parameter":
            numels[info.target] = numel
            if node.users and inside(info.target):
                part.param_bytes += numel * meta.dtype.itemsize
                part.param_tensors += int(info.requires_grad)
        elif inside(info.target) if info.kind == "buffer" else (  # a constant: the block's if only it reads it
                node.users and all(any(inside(p) for p in module_stack(user)) for user in node.users)):
            part.buffer_bytes += numel * meta.dtype.itemsize
    for entry in plan.comm.for_rank(0):
        if entry.phase != "grad_sync" and inside(entry.module):
            part.comm[CommUse(entry.phase, entry.axis, entry.kind, int(plan.comm.number(entry.logical_bytes)),
                              entry.behind)] += entry.times
    part.comm.update({CommUse(p, "dp", "all_reduce", n): c for (p, n), c in data_axis_scales(plan, inside).items()})
    part.fp8_gathered = fp8_gathered_weights(plan, inside)
    for bucket in (b for stage in stages for b in stage.buckets):
        mine = sum(numels[name] for name in bucket.params if inside(name)) * bucket.dtype.itemsize
        for axis in bucket.axes:
            if mine:
                part.grad_sync[axis] += mine
    rest = Part(whole.param_bytes - part.param_bytes, whole.param_tensors - part.param_tensors,
                whole.buffer_bytes - part.buffer_bytes, comm=whole.comm - part.comm,
                grad_sync=whole.grad_sync - part.grad_sync, fp8_gathered=whole.fp8_gathered - part.fp8_gathered)
    return part, rest


def _measured(plan: Any, block: str | None = None) -> tuple[Part, Part | None]:
    """What the plan's fake runs say on rank 0 (activations, the recomputed region's transient,
    the calls, backward's working memory), for the whole rank and, given `block`, for that module
    alone (its calls, `fake_run.ops_run(..., block=)`; the activations its nodes produce, each
    block's output among them)."""
    transient = int(build_memory_ledger(plan, rank=0, activations=False).by_category()["transient"])
    received_transient = 0
    if plan.strategy.recompute is not None:
        inline = saving_run(plan, 0, recompute=False).graph_module.graph
        received_transient = recomputed_region_bytes(plan, rank=0, producers={n.name for n in received_rows(inline)})
    ops = ops_run(plan, 0, block=block)
    if ops.saved is not None:  # read off the ops run's autograd graph: no second forward
        activations, inside, cores, inside_cores, inside_received = ops.saved
        received = inside_received  # a one-block plan: the experts are the block's
    else:  # the plans have no pipeline: one forward's (the cores' share not told apart: no bound)
        saved = saved_activations(plan, rank=0).entries
        rows = {node.name for node in received_rows(saving_run(plan, 0).graph_module.graph)}

        def mine(entry: Any) -> bool:
            return block is not None and (entry.module == block or entry.module.startswith(block + "."))

        activations = sum(e.number for e in saved)
        inside = sum(e.number for e in saved if mine(e))
        received = sum(e.number for e in saved if e.node in rows)
        inside_received = sum(e.number for e in saved if e.node in rows and mine(e))
        cores = inside_cores = 0
    whole = Part(activation_bytes=activations, transient_bytes=transient, core_activation_bytes=cores,
                 forward=ops.forward, backward=ops.backward, taps=ops.taps, working_bytes=ops.working.bytes,
                 working_weights=ops.working.weight_gradients,
                 largest_param=largest_optimized(plan, plan.stages_of_rank(0), "adamw"),
                 received_activation_bytes=received, received_transient_bytes=received_transient)
    if block is None:
        return whole, None
    forward, backward = ops.block
    return whole, Part(activation_bytes=inside, forward=forward, backward=backward, taps=ops.block_taps,
                       core_activation_bytes=inside_cores, received_activation_bytes=inside_received)


def _state_parts(two: Part, one: Part) -> tuple[Part, Part]:
    """(block, rest) of what the placements state: the two plans' difference, and the one-block
    plan less it."""
    block = Part(two.param_bytes - one.param_bytes, two.param_tensors - one.param_tensors,
                 two.buffer_bytes - one.buffer_bytes, comm=two.comm - one.comm, grad_sync=two.grad_sync - one.grad_sync,
                 fp8_gathered=two.fp8_gathered - one.fp8_gathered)
    rest = Part(one.param_bytes - block.param_bytes, one.param_tensors - block.param_tensors,
                one.buffer_bytes - block.buffer_bytes, comm=one.comm - block.comm,
                grad_sync=one.grad_sync - block.grad_sync, fp8_gathered=one.fp8_gathered - block.fp8_gathered)
    return block, rest



def _parts(state: tuple[Part, Part], whole: Part, inside: Part) -> tuple[Part, Part]:
    """(block, rest): the state as given (`_attributed_state`, or the two plans' difference); what
    runs as the block's share of the one-block plan's runs (`inside`), the rest as those runs
    (`whole`) less it."""
    block, rest = state
    return (replace(block, activation_bytes=inside.activation_bytes, forward=inside.forward, backward=inside.backward,
                    taps=inside.taps, largest_param=whole.largest_param,
                    core_activation_bytes=inside.core_activation_bytes,
                    received_activation_bytes=inside.received_activation_bytes),
            replace(rest, activation_bytes=whole.activation_bytes - inside.activation_bytes,
                    core_activation_bytes=whole.core_activation_bytes - inside.core_activation_bytes,
                    received_activation_bytes=whole.received_activation_bytes - inside.received_activation_bytes,
                    transient_bytes=whole.transient_bytes, received_transient_bytes=whole.received_transient_bytes,
                    forward=_less(whole.forward, inside.forward),
                    backward=_less(whole.backward, inside.backward), taps=_less(whole.taps, inside.taps),
                    working_bytes=whole.working_bytes,
                    working_weights=whole.working_weights, largest_param=whole.largest_param))


def _less(whole: OpTotals, block: OpTotals) -> OpTotals:
    """The calls of `whole` less the block's (matched as a multiset of (FLOPs, bytes))."""
    return _totals(Counter(whole.per_call) - Counter(block.per_call))


def _figures(plan: Any) -> Part:
    """Everything `_state` and `_measured` read of one plan, together."""
    state, (whole, _) = _state(plan), _measured(plan)
    return replace(whole, param_bytes=state.param_bytes, param_tensors=state.param_tensors,
                   buffer_bytes=state.buffer_bytes, comm=state.comm, grad_sync=state.grad_sync)


def _difference(two: Part, one: Part) -> tuple[Part, Part]:
    """(block, rest) where both plans ran: what the second block adds, and the one-block plan less it."""
    forward_block, forward_rest = _ops_difference(two.forward, one.forward)
    backward_block, backward_rest = _ops_difference(two.backward, one.backward)
    taps_block, taps_rest = _ops_difference(two.taps, one.taps)
    block, rest = _state_parts(two, one)
    received = two.received_activation_bytes - one.received_activation_bytes
    return (replace(block, activation_bytes=two.activation_bytes - one.activation_bytes,
                    transient_bytes=max(two.transient_bytes - one.transient_bytes, 0), forward=forward_block,
                    backward=backward_block, taps=taps_block, largest_param=two.largest_param,
                    received_activation_bytes=received,
                    received_transient_bytes=max(two.received_transient_bytes - one.received_transient_bytes, 0)),
            replace(rest, activation_bytes=one.activation_bytes - (two.activation_bytes - one.activation_bytes),
                    received_activation_bytes=one.received_activation_bytes - received,
                    transient_bytes=one.transient_bytes, received_transient_bytes=one.received_transient_bytes, forward=forward_rest, backward=backward_rest, taps=taps_rest,
                    working_bytes=one.working_bytes, working_weights=one.working_weights,
                    largest_param=two.largest_param))


def _sliced(values: Sequence[Any], rows: int) -> tuple:
    return tuple(v[:rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for v in values)


def measure_layout(model: torch.nn.Module, layout: Layout, *, example_inputs: Sequence[Any],
                   example_kwargs: dict | None = None, holds: bool = False,
                   fused_attention: bool = False) -> BlockLedgers:
    """The block and rest ledgers of `model` under `layout` (module docstring). `example_inputs`
    hold the global batch; the plans run one sequence per rank of the batch-sharding axes (ep:
    the attention's data parallelism inside an expert-parallel group). `holds`: also what a
    split backward keeps from B to W (`split_backward_holds`; one more fake forward);
    `fused_attention`: attention priced as a fused kernel whatever its head sizes (`Plan.fused_attention`)."""
    path, blocks = _blocks_path(model)
    one, two, chain = layout_plans(model, layout, example_inputs=example_inputs, example_kwargs=example_kwargs,
                                   fused_attention=fused_attention)
    block_path = f"{path}.0"
    if chain:  # the block told apart in the one-block plan: its parameters, collectives, calls, activations
        block, rest = _parts(_attributed_state(one, block_path), *_measured(one, block_path))
    else:  # something outside the blocks reads each block (an auxiliary loss): what the second block adds
        block, rest = _difference(_figures(two), _figures(one))
    if holds:
        block_hold, head_hold = split_backward_holds(one, block_path)
        block, rest = replace(block, hold_bytes=block_hold), replace(rest, hold_bytes=head_hold)
    with truncated(model, path, 1):
        first = _before_blocks(model, path, one)
    return BlockLedgers(layout=layout, blocks=blocks, batch=1, block=block, rest=rest, first_params=sum(first),
                        first_tensors=len(first), boundary_bytes=_boundary_bytes(one, block_path),
                        **_experts(one))


def _experts(plan: Any) -> dict[str, int]:
    """The first experts block's experts, its tokens' picks and the ranks its experts are split over."""
    graph = plan.graph_module.graph
    permute = next((n for n in graph.nodes if n.target is moe.moe_permute), None)
    if permute is None:
        return {}
    unpermute = next((n for n in graph.nodes if n.target is moe.moe_unpermute), None)
    dispatch = next((n for n in graph.nodes if n.target is moe.moe_dispatch), None)
    return {"experts": int(permute.kwargs["num_experts"]),
            "top_k": int(unpermute.kwargs["top_k"]) if unpermute is not None else 0,
            "expert_ranks": plan.mesh.group_size(dispatch.kwargs["group"]) if dispatch is not None else 1}


def layout_plans(model: torch.nn.Module, layout: Layout, *, example_inputs: Sequence[Any],
                 example_kwargs: dict | None = None, both: bool = False,
                 fused_attention: bool = False) -> tuple[Any, Any, bool]:
    """The plans of `model` cut to one block and to two under `layout` (measured only, one sequence
    per rank of the batch-sharding axes), and whether the blocks are a chain: nothing outside them
    reads a block but the next one (`trace.reuse_shortened`: then the one-block trace is the
    two-block one less its last block, and no second export is made). Where they are a chain the
    two-block model is traced but not planned (its plan is None) unless `both`: the one-block plan
    tells its block apart (`_attributed_state`, `_measured`)."""
    path, _ = _blocks_path(model)
    args, kwargs = _layout_inputs(layout, example_inputs, example_kwargs)
    candidate = Candidate(layout.degrees, sequence_parallel=layout.sequence_parallel, recompute=layout.recompute,
                          regather=layout.regather, fold_experts=layout.fold_experts, float8=layout.float8)

    def planned() -> Any:
        made = make_plan(model, layout.mesh_spec, strategies=candidate.strategies(), example_inputs=args,
                         example_kwargs=kwargs, reuse_blocks=False, _measured_only=True)
        if fused_attention:
            made.fuse_attention()
        return made

    chain = traced_blocks(model, layout, example_inputs=example_inputs, example_kwargs=example_kwargs)
    with truncated(model, path, 1):
        one = planned()
    two = None
    if both or not chain:
        with truncated(model, path, 2):
            two = planned()
    return one, two, chain


def _layout_inputs(layout: Layout, example_inputs: Sequence[Any], example_kwargs: dict | None) -> tuple:
    """The inputs a layout's plans run: one sequence per rank of the batch-sharding axes."""
    args = _sliced(example_inputs, layout.ep)
    kwargs = (dict(zip(example_kwargs, _sliced(tuple(example_kwargs.values()), layout.ep)))
              if example_kwargs else None)
    return args, kwargs


def traced_blocks(model: torch.nn.Module, layout: Layout, *, example_inputs: Sequence[Any],
                  example_kwargs: dict | None = None) -> bool:
    """Under `trace.reusing_traces()`: the model cut to two blocks exported (once) on the layout's
    inputs and the one-block trace made from it; whether the blocks are a chain (`layout_plans`).
    The planner calls it before measuring layouts in two processes, so that both share one export."""
    path, _ = _blocks_path(model)
    args, kwargs = _layout_inputs(layout, example_inputs, example_kwargs)
    with truncated(model, path, 2):
        longer = reused_trace(model, args, kwargs, reuse_blocks=False)
        if longer is None:
            trace_model(model, args, kwargs, reuse_blocks=False)
            longer = reused_trace(model, args, kwargs, reuse_blocks=False)
    with truncated(model, path, 1):
        return longer is not None and reuse_shortened(model, args, kwargs, longer, path=path, count=2,
                                                      reuse_blocks=False)


def _before_blocks(model: torch.nn.Module, path: str, plan: Any) -> list[int]:
    """Rank 0's bytes of each parameter registered before the block list (its local shape under
    the plan's placements)."""
    names = [n for n, _ in model.named_parameters()]
    first = next((i for i, n in enumerate(names) if n.startswith(path + ".")), len(names))
    before = set(names[:first])
    return [local for name, local in plan_parameter_bytes(plan).items() if name in before]


def plan_parameter_bytes(plan: Any) -> dict[str, int]:
    """Each parameter's bytes on rank 0 (its local shard under the plan's placements)."""
    result = {}
    for node in plan.program.graph_module.graph.nodes if plan.program.graph_module is not None else ():
        info = plan.context.placeholders.get(node.name) if node.op == "placeholder" else None
        if info is None or info.kind != "parameter" or SPEC not in node.meta:
            continue
        meta = node.meta[SPEC].tensor_meta
        numel = int(local_numel(meta.shape, node.meta[SPEC].placements, plan.mesh.shape))
        result[info.target] = numel * meta.dtype.itemsize
    return result


def _boundary_bytes(plan: Any, block: str) -> int:
    """Rank 0's bytes of the value `block` hands on (the largest output of it that a node outside
    it reads: in a one-block plan what the next block would read)."""
    graph = plan.program.graph_module.graph
    carried = 0
    for node in graph.nodes:
        if block in module_stack(node):
            continue
        for arg in node.all_input_nodes:
            meta = getattr(arg.meta.get(SPEC), "tensor_meta", None)
            if block in module_stack(arg):
                if hasattr(meta, "shape"):
                    carried = max(carried, int(local_numel(meta.shape, arg.meta[SPEC].placements, plan.mesh.shape))
                                  * meta.dtype.itemsize)
    return carried
