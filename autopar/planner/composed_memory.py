"""The memory side of the composed estimate (`autopar/planner/composed_cost.py`): what a composed rank holds, by
the memory ledger's categories (`autopar/compiler/ledger/memory.py`'s rules), and the terms of `autopar/compiler/ledger/peak.py`'s
moments, from one block's ledgers and the candidate's data parallelism, ZeRO and pipeline.

- `rank_memory`: gradients of the parameters' size and dtype; AdamW's two moments and a 4-byte
  step per tensor; ZeRO-1 shards the optimizer state (and keeps a full gradient buffer and a
  replicated compute copy), ZeRO-2 also the gradients, ZeRO-3 also the parameters, with their
  transients (units gathered at once, reduce-scatter inputs in flight, an all-to-all exchange's
  receive buffers, a unit's gradients being laid out); a unit is a block, the rest of the model
  is the root unit;
- `peak_terms`: those categories split by when they live, for `autopar/compiler/ledger/peak.py`'s moments; under
  a pipeline the schedule's own peak (`schedules.peak_live`);
- `activation_peaks`: per pipeline rank, the most activation bytes its schedule keeps at once.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

from autopar.compiler.ledger.peak import PeakTerms
from autopar.core import schedules
from autopar.planner.block_ledgers import BlockLedgers
from autopar.planner.search_space import Candidate

if TYPE_CHECKING:
    from autopar.planner.composed_cost import _Rank, _Stage

GRAD_BYTES_PER_PARAM_BYTE = 1  # a gradient has its parameter's size and dtype
ADAM_MOMENTS = 2


def rest_params(ledgers: BlockLedgers, first: bool, last: bool) -> int:
    """The rest's parameter bytes a stage holds: the embedding on the first, the others on the last."""
    return (ledgers.first_params if first else 0) + (ledgers.rest.param_bytes - ledgers.first_params if last else 0)


def rest_tensors(ledgers: BlockLedgers, first: bool, last: bool) -> int:
    return (ledgers.first_tensors if first else 0) + (ledgers.rest.param_tensors - ledgers.first_tensors if last else 0)


def _units(part_bytes: list[int], largest: int) -> int:
    return sum(sorted(part_bytes, reverse=True)[:largest])


def rank_memory(ledgers: BlockLedgers, candidate: Candidate, rank: "_Rank", activations: float,
                 scale: float, *, exchange: bool = False) -> dict[str, int]:
    block, rest = ledgers.block, ledgers.rest
    blocks, first, last = rank.blocks, rank.first, rank.last
    dp, zero = candidate.degree("dp"), candidate.zero
    rest_bytes = rest_params(ledgers, first, last)
    params = blocks * block.param_bytes + rest_bytes
    tensors = blocks * block.param_tensors + rest_tensors(ledgers, first, last)
    grads = params * GRAD_BYTES_PER_PARAM_BYTE
    units = [block.param_bytes] * blocks + ([rest_bytes] if rest_bytes else [])
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
        memory["transient"] += (rest_bytes if candidate.degree("pp") == 1 else 0) + _units(units[:blocks], 2)
    return memory


