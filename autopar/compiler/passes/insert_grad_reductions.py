"""Pass 3: make the backward pass as correct as the forward, and decide where gradients sync.

Convention: the gradient of a tensor has the placement of the tensor, except that a Partial
tensor's gradient is Replicate. A compute op whose output is not replicated on an axis returns,
for an input replicated on that axis, a Partial gradient (each rank holds a share). This pass
finds those edges, per axis, and restores the convention the cheapest way it knows:
- a parameter all of whose uses give Partial gradients on an axis is synchronised after backward
  by the bucketed all-reduce of `autopar.runtime.grad_sync` (data parallelism, and replicated
  LayerNorm weights under sequence parallelism) - recorded under GRAD_SYNC;
- an all_gather whose output is only used that way gets a reduce_scatter backward
  (sequence parallelism's conjugate) instead of a slice;
- a shard_slice of a value computed only from parameters (e.g. position embeddings) gets a
  zero-padded backward, leaving the parameters' gradients Partial for the same bucketed sync;
- otherwise one `grad_all_reduce` node (identity forward, all-reduce backward: Megatron's f)
  is inserted per tensor and set of axes, shared by every consumer that needs it.
It also drops backward ledger records of collectives on tensors that need no gradient.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from autopar.compiler.context import CompileContext
from autopar.compiler.passes.insert_collectives import collective_info
from autopar.core.comm_kinds import comm_step
from autopar.core.ir import COLLECTIVE, SPEC, module_path
from autopar.core.ops import collectives
from autopar.core.program import Program

aten = torch.ops.aten
REQUIRES_GRAD = "autopar_requires_grad"
# ops that only re-arrange (or re-type) one input: a Partial gradient passes through them unchanged
VIEW_LIKE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
             aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
             aten.expand.default, aten.clone.default, aten.alias.default, aten._to_copy.default}
GRAD_SYNC = "autopar_grad_sync"


def _specs(node: torch.fx.Node) -> list[DTensorSpec]:
    spec = node.meta.get(SPEC)
    return [s for s in (spec if isinstance(spec, (tuple, list)) else (spec,)) if isinstance(s, DTensorSpec)]


def _is_float(value: object) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_is_float(v) for v in value)
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _mark_requires_grad(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            info = ctx.placeholders.get(node.name)
            wants = info is not None and info.kind == "parameter" and info.requires_grad
        elif node.op == "call_function":
            wants = _is_float(node.meta.get("val")) and any(
                n.meta.get(REQUIRES_GRAD) for n in node.all_input_nodes)
        else:
            wants = False
        node.meta[REQUIRES_GRAD] = wants
        if not wants and node.meta.get(COLLECTIVE):
            node.meta[COLLECTIVE] = [c for c in node.meta[COLLECTIVE] if c.phase != "backward"]


def _partial_axes(consumer: torch.fx.Node, axes: list[int], passed_through: dict[torch.fx.Node, set[int]]) -> set[int]:
    """Axes on which `consumer` hands back a Partial gradient for a replicated input."""
    if comm_step(consumer.target) is not None:
        return passed_through.get(consumer, set()) & set(axes)
    if consumer.op != "call_function" or not consumer.meta.get(REQUIRES_GRAD):
        return set()
    outputs = _specs(consumer)
    partial = {a for a in axes if any(not isinstance(s.placements[a], Replicate) for s in outputs)}
    return partial | (passed_through.get(consumer, set()) & set(axes))


def _parameter_only_upstream(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """Parameters feeding `node` through single-use compute nodes, or None if anything else does.

    Single use all the way up (parameters included): a Partial gradient arriving here is then the
    parameters' whole gradient, so synchronising the parameters is exact."""
    params: list[torch.fx.Node] = []
    frontier = [n for n in node.all_input_nodes if n.meta.get(REQUIRES_GRAD)]
    while frontier:
        current = frontier.pop()
        if len(current.users) != 1:
            return None
        if current.op == "placeholder":
            params.append(current)
            continue
        if current.op != "call_function" or comm_step(current.target) is not None:
            return None
        frontier += [n for n in current.all_input_nodes if n.meta.get(REQUIRES_GRAD)]
    return params


