"""The communication ledger: every collective one training step performs, per rank.

Built from the planned graph, not from a model of it: each inserted redistribution node carries
its forward collective and its backward conjugate (`CollectiveInfo`), lowered ops declare the
collectives their kernels issue (`op_rules.InternalCollective`), and the gradient buckets of
`runtime.grad_sync` add one all-reduce per bucket and axis, and ZeRO/FSDP units (`zero_units`)
their all-gathers (forward, backward, or after the optimizer step) and reduce-scatters. Each entry has kind, mesh axis,
link (intra/inter node), phase, count, the logical size S (all-reduce input, all-gather output,
reduce-scatter input, all-to-all input) as a sympy expression in the traced symbols, and the
NCCL bus-bandwidth wire bytes: 2(N-1)/N*S for all-reduce, (N-1)/N*S for the others.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import sympy
import torch
from tabulate import tabulate

from autopar.comm_kinds import wire_bytes
from autopar.mesh import Mesh


@dataclass(frozen=True)
class CommEntry:
    phase: str
    kind: str
    axis: str
    link: str
    group_size: int
    module: str
    tensor: str
    why: str
    dtype: torch.dtype
    logical_bytes: sympy.Expr

    @property
    def wire_bytes(self) -> sympy.Expr:
        return wire_bytes(self.kind, self.group_size, self.logical_bytes)


@dataclass
class CommLedger:
    entries: list[CommEntry]
    symbol_values: dict[sympy.Symbol, int]

    def number(self, expr: sympy.Expr) -> int:
        value = sympy.sympify(expr).subs(self.symbol_values)
        return int(value) if value.is_number else value

    def total(self, *, axis: str | None = None, phase: str | None = None, kind: str | None = None,
              wire: bool = False) -> sympy.Expr:
        chosen = [e for e in self.entries if (axis is None or e.axis == axis) and (phase is None or e.phase == phase)
                  and (kind is None or e.kind == kind)]
        return sympy.simplify(sum((e.wire_bytes if wire else e.logical_bytes) for e in chosen) or sympy.Integer(0))

    def count(self, *, axis: str | None = None, phase: str | None = None, kind: str | None = None) -> int:
        return sum(1 for e in self.entries if (axis is None or e.axis == axis) and (phase is None or e.phase == phase)
                   and (kind is None or e.kind == kind))

    def by_key(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """(phase, kind, axis) -> (calls, logical bytes as a number): what a run should measure."""
        result: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for e in self.entries:
            row = result[(e.phase, e.kind, e.axis)]
            row[0] += 1
            row[1] += self.number(e.logical_bytes)
        return {k: (v[0], v[1]) for k, v in result.items()}

    def accumulation(self, *, micro_batches: int, no_sync: bool) -> dict[tuple[str, str, str], tuple[int, int]]:
        """by_key() for one optimizer step over `micro_batches` forward/backward passes. With
        `no_sync` (ParallelModule.no_sync around all but the last), gradients are reduced once and
        ZeRO-3 units are gathered once and kept, never re-gathered in backward; without it every
        micro-batch repeats the step's gathers and reductions."""
        result: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for e in self.entries:
            state = e.module.startswith(("unit ", "bucket "))
            if e.phase == "optimizer":
                times = 1
            elif state and no_sync:
                times = 0 if e.phase == "backward" else 1
            else:
                times = micro_batches
            if times:
                row = result[(e.phase, e.kind, e.axis)]
                row[0] += times
                row[1] += times * self.number(e.logical_bytes)
        return {k: (v[0], v[1]) for k, v in result.items()}

    def table(self) -> str:
        grouped: dict[tuple, list[CommEntry]] = defaultdict(list)
        for e in self.entries:
            grouped[(e.phase, e.module or "<top>", e.kind, e.axis, e.link)].append(e)
        rows = []
        for (phase, module, kind, axis, link), entries in grouped.items():
            logical = sympy.simplify(sum(e.logical_bytes for e in entries))
            wire = sympy.simplify(sum(e.wire_bytes for e in entries))
            rows.append([phase, module, kind, axis, link, len(entries), str(logical), self.number(logical), self.number(wire)])
        body = tabulate(rows, headers=["phase", "module", "collective", "axis", "link", "count", "bytes/rank (S)",
                                       "S", "wire bytes"], tablefmt="simple")
        return body + "\n\n" + self.totals_table()

    def totals_table(self) -> str:
        rows = []
        for axis in sorted({e.axis for e in self.entries}):
            link = next(e.link for e in self.entries if e.axis == axis)
            logical, wire = self.total(axis=axis), self.total(axis=axis, wire=True)
            rows.append([axis, link, self.count(axis=axis), str(logical), self.number(logical), self.number(wire)])
        logical, wire = self.total(), self.total(wire=True)
        rows.append(["all", "", len(self.entries), str(logical), self.number(logical), self.number(wire)])
        return tabulate(rows, headers=["axis", "link", "collectives", "bytes/rank (S)", "S", "wire bytes"],
                        tablefmt="simple")


