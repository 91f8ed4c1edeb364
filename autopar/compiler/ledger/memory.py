"""The per-rank memory ledger: what one rank holds after a training step, and what it holds for a moment.

Categories (bytes per rank, sympy expressions in the traced symbols and numbers):
- parameters: the rank's parameter tensors (tensor-parallel shards; ZeRO/FSDP dim-0 shards,
  padded) plus, at ZeRO stages 1/2, the replicated compute copy each unit keeps;
- model buffers: buffers and constants (replicated);
- gradients: what backward leaves for the optimizer: the bucket buffers of `runtime.grad_sync`
  (gradients are views of them), other parameters' own gradients, and for ZeRO units the
  reduce-scatter output (stage 2/3), plus ZeRO-1's persistent full-gradient buffer;
- optimizer state: per parameter the optimizer sees (`OPTIMIZER_STATE`: AdamW keeps exp_avg and
  exp_avg_sq of the parameter's size and dtype and a 4-byte float32 `step`);
- activations: tensors autograd saves for backward (`autopar/compiler/ledger/activations.py`, from the emitted graph);
- transient: not held after the step: ZeRO-3 gathered units alive at once (the kept root unit,
  plus one resharded block, two with prefetching) and reduce-scatter inputs in flight (at most
  two: the one being laid out and the one landing), a gradient exchange's receive buffer
  (`reduce_kind` all_to_all: one unit at stages 2/3, every unit at the end of ZeRO-1's
  backward), and under `autopar.recompute` the largest recomputed region's activations while
  its backward runs. An upper bound, not measured exactly.
The categories never all live at once: the step's peak is the largest of a few moments, each
the categories alive then (`autopar/compiler/ledger/peak.py`, what `autopar.estimate` reports).
The tests compare these categories with bytes measured from outside the runtime
(`autopar.measure.memory`, `autopar.measure.activations`).

`largest_model` answers the lecture's slide 28 from `ZERO_SHARDED`, the same table of which
categories each stage shards that the strategies implement.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import sympy
from tabulate import tabulate

from autopar.compiler.ledger.activations import recomputed_region_bytes, saved_activations
from autopar.compiler.passes.insert_grad_reductions import VIEW_LIKE
from autopar.core import schedules
from autopar.core.errors import PlanError
from autopar.core.ir import SPEC, local_numel

ZERO1_EXCHANGES = "ZeRO-1 all-to-all receive buffers at the end of backward (every unit)"
ZERO_SHARDED = {0: (), 1: ("optimizer state",), 2: ("optimizer state", "gradients"),
                3: ("optimizer state", "gradients", "parameters")}
# optimizer name -> (parameter-sized state tensors, 4-byte scalar tensors) per parameter
OPTIMIZER_STATE = {"adamw": (2, 1), "adam": (2, 1), "sgd": (0, 0), "sgd_momentum": (1, 0)}
CATEGORIES = ("parameters", "model buffers", "gradients", "optimizer state", "activations", "transient")

ZERO_GRADIENT_SHARDS = "ZeRO gradient shards"  # the entry of a ZeRO unit's `.grad` shards


@dataclass(frozen=True)
class MemoryEntry:
    category: str
    what: str
    bytes: sympy.Expr


@dataclass
class MemoryLedger:
    entries: list[MemoryEntry]
    symbol_values: dict[sympy.Symbol, int]

    def number(self, expr: Any) -> int:
        value = sympy.sympify(expr).subs(self.symbol_values)
        return int(value) if value.is_number else value

    def total(self, category: str | None = None) -> sympy.Expr:
        chosen = [e.bytes for e in self.entries if category is None or e.category == category]
        return sympy.simplify(sum(chosen) if chosen else sympy.Integer(0))

    def by_category(self) -> dict[str, int]:
        return {c: self.number(self.total(c)) for c in CATEGORIES}

    def table(self) -> str:
        rows = []
        for category in CATEGORIES:
            total = self.total(category)
            rows.append([category, str(total), f"{self.number(total):,}"])
        held = sympy.simplify(sum(self.total(c) for c in CATEGORIES if c != "transient"))
        rows.append(["held (all but transient)", str(held), f"{self.number(held):,}"])
        return tabulate(rows, headers=["category", "bytes/rank", "bytes"], tablefmt="simple")

    def detail(self) -> str:
        grouped: dict[tuple[str, str], sympy.Expr] = defaultdict(lambda: sympy.Integer(0))
        for e in self.entries:
            grouped[(e.category, e.what)] += e.bytes
        return tabulate([[c, w, str(sympy.simplify(b)), f"{self.number(b):,}"] for (c, w), b in grouped.items()],
                        headers=["category", "what", "bytes/rank", "bytes"], tablefmt="simple")


def _rank_placeholders(plan: Any, stages: list) -> list[Any]:
    """The placeholders of the rank's stage graphs, each tensor once (a buffer read by two stages
    of one rank is one buffer)."""
    seen, nodes = set(), []
    for stage in stages:
        for node in stage.graph_module.graph.nodes:
            info = plan.context.placeholders.get(node.name)
            if node.op == "placeholder" and info is not None and info.target not in seen \
                    and info.kind not in ("input", "token"):
                seen.add(info.target)
                nodes.append(node)
    return nodes


def _parameter_entries(plan: Any, optimizer: str, stages: list) -> list[MemoryEntry]:
    zero = {p.fqn: (u, p) for stage in stages for u in stage.units for p in u.params}
    buckets = [b for stage in stages for b in stage.buckets]
    in_bucket = {fqn for b in buckets for fqn in b.params}
    per_param, scalars = OPTIMIZER_STATE[optimizer]
    entries = []
    for node in _rank_placeholders(plan, stages):
        info = plan.context.placeholders.get(node.name)
        if info.kind == "parameter" and not node.users:  # not registered (a tied weight's second name)
            continue
        meta = node.meta[SPEC].tensor_meta
        numel = local_numel(meta.shape, node.meta[SPEC].placements, plan.mesh.shape)
        itemsize = meta.dtype.itemsize
        if info.kind != "parameter":
            entries.append(MemoryEntry("model buffers", info.kind, numel * itemsize))
            continue
        if info.target in zero:
            unit, param = zero[info.target]
            kept = param.shard_numel * unit.master_dtype.itemsize  # mixed precision: fp32 masters
            entries.append(MemoryEntry("parameters", f"ZeRO-{unit.stage} shards", kept))
            if unit.stage < 3:
                entries.append(MemoryEntry("parameters", f"ZeRO-{unit.stage} replicated compute copy",
                                           numel * itemsize))
            grad = kept
        else:
            entries.append(MemoryEntry("parameters", "local (replicated or tensor-parallel shards)", numel * itemsize))
            kept, grad = numel * itemsize, (numel * itemsize if info.target not in in_bucket else 0)
        if not info.requires_grad:
            continue
        if grad:
            entries.append(MemoryEntry("gradients", "parameter gradients" if info.target not in zero
                                       else ZERO_GRADIENT_SHARDS, grad))
        entries.append(MemoryEntry("optimizer state", f"{optimizer}", per_param * kept + scalars * 4))
    for bucket in buckets:
        entries.append(MemoryEntry("gradients", "bucket buffers (gradients are views)",
                                   sympy.Integer(bucket.numel * bucket.dtype.itemsize)))
    for unit in (u for stage in stages for u in stage.units):
        if unit.stage == 1:
            entries.append(MemoryEntry("gradients", "ZeRO-1 full-gradient buffer",
                                       sympy.Integer(unit.gathered_numel * unit.reduce_dtype.itemsize)))
    return entries


def _recompute_entries(plan: Any, rank: int, stages: list) -> list[MemoryEntry]:
    """A recomputed region's activations, saved again while its backward runs (the largest region
    of the rank's stages; one at a time)."""
    if plan.strategy.recompute is None:
        return []

    largest = max(recomputed_region_bytes(plan, rank=rank, stage=stage.index) for stage in stages)
    return [MemoryEntry("transient", "a recomputed region's activations during its backward (largest region)",
                        sympy.Integer(largest))]