def insert_grad_reductions(program: Program, ctx: CompileContext) -> Program:
    """Walks the graph backwards (consumers before producers), as the gradients flow."""
    gm = program.graph_module
    _mark_requires_grad(gm, ctx)
    graph = gm.graph
    passed_through: dict[torch.fx.Node, set[int]] = {}
    for node in reversed(list(graph.nodes)):
        if not node.meta.get(REQUIRES_GRAD) or not isinstance(node.meta.get(SPEC), DTensorSpec):
            continue
        spec: DTensorSpec = node.meta[SPEC]
        axes = [a for a, p in enumerate(spec.placements) if isinstance(p, Replicate)]
        if not axes:
            continue
        users = [u for u in node.users if u.meta.get(REQUIRES_GRAD) or u.op == "output" or comm_step(u.target) is not None]
        needs = {user: _partial_axes(user, axes, passed_through) for user in users}
        step = comm_step(node.target)
        if node.target in VIEW_LIKE or step is not None:  # let a Partial gradient through, reduce it once
            for axis in axes:
                if step is not None and node.kwargs["group"] == ctx.mesh.names[axis]:
                    continue
                if users and all(axis in needs[u] for u in users):
                    passed_through.setdefault(node, set()).add(axis)
                    for user in users:
                        needs[user].discard(axis)
        _settle_free_reductions(node, users, needs, axes, ctx)
        by_axes: dict[frozenset[int], list[torch.fx.Node]] = {}
        for user, partial in needs.items():
            if partial:
                by_axes.setdefault(frozenset(partial), []).append(user)
        for partial, group in by_axes.items():
            reduced = _insert_grad_all_reduce(graph, node, sorted(partial), ctx)
            for user in group:
                user.replace_input_with(node, reduced)
    graph.lint()
    gm.recompile()
    return program


def _settle_free_reductions(node: torch.fx.Node, users: list[torch.fx.Node], needs: dict[torch.fx.Node, set[int]],
                            axes: list[int], ctx: CompileContext) -> None:
    """Axes every user reduces anyway: let a parameter sync, or an all_gather reduce-scatter, absorb them."""
    for axis in axes:
        if not users or not all(axis in needs[u] for u in users):
            _zero_pad_slices(node, users, axis, ctx)
            continue
        name = ctx.mesh.names[axis]
        if node.op == "placeholder":
            node.meta.setdefault(GRAD_SYNC, []).append(name)
        elif node.target is collectives.all_gather and node.kwargs["group"] == name:
            regather = ctx.strategy.regathers(name)
            node.kwargs = dict(node.kwargs, grad_partial=True, **({"regather": True} if regather else {}))
            node.meta[COLLECTIVE] = node.meta[COLLECTIVE] + [collective_info(
                "reduce_scatter", name, "backward", node.meta[SPEC], ctx.mesh.shape, node.meta["val"],
                node.args[0].name, module_path(node), "conjugate of the all_gather: gradient is partial")] + ([
                collective_info("all_gather", name, "backward", node.meta[SPEC], ctx.mesh.shape, node.meta["val"],
                                node.args[0].name, module_path(node), "the shard saved for backward gathered again")]
                if regather else [])
        elif node.op == "call_function" and comm_step(node.target) is None and (params := _parameter_only_upstream(node)):
            _sync_parameters(params, name)  # e.g. position embeddings under data parallelism: sync the weight
        else:
            continue
        for user in users:
            needs[user].discard(axis)


def _zero_pad_slices(node: torch.fx.Node, users: list[torch.fx.Node], axis: int, ctx: CompileContext) -> None:
    """A slice of a parameter-only value: zero-pad its gradient and sync the parameters instead."""
    name = ctx.mesh.names[axis]
    slices = [u for u in users if u.target is collectives.shard_slice and u.kwargs["group"] == name]
    if len(slices) != 1 or len(users) != 1:
        return
    params = _parameter_only_upstream(node) if node.op == "call_function" else None
    if not params or len(node.users) != 1:
        return
    (slice_node,) = slices
    slice_node.kwargs = dict(slice_node.kwargs, grad_partial=True)
    slice_node.meta[COLLECTIVE] = [c for c in slice_node.meta.get(COLLECTIVE, []) if c.phase != "backward"]
    _sync_parameters(params, name)


def _sync_parameters(params: list[torch.fx.Node], axis: str) -> None:
    for param in params:
        if axis not in param.meta.setdefault(GRAD_SYNC, []):
            param.meta[GRAD_SYNC].append(axis)


def _insert_grad_all_reduce(graph: torch.fx.Graph, node: torch.fx.Node, axes: list[int],
                            ctx: CompileContext) -> torch.fx.Node:
    current = node
    anchor = node
    while anchor.next.op == "placeholder":
        anchor = anchor.next
    for axis in axes:
        name = ctx.mesh.names[axis]
        with graph.inserting_after(anchor):
            current = graph.call_function(collectives.grad_all_reduce, (current,), {"group": name})
        anchor = current
        current.meta.update({"val": node.meta["val"], SPEC: node.meta[SPEC], REQUIRES_GRAD: True,
                             "nn_module_stack": node.meta.get("nn_module_stack", {}),
                             "stack_trace": node.meta.get("stack_trace")})
        current.meta[COLLECTIVE] = [collective_info(
            "all_reduce", name, "backward", node.meta[SPEC], ctx.mesh.shape, node.meta["val"], node.name,
            module_path(node), "conjugate of using a replicated tensor in a sharded op (Megatron f)")]
    return current
