"""A candidate's step time and peak memory composed from one block's ledgers (`block_ledgers.py`).

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
- stages: the blocks cut as `passes/split_pipeline.py` cuts them (`balanced_starts` on forward
  FLOPs, the head and loss on the last stage; the embedding's parameters on the first); the
  stage of the largest peak is the candidate's peak;
- memory (`ledger/memory.py`'s rules): gradients of the parameters' size and dtype; AdamW's two
  moments and a 4-byte step per tensor; ZeRO-1 shards the optimizer state (and keeps a full
  gradient buffer and a replicated compute copy), ZeRO-2 also the gradients, ZeRO-3 also the
  parameters, with their transients (units gathered at once, reduce-scatter inputs in flight, a
  unit's gradients being laid out); a unit is a block, the rest of the model is the root unit;
  activations of the micro-batches in flight (1 without a pipeline; 1F1B: min(m, p − stage);
  GPipe: m); the peak is the largest of `ledger/peak.py`'s moments over these categories (data-
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
  sends' latency; its idle part is the bubble;
- optimizer: `step_cost`'s AdamW model over the parameters the rank updates.
Each rank is taken to have its own processor (the accelerator clusters this is for): the
processor sharing `step_cost` models for CPU ranks on shared cores is not composed.
`tests/test_composed_cost.py` compares it, candidate by candidate, with `step_cost.estimate` of
the real plans on small models.
"""
from __future__ import annotations

import math
from collections import defaultdict
from functools import lru_cache

from autopar.block_ledgers import BlockLedgers, Part
from autopar.cluster import Cluster
from autopar.comm_kinds import KINDS, gradient_exchange_kind, wire_factor
from autopar.ledger.peak import PeakTerms, moments
from autopar.mesh import JOIN, joined_by_link
from autopar.search_space import Candidate
from autopar.step_cost import OPTIMIZER_CALLS, OPTIMIZER_TRAFFIC, RUNTIME_COPY_TRAFFIC, StepEstimate, exposed_seconds

LOSS_REDUCTION_BYTES = 8  # fp32 (sum, count of targets): how autopar reduces a mean loss over batch shards
GRAD_BYTES_PER_PARAM_BYTE = 1  # a gradient has its parameter's size and dtype
ADAM_MOMENTS = 2


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
    from passes.split_pipeline import balanced_starts

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


def _rest_params(ledgers: BlockLedgers, first: bool, last: bool) -> int:
    """The rest's parameter bytes a stage holds: the embedding on the first, the others on the last."""
    return (ledgers.first_params if first else 0) + (ledgers.rest.param_bytes - ledgers.first_params if last else 0)


def _rest_tensors(ledgers: BlockLedgers, first: bool, last: bool) -> int:
    return (ledgers.first_tensors if first else 0) + (ledgers.rest.param_tensors - ledgers.first_tensors if last else 0)


def _units(part_bytes: list[int], largest: int) -> int:
    return sum(sorted(part_bytes, reverse=True)[:largest])


