"""A rank's peak memory as the largest of a few moments of the step, not the sum of every category.

The memory ledger's categories (`autopar/compiler/ledger/memory.py`) never all live at once: activations are gone
before the optimizer steps, ZeRO-1/2's re-gathered parameters arrive after backward, a ZeRO unit's
gradients are handed over when most activations are freed. Measured from outside on 4 gloo ranks
(`benchmarks/planner_vs_measured.py`), the step's peak sits at one of these moments:

- **backward starts**: what the rank always holds (`steady`: parameters, buffers, optimizer state,
  persistent gradient buffers — data-parallel buckets, ZeRO-1's full-gradient buffer), every saved
  activation, what the first backward ops allocate beyond them (`backward_working`, from a fake run:
  the loss's gradient over the vocabulary), ZeRO-3 units gathered then, a recomputed region's
  activations. Under a pipeline "activations" is the schedule's own peak (`schedules.peak_live`):
  the micro-batches held, a stage's working memory during its backward, the step's sends so far
  and, after the rank's first backward, the gradients accumulating over the micro-batches (a
  parameter's own `.grad`; ZeRO's gradient shards land only when the step's last backward ends —
  the micro-batches accumulate into ZeRO-1's full-gradient buffer, already in `steady`);
- **the last ZeRO-3 block gathered again for its backward** (resharded blocks are not gathered
  when backward starts): the activations saved up to that block's end, it and the block before
  (prefetched), the units kept gathered;
- **the first ZeRO unit's gradients handed over**: the activations saved before that unit's first
  use (the later ones are freed by then), its whole gradients as autograd hands them over, laid out
  flat for their collective (and, exchanged by an all-to-all, its receive buffer, with the block
  before gathered again meanwhile), and ZeRO-3 units gathered at that moment;
- **ZeRO-1's gradient exchanges landing** (`reduce_kind` all_to_all): steady (the full-gradient
  buffer is in it) and every unit's receive buffer, all launched when backward ends;
- **the optimizer step**: steady, the step's gradients (a parameter's own `.grad`, ZeRO's gradient
  shards), and the larger of AdamW's temporary (one tensor of the largest parameter it updates,
  `exp_avg_sq.sqrt()`) and ZeRO-1/2's re-gather of the parameters (every unit of a refresh group
  in one collective: its gathered buffer, and the send buffer of an all-gather).

`PeakTerms` is what the memory ledger reads off a plan and the composed cost model composes from a
block's ledgers (`autopar/planner/composed_cost.py`); `moments` is the one rule both apply.
"""
from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import sympy

from autopar.compiler.ledger.activations import ZERO_UNIT, saved_activations
from autopar.compiler.ledger.fake_run import backward_working
from autopar.compiler.ledger.memory import (
    OPTIMIZER_STATE,
    ZERO1_EXCHANGES,
    ZERO_GRADIENT_SHARDS,
    MemoryLedger,
    _rank_placeholders,
    _schedule_inputs,
)
from autopar.core import schedules
from autopar.core.ir import SPEC, local_numel
from autopar.core.zero_units import refresh_groups


@dataclass(frozen=True)
class PeakTerms:
    steady: int  # parameters, buffers, optimizer state, persistent gradient buffers
    step_gradients: int  # made in backward, kept for the optimizer
    activations: int  # saved for backward, at the schedule's peak
    backward_working: int = 0  # what backward allocates beyond them at its start
    gathered_at_backward: int = 0  # ZeRO-3 units gathered when backward starts
    recompute: int = 0  # a recomputed region's activations during its backward
    regather: int = 0  # ZeRO-3: the last resharded block gathered again for its backward, the one before
    # prefetched, the kept units (0 without resharded units)
    regather_activations: int = 0  # activations still saved then (the head's are freed)
    handover: int = 0  # a unit's gradients as handed over and laid out, and the units gathered then
    handover_activations: int = 0  # activations still saved at that moment
    optimizer_transient: int = 0  # the larger of AdamW's temporary and ZeRO-1/2's re-gather
    exchange_landing: int = 0  # ZeRO-1 exchanging by all-to-all: every unit's receive buffer at once