def peak_terms(ledgers: BlockLedgers, candidate: Candidate, rank: "_Rank", stages: list["_Stage"],
                in_flight: float, scale: float, micro: int, *, exchange: bool = False,
                broadcasts: bool = False) -> PeakTerms:
    """`autopar/compiler/ledger/peak.py`'s terms for a composed rank: the memory categories split by when they live
    (data-parallel buckets and ZeRO-1's buffer always; a parameter's own gradient or a ZeRO shard
    from backward on), the loss's working memory on the last stage, ZeRO-3's units at backward, a
    block's hand-over, the optimizer's transient; under a pipeline the schedule's own peak.
    `exchange`: ZeRO's gradients by all-to-all; `broadcasts`: ZeRO-1/2's refresh by owner broadcasts."""
    memory, block, rest = rank.memory, ledgers.block, ledgers.rest
    dp, pp, zero = candidate.degree("dp"), candidate.degree("pp"), candidate.zero
    grads = memory["gradients"]
    params = rest_params(ledgers, rank.first, rank.last) + rank.blocks * block.param_bytes
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
    unit_bytes = block.param_bytes if rank.blocks else rest_params(ledgers, rank.first, rank.last)
    rest_kept = rest_params(ledgers, rank.first, rank.last) if zero == 3 else 0
    if pp > 1:  # ZeRO shards land when the step's last backward ends (as in autopar/compiler/ledger/peak.py)
        during = 0 if zero else step_gradients
        activations = _pipeline_live(candidate, rank, stages, ledgers, scale, working, during, micro)
        working = 0.0
    else:
        activations = in_flight
    regather = regather_acts = handover = handover_acts = 0
    # the rest's whole gradients after the blocks (the head's) wait for the embedding's (autopar/compiler/ledger/peak.py)
    pending = rest.param_bytes - ledgers.first_params if ledgers.first_params and rank.blocks else 0
    if zero == 3 and pp == 1 and rank.blocks:
        regather = 2 * block.param_bytes + rest_kept + pending
        regather_acts = int(in_flight - scale * rest.activation_bytes)
    if zero >= 1 and pp == 1:
        # stages 2/3 exchanging by all-to-all launch it there: its receive buffer (autopar/compiler/ledger/peak.py)
        handover = ((3 if exchange and zero > 1 else 2) * unit_bytes
                    + (rest_kept + block.param_bytes if zero == 3 and rank.blocks else 0) + pending)
        handover_acts = int(in_flight - scale * (rest.activation_bytes + (block.activation_bytes if rank.blocks else 0)))
    largest = math.ceil(block.largest_param / dp) if zero else block.largest_param
    # ZeRO-1/2's refresh, one pipeline stage at a time: its gathered buffer and, for an all-gather,
    # the send buffer of the shards (autopar/compiler/ledger/peak.py `_regather`)
    staged = max((s.blocks * block.param_bytes + rest_params(ledgers, s.first, s.last) for s in rank.stages),
                 default=params)
    regathered = staged + (0 if broadcasts else math.ceil(staged / dp)) if zero in (1, 2) else 0
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
    return schedules.peak_live(list(order), releases=_releases(candidate, mine),
                               forward_bytes={s: stages[s].activation for s in mine},
                               after_input_bytes={s: stages[s].after_input for s in mine},
                               working=per_stage,
                               sent_forward={s: boundary for s in mine if s < chunks - 1},
                               sent_backward={s: boundary for s in mine if s > 0}, gradients=gradients)


@lru_cache(maxsize=256)
def _action_orders(schedule: str, pp: int, virtual: int, micro: int) -> tuple[tuple, ...]:
    """The schedule's action lists, made once per shape: a search prices hundreds of candidates
    that share a few (schedule, degree, virtual stages, micro-batches)."""
    return tuple(tuple(order) for order in schedules.actions(schedule, degree=pp, virtual=virtual, microbatches=micro))


def _releases(candidate: Candidate, mine: list[int]) -> dict[int, str]:
    """When each stage's micro-batch lets its activations go: at its W under a split backward
    (what B kept, `_Stage.after_input`, until then), but on the first stage, which receives nothing
    and runs its whole backward at B; at its B otherwise."""
    split = candidate.schedule in schedules.SPLIT_BACKWARD
    return {s: "W" if split and s else "B" for s in mine}


def activation_peaks(candidate: Candidate, stages: list["_Stage"], pp: int, micro: int) -> list[float]:
    """Per pipeline rank, the most activation bytes its schedule keeps at once: a forward holds its
    stage's activations until that stage's backward of the same micro-batch runs (under a split
    backward, what B kept until its W: `schedules.peak_held`)."""
    if pp == 1:
        return [stages[0].activation]
    if candidate.virtual == 1 and candidate.schedule in ("1f1b", "gpipe"):  # what their action lists give
        return [stages[r].activation * (micro if candidate.schedule == "gpipe" else min(micro, pp - r))
                for r in range(pp)]
    orders = _action_orders(candidate.schedule, pp, candidate.virtual, micro)
    if candidate.schedule in schedules.SPLIT_BACKWARD:
        peaks = []
        for order in orders:
            mine = sorted({action.stage for action in order})
            held = schedules.peak_held(list(order), releases=_releases(candidate, mine),
                                       forward_bytes={s: stages[s].activation for s in mine},
                                       after_input_bytes={s: stages[s].after_input for s in mine})
            peaks.append(sum(f * stages[s].activation + w * stages[s].after_input for s, (f, w) in held.items()))
        return peaks
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