def _rank_memory(ledgers: BlockLedgers, candidate: Candidate, rank: "_Rank", activations: float,
                 scale: float, *, exchange: bool = False) -> dict[str, int]:
    block, rest = ledgers.block, ledgers.rest
    blocks, first, last = rank.blocks, rank.first, rank.last
    dp, zero = candidate.degree("dp"), candidate.zero
    rest_params = _rest_params(ledgers, first, last)
    params = blocks * block.param_bytes + rest_params
    tensors = blocks * block.param_tensors + _rest_tensors(ledgers, first, last)
    grads = params * GRAD_BYTES_PER_PARAM_BYTE
    units = [block.param_bytes] * blocks + ([rest_params] if rest_params else [])
    shard = math.ceil(params / dp)
    memory = {"parameters": params, "model buffers": blocks * block.buffer_bytes + (rest.buffer_bytes if last else 0),
              "gradients": grads, "optimizer state": ADAM_MOMENTS * params + 4 * tensors,
              "activations": int(activations),
              "transient": int(scale * max(block.transient_bytes, rest.transient_bytes))}
    if zero >= 1:
        memory["optimizer state"] = ADAM_MOMENTS * shard + 4 * tensors
        memory["parameters"] = shard + (params if zero < 3 else 0)
        memory["transient"] += _units(units, 1)  # a unit's gradients as backward hands them over
    if zero == 1:
        memory["gradients"] = grads + shard  # the full-gradient buffer and each unit's shard
        memory["transient"] += _units(units, 1)  # laid out for the full-gradient buffer
    if zero >= 2:
        memory["gradients"] = shard
        memory["transient"] += _units(units, 2)  # reduce-scatter inputs in flight
        if exchange:
            memory["transient"] += _units(units, 1)  # the exchange's receive buffer (one unit in flight)
    if zero == 1 and exchange:
        memory["transient"] += sum(units)  # every unit's receive buffer at the end of backward
    if zero == 3:
        memory["transient"] += (rest_params if candidate.degree("pp") == 1 else 0) + _units(units[:blocks], 2)
    return memory


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
    counts = _stage_blocks(ledgers.blocks, chunks, block.forward.flops, rest.forward.flops)
    block_f, block_b = _stage_compute(block, cluster, scale)
    rest_f, rest_b = _stage_compute(rest, cluster, scale)
    block_cf, block_cb, block_sends, block_wire = _blocking(block, price, scale, sum(counts) * micro)
    rest_cf, rest_cb, rest_sends, rest_wire = _blocking(rest, price, scale, micro)
    if dp > 1:  # the loss's (sum, count) over the data-parallel batch shards, as over cp's
        rest_cf += price("all_reduce", "dp", LOSS_REDUCTION_BYTES, micro, stage=(chunks - 1) % pp)
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
        price.stage_wire[index % pp] += micro * (blocks * block_wire + (rest_wire if last else 0.0))
        stages.append(stage)
    ranks = [_Rank([s for s in stages if s.index % pp == r]) for r in range(pp)]
    in_flight = _activation_peaks(candidate, stages, pp, micro)
    # ZeRO's gradients exchanged by all-to-all on the cluster's backend: a receive buffer of each unit's size
    exchange = bool(candidate.zero) and gradient_exchange_kind("auto", cluster.backend) == "all_to_all"
    for rank in ranks:
        rank.memory = _rank_memory(ledgers, candidate, rank, in_flight[rank.index], scale, exchange=exchange)
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
        rank.moments = moments(_peak_terms(ledgers, candidate, rank, stages, in_flight[rank.index], scale, micro,
                                           exchange=exchange))
    peak = max(ranks, key=lambda r: max(r.moments.values()))
    return StepEstimate(cluster=cluster, seconds=sum(parts.values()), parts=parts,
                        comm_seconds=sum(price.by_kind.values()) / pp,
                        wire_bytes=int(max(price.stage_wire.values(), default=0)),
                        peak_bytes=max(peak.moments.values()), memory=peak.memory, moments=peak.moments,
                        comm_by_kind=dict(price.by_kind), held_bytes=max(sum(r.memory.values()) for r in ranks))


