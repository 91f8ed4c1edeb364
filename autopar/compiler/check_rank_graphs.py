"""Plan-time check that an accepted plan runs: each rank graph, forward and backward, on fake tensors.

A plan can be accepted by every rule and still hold a rank graph that fails when it runs (a
slice along a dimension a tensor does not have, a kernel given an argument it does not take).
`check_rank_graphs(plan)` finds that before any process group exists: it emits, for every
pipeline stage (the whole graph without a pipeline), the rank graphs (`Plan.rank_graph`) of the
first and last rank holding it — ranks differ only in their coordinates (shard indices,
group names, peers), which change no shape, and the two ends hold the extreme indices —
and runs each on fake tensors of the rank's local shapes, built as the activation ledger builds
them (`autopar.compiler.ledger.activations`: same inputs, factory calls moved to the kernels' device,
the traced program's fake mode; a caller's own FakeTensorMode is set aside meanwhile). The collectives in a rank
graph are PyTorch's functional collectives, whose fake kernels only compute shapes: the group
names need not exist. Forward runs node by node (`_CheckedRun`); a node that raises becomes a
`PlanError` naming it, its op, module and source line. Backward then runs from the outputs
(`_check_backward`); each node's output gradient registers a hook, so an error in backward names
the node whose gradient was being computed last. Plans with symbolic sizes (`dynamic_dims`) run
too, at the example's sizes: their rank graphs compute every size from the local inputs
(`autopar/compiler/passes/emit_rank_graph.py`), so the fake inputs of the example's local shapes exercise the same
code the run does at other sizes.

Copied blocks are not run again: the nodes the check runs grow with the distinct blocks, not the
layer count. Where the model's blocks were copied rather than traced (`TracedProgram.copied_blocks`,
`autopar/compiler/repeated_blocks.py`: "model.layers.3-31"), `block_counterparts` pairs each node of a
later block with the node in the same position of the template, the graph's first block from
block 2 on (block 2, or a later pipeline stage's first block). A node belongs to block k when its
module path is `<list>.k` or lies inside it (the nodes `insert_collectives`,
`insert_grad_reductions` and `emit_rank_graph` add carry the path of the node they serve), or,
for what `shard_parameters` adds without one (a unit's gather, its items, boundaries and
release), when its ZeRO unit is that block; a pipeline stage's sends and receives belong to no
block (they carry the path of the block whose output they move). A node of a copied block whose
call matches its counterpart's (`_call_key`: the same target, equal non-tensor arguments, tensor
arguments of the same shape, stride, storage offset, dtype, device and requires_grad, aliased
alike, read from the fake values in the interpreter's env) is not run: it gets the counterpart's
result. Why that cannot hide a failure:
- Forward. Under FakeTensorMode an ATen kernel's result, and whether it raises, depend on the op,
  its non-tensor arguments and its tensors' metadata, never on data, which fake tensors do not
  have; the Python-level calls of a rank graph (autopar's collectives and local kernels) are made
  of such ops and read nothing but their arguments. The key compares exactly those, so the node
  would have returned what its counterpart returned, up to identity. `UnitCalls`' planning
  stand-ins also read their unit, named by index (`unit=k`, different in every block): that
  argument is compared as what they read of the unit (`_unit_layout`: parameter shapes and shard
  rows, dtypes, axis, flags; not its index, name or parameter names). An argument the key cannot
  compare (a SymInt, an object) makes the node run. A graph whose copies mutate an argument (an
  op whose schema writes) reuses nothing: a copy reads its counterpart's values, and the mutation
  would land on those.
- Backward. A skipped node's backward would be its counterpart's derivative formulas applied to
  saved tensors of the same metadata and to an output gradient of the same shape and dtype
  (autograd refuses or casts any other, `validate_outputs`). The template's backward runs (the
  last copy's output is the template's, so the loss reaches it) on gradients that can differ from
  a copy's only in their strides, which autograd does not fix: a derivative that failed for some
  layouts of its incoming gradient only could pass in the template and fail in a copy. That no
  derivative in a copied block depends on its gradient's layout is the one assumption reuse
  adds (a view, the usual such case, is a reshape in a rank graph).
- Difference. A node of a copied block that runs (its key differs, or it has no counterpart) makes
  its result fresh, and so is every result computed from a fresh value; a node that reads a fresh
  value always runs. So a copy that differs runs from the first differing node on, forward, and
  backward (its outputs reach the loss through run nodes only), as without reuse.
`CheckedGraph` counts what ran (`tests/test_check_rank_graphs.py`: the counts do not grow with the
layer count; an altered copy is run and its failure caught).
"""
from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils import _pytree as pytree

