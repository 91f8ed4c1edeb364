"""A candidate's step time and peak memory composed from one block's ledgers (`autopar/planner/block_ledgers.py`).

`composed_estimate(ledgers, candidate, cluster, global_batch=)` is `step_cost.estimate` for a
candidate that was never planned: what one block and the rest of the model hold, compute and
move under the candidate's in-node layout (tp, sp, cp, ep, recompute) come from two real plans;
what data parallelism, ZeRO and the pipeline add is the ledger formulas (`../shared/reference/
LEDGER.md`) applied to those figures, the same rules the memory and communication ledgers
implement for a planned model:

- micro-batch: the global batch over dp × ep × micro-batches (ep splits the batch of everything
  but the experts); activations, op FLOPs and bytes, and
  the layout's collectives scale with it from the plans' batch (calls and their fixed cost do
  not); parameters, gradients and optimizer state do not;
- stages: the blocks cut as `autopar/compiler/passes/split_pipeline.py` cuts them (`balanced_starts` on forward
  FLOPs, the head and loss on the last stage; the embedding's parameters on the first); the
  stage of the largest peak is the candidate's peak;
- memory (`autopar/planner/composed_memory.py`, `autopar/compiler/ledger/memory.py`'s rules): the parameters, gradients,
  optimizer state and ZeRO's transients of the rank's blocks and its share of the rest;
  activations of the micro-batches in flight (1 without a pipeline; 1F1B: min(m, p − stage);
  GPipe: m); the peak is the largest of `autopar/compiler/ledger/peak.py`'s moments over these categories (data-
  parallel buckets and ZeRO-1's buffer kept, a parameter's own gradient and ZeRO-2/3's shards
  made in backward, the loss's backward working memory from the one-block plan's fake run —
  its batch-scaled part scaled, a weight gradient alive beside it not — ZeRO-3's blocks gathered
  again, a block's hand-over, AdamW's temporary or ZeRO-1/2's re-gather); under a pipeline
  the schedule's own peak (`schedules.peak_live`: micro-batches held, the last stage's working
  memory, a block's hand-over per micro-batch under ZeRO, the sends so far);
- communication on the candidate's mesh as the cluster lays it (an axis crosses nodes when its
  groups do): the layout's collectives per micro-batch, blocking, but for backward's tensor and
  sequence-parallel input-gradient reductions, hidden by the cluster's `overlap` share of the
  weight-gradient taps of their part (a block's behind the block's, as `step_cost` does per
  stage); data-parallel gradient
  all-reduces in buckets of `bucket_cap_mb` behind backward (the last one exposed), ZeRO's
  reduce-scatters per unit behind backward and all-gathers after the optimizer (ZeRO-3: forward
  gathers behind forward, backward gathers behind backward), the cluster's `overlap` share
  hidden; the layout's own gradient synchronisation (over cp, or tp for SP's replicated norms)
  in buckets behind backward, under plain data parallelism joined with dp's into one all-reduce
  over the flattened group where their links agree (`Mesh.sync_keys`; a layout key is taken
  whole, its axes' links in the candidate not told apart); a pipeline send per stage boundary
  per micro-batch as latency;
- the pipeline's span for stage costs F_s + B_s (compute, blocking collectives and the
  exposed part of the stage's own ring sends — context parallelism's, each micro-batch's — per
  micro-batch): Σ_s (F_s + B_s) + (m − 1) · max_s (F_s + B_s), the GPipe/1F1B span, plus the
  sends' latency; a split-backward schedule's (ZB-H1, DualPipeV) simulated over its action lists
  (`_split_span`); its idle part is the bubble;
- optimizer: `step_cost`'s AdamW model over the parameters the rank updates.
Each rank is taken to have its own processor (the accelerator clusters this is for): the
processor sharing `step_cost` models for CPU ranks on shared cores is not composed.
`tests/test_composed_cost.py` compares it, candidate by candidate, with `step_cost.estimate` of
the real plans on small models.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from functools import lru_cache

from autopar.compiler.ledger.peak import moments
from autopar.compiler.passes.split_pipeline import balanced_starts
from autopar.core import schedules
from autopar.core.comm_kinds import KINDS, gradient_exchange_kind, parameter_gather_kind, wire_factor
from autopar.core.mesh import JOIN, joined_by_link
from autopar.cost.cluster import Cluster
from autopar.cost.step_cost import (
    OPTIMIZER_CALLS,
    OPTIMIZER_TRAFFIC,
    RUNTIME_COPY_TRAFFIC,
    StepEstimate,
    exposed_seconds,
    pair_seconds,
)
from autopar.planner.block_ledgers import BlockLedgers, Part
from autopar.planner.composed_memory import activation_peaks, peak_terms, rank_memory, rest_params, rest_tensors
from autopar.planner.search_space import Candidate

LOSS_REDUCTION_BYTES = 8  # fp32 (sum, count of targets): how autopar reduces a mean loss over batch shards


def axis_links(candidate: Candidate, cluster: Cluster) -> dict[str, str]:
    """Each axis's link as `Cluster.mesh` lays the candidate's mesh (axes in AXIS_ORDER, the last
    fastest-varying): 'intra' when every group of the axis stays in one node."""
    sizes = [(a, n) for a, n in candidate.degrees]
    per_node = cluster.gpus_per_node if cluster.world_size > cluster.gpus_per_node else cluster.world_size
    links, stride = {}, 1
    for axis, size in reversed(sizes):
        span = stride * size
        links[axis] = "intra" if span <= per_node and per_node % span == 0 else "inter"
        stride = span
    return links


def _wire(kind: str, group: int, logical: float) -> float:
    return wire_factor(kind, group) * logical


class _Pricer:
    """Per-call seconds of collectives on the candidate's mesh; wire bytes per pipeline stage."""

    def __init__(self, candidate: Candidate, cluster: Cluster) -> None:
        self.cluster, self.links = cluster, axis_links(candidate, cluster)
        self.sizes = dict(candidate.degrees)
        self.stage_wire: dict[int, float] = defaultdict(float)
        self.by_kind: dict[str, float] = defaultdict(float)
        self.seconds: dict[tuple[str, str, int], float] = {}

    def group(self, key: str) -> int:
        """The group size of an axis or of a key over several (`cp+tp`, `Mesh.sync_keys`)."""
        return math.prod(self.sizes.get(part, 1) for part in key.split(JOIN))

    def link(self, key: str) -> str:
        return "inter" if any(self.links.get(part, "intra") == "inter" for part in key.split(JOIN)) else "intra"

    def sync_keys(self, axes: list[str]) -> tuple[str, ...]:
        """The keys the runtime reduces a gradient partial over `axes` over on this candidate's mesh
        (`Mesh.sync_keys`): a layout's key, measured on a mesh inside one node, split where the
        candidate lays its axes on different links."""
        return joined_by_link(axes, lambda axis: self.links.get(axis, "intra"), lambda axis: self.sizes.get(axis, 1))

    def wire(self, kind: str, axis: str, logical: float) -> float:
        group = self.group(axis)
        if group <= 1 and not KINDS[kind].peer:
            return 0.0
        return _wire(kind, 2 if KINDS[kind].peer else group, logical)

    def __call__(self, kind: str, axis: str, logical: float, calls: float = 1, stage: int | None = None) -> float:
        """Seconds of one call; `calls` per step on `stage` (None: counted by the caller) go to the
        stage's wire bytes and the per-kind seconds."""
        group = self.group(axis)
        if group <= 1 and not KINDS[kind].peer:
            return 0.0
        key = (kind, axis, int(logical))
        if key not in self.seconds:
            self.seconds[key] = self.cluster.collective_seconds(kind, group, int(logical), self.link(axis))
        seconds = self.seconds[key]
        self.by_kind[f"{axis} {kind}"] += calls * seconds
        if stage is not None:
            self.stage_wire[stage] += calls * self.wire(kind, axis, logical)
        return seconds