def _peak_terms(ledgers: BlockLedgers, candidate: Candidate, rank: "_Rank", stages: list["_Stage"],
                in_flight: float, scale: float, micro: int, *, exchange: bool = False) -> PeakTerms:
    """`ledger/peak.py`'s terms for a composed rank: the memory categories split by when they live
    (data-parallel buckets and ZeRO-1's buffer always; a parameter's own gradient or a ZeRO shard
    from backward on), the loss's working memory on the last stage, ZeRO-3's units at backward, a
    block's hand-over, the optimizer's transient; under a pipeline the schedule's own peak."""
    memory, block, rest = rank.memory, ledgers.block, ledgers.rest
    dp, pp, zero = candidate.degree("dp"), candidate.degree("pp"), candidate.zero
    grads = memory["gradients"]
    params = _rest_params(ledgers, rank.first, rank.last) + rank.blocks * block.param_bytes
    if zero == 1:  # the full-gradient buffer (the parameters' size) stays; each unit's shard is the step's
        persistent = grads - math.ceil(params / dp)
    elif zero == 0 and dp > 1:  # data-parallel buckets stay
        persistent = grads
    else:  # the layout's own buckets (cp, SP's norms) stay; a parameter's own gradient, ZeRO-2/3's shards are the step's
        synced = rank.blocks * sum(block.grad_sync.values()) + sum(rest.grad_sync.values())  # disjoint keys
        persistent = min(grads, synced) if zero == 0 else 0
    steady = memory["parameters"] + memory["model buffers"] + memory["optimizer state"] + persistent
    step_gradients = grads - persistent
    # the loss's working memory grows with the batch; a weight gradient alive beside it does not
    working = scale * (rest.working_bytes - rest.working_weights) + rest.working_weights if rank.last else 0.0
    unit_bytes = block.param_bytes if rank.blocks else _rest_params(ledgers, rank.first, rank.last)
    rest_kept = _rest_params(ledgers, rank.first, rank.last) if zero == 3 else 0
    if pp > 1:  # ZeRO shards land when the step's last backward ends (as in ledger/peak.py)
        during = 0 if zero else step_gradients
        activations = _pipeline_live(candidate, rank, stages, ledgers, scale, working, during, micro)
        working = 0.0
    else:
        activations = in_flight
    regather = regather_acts = handover = handover_acts = 0
    # the rest's whole gradients after the blocks (the head's) wait for the embedding's (ledger/peak.py)
    pending = rest.param_bytes - ledgers.first_params if ledgers.first_params and rank.blocks else 0
    if zero == 3 and pp == 1 and rank.blocks:
        regather = 2 * block.param_bytes + rest_kept + pending
        regather_acts = int(in_flight - scale * rest.activation_bytes)
    if zero >= 1 and pp == 1:
        # stages 2/3 exchanging by all-to-all launch it there: its receive buffer (ledger/peak.py)
        handover = ((3 if exchange and zero > 1 else 2) * unit_bytes
                    + (rest_kept + block.param_bytes if zero == 3 and rank.blocks else 0) + pending)
        handover_acts = int(in_flight - scale * (rest.activation_bytes + (block.activation_bytes if rank.blocks else 0)))
    largest = math.ceil(block.largest_param / dp) if zero else block.largest_param
    regathered = params + math.ceil(params / dp) if zero in (1, 2) else 0
    return PeakTerms(steady=int(steady), step_gradients=int(step_gradients), activations=int(activations),
                     backward_working=int(working),
                     gathered_at_backward=(rest_kept if pp == 1 else params) if zero == 3 else 0,
                     recompute=int(scale * max(block.transient_bytes, rest.transient_bytes)),  # a recomputed region
                     regather=regather, regather_activations=max(regather_acts, 0),
                     handover=handover, handover_activations=max(handover_acts, 0),
                     optimizer_transient=max(largest, regathered),
                     exchange_landing=params if zero == 1 and exchange else 0)


def _pipeline_live(candidate: Candidate, rank: "_Rank", stages: list["_Stage"], ledgers: BlockLedgers, scale: float,
                   working: float, gradients: float, micro: int) -> float:
    """`schedules.peak_live` of the rank's action list: its stages' activations per micro-batch,
    the loss's working memory on the last stage, a send per boundary per micro-batch each way."""
    from autopar import schedules

    pp, chunks = candidate.degree("pp"), len(stages)
    order = _action_orders(candidate.schedule, pp, candidate.virtual, micro)[rank.index]
    mine = [s.index for s in rank.stages]
    boundary = scale * ledgers.boundary_bytes
    block, rest = ledgers.block, ledgers.rest
    per_stage = {s: working if stages[s].last else 0.0 for s in mine}
    if candidate.zero:  # each micro-batch's backward hands its last block's gradients over, laid out flat
        for s in mine:
            if stages[s].blocks:
                freed = scale * (block.activation_bytes + (rest.activation_bytes if stages[s].last else 0))
                per_stage[s] = max(per_stage[s], 2 * block.param_bytes - freed)
    return schedules.peak_live(list(order), releases={s: "B" for s in mine},
                               forward_bytes={s: stages[s].activation for s in mine},
                               working=per_stage,
                               sent_forward={s: boundary for s in mine if s < chunks - 1},
                               sent_backward={s: boundary for s in mine if s > 0}, gradients=gradients)


@lru_cache(maxsize=256)
def _action_orders(schedule: str, pp: int, virtual: int, micro: int) -> tuple[tuple, ...]:
    """The schedule's action lists, made once per shape: a search prices hundreds of candidates
    that share a few (schedule, degree, virtual stages, micro-batches)."""
    from autopar import schedules

    return tuple(tuple(order) for order in schedules.actions(schedule, degree=pp, virtual=virtual, microbatches=micro))