def _transient_entries(plan: Any, stages: list) -> list[MemoryEntry]:
    units = [u for stage in stages for u in stage.units]
    if not units:
        return []
    gathered = {u.index: sympy.Integer(u.gathered_numel * u.dtype.itemsize) for u in units}
    laid_out = {u.index: sympy.Integer(u.gathered_numel * u.reduce_dtype.itemsize) for u in units}
    entries = []
    scales = sum(len(u.float8) for u in units if u.stage == 3)
    if scales:  # autopar/core/ops/float8_gather.py: one fp32 scale per FP8-gathered weight, forward to backward
        entries.append(MemoryEntry("activations", "FP8 scales of gathered weights, forward to backward",
                                   sympy.Integer(4 * scales)))
    if plan.pipeline is not None:  # every ZeRO-3 unit of the rank's stages stays gathered over the micro-batches
        kept = [gathered[u.index] for u in units if u.stage == 3]
        if kept:
            entries.append(MemoryEntry("transient", "ZeRO-3 units gathered for the whole pipeline step", sum(kept)))
    else:
        kept = [u for u in units if u.stage == 3 and not u.reshard]
        resharded = [u for u in units if u.reshard]
        if kept:
            entries.append(MemoryEntry("transient", "ZeRO-3 units kept gathered forward to backward",
                                       sum(gathered[u.index] for u in kept)))
        if resharded:
            alive = 2 if any(u.prefetch or u.backward_prefetch for u in resharded) else 1
            largest = sorted((gathered[u.index] for u in resharded), reverse=True)[:alive]
            entries.append(MemoryEntry("transient", f"ZeRO-3 resharded blocks gathered at once ({alive})", sum(largest)))
    reducing = [laid_out[u.index] for u in units if u.stage > 1]
    if reducing:
        entries.append(MemoryEntry("transient", "reduce-scatter inputs in flight (2)",
                                   sum(sorted(reducing, reverse=True)[:2])))
    # an exchanged unit (`reduce_kind` all_to_all) receives its whole size, summed into the shard on
    # landing: stages 2/3 one unit in flight, stage 1 every unit at the end of backward
    exchanged = [laid_out[u.index] for u in units if u.stage > 1 and u.reduce_kind == "all_to_all"]
    if exchanged:
        entries.append(MemoryEntry("transient", "all-to-all receive buffer of a gradient exchange in flight (1)",
                                   max(exchanged)))
    exchanged_at_end = [laid_out[u.index] for u in units if u.stage == 1 and u.reduce_kind == "all_to_all"]
    if exchanged_at_end:
        entries.append(MemoryEntry("transient", ZERO1_EXCHANGES, sum(exchanged_at_end)))
    buffered = [laid_out[u.index] for u in units if u.stage == 1]
    if buffered:  # ZeRO-1: each unit's gradients are laid out flat, then added into the persistent buffer
        entries.append(MemoryEntry("transient", "ZeRO-1 gradients laid out for the full-gradient buffer (1)",
                                   max(buffered)))
    # while a unit's gradients are laid out, the whole gradients autograd handed over still exist
    handed = [sympy.Integer(sum(math.prod(p.shape) for p in u.params) * u.dtype.itemsize) for u in units]
    entries.append(MemoryEntry("transient", "a unit's gradients as backward hands them over, while laid out (1)",
                               max(handed)))
    return entries


