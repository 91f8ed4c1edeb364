"""The compiler passes, one per file, and the runner that applies them in order.

Order: `drop_empty_concats` (an empty KV cache concatenated with keys and values) ->
`propagate_placements` -> `insert_collectives` -> `insert_grad_reductions` ->
`shard_parameters` (ZeRO/FSDP units; a no-op without a sharded-state strategy), then
`emit_rank_graph` once per rank. `run_passes` names the pass that failed, times each one and
records how many nodes it added (`PassRecord`), so `autopar plan` can show what each pass did.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch.fx

from autopar.context import CompileContext
from autopar.errors import PlanError

Pass = Callable[[torch.fx.GraphModule, CompileContext], torch.fx.GraphModule]


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int


def run_passes(gm: torch.fx.GraphModule, ctx: CompileContext, passes: list[Pass]) -> tuple[torch.fx.GraphModule, list[PassRecord]]:
    records = []
    for compiler_pass in passes:
        before = len(gm.graph.nodes)
        start = time.perf_counter()
        try:
            gm = compiler_pass(gm, ctx)
        except PlanError:
            raise
        except Exception as error:
            raise PlanError(f"pass {compiler_pass.__name__} failed: {type(error).__name__}: {error}") from error
        records.append(PassRecord(compiler_pass.__name__, time.perf_counter() - start, before, len(gm.graph.nodes)))
    return gm, records


def default_passes() -> list[Pass]:
    from autopar.passes.drop_empty_concats import drop_empty_concats
    from autopar.passes.insert_collectives import insert_collectives
    from autopar.passes.insert_grad_reductions import insert_grad_reductions
    from autopar.passes.propagate_placements import propagate_placements
    from autopar.passes.shard_parameters import shard_parameters

    return [drop_empty_concats, propagate_placements, insert_collectives, insert_grad_reductions, shard_parameters]
