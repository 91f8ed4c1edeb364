"""The cost model's communication part: a plan's communication ledger priced on a `Cluster`.

`comm_time(plan, cluster, rank=0)` prices every entry rank `rank` performs in one step
(`CommLedger.for_rank`) with the α-β model (`Cluster.collective_seconds`: ring steps · α +
wire bytes / β of the entry's link, intra or inter node as the plan's mesh places its groups),
times its calls per step. Nothing is estimated beyond that: the bytes are the ledger's, exact
for the emitted program; what the model adds is the two numbers per link, which
`autopar.calibrate()` measures and the presets state. The result keeps one row per entry
(`CommTime.rows`) and sums per (phase, axis, link, kind); overlap with compute is not applied
here: `autopar/cost/step_cost.py` hides what the runtime runs asynchronously behind the compute beside it
(each row keeps what it is in flight behind, `CommTimeRow.behind`).

The plan's mesh must be the cluster's (`Cluster.mesh(spec)`): a plan whose node size differs
would put its axes on other links than the cluster has, and is refused naming both.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from tabulate import tabulate

from autopar.core.errors import PlanError
from autopar.cost.cluster import Cluster


@dataclass(frozen=True)
class CommTimeRow:
    phase: str
    kind: str
    axis: str
    link: str  # 'intra' or 'inter' node (`CommEntry.path`)
    group_size: int
    calls: int
    logical_bytes: int  # per call
    seconds: float  # all calls of a step
    why: str = ""
    stage: int | None = 0
    module: str = ""
    behind: str = ""  # the compute the runtime does while it is in flight (`CommEntry.behind`)

    @property
    def per_call(self) -> float:
        return self.seconds / self.calls if self.calls else 0.0


@dataclass(frozen=True)
class CommTime:
    cluster: Cluster
    rank: int
    rows: tuple[CommTimeRow, ...]

    @property
    def seconds(self) -> float:
        return sum(row.seconds for row in self.rows)

    def by_key(self) -> dict[tuple[str, str, str, str], float]:
        """(phase, axis, link, kind) -> seconds per step."""
        totals: dict[tuple[str, str, str, str], float] = defaultdict(float)
        for row in self.rows:
            totals[(row.phase, row.axis, row.link, row.kind)] += row.seconds
        return dict(totals)

    def table(self) -> str:
        rows = [(*key, f"{seconds * 1e3:.3f}") for key, seconds in sorted(self.by_key().items())]
        rows.append(("total", "", "", "", f"{self.seconds * 1e3:.3f}"))
        return tabulate(rows, headers=["phase", "axis", "link", "collective", "ms per step"], disable_numparse=True)


def _check_mesh(plan: Any, cluster: Cluster) -> None:
    """The plan's mesh must be the one `cluster.mesh` lays out (world size, then node size)."""
    laid = cluster.mesh(plan.mesh)
    if (plan.mesh.ranks_per_node or plan.mesh.world_size) != (laid.ranks_per_node or laid.world_size):
        raise PlanError(f"the plan's mesh puts {plan.mesh.ranks_per_node or plan.mesh.world_size} ranks on a node; "
                        f"cluster {cluster.label} has {cluster.gpus_per_node}\n"
                        f"  fix: plan with mesh=cluster.mesh({str(plan.mesh)!r})")


def comm_time(plan: Any, cluster: Cluster, *, rank: int = 0) -> CommTime:
    """Seconds of communication rank `rank` performs per step on `cluster` (module docstring)."""
    _check_mesh(plan, cluster)
    ledger = plan.comm
    rows = []
    for entry in ledger.for_rank(rank):
        logical = int(ledger.number(entry.logical_bytes))
        one_call = cluster.collective_seconds(entry.kind, entry.group_size, logical, entry.link)
        rows.append(CommTimeRow(entry.phase, entry.kind, entry.axis, entry.path, entry.group_size, entry.times,
                                logical, entry.times * one_call, entry.why, entry.stage, entry.module, entry.behind))
    return CommTime(cluster, rank, tuple(rows))
