"""Pass 2: insert the redistributions that make every argument arrive with the placement its
consumer needs (recorded by `propagate_placements` under ARG_SPECS).

A redistribution from one placement tuple to another is split into one step per mesh axis:
reductions first (Partial -> Replicate: all_reduce; Partial -> Shard(d): reduce_scatter), then
gathers innermost axis first (Shard(d) -> Replicate: all_gather), then local slices outermost
first (Replicate -> Shard(d): shard_slice, no communication), Shard(a) -> Shard(b) as all_to_all,
and Replicate -> Partial as partial_from_replicate. Each step is a call to a function of
`autopar.core.ops.collectives` whose backward is the conjugate step; the node records its spec
and a forward and backward `CollectiveInfo` for the ledger (the kinds come from the registry,
`autopar.core.comm_kinds.STEPS`). One chain is built per (tensor, target placements) however many
consumers need it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils import _pytree as pytree

from autopar.compiler.argument_trees import argument_leaves
from autopar.compiler.context import CompileContext
from autopar.core.comm_kinds import STEPS
from autopar.core.errors import PlanError
from autopar.core.ir import ARG_SPECS, COLLECTIVE, SPEC, CollectiveInfo, describe, local_numel, module_path, simplified
from autopar.core.ops import collectives
from autopar.core.program import Program


def _step(src: Placement, dst: Placement, axis: str, size: int, layout: str = "contiguous"
          ) -> tuple[Any, dict[str, Any]] | None:
    """`layout`: how a dimension is cut on `axis` (`autopar.core.sequence_chunks`; "balanced" on
    a load-balanced context-parallel axis), passed to the steps that cut or join one."""
    common = {"group": axis, "size": size}
    cut = {} if layout == "contiguous" else {"layout": layout}
    if src == dst:
        return None
    if isinstance(dst, _StridedShard) and isinstance(src, Replicate):  # rows of [batch, seq] cut on seq
        return collectives.shard_slice, dict(common, index=axis, dim=dst.dim, grad_partial=False, **cut,
                                             blocks=dst.split_factor)
    if isinstance(src, _StridedShard) and isinstance(dst, Replicate):
        return collectives.all_gather, dict(common, index=axis, dim=src.dim, grad_partial=False, **cut,
                                            blocks=src.split_factor)
    if not all(type(p) in (Shard, Replicate, Partial) for p in (src, dst)):
        return None  # e.g. DTensor's _MaskPartial: needs the op's own lowering (autopar.compiler.rules.op_rules)
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return collectives.all_reduce, dict(common, reduce_op=src.reduce_op)
        if isinstance(dst, Shard) and src.reduce_op == "sum":
            return collectives.reduce_scatter, dict(common, dim=dst.dim)
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return collectives.all_gather, dict(common, index=axis, dim=src.dim, grad_partial=False, **cut)
        if isinstance(dst, Shard):
            if cut:
                return None  # a balanced shard's two chunks do not map onto another dimension's
            return collectives.all_to_all, dict(common, from_dim=src.dim, to_dim=dst.dim)
    if isinstance(src, Replicate):
        if isinstance(dst, Shard):
            return collectives.shard_slice, dict(common, index=axis, dim=dst.dim, grad_partial=False, **cut)
        if isinstance(dst, Partial):
            return collectives.partial_from_replicate, {"group": axis, "index": axis}
    return None


def _order(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> list[int]:
    axes = range(len(src))
    reduce = [i for i in axes if isinstance(src[i], Partial) and src[i] != dst[i]]
    gather = [i for i in reversed(axes) if isinstance(src[i], (Shard, _StridedShard)) and isinstance(dst[i], Replicate)]
    rest = [i for i in axes if i not in reduce and i not in gather and src[i] != dst[i]]
    return reduce + gather + rest


def collective_info(kind: str | None, axis: str, phase: str, spec: DTensorSpec, mesh_shape: tuple[int, ...],
                    value: torch.Tensor, tensor: str, module: str, why: str) -> CollectiveInfo | None:
    """Ledger record: logical bytes S of the collective, from the tensor's (symbolic) global shape."""
    if kind is None:
        return None
    numel = local_numel(tuple(value.shape), spec.placements, mesh_shape)
    return CollectiveInfo(kind=kind, axis=axis, phase=phase, logical_bytes=simplified(numel * value.dtype.itemsize),
                          dtype=value.dtype, tensor=tensor, module=module, why=why)


