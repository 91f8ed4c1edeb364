"""The compiler passes, one per file, and the runner that applies them in order.

Every pass maps a `Program` (autopar.core.program) to a `Program`. Order: `drop_empty_concats` (an empty
KV cache concatenated with keys and values) -> `lower_moe` (mixture-of-experts routing to autopar's
kernels, with the all-to-all exchange under expert parallelism) -> `float8_linears` (the products of the
linears `float8()` names, as FP8 products; a no-op without it) -> `propagate_placements` ->
`insert_collectives` -> `insert_grad_reductions` (these decide the whole graph) -> `split_pipeline`
(the stage graphs: one, the whole graph, without a pipeline) -> `shard_parameters` (ZeRO/FSDP units
per stage; a no-op without a sharded-state strategy) -> `cast_parameters` (mixed precision: every other
trainable parameter held as its fp32 master and cast to the compute dtype; a no-op without it) -> `cast_outputs`
(the model's outputs in `mixed_precision(output_dtype=)`; a no-op without it) -> `recompute` (marks the regions activation
recomputation runs again; a no-op without it) -> `chunk_collectives` (async TP: each TP/SP linear
and its forward collective cut into pieces of rows under `autopar.schedule(chunks=k)`; a no-op
without it) -> `schedule_collectives` (each collective split into a start and a finish, small
finishes deferred to where they are needed; off under `autopar.schedule(overlap=False)`), then
`emit_rank_graph` once per (rank, stage), which wraps each marked region in a checkpointed call.
`run_passes` times each pass and records how many nodes it added over all stage graphs (`PassRecord`),
so `autopar plan` can show what each pass did; an exception of a pass that is not autopar's own
becomes a `PlanError` naming the pass, the node it was processing, what is unsupported and the fix
(`autopar/compiler/planning_errors.py`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from autopar.compiler.context import CompileContext
from autopar.compiler.passes.cast_outputs import cast_outputs
from autopar.compiler.passes.causal_masks import causal_masks
from autopar.compiler.passes.cast_parameters import cast_parameters
from autopar.compiler.passes.chunk_collectives import chunk_collectives
from autopar.compiler.passes.drop_empty_concats import drop_empty_concats
from autopar.compiler.passes.float8_linears import float8_linears
from autopar.compiler.passes.insert_collectives import insert_collectives
from autopar.compiler.passes.insert_grad_reductions import insert_grad_reductions
from autopar.compiler.passes.lower_moe import lower_moe
from autopar.compiler.passes.propagate_placements import propagate_placements
from autopar.compiler.passes.recompute import recompute
from autopar.compiler.passes.schedule_collectives import schedule_collectives
from autopar.compiler.passes.shard_parameters import shard_parameters
from autopar.compiler.passes.split_pipeline import split_pipeline
from autopar.compiler.planning_errors import planning_error
from autopar.core.errors import PlanError
from autopar.core.program import Program

Pass = Callable[[Program, CompileContext], Program]


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int


def run_passes(program: Program, ctx: CompileContext, passes: list[Pass]) -> tuple[Program, list[PassRecord]]:
    """Run `passes` in order. A pass that refuses some combinations of strategies whatever the graph
    says (its `refuses(ctx)` raises PlanError) is asked before any pass runs."""
    for compiler_pass in passes:
        refuses = getattr(compiler_pass, "refuses", None)
        if refuses is not None:
            refuses(ctx)
    records = []
    for compiler_pass in passes:
        before = program.node_count()
        start = time.perf_counter()
        try:
            program = compiler_pass(program, ctx)
        except PlanError:
            raise
        except Exception as error:
            raise planning_error(error, phase=f"pass {compiler_pass.__name__}",
                                 strategies=_described(ctx)) from error
        records.append(PassRecord(compiler_pass.__name__, time.perf_counter() - start, before, program.node_count()))
    return program, records


def _described(ctx: CompileContext) -> str:
    names = [s.name for s in ctx.strategy.strategies if ctx.mesh.size(s.axis) > 1]
    return " + ".join(names) or "the declared strategies"


def default_passes() -> list[Pass]:
    return [drop_empty_concats, causal_masks, lower_moe, float8_linears, propagate_placements, insert_collectives, insert_grad_reductions,
            split_pipeline, shard_parameters, cast_parameters, cast_outputs,
            recompute, chunk_collectives, schedule_collectives]