def moments(terms: PeakTerms) -> dict[str, int]:
    """Bytes alive at each moment of the step (module docstring); the peak is the largest."""
    t = terms
    result = {"backward starts": t.steady + t.activations + t.backward_working + t.gathered_at_backward
              + t.recompute,
              "optimizer step": t.steady + t.step_gradients + t.optimizer_transient}
    if t.regather:
        result["last ZeRO-3 block gathered again"] = t.steady + t.regather_activations + t.regather
    if t.handover:
        result["first unit's gradients handed over"] = t.steady + t.handover_activations + t.handover
    if t.exchange_landing:
        result["ZeRO-1 gradient exchanges landing"] = t.steady + t.exchange_landing
    return result


PERSISTENT_GRADIENTS = ("bucket buffers (gradients are views)", "ZeRO-1 full-gradient buffer")
GATHERED_AT_BACKWARD = ("ZeRO-3 units kept gathered forward to backward", "ZeRO-3 units gathered for the whole pipeline step")


def peak_terms(plan: Any, ledger: MemoryLedger, *, rank: int = 0, optimizer: str = "adamw",
               ops: dict[int, Any] | None = None) -> PeakTerms:
    """What the moments read off `rank`'s memory ledger and plan: the categories split by when
    they live, the backward's working memory (the op ledger's fake run, `autopar/compiler/ledger/working_memory.py`;
    `ops`: the rank's `rank_ops` by stage, when the caller has them), the first ZeRO unit's
    hand-over and the optimizer's transient."""
    activations_of = functools.lru_cache(maxsize=None)(  # one fake run per stage (None: no pipeline)
        lambda stage: saved_activations(plan, rank=rank, stage=stage))
    number = ledger.number
    by_what: dict[str, int] = defaultdict(int)
    for entry in ledger.entries:
        by_what[entry.what] += number(entry.bytes)
    totals = ledger.by_category()
    persistent = sum(by_what[w] for w in PERSISTENT_GRADIENTS)
    stages = plan.stages_of_rank(rank)
    units = [u for stage in stages for u in stage.units]
    gathered_at_backward = sum(by_what[w] for w in GATHERED_AT_BACKWARD)  # resharded blocks come back later
    resharded = sum(n for w, n in by_what.items() if w.startswith("ZeRO-3 resharded blocks gathered at once"))
    recompute = sum(n for w, n in by_what.items() if w.startswith("a recomputed region's activations"))
    step_gradients = totals["gradients"] - persistent
    working = {s.index: (ops[s.index].working if ops and s.index in ops else
                         backward_working(plan, rank=rank, stage=s.index)).bytes for s in stages}
    activations, working_at_backward = totals["activations"], max(working.values())
    if plan.pipeline is not None:  # the schedule's own moments: held micro-batches, sends, gradients
        for stage in stages:  # every micro-batch's backward hands a ZeRO unit's gradients over
            if stage.units:
                working[stage.index] = max(working[stage.index], _micro_batch_handover(plan, stage, activations_of))
        # a ZeRO unit's gradient shards land when the step's synchronising backward ends (until then
        # the micro-batches accumulate into full gradients: ZeRO-1's persistent buffer, in `steady`)
        during = step_gradients - by_what[ZERO_GRADIENT_SHARDS]
        activations, working_at_backward = _pipeline_live(plan, rank, stages, working, during), 0
    return PeakTerms(
        steady=totals["parameters"] + totals["model buffers"] + totals["optimizer state"] + persistent,
        step_gradients=step_gradients, activations=activations, backward_working=working_at_backward,
        gathered_at_backward=gathered_at_backward, recompute=recompute,
        regather=resharded and (resharded + by_what["ZeRO-3 units kept gathered forward to backward"]
                                + _pending_gradients(plan, units, _last_resharded(plan, units))),
        regather_activations=resharded and _activations_before(plan, _last_resharded(plan, units), activations_of,
                                                               end=True),
        handover=_handover(plan, units),
        handover_activations=_activations_before(plan, _first_handed(plan, units), activations_of,
                                                 end=False) if units else 0,
        optimizer_transient=max(largest_optimized(plan, stages, optimizer), _regather(units)),
        exchange_landing=by_what[ZERO1_EXCHANGES])