def build_memory_ledger(plan: Any, *, rank: int = 0, optimizer: str = "adamw",
                        activations: bool = True, fake_runs: bool = True) -> MemoryLedger:
    """The memory ledger of `rank` (see module docstring). `optimizer`: a key of OPTIMIZER_STATE.
    `fake_runs=False`: only what the placements state, without running the rank graph (no
    activations, no recomputed region)."""
    if optimizer not in OPTIMIZER_STATE:

        raise PlanError(f"no memory model for optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE)}")
    stages = plan.stages_of_rank(rank)
    entries = _parameter_entries(plan, optimizer, stages) + _transient_entries(plan, stages)
    if not fake_runs:
        return MemoryLedger(entries=entries, symbol_values=plan.comm.symbol_values)
    entries += _recompute_entries(plan, rank, stages)
    if activations:
        entries += _activation_entries(plan, rank, stages)
    return MemoryLedger(entries=entries, symbol_values=plan.comm.symbol_values)


def _activation_entries(plan: Any, rank: int, stages: list) -> list[MemoryEntry]:
    """Saved for backward: one forward's worth without a pipeline. With one, each stage's micro-batch
    times the micro-batches the rank holds at its peak (`schedules.peak_held`). With a split
    backward, a micro-batch past its B (input gradient) and before its W (weight gradient) holds
    what the weight pass still needs (`split_backward_hold`) instead of its whole forward."""
    if plan.pipeline is None:
        return [MemoryEntry("activations", "saved for backward", saved_activations(plan, rank=rank).total)]

    order, releases, ledgers, waiting = _schedule_inputs(plan, rank, stages)
    held = schedules.peak_held(order, releases=releases,
                               forward_bytes={s: plan.comm.number(ledger.total) for s, ledger in ledgers.items()},
                               after_input_bytes={s: plan.comm.number(sum(b)) for s, b in waiting.items()})
    entries = [MemoryEntry("activations", f"stage {s}: {count} micro-batch(es) before their backward at the peak "
                                          f"({plan.pipeline.schedule})", count * ledgers[s].total)
               for s, (count, _) in held.items() if count]
    for s, (_, count) in held.items():
        if count:
            retained, gradients = waiting[s]
            entries.append(MemoryEntry("activations", f"stage {s}: {count} micro-batch(es) between B and W at the "
                                                      f"peak: what the weight pass still reads", count * retained))
            entries.append(MemoryEntry("activations", f"stage {s}: {count} micro-batch(es) between B and W at the "
                                                      f"peak: gradients the weight pass starts from", count * gradients))
    return entries