from autopar.compiler.ledger.fake_tensors import fake_inputs, kernel_device, on_device, traced_mode
from autopar.compiler.passes.shard_parameters import ZERO_UNIT
from autopar.compiler.repeated_blocks import TRACED
from autopar.core.errors import PlanError
from autopar.core.ir import module_stack
from autopar.core.ops.p2p import PLANNING_STAND_INS
from autopar.core.ops.sharded_state import unit_call
from autopar.core.zero_units import ShardUnit

if TYPE_CHECKING:
    from autopar.compiler.plan import Plan

_FIX = ("this is a bug in the rule or lowering that placed the node (autopar.compiler.rules.op_rules / autopar.core.ops.local_ops); "
        "keep the tensors it touches replicated (declare a layout without them) until it is fixed")
_CALLS = ("call_function", "call_method", "call_module")
_PLAIN = (int, float, bool, str, type(None), slice, torch.Size, torch.dtype, torch.device, torch.layout,
          torch.memory_format)
_PIPELINE_P2P = {*PLANNING_STAND_INS, *PLANNING_STAND_INS.values()}
_COPIED = re.compile(r"^(?P<path>.+)\.(?P<first>\d+)-(?P<last>\d+)$")


@dataclasses.dataclass(frozen=True)
class CheckedGraph:
    """What the check did with one rank graph: call nodes run, call nodes given their template
    counterpart's result, nodes whose output gradient arrived in backward."""

    rank: int
    stage: int
    executed: int
    reused: int
    backward: int


def _block_of(node: torch.fx.Node, blocks: re.Pattern, unit_names: dict[int, str]) -> int | None:
    for path in module_stack(node):
        match = blocks.match(path)
        if match:
            return int(match.group(1))
    unit = node.meta.get(ZERO_UNIT)
    if unit is None and unit_call(node.target) is not None:
        unit = node.kwargs.get("unit")
    match = blocks.match(unit_names.get(unit, "")) if unit is not None else None
    return int(match.group(1)) if match else None