@lru_cache(maxsize=256)
def _stage_blocks(blocks: int, stages: int, block_flops: int, tail_flops: int) -> tuple[int, ...]:
    if stages == 1:
        return (blocks,)
    if blocks > 64:  # balanced_starts is O(blocks^2 * stages): even groups, the last one lighter
        tail = tail_flops / max(block_flops, 1)
        counts = [0] * stages
        for index in range(blocks):  # greedy: the next block to the stage of least cost so far
            costs = [c + (tail if s == stages - 1 else 0) for s, c in enumerate(counts)]
            counts[costs.index(min(costs))] += 1
        return tuple(counts)
    starts = balanced_starts([block_flops] * blocks, stages, head=0, tail=tail_flops) + [blocks]
    return tuple(starts[i + 1] - starts[i] for i in range(stages))


def _stage_compute(part: Part, cluster: Cluster, scale: float) -> tuple[float, float]:
    return part.forward.seconds(cluster, scale), part.backward.seconds(cluster, scale)


def _blocking(part: Part, price: _Pricer, scale: float, times: float) -> tuple[float, float, list[float], float]:
    """(forward, backward) seconds per micro-batch of a part's blocking collectives (backward's
    reductions in flight behind the part's weight-gradient taps: their exposed share), its sends'
    seconds, and its wire bytes per micro-batch; `times` calls per step of the part (per-kind totals)."""
    forward = backward = wire = 0.0
    sends: list[float] = []
    tapped: list[float] = []
    for use, calls in part.comm.items():
        wire += calls * price.wire(use.kind, use.axis, use.logical_bytes * scale)
        if use.kind == "recv":  # the other end of a peer's send: timed once, at the sender
            continue
        seconds = price(use.kind, use.axis, use.logical_bytes * scale, calls * times)
        if use.kind == "send":
            sends += [seconds] * int(calls)
        elif use.behind:
            tapped += [seconds] * int(calls)
        elif use.phase == "forward":
            forward += calls * seconds
        else:
            backward += calls * seconds
    backward += exposed_seconds(tapped, part.taps.seconds(price.cluster, scale), price.cluster.overlap,
                                unhidden=None)
    return forward, backward, sends, wire


