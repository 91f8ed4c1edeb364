"""The bubble ledger: how much of a pipeline step each rank idles, predicted from the program.

Each stage's forward is priced by the compute ledger (`ledger.compute.node_flops` over the stage
graph: one micro-batch, global shapes — every stage is split alike over the other axes, so only
ratios matter); a full backward costs two forwards (input and weight gradients), a split
backward's B and W one each — except on a stage that receives nothing (the first), whose B is
its whole backward and W empty, as the runtime runs it. Measured on CPU (benchmarks/
pipeline_bubble.py) a backward costs ~1.7 forwards and B + W ~1.5 full backwards; the ledger
counts operations, a calibrated cost model is the planner's business. The rank's actions (`autopar.core.schedules.actions`) run through
`schedules.simulate`, which gives every action's start and end in units of the heaviest stage's
forward: the predicted timeline the picture draws beside a measured one, and per rank the idle
fraction of the step. On a machine with fewer cores than pipeline ranks, `cores=` shares them
(processor sharing), which is what such a machine measures. The textbook figure for balanced stages is printed beside it
(`formula`): (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, and for ZB-H1
(p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)), which is (p-1)/(3m+p-1) at equal F, B and W.
`measured_fractions(timelines)` turns the timestamps a run recorded into the same figure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tabulate import tabulate

from autopar.compiler.flops import node_flops
from autopar.core import schedules


@dataclass(frozen=True)
class BubbleLedger:
    schedule: str
    degree: int
    virtual: int
    microbatches: int
    stage_flops: dict[int, int]
    timeline: list[schedules.Timed]  # predicted, in units of the heaviest stage's forward
    fractions: list[float]  # idle fraction of the step per pipeline rank

    @property
    def formula(self) -> float:
        p, m, v = self.degree, self.microbatches, self.virtual
        if self.schedule in schedules.V_SHAPED:  # half-size stages: p - 1 of their actions idle per rank
            return (p - 1) / (6 * m + p - 1)
        if self.schedule in schedules.SPLIT_BACKWARD:
            return (p - 1) / (3 * m + p - 1)
        if self.schedule == "interleaved_1f1b":
            return (p - 1) / (v * m + p - 1)
        return (p - 1) / (m + p - 1)

    def table(self) -> str:
        rows = [[rank, f"{fraction:.1%}"] for rank, fraction in enumerate(self.fractions)]
        header = (f"schedule {self.schedule}: p={self.degree}, v={self.virtual}, m={self.microbatches}; "
                  f"balanced-stage formula {self.formula:.1%}\n")
        return header + tabulate(rows, headers=["pp rank", "idle (predicted)"], tablefmt="simple")


def build_bubble_ledger(plan: Any, *, cores: int | None = None) -> BubbleLedger:
    """`cores`: the ranks of one pipeline share that many processors (a host with fewer cores
    than ranks); None: each rank has its own."""
    layout = plan.pipeline
    flops = {stage.index: sum(node_flops(n) for n in stage.graph_module.graph.nodes) for stage in plan.stages}
    unit = max(flops.values()) or 1
    split = layout.schedule in schedules.SPLIT_BACKWARD

    whole = {stage.index for stage in plan.stages if not stage.receives}  # nothing to split: B is the whole backward

    orders = schedules.actions(layout.schedule, degree=layout.degree, virtual=layout.virtual,
                               microbatches=layout.microbatches)
    pairs = schedules.overlapped(layout.schedule, degree=layout.degree, virtual=layout.virtual,
                                 microbatches=layout.microbatches) if layout.overlap else None

    def cost(action: schedules.Action) -> float:
        forward = flops[action.stage] / unit
        if action.kind == "F":
            return forward
        if split and action.stage in whole:
            return 2 * forward if action.kind == "B" else 0.0
        return forward if split else 2 * forward

    # a pair's two halves share the rank's processor: compute alone, they take their sum (simulate's
    # default; what overlapping them hides is communication, which this ledger does not price)
    timed = schedules.simulate(orders, cost, stages=layout.stages, split_backward=split, cores=cores,
                               rank_of=layout.coordinate, pairs=pairs)
    return BubbleLedger(schedule=layout.schedule, degree=layout.degree, virtual=layout.virtual,
                        microbatches=layout.microbatches, stage_flops=flops, timeline=timed,
                        fractions=schedules.bubble_fractions(timed, layout.degree))


def measured_timeline(timelines: list[list[Any]]) -> list[schedules.Timed]:
    """A run's actions (one list of `TimedAction`s per pipeline rank) as compute intervals: each
    action's time blocked in receives (at its start: the receive comes first) is not compute."""
    timed = []
    for rank, actions in enumerate(timelines):
        for a in actions:
            timed.append(schedules.Timed(schedules.Action(a.kind, a.stage, a.microbatch), rank,
                                         a.start + a.waited, a.end))
    return timed


def waited_seconds(timelines: list[list[Any]]) -> dict[tuple[int, str, int, int], float]:
    """(rank, kind, stage, micro-batch) -> seconds the action waited for a receive (for the picture)."""
    return {(rank, a.kind, a.stage, a.microbatch): a.waited for rank, actions in enumerate(timelines) for a in actions}


def measured_fractions(timelines: list[list[Any]]) -> list[float]:
    """Per pipeline rank, the idle fraction of the step a run recorded."""
    return schedules.bubble_fractions(measured_timeline(timelines), len(timelines))