def _schedule_inputs(plan: Any, rank: int, stages: list) -> tuple[list, dict, dict, dict]:
    """The rank's action list, when each stage's micro-batch lets its activations go ("B", or "W"
    with a split backward), each stage's activation ledger, and what a split backward keeps from B to W."""
    layout = plan.pipeline
    split = layout.schedule in schedules.SPLIT_BACKWARD
    ledgers = {s.index: saved_activations(plan, rank=rank, stage=s.index) for s in stages}
    # the runtime runs a stage's whole backward at B when it receives nothing (no input gradient to split)
    releases = {s.index: "W" if split and s.receives else "B" for s in stages}
    waiting = {s.index: split_backward_hold(plan, s, ledgers[s.index]) for s in stages if releases[s.index] == "W"}
    order = schedules.actions(layout.schedule, degree=layout.degree, virtual=layout.virtual,
                              microbatches=layout.microbatches)[plan.mesh.coordinate(rank, layout.axis)]
    return order, releases, ledgers, waiting


def weight_meets(plan: Any, graph: Any, received: Callable[[Any], bool],
                 within: Callable[[Any], bool] | None = None) -> list[Any]:
    """The ops of `graph` where a trainable parameter's path meets what flows from the values
    `received` marks (a stage's received tokens; a block's inputs): a linear, a norm — where
    `torch.distributed.pipelining`'s `stage_backward_input` stops and keeps the gradient. With
    `within`, only the ops it accepts."""
    weights: set = set()
    flowing: set = set()
    meets = []
    for node in graph.nodes:
        info = plan.context.placeholders.get(node.name) if node.op == "placeholder" else None
        inputs = node.all_input_nodes
        if info is not None and info.kind == "parameter" and info.requires_grad:
            weights.add(node)
        elif node.op == "call_function" and node.target in VIEW_LIKE and inputs and all(i in weights for i in inputs):
            weights.add(node)
        elif received(node):
            flowing.add(node)
        elif node.op == "call_function" and any(i in flowing for i in inputs):
            flowing.add(node)
            if node.target not in VIEW_LIKE and any(i in weights for i in inputs) and (within is None or within(node)):
                meets.append(node)
    return meets


def held_until_w(plan: Any, meets: list[Any], entries: list[Any], saved_in: set[str] | None = None
                 ) -> tuple[sympy.Expr, sympy.Expr]:
    """Per micro-batch between a split backward's B and W: (saved activations the weight pass still
    reads — those saved by the meeting ops and everything before them; what only later ops saved,
    e.g. the loss's log-probabilities, is freed when B lets the outputs go — and the gradients B
    kept at the meeting ops, one per op output). `saved_in`: of `entries`, only those these nodes
    produced."""
    before: set[str] = set()
    stack = list(meets)
    while stack:
        node = stack.pop()
        if node.name not in before:
            before.add(node.name)
            stack.extend(node.all_input_nodes)
    retained = sum((e.bytes for e in entries if (saved_in is None or e.node in saved_in) and before & set(e.saved_by)),
                   sympy.Integer(0))
    gradients = sympy.Integer(0)
    for node in meets:
        value, spec = node.meta.get("val"), node.meta.get(SPEC)
        if isinstance(value, (tuple, list)):
            value, spec = value[0], spec[0]
        gradients += local_numel(tuple(value.shape), spec.placements, plan.mesh.shape) * value.dtype.itemsize
    return sympy.simplify(retained), sympy.simplify(gradients.subs(plan.traced.symbols))


def split_backward_hold(plan: Any, stage: Any, ledger: Any) -> tuple[sympy.Expr, sympy.Expr]:
    """`held_until_w` of a pipeline stage: its weights meeting what it received (its tokens)."""
    def token(node: Any) -> bool:
        info = plan.context.placeholders.get(node.name) if node.op == "placeholder" else None
        return info is not None and info.kind == "token"

    return held_until_w(plan, weight_meets(plan, stage.graph_module.graph, token), ledger.entries)


def largest_model(*, devices: int, memory_bytes: float, stage: int,
                  bytes_per_param: tuple[float, float, float] = (2, 2, 8)) -> float:
    """Parameters that fit when (parameters, gradients, optimizer state) take `bytes_per_param`
    bytes each per parameter and ZeRO `stage` shards its categories over `devices` (activations
    ignored, as on the lecture's slide 28: 8 x 80 GB, 12 bytes/param)."""
    per_param = sum(b / devices if category in ZERO_SHARDED[stage] else b
                    for category, b in zip(("parameters", "gradients", "optimizer state"), bytes_per_param))
    return memory_bytes / per_param