def _unit_entries(unit, entry) -> list[CommEntry]:
    """ZeRO/FSDP: what one unit moves per step (autopar.runtime.sharded_state)."""
    gathered = unit.gathered_numel * unit.dtype.itemsize
    reduced = unit.gathered_numel * unit.reduce_dtype.itemsize
    name, tensors = f"unit {unit.index} {unit.name or '<root>'}", ",".join(p.fqn for p in unit.params[:3]) + (
        "..." if len(unit.params) > 3 else "")
    entries = []
    if unit.stage == 3:
        entries.append(entry("forward", "all_gather", unit.axis, name, tensors, "ZeRO-3 parameters before use",
                             unit.dtype, gathered))
        if unit.reshard:
            entries.append(entry("backward", "all_gather", unit.axis, name, tensors,
                                 "ZeRO-3 parameters again for backward (resharded after forward)", unit.dtype, gathered))
    else:
        entries.append(entry("optimizer", "all_gather", unit.axis, name, tensors,
                             f"ZeRO-{unit.stage} updated parameters after the step", unit.dtype, gathered))
    entries.append(entry("grad_sync", "reduce_scatter", unit.axis, name, tensors,
                         "gradients to their owners", unit.reduce_dtype, reduced))
    for axis in unit.extra_axes:
        entries.append(entry("grad_sync", "all_reduce", axis, name, tensors, "gradient shard over a replicated axis",
                             unit.reduce_dtype, unit.shard_numel * unit.reduce_dtype.itemsize))
    return entries


def build_comm_ledger(graph: torch.fx.Graph, mesh: Mesh, buckets: list, param_dtypes: dict[str, torch.dtype],
                      symbols: dict[sympy.Symbol, sympy.Symbol], symbol_values: dict[sympy.Symbol, int],
                      *, units: list = ()) -> CommLedger:
    from autopar.ir import COLLECTIVE, RULE, module_path

    def entry(phase: str, kind: str, axis: str, module: str, tensor: str, why: str, dtype: torch.dtype,
              logical: sympy.Expr) -> CommEntry:
        return CommEntry(phase=phase, kind=kind, axis=axis, link=mesh.link(axis), group_size=mesh.size(axis),
                         module=module, tensor=tensor, why=why, dtype=dtype,
                         logical_bytes=sympy.simplify(sympy.sympify(logical).subs(symbols)))

    entries = []
    for node in graph.nodes:
        for info in node.meta.get(COLLECTIVE, []):
            entries.append(entry(info.phase, info.kind, info.axis, info.module, info.tensor, info.why, info.dtype,
                                 info.logical_bytes))
        rule = node.meta.get(RULE)
        for internal in (rule.internal if rule is not None else []):
            entries.append(entry(internal.phase, internal.kind, internal.axis, module_path(node), node.name,
                                 internal.why, internal.dtype, internal.logical_bytes))
    for index, bucket in enumerate(buckets):
        for axis in bucket.axes:
            entries.append(entry("grad_sync", "all_reduce", axis, f"bucket {index}", ",".join(bucket.params[:3])
                                 + ("..." if len(bucket.params) > 3 else ""), "gradient synchronisation",
                                 bucket.dtype, bucket.numel * bucket.dtype.itemsize))
    for unit in units:
        entries.extend(_unit_entries(unit, entry))
    return CommLedger(entries=entries, symbol_values=symbol_values)
