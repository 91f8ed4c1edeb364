"""How the rank graph is scheduled, as data: `schedule(overlap=False)` keeps every collective
synchronous where `insert_collectives` put it (the scheduling pass, `passes/schedule_collectives.py`,
does not run); the default (nothing declared, or `overlap=True`) splits each into a start and a
finish, leaves the weight gradients of the linears after an f or SP all-gather to run while its
backward reduction is in flight, and defers small statistics' finishes to where they are needed.

The declaration belongs to no mesh axis; `resolve_strategies` takes it out of the strategy list
(`ResolvedStrategy.schedule`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleDeclaration:
    overlap: bool = True
    name: str = "schedule"

    def describe(self) -> str:
        return "overlap" if self.overlap else "in issue order"


def schedule(*, overlap: bool = True) -> ScheduleDeclaration:
    """`overlap=False`: every collective waits where it is issued (the scheduling pass is off)."""
    return ScheduleDeclaration(overlap=bool(overlap))
