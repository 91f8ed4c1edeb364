"""Pass 4 (ZeRO / FSDP): group the parameters of the sharded-state axis into units and make the
graph gather them where they are used.

Runs after `split_pipeline`, only when a strategy declares a `ShardedState` (autopar/compiler/strategies/zero.py),
on each stage graph (units never span stages). For each unit (a repeated block such as `layers.3`, or the root: every
other parameter) it
- decides each parameter's dim-0 shard rows (`autopar.core.zero_units`, padded when uneven) and
  takes the sharded axis out of the parameter's GRAD_SYNC axes: the unit's own reduce-scatter
  replaces the bucketed all-reduce; axes left (HSDP's replicate axis, sequence-parallel norms)
  become the unit's `extra_axes`, all-reduced on the shard;
- inserts `gather_unit(shards)` before the first use of any of its parameters, with one
  getitem per parameter replacing the placeholder in every use. The placeholder now receives
  the rank's shard; the getitem is the gathered compute tensor (node meta ZERO_UNIT);
- stage 3, resharded units: inserts `release_unit` after the last forward use, and
  `unit_boundary` on every tensor leaving the block, whose backward gathers the unit again
  (and prefetches the one before) just before the block's backward needs it.
A unit is resharded only when all its parameters are used inside its own module; the root unit
only with `reshard_root` (FSDP2 keeps its root gathered: it is needed again first in backward),
its boundary then sits on the graph's outputs. The runtime that executes
the three calls (bound methods of `sharded_state.UnitCalls`) is `autopar.core.ops.sharded_state`.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import operator
import re
from typing import TYPE_CHECKING

import torch
import torch.fx
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from autopar.compiler.context import CompileContext
from autopar.compiler.passes.insert_grad_reductions import GRAD_SYNC
from autopar.core.comm_kinds import gradient_exchange_kind, parameter_gather_kind
from autopar.core.ir import ARG_SPECS, COLLECTIVE, LOCAL_ARGS, RULE, SPEC, local_shape, module_path, shard_dim, tensor_meta
from autopar.core.ops import sharded_state
from autopar.core.ops.float8_matmul import float8_matmul
from autopar.core.program import Program
from autopar.core.zero_units import ShardUnit, UnitParam, rows_per_rank

if TYPE_CHECKING:  # strategies sit above the passes: what the passes read of them comes through the context
    from autopar.compiler.strategies.zero import ShardedState

ZERO_UNIT = "autopar_zero_unit"  # on gather / getitem / boundary nodes: the unit's index
ZERO_SHARD = "autopar_zero_shard"  # on a parameter placeholder: (unit index, shard shape)
_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


def _unit_name(fqn: str, patterns: tuple[str, ...] | None) -> str:
    module = fqn.rsplit(".", 1)[0] if "." in fqn else ""
    if patterns is not None:
        parts = module.split(".")
        prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        return next((p for p in prefixes for pattern in patterns if fnmatch.fnmatchcase(p, pattern)), "")
    match = _BLOCK.match(fqn)
    return match.group(1) if match else ""


def _inside(node: torch.fx.Node, unit_name: str) -> bool:
    path = module_path(node)
    return bool(unit_name) and (path == unit_name or path.startswith(unit_name + "."))


def _plan_units(gm: torch.fx.GraphModule, ctx: CompileContext, axis: str, declared, *, first: int,
                stage: int) -> list[tuple[ShardUnit, list]]:
    size = ctx.mesh.size(axis)
    groups: dict[tuple, list[tuple[UnitParam, torch.fx.Node]]] = {}
    for node in gm.graph.nodes:
        info = ctx.placeholders.get(node.name)
        if node.op != "placeholder" or info is None or info.kind != "parameter" or not info.requires_grad:
            continue
        spec = node.meta[SPEC]
        sync = list(node.meta.get(GRAD_SYNC, []))
        if not node.users or axis not in sync or len(spec.tensor_meta.shape) == 0:
            continue  # unread, not data-parallel on the axis, or 0-d: stays replicated
        shape = tuple(local_shape(spec.tensor_meta.shape, spec.placements, ctx.mesh.shape))
        extra = ctx.mesh.sync_keys([a for a in sync if a != axis])
        key = (_unit_name(info.target, declared.units), extra, spec.tensor_meta.dtype)
        groups.setdefault(key, []).append((UnitParam(info.target, node.name, shape, rows_per_rank(shape[0], size)), node))
    units = []
    for index, ((name, extra, dtype), members) in enumerate(groups.items(), start=first):
        if any("@" in axis for axis in extra):
            # held by several pipeline stages (tied) and reduced over their group too: the same
            # parameters in the same order on every holder, whatever each stage's graph order
            members = sorted(members, key=lambda m: m[0].fqn)
        params = tuple(p for p, _ in members)
        nodes = [n for _, n in members]
        self_contained = bool(name) and all(_inside(user, name) for n in nodes for user in n.users)
        reshard = declared.stage == 3 and declared.reshard_after_forward and (
            self_contained or (not name and declared.reshard_root))
        master = ctx.master_dtypes.get(params[0].fqn, dtype)
        kinds = _kinds(declared, backend=ctx.strategy.backend)
        fp8 = tuple(i for i, n in enumerate(nodes) if gathered_in_float8(n)) \
            if declared.stage == 3 and kinds["gather_kind"] == "all_gather" else ()
        cutting = {ctx.mesh.names[i] for position in fp8 for i, p in enumerate(nodes[position].meta[SPEC].placements)
                   if shard_dim(p) is not None and ctx.mesh.shape[i] > 1}
        units.append((ShardUnit(index=index, name=name, axis=axis, group_size=size, stage=declared.stage,
                                dtype=dtype, params=params, extra_axes=extra, reshard=reshard,
                                prefetch=declared.prefetch, backward_prefetch=declared.backward_prefetch,
                                master_dtype=master,
                                reduce_dtype=_reduce_dtype(declared, ctx) or dtype, pipeline_stage=stage,
                                float8=fp8, float8_axes=tuple(sorted(cutting - {axis})), **kinds), nodes))
    return units


def gathered_in_float8(node: torch.fx.Node) -> bool:
    """A parameter read only as the weight of tensorwise FP8 products (directly, or through mixed
    precision's cast, as a layout's plan reads it): its ZeRO-3 unit gathers it in FP8
    (`autopar/core/ops/float8_gather.py`; rowwise weights are cast per row along each product's
    dimension, which one gathered FP8 copy cannot serve, so they are gathered in the compute dtype,
    as torchao gathers them). The planner prices the same weights (`planner/float8_pricing.py`)."""
    # (reader, the value it reads): the parameter itself, or its cast
    reads = [(user, use) if use.target is torch.ops.aten._to_copy.default else (use, node)
             for use in node.users for user in (use.users if use.target is torch.ops.aten._to_copy.default else [use])]
    return bool(reads) and all(user.target is float8_matmul and user.args[1] is value
                               and user.kwargs.get("recipe") == "tensorwise" for user, value in reads)


def _float8_scales(graph: torch.fx.Graph, gather: torch.fx.Node, unit: ShardUnit, items: list[torch.fx.Node],
                   spec_of: torch.fx.Node) -> None:
    """The unit's FP8 weights' scales (the gather's outputs after the parameters) handed to the
    products reading them; the products' own weight-scale reductions are dropped from their rule."""
    for k, position in enumerate(unit.float8):
        with graph.inserting_after(items[-1]):
            scale = graph.call_function(operator.getitem, (gather, len(items) + k))
        scale.meta["val"] = spec_of.meta["val"].new_empty((), dtype=torch.float32)  # a fake tensor, as the graph's
        spec = spec_of.meta[SPEC]
        scale.meta[SPEC] = DTensorSpec(spec.mesh, tuple(Replicate() for _ in spec.placements), tensor_meta(scale.meta["val"]))
        scale.meta[ZERO_UNIT] = unit.index
        for user in list(items[position].users):
            user.kwargs = dict(user.kwargs, weight_scale=scale)
            rule = user.meta[RULE]
            user.meta[RULE] = dataclasses.replace(rule, internal=[c for c in rule.internal if c.operand != "wt"])


def _reduce_dtype(declared: ShardedState, ctx: CompileContext) -> torch.dtype | None:
    """The dtype gradients are reduce-scattered in: ZeRO's own, else `mixed_precision()`'s, else None
    (the traced parameter's)."""
    precision = ctx.strategy.mixed_precision
    return declared.reduce_dtype or (precision.reduce_dtype if precision is not None else None)


def _kinds(declared: ShardedState, *, backend: str | None) -> dict[str, str]:
    """The unit's reduce and gather kinds, as `comm_kinds` resolves the declared ones for `backend`
    (the plan's, `plan(backend=)`; None: the initialised process group's)."""
    return {"reduce_kind": gradient_exchange_kind(declared.reduce, backend),
            "gather_kind": parameter_gather_kind(declared.gather, backend)}


def _graph_order(graph: torch.fx.Graph, order: dict[torch.fx.Node, int], wanted: list[torch.fx.Node]
                 ) -> dict[torch.fx.Node, int]:
    """Positions in `graph`: `order` as computed before, refreshed when a wanted node is newer."""
    if any(node not in order for node in wanted):
        order.clear()
        order.update((n, i) for i, n in enumerate(graph.nodes))
    return order


def _unit_members(graph: torch.fx.Graph, units: list[ShardUnit]) -> dict[str, list[torch.fx.Node]]:
    """The call_function nodes inside each unit's module (`_inside`), in graph order, found once:
    the nodes the rewrite adds (gathers, their items, boundaries) carry no module path."""
    names = {unit.name for unit in units if unit.name}
    members: dict[str, list[torch.fx.Node]] = {name: [] for name in names}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        parts = module_path(node).split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in names:
                members[prefix].append(node)
    return members


def _rewrite_unit(graph: torch.fx.Graph, unit: ShardUnit, nodes: list[torch.fx.Node], calls,
                  order: dict[torch.fx.Node, int], members: dict[str, list[torch.fx.Node]]) -> None:
    users = [user for n in nodes for user in n.users]
    first_use = min(users, key=_graph_order(graph, order, users).__getitem__)
    with graph.inserting_before(first_use):
        gather = graph.call_function(calls.gather_unit, (tuple(nodes),), {"unit": unit.index})
        gather.meta[ZERO_UNIT] = unit.index
        gathered = []
        for i, node in enumerate(nodes):
            item = graph.call_function(operator.getitem, (gather, i))
            item.meta.update({k: v for k, v in node.meta.items() if k not in (GRAD_SYNC,)})
            item.meta[ZERO_UNIT] = unit.index
            gathered.append(item)
    for node, item, param in zip(nodes, gathered, unit.params):
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user is not gather)
        node.meta[GRAD_SYNC] = []  # the unit reduces its gradient: over the axis, then its extra_axes
        node.meta[ZERO_SHARD] = (unit.index, param.shard_shape)
    _float8_scales(graph, gather, unit, gathered, nodes[0])
    if not unit.reshard:
        return
    users = [user for view in _aliases(gathered) for user in view.users]
    last_use = max(users, key=_graph_order(graph, order, users).__getitem__)
    with graph.inserting_after(last_use):
        graph.call_function(calls.release_unit, (), {"unit": unit.index})
    _insert_boundaries(graph, unit, calls, members.get(unit.name, []))