def _pipeline_live(plan: Any, rank: int, stages: list, working: dict[int, int], gradients: int) -> int:
    """`schedules.peak_live` for the rank: activations per micro-batch from the stage ledgers, each
    stage's sends per micro-batch from the communication ledger (activations in F, gradients in B)."""
    order, releases, ledgers, waiting = _schedule_inputs(plan, rank, stages)
    sent = {"forward": defaultdict(float), "backward": defaultdict(float)}
    for entry in plan.comm.for_rank(rank):
        if entry.kind == "send" and entry.axis == plan.pipeline.axis and entry.stage is not None and entry.phase in sent:
            sent[entry.phase][entry.stage] += plan.comm.number(entry.logical_bytes)
    return int(schedules.peak_live(order, releases=releases,
                                   forward_bytes={s: plan.comm.number(ledger.total) for s, ledger in ledgers.items()},
                                   after_input_bytes={s: plan.comm.number(sum(b)) for s, b in waiting.items()},
                                   working=working, sent_forward=sent["forward"], sent_backward=sent["backward"],
                                   gradients=gradients))


def _micro_batch_handover(plan: Any, stage: Any, activations_of: Callable) -> int:
    """Under a pipeline, the most a micro-batch's backward adds when it hands one of the stage's
    units over (its gradients whole and laid out flat), less that micro-batch's activations freed
    by then. The largest over the units, not the first handed: on the last stage the first is the
    head's (the final norm and the head, small), and a block after it holds more (pp2 GPipe m4 ×
    dp2 ZeRO-1's last stage: 537 KB over the first's, 4.3% of its peak)."""
    micro_batch = activations_of(stage.index).number()
    return max(max(0, _handed_and_laid_out(unit) - micro_batch
                   + _activations_before(plan, unit, activations_of, end=False)) for unit in stage.units)


def _handover(plan: Any, units: list) -> int:
    """The first unit's gradients whole as handed over, laid out flat, and the ZeRO-3 units gathered
    then (kept ones, the block before it prefetched; under a pipeline every stage-3 unit)."""
    if not units:
        return 0
    unit = _first_handed(plan, units)
    full = {u.index: u.gathered_numel * u.dtype.itemsize for u in units if u.stage == 3}
    if plan.pipeline is not None:
        gathered = sum(full.values())
    else:
        gathered = sum(full[u.index] for u in units if u.stage == 3 and not u.reshard)
        # the block before is gathered while this one's gradients are in flight: prefetched, or
        # (measured) gathered again while an exchange's receive buffer is still alive
        if unit.reshard and (unit.backward_prefetch or unit.reduce_kind == "all_to_all"):
            gathered += max((full[u.index] for u in units if u.reshard and u is not unit), default=0)
    return _handed_and_laid_out(unit) + gathered + _pending_gradients(plan, units, unit)


def _pending_gradients(plan: Any, units: list, unit: Any) -> int:
    """Whole gradients alive, not yet handed over, when backward reaches `unit`'s block: another
    unit's parameters used after the block in forward, when that unit also has parameters used
    before it — the root unit's head and final norm beside its embedding. Autograd hands a unit's
    gradients over once all of them are made, so the head's waits for the embedding's, at the end
    of backward (measured: ZeRO-3 on 4 ranks held the head's 16 KB gradient through every block's
    backward). Without a pipeline; a pipeline's micro-batches accumulate into `.grad` (counted)."""
    if plan.pipeline is not None:
        return 0
    position, marked = _unit_positions(plan, unit)
    start, end = min(marked), max(marked)
    readers: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))  # unit: parameter: positions
    for node in plan.stages[unit.pipeline_stage].graph_module.graph.nodes:
        if node.target is operator.getitem and ZERO_UNIT in node.meta and isinstance(node.args[1], int):
            readers[node.meta[ZERO_UNIT]][node.args[1]] += [position[user.name] for user in node.users]
    pending = 0
    for other in units:
        uses = readers.get(other.index, {})
        if other is not unit and any(p < start for read in uses.values() for p in read):  # handed over later
            pending += sum(math.prod(other.params[i].shape) * other.dtype.itemsize
                           for i, read in uses.items() if read and max(read) > end)
    return pending


