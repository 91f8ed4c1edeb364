"""Pass (mixed precision): the model's floating-point outputs in `mixed_precision(output_dtype=)`.

The outputs of the stage graph that returns what the model's forward returns (the one stage that
sends nothing on: the only stage without a pipeline, the last one with) get one
`aten._to_copy(dtype=output_dtype)` each, just before the graph returns them, where their dtype
differs — FSDP2's `output_dtype`: a loss or logits handed to the caller in fp32. Its backward
casts the incoming gradient back to the compute dtype. A no-op without `output_dtype`.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.utils import _pytree as pytree

from autopar.compiler.context import CompileContext
from autopar.core.ir import ARG_SPECS, SPEC, insert_cast, retyped
from autopar.core.program import Program


def cast_outputs(program: Program, ctx: CompileContext) -> Program:
    precision = ctx.strategy.mixed_precision
    wanted = precision.output_dtype if precision is not None else None
    if wanted is None:
        return program
    for stage in program.stages:
        if stage.sends:
            continue
        graph = stage.graph_module.graph
        output = next(node for node in graph.nodes if node.op == "output")
        casts: dict[torch.fx.Node, torch.fx.Node] = {}
        for value in pytree.tree_leaves(output.args):
            if isinstance(value, torch.fx.Node) and value not in casts and _needs_cast(value, wanted):
                casts[value] = insert_cast(graph, value, wanted, before=output,
                                           why=f"mixed precision: the model's output in {wanted}")
        if not casts:
            continue
        output.args = pytree.tree_map(lambda a: casts.get(a, a) if isinstance(a, torch.fx.Node) else a, output.args)
        if output.meta.get(ARG_SPECS) is not None:  # what the output wants: the casts' dtype
            cast_nodes = set(casts.values())
            output.meta[ARG_SPECS] = [retyped(spec, wanted) if leaf in cast_nodes and isinstance(spec, DTensorSpec)
                                      else spec for spec, leaf in zip(output.meta[ARG_SPECS],
                                                                      pytree.tree_leaves(output.args))]
        graph.lint()
        stage.graph_module.recompile()
    return program


def _needs_cast(node: torch.fx.Node, wanted: torch.dtype) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != wanted \
        and isinstance(node.meta.get(SPEC), DTensorSpec)

