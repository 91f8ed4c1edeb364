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
- activations: tensors autograd saves for backward (`ledger/activations.py`, from the emitted graph);
- transient: not held after the step: ZeRO-3 gathered units alive at once (the kept root unit,
  plus one resharded block, two with prefetching) and reduce-scatter inputs in flight (at most
  two: the one being laid out and the one landing). An upper bound, not measured exactly.
The tests compare these categories with bytes measured from outside the runtime
(`autopar.measure.memory`, `autopar.measure.activations`).

`largest_model` answers the lecture's slide 28 from `ZERO_SHARDED`, the same table of which
categories each stage shards that the strategies implement.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import sympy
from tabulate import tabulate

from autopar.ir import SPEC, local_numel

ZERO_SHARDED = {0: (), 1: ("optimizer state",), 2: ("optimizer state", "gradients"),
                3: ("optimizer state", "gradients", "parameters")}
# optimizer name -> (parameter-sized state tensors, 4-byte scalar tensors) per parameter
OPTIMIZER_STATE = {"adamw": (2, 1), "adam": (2, 1), "sgd": (0, 0), "sgd_momentum": (1, 0)}
CATEGORIES = ("parameters", "model buffers", "gradients", "optimizer state", "activations", "transient")


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


def _parameter_entries(plan: Any, optimizer: str) -> list[MemoryEntry]:
    zero = {p.fqn: (u, p) for u in plan.units for p in u.params}
    in_bucket = {fqn for b in plan.buckets for fqn in b.params}
    per_param, scalars = OPTIMIZER_STATE[optimizer]
    entries = []
    for node in plan.graph_module.graph.nodes:
        info = plan.context.placeholders.get(node.name)
        if node.op != "placeholder" or info is None or info.kind == "input":
            continue
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
                                       else "ZeRO gradient shards", grad))
        entries.append(MemoryEntry("optimizer state", f"{optimizer}", per_param * kept + scalars * 4))
    for bucket in plan.buckets:
        entries.append(MemoryEntry("gradients", "bucket buffers (gradients are views)",
                                   sympy.Integer(bucket.numel * bucket.dtype.itemsize)))
    for unit in plan.units:
        if unit.stage == 1:
            entries.append(MemoryEntry("gradients", "ZeRO-1 full-gradient buffer",
                                       sympy.Integer(unit.gathered_numel * unit.reduce_dtype.itemsize)))
    return entries


def _transient_entries(plan: Any) -> list[MemoryEntry]:
    units = plan.units
    if not units:
        return []
    gathered = {u.index: sympy.Integer(u.gathered_numel * u.dtype.itemsize) for u in units}
    entries = []
    kept = [u for u in units if u.stage == 3 and not u.reshard]
    resharded = [u for u in units if u.reshard]
    if kept:
        entries.append(MemoryEntry("transient", "ZeRO-3 units kept gathered forward to backward",
                                   sum(gathered[u.index] for u in kept)))
    if resharded:
        alive = 2 if any(u.prefetch or u.backward_prefetch for u in resharded) else 1
        largest = sorted((gathered[u.index] for u in resharded), reverse=True)[:alive]
        entries.append(MemoryEntry("transient", f"ZeRO-3 resharded blocks gathered at once ({alive})", sum(largest)))
    reducing = [gathered[u.index] for u in units if u.stage > 1]
    if reducing:
        entries.append(MemoryEntry("transient", "reduce-scatter inputs in flight (2)",
                                   sum(sorted(reducing, reverse=True)[:2])))
    return entries


def build_memory_ledger(plan: Any, *, rank: int = 0, optimizer: str = "adamw",
                        activations: bool = True) -> MemoryLedger:
    """The memory ledger of `rank` (see module docstring). `optimizer`: a key of OPTIMIZER_STATE."""
    if optimizer not in OPTIMIZER_STATE:
        from autopar.errors import PlanError

        raise PlanError(f"no memory model for optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE)}")
    entries = _parameter_entries(plan, optimizer) + _transient_entries(plan)
    if activations:
        from autopar.ledger.activations import saved_activations

        saved = saved_activations(plan, rank=rank)
        entries.append(MemoryEntry("activations", "saved for backward", saved.total))
    return MemoryLedger(entries=entries, symbol_values=plan.comm.symbol_values)


def largest_model(*, devices: int, memory_bytes: float, stage: int,
                  bytes_per_param: tuple[float, float, float] = (2, 2, 8)) -> float:
    """Parameters that fit when (parameters, gradients, optimizer state) take `bytes_per_param`
    bytes each per parameter and ZeRO `stage` shards its categories over `devices` (activations
    ignored, as on the lecture's slide 28: 8 x 80 GB, 12 bytes/param)."""
    per_param = sum(b / devices if category in ZERO_SHARDED[stage] else b
                    for category, b in zip(("parameters", "gradients", "optimizer state"), bytes_per_param))
    return memory_bytes / per_param