def _activation_peaks(candidate: Candidate, stages: list["_Stage"], pp: int, micro: int) -> list[float]:
    """Per pipeline rank, the most activation bytes its schedule keeps at once: a forward holds its
    stage's activations until that stage's backward of the same micro-batch runs."""
    if pp == 1:
        return [stages[0].activation]
    if candidate.virtual == 1 and candidate.schedule in ("1f1b", "gpipe"):  # what their action lists give
        return [stages[r].activation * (micro if candidate.schedule == "gpipe" else min(micro, pp - r))
                for r in range(pp)]
    orders = _action_orders(candidate.schedule, pp, candidate.virtual, micro)
    peaks = []
    for order in orders:
        held = most = 0.0
        for action in order:
            if action.kind == "F":
                held += stages[action.stage].activation
                most = max(most, held)
            elif action.kind == "B":
                held -= stages[action.stage].activation
        peaks.append(most)
    return peaks


class _Stage:
    """A pipeline stage (a virtual one under interleaving): its blocks and per-micro-batch costs."""

    def __init__(self, index: int, blocks: int, first: bool, last: bool) -> None:
        self.index, self.blocks, self.first, self.last = index, blocks, first, last
        self.compute_f = self.compute_b = self.blocking_f = self.blocking_b = self.activation = 0.0
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
    rest_params = _rest_params(ledgers, stage.first, stage.last)
    full = stage.blocks * block.param_bytes + rest_params
    dp, zero = candidate.degree("dp"), candidate.zero
    units = [block.param_bytes] * stage.blocks + ([rest_params] if rest_params else [])
    tensors = [block.param_tensors] * stage.blocks + ([_rest_tensors(ledgers, stage.first, stage.last)]
                                                      if rest_params else [])
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
        for unit, count in zip(units, tensors):
            tail.behind_backward.append(price(gradient_exchange_kind("auto", cluster.backend), "dp", unit, stage=at))
            copy = RUNTIME_COPY_TRAFFIC * unit / cluster.bandwidth_for(unit) + (2 + count) * cluster.op_overhead
            tail.copies += copy
            if zero < 3:
                tail.after += price("all_gather", "dp", unit, stage=at)
                tail.copies += copy
            else:
                tail.behind_forward += [price("all_gather", "dp", unit, gathers, stage=at)] * gathers
                tail.behind_backward += [price("all_gather", "dp", unit, gathers, stage=at)] * gathers
                tail.copies += 2 * gathers * copy
    shard = dp if zero and dp > 1 else 1  # ZeRO reduces a unit's extra axes on its shard, after the reduce-scatter
    for key, nbytes in synced.items():
        for chained in price.sync_keys(key.split(JOIN)):
            tail.behind_backward += _bucketed(price, "all_reduce", chained, math.ceil(nbytes / shard), cap, at)
    owned = math.ceil(full / dp) if zero >= 1 else full
    tail.optimizer = (OPTIMIZER_CALLS * sum(tensors) * cluster.op_overhead  # each tensor at the mean's bandwidth
                      + OPTIMIZER_TRAFFIC * owned / cluster.bandwidth_for(owned / max(sum(tensors), 1)))
    return tail


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
    price("send", "pp", boundary, 2 * micro * (chunks - 1))  # the wire bytes and per-kind seconds
    send = cluster.handover_seconds(int(boundary), price.links.get("pp", "intra"))
    for rank in ranks:  # per micro-batch at each boundary of each of its stages: one transfer forward, one backward
        boundaries = sum((not s.first) + (not s.last) for s in rank.stages)
        price.stage_wire[rank.index] += 2 * micro * boundaries * price.wire("send", "pp", boundary)
    work = [sum(s.compute_f + s.compute_b + s.blocking_f + s.blocking_b
                + exposed_seconds(s.sends, s.compute_f + s.compute_b, cluster.overlap, unhidden="first")  # cp's ring
                for s in r.stages) for r in ranks]
    critical = max(range(pp), key=work.__getitem__)
    span = sum(work) / virtual + (micro - 1 / virtual) * work[critical] + 2 * (chunks - 1) * send
    busy = micro * work[critical]
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