def _returns_alias(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def _aliases(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The nodes plus every view of them (permute, reshape, ...): a use of a view is a use of the
    gathered storage, so release_unit must follow the last of those too."""
    found, stack = [], list(nodes)
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(user for user in node.users if _returns_alias(user) and user not in found)
    return found


def _insert_boundaries(graph: torch.fx.Graph, unit: ShardUnit, calls, inside: list[torch.fx.Node]) -> None:
    """`unit_boundary` on every floating-point tensor computed in the block and read outside it;
    for the root unit, on the graph's outputs (its backward is the first to run)."""
    if not unit.name:
        output = next(n for n in graph.nodes if n.op == "output")
        for node in output.all_input_nodes:
            _boundary(graph, node, [output], unit, calls)
        return
    for node in inside:
        outside = [u for u in node.users if not _inside(u, unit.name)
                   and sharded_state.unit_call(u.target) != "release_unit"]
        _boundary(graph, node, outside, unit, calls)


def _boundary(graph: torch.fx.Graph, node: torch.fx.Node, users: list[torch.fx.Node], unit: ShardUnit,
              calls) -> None:
    """Route `users`' reads of a floating-point `node` through one unit_boundary."""
    value = node.meta.get("val")
    if not users or not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        return
    with graph.inserting_after(node):
        boundary = graph.call_function(calls.unit_boundary, (node,), {"unit": unit.index})
    # what the node computes (value, placement, provenance), not how it was lowered (a view's local
    # shape arguments, a rule's kernel) nor the collective it performs (the ledger would count it twice)
    lowering = ("nn_module_stack", LOCAL_ARGS, RULE, ARG_SPECS, COLLECTIVE)
    boundary.meta.update({k: v for k, v in node.meta.items() if k not in lowering})
    boundary.meta[ZERO_UNIT] = unit.index
    for user in users:
        user.replace_input_with(node, boundary)


def shard_parameters(program: Program, ctx: CompileContext) -> Program:
    declared = ctx.strategy.sharded_state()
    if declared is None:
        return program
    axis, state = declared
    ctx.units = []
    for stage in program.stages:
        gm = stage.graph_module
        units = _plan_units(gm, ctx, axis, state, first=len(ctx.units), stage=stage.index)
        calls = sharded_state.UnitCalls([unit for unit, _ in units])
        order: dict[torch.fx.Node, int] = {}
        members = _unit_members(gm.graph, [unit for unit, _ in units])
        for unit, nodes in units:
            _rewrite_unit(gm.graph, unit, nodes, calls, order, members)
        stage.units = [unit for unit, _ in units]
        ctx.units += stage.units
        gm.graph.lint()
        gm.recompile()
    return program