def _handed_and_laid_out(unit: Any) -> int:
    """A unit's gradients whole, as autograd hands them over, and laid out flat for its collective
    (twice when stages 2/3 exchange it by an all-to-all, launched there: the receive buffer is the
    input's size; ZeRO-1 launches its reductions at the end of backward)."""
    laid_out = unit.gathered_numel * unit.reduce_dtype.itemsize
    copies = 2 if unit.reduce_kind == "all_to_all" and unit.stage > 1 else 1
    return sum(math.prod(p.shape) for p in unit.params) * unit.dtype.itemsize + laid_out * copies


def _unit_positions(plan: Any, unit: Any) -> tuple[dict[str, int], list[int]]:
    stage = plan.stages[unit.pipeline_stage]
    position = {node.name: i for i, node in enumerate(stage.graph_module.graph.nodes)}
    marked = [i for i, n in enumerate(stage.graph_module.graph.nodes) if n.meta.get("autopar_zero_unit") == unit.index]
    return position, marked


def _first_handed(plan: Any, units: list) -> Any:
    """The unit whose gradients backward completes first: the one whose first use in forward comes last."""
    return max(units, key=lambda u: (u.pipeline_stage, min(_unit_positions(plan, u)[1])))


def _last_resharded(plan: Any, units: list) -> Any:
    """The resharded ZeRO-3 block whose backward comes first: the one whose last node comes last."""
    return max((u for u in units if u.reshard), key=lambda u: (u.pipeline_stage, max(_unit_positions(plan, u)[1])))


def _activations_before(plan: Any, unit: Any, activations_of: Callable, *, end: bool) -> int:
    """Activations saved by nodes before `unit`'s first (`end`: last) node in its stage graph: the
    later ones are freed when backward reaches it (under a pipeline: one micro-batch of its stage,
    the step's last backward)."""
    position, marked = _unit_positions(plan, unit)
    limit = max(marked) if end else min(marked)
    ledger = activations_of(unit.pipeline_stage if plan.pipeline is not None else None)
    return sum(e.number for e in ledger.entries if position.get(e.node, len(position)) < limit)


def largest_optimized(plan: Any, stages: list, optimizer: str) -> int:
    """AdamW's temporary (`exp_avg_sq.sqrt()`): one tensor of the largest parameter it updates."""
    if not OPTIMIZER_STATE[optimizer][0]:
        return 0
    zero = {p.fqn: p.shard_numel * u.master_dtype.itemsize for stage in stages for u in stage.units for p in u.params}
    largest = 0
    for node in _rank_placeholders(plan, stages):
        info = plan.context.placeholders.get(node.name)
        if info.kind != "parameter" or not info.requires_grad:
            continue
        meta = node.meta[SPEC].tensor_meta
        local = int(sympy.sympify(local_numel(meta.shape, node.meta[SPEC].placements, plan.mesh.shape))
                    .subs(plan.comm.symbol_values)) * meta.dtype.itemsize
        largest = max(largest, zero.get(info.target, local))
    return largest


def _regather(units: list) -> int:
    """ZeRO-1/2 after the optimizer: one refresh group at a time (`refresh_groups`), its gathered
    buffer and, for an all-gather, the send buffer of the rank's shards; owners broadcast into
    their rows of the gathered buffer."""
    largest = 0
    for group in refresh_groups(units):
        row = sum(u.shard_numel for u in group) * group[0].dtype.itemsize
        largest = max(largest, group[0].group_size * row + (row if group[0].gather_kind == "all_gather" else 0))
    return largest