def _insert_chain(graph: torch.fx.Graph, producer: torch.fx.Node, target: DTensorSpec, before: torch.fx.Node,
                  ctx: CompileContext) -> torch.fx.Node:
    spec: DTensorSpec = producer.meta[SPEC]
    value = producer.meta["val"]
    current = producer
    for axis_index in _order(spec.placements, target.placements):
        axis = ctx.mesh.names[axis_index]
        src, dst = spec.placements[axis_index], target.placements[axis_index]
        step = _step(src, dst, axis, ctx.mesh.shape[axis_index], ctx.strategy.sequence_layout(axis))
        if step is None:
            raise PlanError.at(before, f"cannot redistribute {producer.name} from {describe(spec.placements)} to "
                                       f"{describe(target.placements)} on axis {axis!r}",
                               fix="declare a module layout that avoids this conversion")
        function, kwargs = step
        placements = list(spec.placements)
        placements[axis_index] = dst
        # S of a step is the size of the tensor it gathers into, or else of the tensor it takes in
        measured_on = DTensorSpec(spec.mesh, tuple(placements)) if function is collectives.all_gather else spec
        with graph.inserting_before(before):
            current = graph.call_function(function, (current,), kwargs)
        new_spec = DTensorSpec(spec.mesh, tuple(placements), spec.tensor_meta)
        current.meta.update(val=value, **{SPEC: new_spec})
        # attributed to where the value was produced (the o_proj whose partial sum is reduced), or for
        # graph inputs to where it is first used
        origin = producer if producer.op != "placeholder" else before
        current.meta["nn_module_stack"] = origin.meta.get("nn_module_stack", {})
        current.meta["stack_trace"] = origin.meta.get("stack_trace")
        forward_kind, backward_kind = STEPS[function].forward, STEPS[function].backward
        why = f"{describe(spec.placements)} -> {describe(tuple(placements))} for {before.name}"
        current.meta[COLLECTIVE] = [
            info for info in (
                collective_info(forward_kind, axis, "forward", measured_on, ctx.mesh.shape, value, producer.name,
                                module_path(origin), why),
                collective_info(backward_kind, axis, "backward", measured_on, ctx.mesh.shape, value, producer.name,
                                module_path(origin), why))
            if info is not None]
        spec = new_spec
    return current


def insert_collectives(program: Program, ctx: CompileContext) -> Program:
    gm = program.graph_module
    graph = gm.graph
    chains: dict[tuple[torch.fx.Node, tuple[Placement, ...]], torch.fx.Node] = {}
    for node in list(graph.nodes):
        wanted = node.meta.get(ARG_SPECS)
        if not wanted:
            continue
        leaves = argument_leaves((node.args, node.kwargs))  # pytree's leaves, without its cost per leaf
        changed = False
        for position, (leaf, target) in enumerate(zip(leaves, wanted)):
            if not isinstance(leaf, torch.fx.Node) or not isinstance(target, DTensorSpec):
                continue
            have = leaf.meta.get(SPEC)
            if not isinstance(have, DTensorSpec) or have.placements == target.placements:
                continue
            key = (leaf, target.placements)
            if key not in chains:  # first consumer in graph order: the chain dominates the later ones
                chains[key] = _insert_chain(graph, leaf, target, node, ctx)
            leaves[position] = chains[key]
            changed = True
        if changed:
            node.args, node.kwargs = pytree.tree_unflatten(leaves, pytree.tree_structure((node.args, node.kwargs)))
    graph.lint()
    gm.recompile()
    return program

