"""How the rank graph is scheduled, as data: `schedule(overlap=False)` keeps every collective
synchronous where `insert_collectives` put it (the scheduling pass, `autopar/compiler/passes/schedule_collectives.py`,
does not run); the default (nothing declared, or `overlap=True`) splits each into a start and a
finish, leaves the weight gradients of the linears after an f or SP all-gather to run while its
backward reduction is in flight, and defers small statistics' finishes to where they are needed.
`schedule(chunks=k)` (k > 1) also cuts each tensor- or sequence-parallel linear's forward
collective, with the linear, into k pieces of rows (async TP, `autopar/compiler/passes/chunk_collectives.py`), so
one piece's collective is in flight while another piece's matmul runs.

The declaration belongs to no mesh axis; `resolve_strategies` takes it out of the strategy list
(`ResolvedStrategy.schedule`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleDeclaration:
    overlap: bool = True
    chunks: int = 1
    name: str = "schedule"

    def describe(self) -> str:
        if not self.overlap:
            return "in issue order"
        return "overlap" if self.chunks == 1 else f"overlap, linears' collectives in {self.chunks} chunks"


def schedule(*, overlap: bool = True, chunks: int = 1) -> ScheduleDeclaration:
    """`overlap=False`: every collective waits where it is issued (the scheduling pass is off).
    `chunks=k`: each TP/SP linear and its forward collective run as k pieces of rows (async TP);
    it needs the overlap (what else would the pieces be for)."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"schedule(chunks={chunks!r}): chunks is a whole number >= 1 (1: no chunking)")
    if chunks > 1 and not overlap:
        raise ValueError(f"schedule(overlap=False, chunks={chunks}): chunks put one piece's collective in flight "
                         "over another's matmul, which needs the overlap; drop chunks or overlap=False")
    return ScheduleDeclaration(overlap=bool(overlap), chunks=chunks)