def _bucketed(price: _Pricer, kind: str, axis: str, nbytes: int, cap: int, stage: int) -> list[float]:
    """Per-call seconds of `nbytes` moved in buckets of `cap` bytes (each size priced once)."""
    if nbytes <= 0:
        return []
    full, left = divmod(nbytes, cap)
    calls = [price(kind, axis, cap, full, stage=stage)] * full if full else []
    return calls + ([price(kind, axis, left, 1, stage=stage)] if left else [])


def composed_estimate(ledgers: BlockLedgers, candidate: Candidate, cluster: Cluster, *, global_batch: int,
                      bucket_cap_mb: float = 25.0) -> StepEstimate:
    """`candidate`'s predicted step time and peak memory per rank (module docstring)."""
    dp, pp = candidate.degree("dp"), candidate.degree("pp")
    micro, virtual = candidate.microbatches or 1, candidate.virtual
    scale = global_batch / (dp * candidate.degree("ep") * micro) / ledgers.batch
    block, rest = ledgers.block, ledgers.rest
    price = _Pricer(candidate, cluster)
    chunks = pp * virtual

    def holder(stage: int) -> int:  # the pipeline rank of a stage: round-robin, or in a V (DualPipeV)
        return schedules.stage_coordinate(candidate.schedule or "1f1b", pp, stage)

    counts = _stage_blocks(ledgers.blocks, chunks, block.forward.flops, rest.forward.flops)
    block_f, block_b = _stage_compute(block, cluster, scale)
    rest_f, rest_b = _stage_compute(rest, cluster, scale)
    block_cf, block_cb, block_sends, block_wire = _blocking(block, price, scale, sum(counts) * micro)
    rest_cf, rest_cb, rest_sends, rest_wire = _blocking(rest, price, scale, micro)
    if dp > 1:  # the loss's (sum, count) over the data-parallel batch shards, as over cp's
        rest_cf += price("all_reduce", "dp", LOSS_REDUCTION_BYTES, micro, stage=holder(chunks - 1))
    stages = []
    for index, blocks in enumerate(counts):
        last = index == chunks - 1
        stage = _Stage(index, blocks, index == 0, last)
        stage.compute_f = blocks * block_f + (rest_f if last else 0.0)
        stage.compute_b = blocks * block_b + (rest_b if last else 0.0)
        stage.blocking_f = blocks * block_cf + (rest_cf if last else 0.0)
        stage.blocking_b = blocks * block_cb + (rest_cb if last else 0.0)
        stage.sends = block_sends * blocks + (rest_sends if last else [])
        stage.activation = scale * (blocks * block.activation_bytes + (rest.activation_bytes if last else 0))
        # a split backward's B keeps this much of the micro-batch until its W, on every stage that
        # receives (the first runs its whole backward at B)
        stage.after_input = scale * (blocks * block.hold_bytes + (rest.hold_bytes if last else 0)) if index else 0.0
        price.stage_wire[holder(index)] += micro * (blocks * block_wire + (rest_wire if last else 0.0))
        stages.append(stage)
    ranks = [_Rank([s for s in stages if holder(s.index) == r]) for r in range(pp)]
    in_flight = activation_peaks(candidate, stages, pp, micro)
    # ZeRO's gradients exchanged by all-to-all on the cluster's backend: a receive buffer of each unit's size
    exchange = bool(candidate.zero) and gradient_exchange_kind("auto", cluster.backend) == "all_to_all"
    broadcasts = parameter_gather_kind("auto", cluster.backend) == "broadcast"  # ZeRO-1/2: no send buffer
    for rank in ranks:
        rank.memory = rank_memory(ledgers, candidate, rank, in_flight[rank.index], scale, exchange=exchange)
        rank.tail = _gradient_and_optimizer(ledgers, candidate, cluster, price, rank, int(bucket_cap_mb * 2**20), micro)
    if pp == 1:
        stage, tail = stages[0], ranks[0].tail
        compute = stage.compute_f + stage.compute_b
        exposed = (stage.blocking_f + stage.blocking_b
                   + exposed_seconds(stage.sends, compute, cluster.overlap, unhidden="first")
                   + exposed_seconds(tail.behind_forward, stage.compute_f, cluster.overlap, unhidden="first")
                   + exposed_seconds(tail.behind_backward, stage.compute_b, cluster.overlap, unhidden="last")
                   + tail.after)
        parts = {"compute": compute + tail.copies, "communication": exposed, "bubble": 0.0,
                 "optimizer": tail.optimizer}
    else:
        parts = _pipelined(stages, ranks, candidate, cluster, price, ledgers, scale, micro)
    for rank in ranks:
        rank.moments = moments(peak_terms(ledgers, candidate, rank, stages, in_flight[rank.index], scale, micro,
                                           exchange=exchange, broadcasts=broadcasts))
    peak = max(ranks, key=lambda r: max(r.moments.values()))
    return StepEstimate(cluster=cluster, seconds=sum(parts.values()), parts=parts,
                        comm_seconds=sum(price.by_kind.values()) / pp,
                        wire_bytes=int(max(price.stage_wire.values(), default=0)),
                        peak_bytes=max(peak.moments.values()), memory=peak.memory, moments=peak.moments,
                        comm_by_kind=dict(price.by_kind), held_bytes=max(sum(r.memory.values()) for r in ranks))