def block_counterparts(gm: torch.fx.GraphModule, copied_blocks: str, unit_names: dict[int, str]
                       ) -> dict[torch.fx.Node, torch.fx.Node | None]:
    """Each call node of a copied block -> the node in the same position of the template block,
    None past the template's length (module docstring)."""
    copied = _COPIED.match(copied_blocks)
    if copied is None:
        return {}
    blocks = re.compile(rf"^{re.escape(copied['path'])}\.(\d+)(?=\.|$)")
    members: dict[int, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in _CALLS and node.target not in _PIPELINE_P2P:
            block = _block_of(node, blocks, unit_names)
            if block is not None and block >= TRACED - 1:
                members.setdefault(block, []).append(node)
    if not members:
        return {}
    first, *later = sorted(members)
    if any(_mutates(node) for block in later for node in members[block]):
        return {}
    template = members[first]
    return {node: (template[i] if i < len(template) else None) for block in later
            for i, node in enumerate(members[block])}


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _unit_layout(unit: ShardUnit) -> ShardUnit:
    """What a `UnitCalls` stand-in reads of a unit: everything but its index, name and parameter names."""
    params = tuple(dataclasses.replace(p, fqn="", placeholder="") for p in unit.params)
    return dataclasses.replace(unit, index=0, name="", params=params)


def _call_key(node: torch.fx.Node, args: tuple, kwargs: dict) -> tuple | None:
    """What a fake kernel's result depends on (module docstring); None where the node must run."""
    if "unit" in kwargs and unit_call(node.target) is not None:
        kwargs = dict(kwargs, unit=_unit_layout(node.target.__self__.units[kwargs["unit"]]))
    key: list[Any] = [node.op, node.target]
    return tuple(key) if _append_key((args, kwargs), key, {}) else None


def _append_key(value: Any, key: list, first_seen: dict[int, int]) -> bool:
    """`value`'s part of a call key appended to `key` (containers by type and length, tensors by
    metadata and first position among the arguments); False where it cannot be compared. Loops,
    not generators: it runs for every call node of every copied block."""
    if isinstance(value, torch.Tensor):
        key.append((type(value), value.shape, value.stride(), value.storage_offset(), value.dtype, value.device,
                    value.requires_grad, first_seen.setdefault(id(value), len(first_seen))))
        return True
    if isinstance(value, (tuple, list)):
        key.append((type(value), len(value)))
        for item in value:
            if not _append_key(item, key, first_seen):
                return False
        return True
    if isinstance(value, dict):
        key.append((type(value), tuple(value)))
        for item in value.values():
            if not _append_key(item, key, first_seen):
                return False
        return True
    if type(value) in _PLAIN or isinstance(value, ShardUnit):
        key.append((type(value), value))
        return True
    return False


class _CheckedRun(torch.fx.Interpreter):
    """Runs a rank graph node by node; a failing node is a PlanError; output gradients are
    watched; a copied block's node whose call matches its counterpart's gets its result."""

    def __init__(self, gm: torch.fx.GraphModule, rank: int,
                 counterparts: dict[torch.fx.Node, torch.fx.Node | None] | None = None) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # the PlanError names the node already
        self.rank = rank
        self.last_backward: torch.fx.Node | None = None
        self.counterparts = counterparts or {}
        self.templates = {node for node in self.counterparts.values() if node is not None}
        self.recorded: dict[torch.fx.Node, tuple[tuple | None, Any]] = {}  # template node -> (key, result)
        self.fresh: set[torch.fx.Node] = set()
        self.executed, self.reused = 0, 0
        self.arrived: set[torch.fx.Node] = set()

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op not in _CALLS:
            return super().run_node(node)
        reads_fresh = any(i in self.fresh for i in node.all_input_nodes)
        with self._set_current_node(node):
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            counterpart = self.counterparts.get(node)
            if counterpart in self.recorded and not reads_fresh:
                key, result = self.recorded[counterpart]
                if key is not None and key == _call_key(node, args, kwargs):
                    self.reused += 1
                    return result
            result = self._call(node, args, kwargs)
        if node in self.templates:
            self.recorded[node] = (_call_key(node, args, kwargs), result)
        if node in self.counterparts or reads_fresh:
            self.fresh.add(node)
        return result

    def _call(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        self.executed += 1
        try:
            result = getattr(self, node.op)(node.target, args, kwargs)
        except PlanError:
            raise
        except Exception as error:
            raise PlanError.at(node, f"rank {self.rank}'s graph fails on fake tensors of its local shapes (forward): "
                                     f"{type(error).__name__}: {_first_line(error)}", fix=_FIX) from error
        for value in pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(lambda grad, node=node: self._arrived(node))
        return result

    def _arrived(self, node: torch.fx.Node) -> None:
        self.last_backward = node
        self.arrived.add(node)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _check_backward(run: _CheckedRun, outputs: Any) -> None:
    roots = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not roots:
        return
    try:
        torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
    except Exception as error:
        node = run.last_backward
        message = (f"rank {run.rank}'s graph fails on fake tensors of its local shapes (backward): "
                   f"{type(error).__name__}: {_first_line(error)}")
        if node is None:
            raise PlanError(f"{message}\n  fix: {_FIX}") from error
        raise PlanError.at(node, message + " (in the backward of this node or the next one back)", fix=_FIX) from error


def check_rank_graph(plan: "Plan", rank: int, *, stage: int | None = None) -> CheckedGraph:
    """Run `rank`'s graph of `stage` (default: its first) forward and backward on fake tensors;
    PlanError naming the failing node."""
    chosen = plan.stages[stage] if stage is not None else plan.stages_of_rank(rank)[0]
    device = kernel_device(plan, None)
    gm = on_device(plan.rank_graph(rank, stage=chosen.index), device)
    unit_names = {unit.index: unit.name for unit in plan.context.units}
    mode = traced_mode(plan)
    inputs = fake_inputs(plan, chosen.graph_module.graph, mode, device)
    run = _CheckedRun(gm, rank, block_counterparts(gm, plan.traced.copied_blocks, unit_names))
    with mode, torch.enable_grad():
        outputs = run.run(*inputs)
        _check_backward(run, outputs)
    return CheckedGraph(rank, chosen.index, run.executed, run.reused, len(run.arrived))


def check_rank_graphs(plan: "Plan") -> list[CheckedGraph]:
    """`check_rank_graph` on the first and the last rank of every stage (module docstring)."""
    checked = []
    with unset_fake_temporarily():  # planning may run under the caller's FakeTensorMode
        for stage in plan.stages:
            holders = [r for r in range(plan.mesh.world_size) if stage in plan.stages_of_rank(r)]
            checked += [check_rank_graph(plan, rank, stage=stage.index) for rank in sorted({holders[0], holders[-1]})]
    return checked
