"""The cost model: a plan's step time and peak memory per rank on a `Cluster`, read off its ledgers.

`estimate(plan, cluster)` puts together, for the ranks that differ (rank 0; under a pipeline one
rank per pipeline coordinate, the others' coordinates 0 — ranks of one stage run the same graph):

- compute: the op ledger (`autopar/compiler/ledger/op_cost.py`): every call of the rank's emitted graph, forward
  and backward (recomputation included), on a roofline per call plus the cluster's fixed cost
  per call; the optimizer step from the memory ledger's optimizer entries (AdamW reads parameter,
  gradient and both moments and writes three of them: 7 × the parameter's bytes, in
  `OPTIMIZER_CALLS` calls per tensor, as `torch.optim.AdamW`'s single-tensor loop makes them);
- communication: the communication ledger priced by α-β per link (`cost.comm_time`). What the
  runtime issues asynchronously hides behind compute by the cluster's `overlap` share:
  gradient buckets and ZeRO reduce-scatters (`grad_sync`) behind backward, ZeRO-3's prefetched
  forward gathers behind forward; the last bucket (the first gather) cannot hide, nothing
  follows (precedes) it; context parallelism's ring sends behind the attention they feed (a
  receive is the other end of a send a peer makes at the same time: counted once, as the send);
  tensor and sequence parallelism's input-gradient reductions in backward (an f's all-reduce,
  SP's reduce-scatter) behind the weight-gradient taps the scheduling pass puts between their
  halves (`CommEntry.behind`; the op ledger's `RankOps.taps`, per stage, all such reductions
  against all taps: each can hide whole). ZeRO's own copies around its collectives (outside the
  rank graph) cost their bytes through memory. Everything else waits where it is issued (the
  forward's tensor, sequence, context and expert parallelism's collectives feed the next op),
  and the optimizer's and the step's collectives come after backward;
- the pipeline: each stage's forward and backward per micro-batch (compute plus its blocking
  collectives plus the exposed part of its own ring sends — context parallelism's, which a
  stage makes at every micro-batch) run through the schedule's own action lists
  (`schedules.simulate`; the pipeline's own sends are the latency between stages, a hand-over's
  time each: `Cluster.handover_seconds`, a lone message's α where the cluster measured one): the
  step's span, whose idle part is the bubble;
- memory: the largest of the step's moments (`autopar/compiler/ledger/peak.py`: backward starting, the first ZeRO
  unit's gradients handed over, the optimizer step), each the memory ledger's categories that
  live then: the predicted peak.

`StepEstimate.parts` splits the predicted step into compute, exposed communication, bubble and
optimizer; `binding` names what bounds the plan (memory that does not fit, else the largest
part). Nothing is fitted per model: the cluster's few numbers (`autopar.calibrate`) and the
ledgers are all there is.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from autopar.compiler.ledger.fake_run import rank_ops
from autopar.compiler.ledger.op_cost import RankOps
from autopar.compiler.ledger.peak import moments, peak_terms
from autopar.core import schedules
from autopar.cost.cluster import GB, Cluster
from autopar.cost.comm_cost import CommTimeRow, comm_time

OPTIMIZER_CALLS = 12  # torch.optim.AdamW (foreach=False) per parameter tensor: lerp_, mul_, addcmul_, sqrt, ...
OPTIMIZER_TRAFFIC = 7  # bytes moved per byte of parameter (read p, g, m, v; write p, m, v)
RUNTIME_COPY_TRAFFIC = 4  # a copy into the collective's buffer and one out of it, each read + write


@dataclass(frozen=True)
class StepEstimate:
    cluster: Cluster
    seconds: float
    parts: dict[str, float]  # compute, communication (exposed), bubble, optimizer
    comm_seconds: float  # every collective's time, hidden or not, on the busiest rank
    wire_bytes: int  # per step, on the busiest rank
    peak_bytes: int  # the largest over the ranks
    memory: dict[str, int] = field(default_factory=dict)  # categories on the rank of the largest peak
    moments: dict[str, int] = field(default_factory=dict)  # bytes alive at each moment on that rank (autopar/compiler/ledger/peak.py)
    held_bytes: int = 0  # every memory category at once, the largest over the ranks (the ledger's sum)
    comm_by_kind: dict[str, float] = field(default_factory=dict)  # "axis kind" -> seconds (exposed or not)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.cluster.memory_bytes

    @property
    def binding(self) -> str:
        if not self.fits:
            when = f" ({max(self.moments, key=self.moments.get)})" if self.moments else ""
            return (f"memory: {self.peak_bytes / GB:.3g} GB per rank at the peak{when}, {self.cluster.memory_gb:g} GB "
                    f"available")
        part, seconds = max(self.parts.items(), key=lambda item: item[1])
        share = seconds / self.seconds if self.seconds else 0.0
        detail = ""
        if part == "communication" and self.comm_by_kind:
            detail = "; most of it " + max(self.comm_by_kind.items(), key=lambda item: item[1])[0]
        return f"{part}: {share:.0%} of the step{detail}"


def _representative_ranks(plan: Any) -> list[int]:
    """Rank 0; under a pipeline the first rank of each pipeline coordinate."""
    if plan.pipeline is None:
        return [0]
    axis, mesh = plan.pipeline.axis, plan.mesh
    chosen: dict[int, int] = {}
    for rank in range(mesh.world_size):
        if all(mesh.coordinate(rank, a) == 0 for a in mesh.names if a != axis):
            chosen.setdefault(mesh.coordinate(rank, axis), rank)
    return [chosen[c] for c in sorted(chosen)]


def _kind(row: CommTimeRow) -> str:
    if row.behind:
        return "behind taps"
    if row.phase == "grad_sync":
        return "behind backward"
    if row.phase == "forward" and row.why.startswith("ZeRO-3 parameters before use"):
        return "behind forward"
    if row.phase in ("optimizer", "step"):
        return "after"
    if row.kind == "recv":  # the other end of a send the peer makes meanwhile: counted once, at the sender
        return "paired"
    if row.kind == "send":
        return "p2p"
    return "blocking"


def exposed_seconds(calls: list[float], compute: float, overlap: float, *, unhidden: str | None) -> float:
    """Seconds of asynchronous calls left exposed by `compute` seconds of work beside them; the
    `unhidden` end ('last' or 'first') call cannot hide (None: each has compute beside it)."""
    if not calls:
        return 0.0
    fixed = 0.0 if unhidden is None else calls[-1] if unhidden == "last" else calls[0]
    total = sum(calls)
    return total - min(total - fixed, overlap * compute)


def pair_seconds(forward: tuple[float, float], backward: tuple[float, float]) -> float:
    """A forward and another micro-batch's backward run side by side (DualPipeV's pairs), each
    given as (compute, blocking communication) seconds: the two computations share the rank's
    processor, each one's communication waits while the other computes — DeepSeek-V3's claim for
    its all-to-alls, taken whole — and neither half takes less than its own compute and
    communication one after the other."""
    return max(forward[0] + backward[0], forward[1] + backward[1], sum(forward), sum(backward))


def _optimizer_seconds(ledger: Any, cluster: Cluster) -> float:
    seconds = 0.0
    for entry in ledger.entries:
        if entry.category == "optimizer state":
            param_bytes = (int(ledger.number(entry.bytes)) - 4) / 2
            seconds += (OPTIMIZER_CALLS * cluster.op_overhead
                        + OPTIMIZER_TRAFFIC * param_bytes / cluster.bandwidth_for(param_bytes))
    return seconds


def _runtime_copies(plan: Any, rows: list[CommTimeRow], cluster: Cluster) -> float:
    """ZeRO's own copies around its collectives, outside the rank graph (`autopar/core/ops/sharded_state.py`):
    the parameters or gradients of a unit concatenated into the buffer a collective moves and laid
    out again from the one it returns — `RUNTIME_COPY_TRAFFIC` × the logical bytes, one call per
    parameter and two more per collective."""
    params = {unit.index: len(unit.params) for unit in plan.units}
    seconds = 0.0
    for row in rows:
        if row.module.startswith("unit "):
            count = sum(params.get(int(index), 1) for index in row.module.split()[1].split(","))  # a refresh: several
            # the owners' broadcasts of a refresh land in one buffer, laid out once: one pass over them all
            calls, nbytes = (1, row.calls * row.logical_bytes) if row.kind == "broadcast" else (row.calls,
                                                                                                  row.logical_bytes)
            seconds += calls * (RUNTIME_COPY_TRAFFIC * nbytes / cluster.bandwidth_for(nbytes)
                                + (2 + count) * cluster.op_overhead)
    return seconds


@dataclass
class _RankParts:
    rows: list[CommTimeRow]
    memory: dict[str, int]
    optimizer: float
    moments: dict[str, int] = field(default_factory=dict)

    def calls(self, kind: str, stage: int | None = None, phase: str | None = None,
              axis: Callable[[str], bool] | None = None) -> list[float]:
        return [row.per_call for row in self.rows for _ in range(row.calls) if _kind(row) == kind
                and (stage is None or row.stage in (stage, None)) and (phase is None or row.phase == phase)
                and (axis is None or axis(row.axis))]

    def seconds(self, kind: str, **where: Any) -> float:
        return sum(self.calls(kind, **where))


def estimate(plan: Any, cluster: Cluster) -> StepEstimate:
    """Predicted step time and peak memory of `plan` on `cluster` (module docstring)."""
    ranks = _representative_ranks(plan)
    parts: dict[int, _RankParts] = {}
    ops: dict[int, RankOps] = {}
    for rank in ranks:
        ledger = plan.memory(rank=rank)
        for stage in plan.stages_of_rank(rank):
            ops[stage.index] = rank_ops(plan, rank, stage=stage.index)
        parts[rank] = _RankParts(list(comm_time(plan, cluster, rank=rank).rows), ledger.by_category(),
                                 _optimizer_seconds(ledger, cluster), moments(peak_terms(plan, ledger, rank=rank, ops=ops)))
    overlap = cluster.overlap
    if plan.pipeline is None:
        rank = parts[0]
        forward, backward = ops[0].forward.seconds(cluster), ops[0].backward.seconds(cluster)
        exposed = (rank.seconds("blocking") + rank.seconds("after")
                   + exposed_seconds(rank.calls("behind forward"), forward, overlap, unhidden="first")
                   + exposed_seconds(rank.calls("behind backward"), backward, overlap, unhidden="last")
                   + exposed_seconds(rank.calls("p2p"), forward + backward, overlap, unhidden="first")
                   + exposed_seconds(rank.calls("behind taps"), ops[0].taps.seconds(cluster), overlap, unhidden=None))
        split = {"compute": forward + backward + _runtime_copies(plan, rank.rows, cluster), "communication": exposed,
                 "bubble": 0.0, "optimizer": rank.optimizer}
    else:
        split = _pipelined(plan, cluster, ranks, parts, ops)
    busiest = max(ranks, key=lambda r: sum(row.seconds for row in parts[r].rows))
    peak_rank = max(ranks, key=lambda r: max(parts[r].moments.values()))
    by_kind: dict[str, float] = defaultdict(float)
    for row in parts[busiest].rows:
        by_kind[f"{row.axis} {row.kind}"] += row.seconds
    ledger = plan.comm
    wire = sum(int(ledger.number(e.wire_bytes)) * e.times for e in ledger.for_rank(busiest))
    return StepEstimate(cluster=cluster, seconds=sum(split.values()), parts=split,
                        comm_seconds=sum(row.seconds for row in parts[busiest].rows), wire_bytes=wire,
                        peak_bytes=max(parts[peak_rank].moments.values()), memory=parts[peak_rank].memory,
                        moments=parts[peak_rank].moments, comm_by_kind=dict(by_kind),
                        held_bytes=max(sum(parts[r].memory.values()) for r in ranks))


def _pipelined(plan: Any, cluster: Cluster, ranks: list[int], parts: dict[int, _RankParts],
               ops: dict[int, RankOps]) -> dict[str, float]:
    layout = plan.pipeline
    micro = layout.microbatches
    holder = {stage.index: rank for rank in ranks for stage in plan.stages_of_rank(rank)}
    forward, backward = {}, {}
    computing_f, computing_b = {}, {}  # their compute alone (a pair hides the rest: `pair_seconds`)

    def inside(axis: str) -> bool:  # a stage's own transfers (context parallelism's ring), not the pipeline's
        return axis != layout.axis

    for index, rank in holder.items():
        compute_f, compute_b = ops[index].forward.seconds(cluster), ops[index].backward.seconds(cluster)
        computing_f[index], computing_b[index] = compute_f, compute_b
        blocking_f = parts[rank].seconds("blocking", stage=index, phase="forward") / micro
        blocking_b = parts[rank].seconds("blocking", stage=index, phase="backward") / micro
        ring_f = parts[rank].calls("p2p", stage=index, phase="forward", axis=inside)
        ring_b = parts[rank].calls("p2p", stage=index, phase="backward", axis=inside)
        tapped = parts[rank].calls("behind taps", stage=index)
        forward[index] = (compute_f + blocking_f
                          + exposed_seconds(ring_f, compute_f * micro, cluster.overlap, unhidden="first") / micro)
        backward[index] = (compute_b + blocking_b
                           + exposed_seconds(ring_b, compute_b * micro, cluster.overlap, unhidden="first") / micro
                           + exposed_seconds(tapped, ops[index].taps.seconds(cluster) * micro, cluster.overlap,
                                             unhidden=None) / micro)
    split = layout.schedule in schedules.SPLIT_BACKWARD
    whole = {stage.index for stage in plan.stages if not stage.receives}
    orders = schedules.actions(layout.schedule, degree=layout.degree, virtual=layout.virtual, microbatches=micro)
    side_by_side = layout.overlap and cluster.backend in schedules.SIDE_BY_SIDE_BACKENDS
    pairs = schedules.overlapped(layout.schedule, degree=layout.degree, virtual=layout.virtual,
                                 microbatches=micro) if side_by_side else None

    # ranks sharing processors: an action's work in processor-seconds, the pipeline's share of the
    # node's processors (its data-parallel replicas run beside it)
    speedup = cluster.alone_speedup
    cores = cluster.processors * layout.degree / cluster.gpus_per_node if speedup > 1 else None

    def cost(action: schedules.Action) -> float:
        if action.kind == "F":
            return forward[action.stage] / speedup
        if split and action.stage in whole:
            return backward[action.stage] / speedup if action.kind == "B" else 0.0
        return (backward[action.stage] / 2 if split else backward[action.stage]) / speedup

    def pair_cost(f: schedules.Action, b: schedules.Action) -> float:  # b: a full backward (its W is done in it)
        return pair_seconds((computing_f[f.stage], forward[f.stage] - computing_f[f.stage]),
                            (computing_b[b.stage], backward[b.stage] - computing_b[b.stage])) / speedup

    handovers = [cluster.handover_seconds(row.logical_bytes, row.link) for rank in ranks for row in parts[rank].rows
                 if row.calls and row.axis == layout.axis and _kind(row) == "p2p"]
    timed = schedules.simulate(orders, cost, stages=layout.stages, split_backward=split,
                               latency=max(handovers, default=0.0), cores=cores, rank_of=layout.coordinate,
                               pairs=pairs, pair_cost=pair_cost)
    span = max(t.end for t in timed)
    busy = dict(enumerate(schedules.busy_seconds(timed, layout.degree)))
    critical = max(busy, key=busy.get)
    compute = min(busy[critical], sum(ops[i].forward.seconds(cluster) + ops[i].backward.seconds(cluster)
                                      for i, r in holder.items()
                                      if plan.mesh.coordinate(r, layout.axis) == critical) * micro / speedup)
    tails = []
    for rank in ranks:
        last_backward = min(backward[s.index] for s in plan.stages_of_rank(rank))
        behind = parts[rank].calls("behind backward")
        communication = (exposed_seconds(behind, last_backward, cluster.overlap, unhidden="last")
                         + parts[rank].seconds("after") + parts[rank].seconds("behind forward"))
        tails.append((communication, _runtime_copies(plan, parts[rank].rows, cluster), parts[rank].optimizer))
    communication, copies, optimizer = max(tails, key=sum)
    return {"compute": compute + copies, "communication": busy[critical] - compute + communication,
            "bubble": span - busy[critical], "optimizer": optimizer}