class _Stage:
    """A pipeline stage (a virtual one under interleaving): its blocks and per-micro-batch costs."""

    def __init__(self, index: int, blocks: int, first: bool, last: bool) -> None:
        self.index, self.blocks, self.first, self.last = index, blocks, first, last
        self.compute_f = self.compute_b = self.blocking_f = self.blocking_b = self.activation = 0.0
        self.after_input = 0.0  # from a split backward's B to its W, per micro-batch
        self.sends: list[float] = []


class _Rank:
    """The stages one pipeline rank runs (one; `virtual` under interleaving)."""

    def __init__(self, stages: list[_Stage]) -> None:
        self.stages = stages
        self.index = stages[0].index if stages else 0
        self.blocks = sum(s.blocks for s in stages)
        self.first, self.last = any(s.first for s in stages), any(s.last for s in stages)
        self.memory: dict[str, int] = {}
        self.moments: dict[str, int] = {}
        self.tail: "_Tail | None" = None


class _Tail:
    def __init__(self) -> None:
        self.behind_forward: list[float] = []
        self.behind_backward: list[float] = []
        self.after = self.copies = self.optimizer = 0.0


def _gradient_and_optimizer(ledgers: BlockLedgers, candidate: Candidate, cluster: Cluster, price: _Pricer,
                            stage: "_Rank", cap: int, micro: int) -> _Tail:
    """A stage's data-parallel (and the layout's own) gradient collectives, ZeRO's copies and the
    optimizer step, once per step."""
    tail, at = _Tail(), stage.index
    block, rest = ledgers.block, ledgers.rest
    rest_bytes = rest_params(ledgers, stage.first, stage.last)
    full = stage.blocks * block.param_bytes + rest_bytes
    dp, zero = candidate.degree("dp"), candidate.zero
    units = [block.param_bytes] * stage.blocks + ([rest_bytes] if rest_bytes else [])
    tensors = [block.param_tensors] * stage.blocks + ([rest_tensors(ledgers, stage.first, stage.last)]
                                                      if rest_bytes else [])
    # the layout's own reductions (its keys are disjoint: each parameter under one), the rest's
    # keys too where the stage holds the rest
    synced = {key: stage.blocks * block.grad_sync.get(key, 0) + (rest.grad_sync.get(key, 0)
                                                                 if stage.last or stage.first else 0)
              for key in sorted(block.grad_sync.keys() | rest.grad_sync.keys())}
    if dp > 1 and zero == 0:
        # a gradient the layout reduces is partial over dp too: reduced over dp and the key's axes
        # together where their links agree (`Mesh.sync_keys`); dp's own all-reduce carries the rest
        for key, nbytes in synced.items():
            for chained in price.sync_keys(["dp", *key.split(JOIN)]):
                tail.behind_backward += _bucketed(price, "all_reduce", chained, nbytes, cap, at)
        tail.behind_backward += _bucketed(price, "all_reduce", "dp", max(full - sum(synced.values()), 0), cap, at)
        synced = {}
    elif dp > 1:
        gathers = micro if zero == 3 else 1
        reduction = gradient_exchange_kind("auto", cluster.backend)  # reduce-scatter, or gloo's exchange
        gather = parameter_gather_kind("auto", cluster.backend)  # all-gather, or gloo's owner broadcasts
        # a block unit's tensorwise FP8 weights travel one byte an element, after an all-reduce of
        # their largest magnitudes (`core/ops/float8_gather.py`; by all-gather only)
        fp8 = block.fp8_gathered if zero == 3 and gather == "all_gather" else Counter()
        for index, (unit, count) in enumerate(zip(units, tensors)):
            tail.behind_backward.append(price(reduction, "dp", unit, stage=at))
            copy = RUNTIME_COPY_TRAFFIC * unit / cluster.bandwidth_for(unit) + (2 + count) * cluster.op_overhead
            tail.copies += copy
            if zero < 3:
                tail.copies += copy
                continue
            mine = fp8 if index < stage.blocks and fp8["elements"] else Counter()
            for nbytes in [unit - mine["bytes"]] + ([mine["elements"]] if mine else []):
                tail.behind_forward += _gather_seconds(price, gather, dp, nbytes, gathers, at)
                tail.behind_backward += _gather_seconds(price, gather, dp, nbytes, gathers, at)
            if mine:
                scales = mine["tensors"] * (mine["bytes"] // mine["elements"])
                tail.behind_forward += [price("all_reduce", "dp", scales, gathers, stage=at)] * gathers
            tail.copies += 2 * gathers * copy
        for part in (stage.stages if zero < 3 else []):  # each pipeline stage's units in one collective
            staged = part.blocks * block.param_bytes + rest_params(ledgers, part.first, part.last)
            tail.after += sum(_gather_seconds(price, gather, dp, staged, 1, at))
    shard = dp if zero and dp > 1 else 1  # ZeRO reduces a unit's extra axes on its shard, after the reduce-scatter
    for key, nbytes in synced.items():
        for chained in price.sync_keys(key.split(JOIN)):
            tail.behind_backward += _bucketed(price, "all_reduce", chained, math.ceil(nbytes / shard), cap, at)
    owned = math.ceil(full / dp) if zero >= 1 else full
    tail.optimizer = (OPTIMIZER_CALLS * sum(tensors) * cluster.op_overhead  # each tensor at the mean's bandwidth
                      + OPTIMIZER_TRAFFIC * owned / cluster.bandwidth_for(owned / max(sum(tensors), 1)))
    return tail


def _gather_seconds(price: _Pricer, kind: str, dp: int, nbytes: int, gathers: int, at: int) -> list[float]:
    """Each call of `gathers` gathers of `nbytes` over dp: an all-gather, or one broadcast per owner
    of a dp-th of it (`comm_kinds.parameter_gather_kind`)."""
    calls, kind, size = (dp, "broadcast", math.ceil(nbytes / dp)) if kind == "broadcast" else (1, "all_gather", nbytes)
    return [price(kind, "dp", size, gathers * calls, stage=at)] * (gathers * calls)


def _split_span(stages: list[_Stage], candidate: Candidate, cluster: Cluster, micro: int, send: float,
                pp: int) -> tuple[float, list[float]]:
    """The span of a split-backward schedule (ZB-H1, DualPipeV), by `schedules.simulate`, and the
    seconds each rank spends running: their W passes fill what 1F1B leaves idle and
    DualPipeV's phases mix full and split backwards, for which no closed form is kept here; each
    stage's F is its forward (with what blocks it and its ring), B and W each half its backward (a
    full backward: both), every hand-over between ranks waiting `send` (the one at a V's turn
    moves nothing); DualPipeV's paired forward and full backward take `pair_seconds` where the
    cluster's ranks run them side by side (`schedules.SIDE_BY_SIDE_BACKENDS`)."""
    by_index = {s.index: s for s in stages}
    forward = {s.index: s.compute_f + s.blocking_f + exposed_seconds(s.sends, s.compute_f + s.compute_b,
                                                                     cluster.overlap, unhidden="first") for s in stages}
    backward = {s.index: s.compute_b + s.blocking_b for s in stages}
    orders = schedules.actions(candidate.schedule, degree=pp, virtual=candidate.virtual, microbatches=micro)
    side_by_side = cluster.backend in schedules.SIDE_BY_SIDE_BACKENDS
    pairs = schedules.overlapped(candidate.schedule, degree=pp, virtual=candidate.virtual,
                                 microbatches=micro) if side_by_side else None

    def cost(action: schedules.Action) -> float:
        return forward[action.stage] if action.kind == "F" else backward[action.stage] / 2

    def pair_cost(f: schedules.Action, b: schedules.Action) -> float:  # b: a full backward (its W is done in it)
        computing_f, computing_b = by_index[f.stage].compute_f, by_index[b.stage].compute_b
        return pair_seconds((computing_f, forward[f.stage] - computing_f),
                            (computing_b, backward[b.stage] - computing_b))

    timed = schedules.simulate(orders, cost, stages=len(stages), split_backward=True, latency=send,
                               rank_of=lambda stage: schedules.stage_coordinate(candidate.schedule, pp, stage),
                               pairs=pairs, pair_cost=pair_cost)
    return max(t.end for t in timed) - min(t.start for t in timed), schedules.busy_seconds(timed, pp)


def _pipelined(stages: list[_Stage], ranks: list[_Rank], candidate: Candidate, cluster: Cluster, price: _Pricer,
               ledgers: BlockLedgers, scale: float, micro: int) -> dict[str, float]:
    """The span of the schedule for per-rank work T_r (its stages' F + B per micro-batch):
    Σ_r T_r / v + (m − 1/v) · max_r T_r — GPipe's and 1F1B's (m + p − 1) · T, interleaving's
    (m + (p − 1)/v) · T (Narayanan et al. 2021) for equal ranks — plus a hand-over's latency
    (`Cluster.handover_seconds`) per stage boundary on the way down and back.
    (`schedules.simulate` runs every action; for p · m · v in the thousands that is seconds per
    candidate, which the composed search cannot spend.)"""
    pp, chunks, virtual = len(ranks), len(stages), candidate.virtual
    boundary = ledgers.boundary_bytes * scale

    def crosses(stage: int) -> bool:  # the hand-over from `stage` to the next goes to another rank (not a V's turn)
        return schedules.stage_coordinate(candidate.schedule, pp, stage) != schedules.stage_coordinate(
            candidate.schedule, pp, stage + 1)

    crossing = sum(crosses(s) for s in range(chunks - 1))
    price("send", "pp", boundary, 2 * micro * crossing)  # the wire bytes and per-kind seconds
    send = cluster.handover_seconds(int(boundary), price.links.get("pp", "intra"))
    for rank in ranks:  # per micro-batch at each boundary of each of its stages: one transfer forward, one backward
        boundaries = sum((not s.first and crosses(s.index - 1)) + (not s.last and crosses(s.index)) for s in rank.stages)
        price.stage_wire[rank.index] += 2 * micro * boundaries * price.wire("send", "pp", boundary)
    work = [sum(s.compute_f + s.compute_b + s.blocking_f + s.blocking_b
                + exposed_seconds(s.sends, s.compute_f + s.compute_b, cluster.overlap, unhidden="first")  # cp's ring
                for s in r.stages) for r in ranks]
    critical = max(range(pp), key=work.__getitem__)
    busy = micro * work[critical]
    if candidate.schedule in schedules.SPLIT_BACKWARD:
        span, running = _split_span(stages, candidate, cluster, micro, send, pp)
        busy = min(busy, running[critical])  # DualPipeV's pairs: one's communication hidden behind the other's compute
    else:
        span = sum(work) / virtual + (micro - 1 / virtual) * work[critical] + 2 * (chunks - 1) * send
    compute = micro * sum(s.compute_f + s.compute_b for s in ranks[critical].stages)
    ends = []
    for rank in ranks:
        tail = rank.tail
        last_backward = min(s.compute_b / max(s.blocks, 1) for s in rank.stages)
        communication = (exposed_seconds(tail.behind_backward, last_backward, cluster.overlap, unhidden="last")
                         + tail.after + sum(tail.behind_forward))
        ends.append((communication, tail.copies, tail.optimizer))
    communication, copies, optimizer = max(ends, key=sum)
    return {"compute": compute + copies, "communication": busy - compute + communication,
            "bubble": span - busy, "optimizer": optimizer}
