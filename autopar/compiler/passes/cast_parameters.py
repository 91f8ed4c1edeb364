"""Pass (mixed precision): hold every trainable parameter outside ZeRO's units as its fp32 master
and cast it to the compute dtype in the rank graph.

Under `mixed_precision()` (`autopar/compiler/strategies/mixed_precision.py`) the model is traced
with its parameters in the compute dtype, and `plan()` keeps the trainable ones' originals as the
masters (`CompileContext.master_dtypes`). A ZeRO unit holds its master shard and gathers it in the
compute dtype (`shard_parameters.py`, which runs before). Every other trainable parameter read by
a stage graph here gets:
- its placeholder re-typed to the master's dtype (its spec and traced value): the rank holds the
  master, the optimizer updates it, and the memory ledger counts it and its gradient in that dtype;
- one `aten._to_copy(dtype=compute)` node right after the graph's placeholders, replacing the
  placeholder in every use (a tied weight is cast once). Its backward casts the gradient back,
  so the gradient reaches the master, and is reduced over data-parallel axes, in the master's
  dtype. Placed before every region, it is kept, not recomputed, by recomputation.
A declared `reduce_dtype` other than the master's for such a gradient (one reduced by the
bucketed all-reduce) is refused: the buckets reduce gradients where they live.
"""
from __future__ import annotations

import torch
import torch.fx

from autopar.compiler.context import CompileContext
from autopar.compiler.passes.insert_grad_reductions import GRAD_SYNC
from autopar.core.errors import PlanError
from autopar.core.ir import SPEC, insert_cast, retyped
from autopar.core.program import Program


def cast_parameters(program: Program, ctx: CompileContext) -> Program:
    if not ctx.master_dtypes:
        return program
    in_units = {p.fqn for unit in ctx.units for p in unit.params}
    reduce_dtype = ctx.strategy.mixed_precision.reduce_dtype if ctx.strategy.mixed_precision is not None else None
    for stage in program.stages:
        graph = stage.graph_module.graph
        masters = [node for node in graph.nodes if _held_as_master(node, ctx, in_units)]
        if not masters:
            continue
        first_op = next(node for node in graph.nodes if node.op != "placeholder")
        for node in masters:
            _cast_at_start(graph, node, ctx.master_dtypes[ctx.placeholders[node.name].target], first_op)
            _check_reduce_dtype(node, ctx, reduce_dtype)
        graph.lint()
        stage.graph_module.recompile()
    return program


def _held_as_master(node: torch.fx.Node, ctx: CompileContext, in_units: set[str]) -> bool:
    info = ctx.placeholders.get(node.name)
    return (node.op == "placeholder" and info is not None and info.kind == "parameter" and info.requires_grad
            and bool(node.users) and info.target in ctx.master_dtypes and info.target not in in_units)


def _cast_at_start(graph: torch.fx.Graph, node: torch.fx.Node, master: torch.dtype, first_op: torch.fx.Node) -> None:
    """`node` becomes the master (dtype `master`); its users read a cast to its traced dtype."""
    compute = node.meta[SPEC].tensor_meta.dtype
    node.meta[SPEC] = retyped(node.meta[SPEC], master)
    if isinstance(node.meta.get("val"), torch.Tensor):
        node.meta["val"] = node.meta["val"].to(master)  # a fake tensor: its own mode runs the cast
    cast = insert_cast(graph, node, compute, before=first_op,
                       why=f"mixed precision: the {master} master cast to {compute} for compute")
    node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)


def _check_reduce_dtype(node: torch.fx.Node, ctx: CompileContext, reduce_dtype: torch.dtype | None) -> None:
    master = node.meta[SPEC].tensor_meta.dtype
    if reduce_dtype is None or reduce_dtype == master or not node.meta.get(GRAD_SYNC):
        return
    target = ctx.placeholders[node.name].target
    raise PlanError(f"mixed_precision(reduce_dtype={reduce_dtype}): parameter {target!r} is replicated over "
                    f"{sorted(node.meta[GRAD_SYNC])}, and its gradient is all-reduced where it lives, in its "
                    f"{master} master; only ZeRO/FSDP units reduce-scatter in another dtype\n"
                    f"  fix: reduce_dtype={master}, or shard the state over the data axis (zero(), fsdp())")

