"""Pass 4: emit the executable graph of one rank.

Copies the planned graph and binds it to a rank: collective steps get the rank's process-group
name and its coordinate on the axis; nodes an autopar rule lowered call their local kernel
(`autopar.runtime.local_ops`) with the rank's group / shard index; shape arguments DTensor
rewrote to local sizes replace the global ones; `view`s become `reshape`s (a shard's strides
may differ from the traced tensor's); dead nodes (unused outputs of multi-output ops)
are removed. The result is an ordinary `torch.fx.GraphModule` over local tensors, whose code
(`gm.code`) reads like the hand-written per-rank program.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from autopar.context import CompileContext
from autopar.ir import LOCAL_ARGS, RULE
from autopar.passes.insert_collectives import CONJUGATES

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _bind_collective(node: torch.fx.Node, ctx: CompileContext, rank: int, groups: dict[str, str]) -> None:
    kwargs = dict(node.kwargs)
    axis = kwargs["group"]
    kwargs["group"] = groups[axis]
    if "index" in kwargs:
        kwargs["index"] = ctx.mesh.coordinate(rank, axis)
    node.kwargs = kwargs


def _kernel_kwargs(spec: dict[str, tuple[str, str]], ctx: CompileContext, rank: int, groups: dict[str, str]) -> dict[str, Any]:
    bound: dict[str, Any] = {}
    for name, (kind, axis) in spec.items():
        if kind == "index":
            bound[name] = ctx.mesh.coordinate(rank, axis)
        elif kind == "size":
            bound[name] = ctx.mesh.size(axis)
        elif kind == "group":
            bound[name] = groups[axis]
        elif kind == "groups":
            bound[name] = tuple(groups[a] for a in axis.split(",") if a)
        else:
            bound[name] = None
    return bound


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
        if node.target in CONJUGATES:
            _bind_collective(node, ctx, rank, groups)
            continue
        rule = node.meta.get(RULE)
        if rule is not None and rule.local_kernel is not None:
            node.target = rule.local_kernel
            node.kwargs = dict(node.kwargs, **_kernel_kwargs(rule.kernel_kwargs, ctx, rank, groups))
        if LOCAL_ARGS in node.meta:
            _localize_args(node)
        if node.target in _VIEWS:
            # a local shard need not have the strides the global tensor had (a gathered or sliced
            # input is contiguous where the traced one was a transposed view): reshape copies only then
            node.target = torch.ops.aten.reshape.default
    graph.eliminate_dead_code()
    graph.lint()
    return torch.fx.GraphModule(gm, graph, class_name=f"Rank{rank}")
