"""Pass 4: emit the executable graph of one rank.

Copies the planned graph and binds it to a rank: communication steps get their keyword arguments
bound as the registry (`autopar.comm_kinds`) says — the rank's process-group name, its coordinate
on the axis, the global rank of a pipeline peer; nodes an autopar rule lowered call their local
kernel (`autopar.runtime.local_ops`) with arguments bound the same way; shape arguments DTensor
rewrote to local sizes replace the global ones; `view`s become `reshape`s (a shard's strides
may differ from the traced tensor's); dead nodes (unused outputs of multi-output ops)
are removed. The result is an ordinary `torch.fx.GraphModule` over local tensors, whose code
(`gm.code`, generated when first read or run) reads like the hand-written per-rank program.
"""
from __future__ import annotations


import torch
import torch.fx
from torch.utils import _pytree as pytree

from autopar.comm_kinds import bind, comm_step
from autopar.context import CompileContext
from autopar.ir import LOCAL_ARGS, RULE, lazy_graph_module

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _localize_args(node: torch.fx.Node) -> None:
    local_args, local_kwargs = node.meta[LOCAL_ARGS]
    leaves, tree = pytree.tree_flatten((node.args, dict(node.kwargs)))
    local_leaves = pytree.tree_leaves((local_args, local_kwargs))
    if len(local_leaves) != len(leaves):
        raise AssertionError(f"local arguments of {node.format_node()} do not line up with its arguments")
    merged = [leaf if isinstance(leaf, torch.fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor) else local
              for leaf, local in zip(leaves, local_leaves)]
    node.args, node.kwargs = pytree.tree_unflatten(merged, tree)


def emit_rank_graph(gm: torch.fx.GraphModule, ctx: CompileContext, *, rank: int,
                    groups: dict[str, str] | None = None) -> torch.fx.GraphModule:
    """The graph rank `rank` runs. `groups` maps axis -> process-group name (axis names when planning)."""
    groups = groups or {axis: axis for axis in ctx.mesh.names}
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        step = comm_step(node.target)
        if step is not None:
            node.kwargs = bind(dict(node.kwargs), step.binds, ctx.mesh, rank, groups)
            continue
        rule = node.meta.get(RULE)
        if rule is not None and rule.local_kernel is not None:
            node.target = rule.local_kernel
            unbound = {name: axis for name, (_, axis) in rule.kernel_kwargs.items()}
            binds = {name: how for name, (how, _) in rule.kernel_kwargs.items()}
            node.kwargs = dict(node.kwargs, **bind(unbound, binds, ctx.mesh, rank, groups))
        if LOCAL_ARGS in node.meta:
            _localize_args(node)
        if node.target in _VIEWS:
            # a local shard need not have the strides the global tensor had (a gathered or sliced
            # input is contiguous where the traced one was a transposed view): reshape copies only then
            node.target = torch.ops.aten.reshape.default
    graph.eliminate_dead_code()
    graph.lint()
    return lazy_graph_module(gm, graph, class_name=f"Rank{rank}")
