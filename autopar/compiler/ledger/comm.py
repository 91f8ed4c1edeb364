"""The communication ledger: every collective and point-to-point transfer one training step
performs, per rank.

Built from the program the compiler emitted, not from a model of it: each inserted
redistribution node and pipeline send/recv carries its forward step and its backward conjugate
(`CollectiveInfo`), lowered ops declare the collectives their kernels issue
(`op_rules.InternalCollective`), each stage's gradient buckets (`runtime.grad_sync`) add one
all-reduce per bucket and axis, a recomputed region's forward collectives appear again in
backward (`autopar/compiler/passes/recompute.py`), and ZeRO/FSDP units (`zero_units`) their all-gathers (forward,
backward, or after the optimizer step) and reduce-scatters. Each entry has kind, mesh axis (or
`axis@i,j` sub-group), link (intra/inter node), phase, the pipeline stage it belongs to
(None: every rank), how many times a step performs it (`times`: once per micro-batch for what
the stage graphs do, once per step for gradient and parameter synchronisation), the logical
size S per call (all-reduce input, all-gather output, reduce-scatter input, all-to-all input,
the tensor sent or received) as a sympy expression in the traced symbols, and the wire bytes
the registry gives (`autopar.core.comm_kinds`: NCCL's bus-bandwidth convention; point-to-point moves
S). `by_key(rank=)` is what one rank should measure in one step.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from tabulate import tabulate

from autopar.compiler.passes.recompute import RECOMPUTE
from autopar.compiler.passes.schedule_collectives import tapped_starts
from autopar.core.comm_kinds import wire_bytes
from autopar.core.ir import COLLECTIVE, RULE, module_path, simplified
from autopar.core.mesh import JOIN, Mesh
from autopar.core.zero_units import refresh_groups


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
    stage: int | None = 0  # the pipeline stage whose rank performs it; None: every rank
    times: int = 1  # calls per step (micro-batches for what a stage graph does)
    # the compute the eager runtime does while it is in flight, if any: WEIGHT_GRADIENTS for a
    # tensor-parallel input gradient's reduction issued before its linears' weight-gradient taps
    # (`autopar/compiler/passes/schedule_collectives.py`); the cost model hides it behind them
    behind: str = ""

    @property
    def wire_bytes(self) -> sympy.Expr:
        return wire_bytes(self.kind, self.group_size, self.logical_bytes)

    @property
    def path(self) -> str:
        """The link it crosses: 'intra' or 'inter' node."""
        return self.link


@dataclass
class CommLedger:
    entries: list[CommEntry]
    symbol_values: dict[sympy.Symbol, int]
    stage_coordinates: dict[int, int] | None = None  # pipeline stage -> pp coordinate (None: no pipeline)
    pipeline_axis: str | None = None
    mesh: Mesh | None = None

    def number(self, expr: sympy.Expr) -> int:
        value = sympy.sympify(expr).subs(self.symbol_values)
        return int(value) if value.is_number else value

    def _chosen(self, axis: str | None, phase: str | None, kind: str | None, joined: bool = False) -> list[CommEntry]:
        def on_axis(entry: CommEntry) -> bool:
            if axis is None or entry.axis == axis:
                return True
            return joined and axis in Mesh.split_group(entry.axis)[0].split(JOIN)

        return [e for e in self.entries if on_axis(e) and (phase is None or e.phase == phase)
                and (kind is None or e.kind == kind)]

    def total(self, *, axis: str | None = None, phase: str | None = None, kind: str | None = None,
              wire: bool = False, joined: bool = False) -> sympy.Expr:
        """Bytes per step (each entry times its calls per step), summed over every stage. `axis`
        is a group key; with `joined`, also the keys over several axes that include it (`dp+cp`
        for dp: what a question about one axis, such as comparing ZeRO stages, must count)."""
        chosen = self._chosen(axis, phase, kind, joined)
        return sympy.simplify(sum((e.times * (e.wire_bytes if wire else e.logical_bytes)) for e in chosen)
                              or sympy.Integer(0))

    def count(self, *, axis: str | None = None, phase: str | None = None, kind: str | None = None,
              joined: bool = False) -> int:
        return sum(e.times for e in self._chosen(axis, phase, kind, joined))

    def for_rank(self, rank: int) -> list[CommEntry]:
        """The entries `rank` performs: those of its pipeline stages and those of every rank."""
        if self.stage_coordinates is None or rank is None:
            return list(self.entries)
        here = self.mesh.coordinate(rank, self.pipeline_axis)
        return [e for e in self.entries if e.stage is None or self.stage_coordinates[e.stage] == here]

    def by_key(self, *, rank: int | None = None) -> dict[tuple[str, str, str], tuple[int, int]]:
        """(phase, kind, axis) -> (calls, logical bytes as a number) per step: what `rank` should
        measure (every stage's entries when rank is None)."""
        result: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for e in (self.for_rank(rank) if rank is not None else self.entries):
            row = result[(e.phase, e.kind, e.axis)]
            row[0] += e.times
            row[1] += e.times * self.number(e.logical_bytes)
        return {k: (v[0], v[1]) for k, v in result.items()}

    def accumulation(self, *, micro_batches: int, no_sync: bool) -> dict[tuple[str, str, str], tuple[int, int]]:
        """by_key() for one optimizer step over `micro_batches` forward/backward passes. With
        `no_sync` (ParallelModule.no_sync around all but the last), gradients are reduced once and
        ZeRO-3 units are gathered once and kept, never re-gathered in backward; without it every
        micro-batch repeats the step's gathers and reductions."""
        result: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for e in self.entries:
            state = e.module.startswith(("unit ", "bucket "))
            calls = e.times  # per forward/backward pass (a gather by broadcasts: one per owner; a kernel's calls)
            if e.phase == "optimizer":
                times = calls  # once per step
            elif state and no_sync:
                times = 0 if e.phase == "backward" else calls
            else:
                times = micro_batches * calls
            if times:
                row = result[(e.phase, e.kind, e.axis)]
                row[0] += times
                row[1] += times * self.number(e.logical_bytes)
        return {k: (v[0], v[1]) for k, v in result.items()}

    def table(self) -> str:
        grouped: dict[tuple, list[CommEntry]] = defaultdict(list)
        for e in self.entries:
            grouped[(e.stage, e.phase, e.module or "<top>", e.kind, e.axis, e.path)].append(e)
        staged = self.stage_coordinates is not None
        rows = []
        for (stage, phase, module, kind, axis, link), entries in grouped.items():
            logical = sympy.simplify(sum(e.times * e.logical_bytes for e in entries))
            wire = sympy.simplify(sum(e.times * e.wire_bytes for e in entries))
            row = [phase, module, kind, axis, link, sum(e.times for e in entries), str(logical), self.number(logical),
                   self.number(wire)]
            rows.append(([("all" if stage is None else stage)] if staged else []) + row)
        headers = ["phase", "module", "collective", "axis", "link", "count", "bytes/rank (S)", "S", "wire bytes"]
        body = tabulate(rows, headers=(["stage"] if staged else []) + headers, tablefmt="simple")
        return body + "\n\n" + self.totals_table()

    def totals_table(self) -> str:
        rows = []
        for axis in sorted({e.axis for e in self.entries}):
            link = "/".join(sorted({e.path for e in self.entries if e.axis == axis}))
            logical, wire = self.total(axis=axis), self.total(axis=axis, wire=True)
            rows.append([axis, link, self.count(axis=axis), str(logical), self.number(logical), self.number(wire)])
        logical, wire = self.total(), self.total(wire=True)
        rows.append(["all", "", self.count(), str(logical), self.number(logical), self.number(wire)])
        return tabulate(rows, headers=["axis", "link", "collectives", "bytes/rank (S)", "S", "wire bytes"],
                        tablefmt="simple")


def _unit_entries(unit, entry, *, pipelined: bool) -> list[CommEntry]:
    """ZeRO/FSDP: what one unit moves per step (autopar.core.ops.sharded_state). Under a pipeline
    the units stay gathered from the first micro-batch's forward to the last one's backward."""
    gathered = unit.gathered_numel * unit.dtype.itemsize
    reduced = unit.gathered_numel * unit.reduce_dtype.itemsize
    name, tensors = f"unit {unit.index} {unit.name or '<root>'}", ",".join(p.fqn for p in unit.params[:3]) + (
        "..." if len(unit.params) > 3 else "")
    entries = []
    if unit.stage == 3:
        entries += _float8_entries(unit, entry, name, pipelined=pipelined)
        if unit.float8:  # the other parameters' gather
            gathered = (unit.gathered_numel - sum(unit.group_size * unit.params[i].shard_numel for i in unit.float8)
                        ) * unit.dtype.itemsize
        kind, logical, times, how = _gather_calls(unit, gathered)
        for phase, again in (("forward", ""), ("backward", " again for backward (resharded after forward)")):
            if gathered and (phase == "forward" or (unit.reshard and not pipelined)):
                entries.append(entry(phase, kind, unit.axis, name, tensors,
                                     f"ZeRO-3 parameters{again or ' before use'}{how}", unit.dtype, logical, times=times))
    how = "" if unit.reduce_kind == "reduce_scatter" else " (exchanged whole, summed by each owner)"
    entries.append(entry("grad_sync", unit.reduce_kind, unit.axis, name, tensors,
                         f"gradients to their owners{how}", unit.reduce_dtype, reduced))
    for axis in unit.extra_axes:
        entries.append(entry("grad_sync", "all_reduce", axis, name, tensors, "gradient shard over a replicated axis",
                             unit.reduce_dtype, unit.shard_numel * unit.reduce_dtype.itemsize))
    return entries


def _float8_entries(unit, entry, name: str, *, pipelined: bool) -> list[CommEntry]:
    """A unit's FP8 weights (`autopar/core/ops/float8_gather.py`): their largest magnitudes all-reduced
    over the unit's axis and the others cutting them (forward only: backward reuses the scales), and
    one all-gather of their 8-bit values (again in backward when resharded)."""
    if not unit.float8:
        return []
    fp8 = [unit.params[i] for i in unit.float8]
    tensors = ",".join(p.fqn for p in fp8[:3]) + ("..." if len(fp8) > 3 else "")
    entries = [entry("forward", "all_reduce", axis, name, tensors, "fp8 scales of the gathered weights (max)",
                     unit.dtype, len(fp8) * unit.dtype.itemsize) for axis in (unit.axis, *unit.float8_axes)]
    gathered = unit.group_size * sum(p.shard_numel for p in fp8)  # one byte each
    entries.append(entry("forward", "all_gather", unit.axis, name, tensors, "ZeRO-3 weights before use, in FP8",
                         torch.float8_e4m3fn, gathered))
    if unit.reshard and not pipelined:
        entries.append(entry("backward", "all_gather", unit.axis, name, tensors,
                             "ZeRO-3 weights again for backward (resharded after forward), in FP8",
                             torch.float8_e4m3fn, gathered))
    return entries


def _gather_calls(unit, gathered: int) -> tuple[str, int, int, str]:
    """(kind, logical bytes per call, calls, note) of gathering `gathered` bytes as `unit.gather_kind`
    says: one all-gather (logical: the gathered buffer), or one broadcast per owner (its row)."""
    if unit.gather_kind == "broadcast":
        return "broadcast", gathered // unit.group_size, unit.group_size, ", one broadcast per owner"
    return "all_gather", gathered, 1, ""


def _refresh_entries(units: list, entry) -> list[CommEntry]:
    """ZeRO-1/2 after the optimizer step: each refresh group's units in one gather (`_gather_calls`)."""
    entries = []
    for group in refresh_groups(units):
        first = group[0]
        kind, logical, times, how = _gather_calls(first, first.group_size * sum(u.shard_numel for u in group)
                                                  * first.dtype.itemsize)
        name = "unit " + ",".join(str(u.index) for u in group)
        tensors = ",".join(u.name or "<root>" for u in group[:3]) + ("..." if len(group) > 3 else "")
        entries.append(entry("optimizer", kind, first.axis, name, tensors,
                             f"ZeRO-{first.stage} updated parameters after the step{how}", first.dtype, logical,
                             times=times))
    return entries


def _phases(phase: str, region: str | None) -> tuple[str, ...]:
    """A forward collective of a recomputed region (autopar/compiler/passes/recompute.py) runs again in backward."""
    return (phase, "backward") if region is not None and phase == "forward" else (phase,)


def _why(why: str, phase: str, planned_phase: str, region: str | None) -> str:
    return why if phase == planned_phase else f"{why}; run again by the recomputation of {region}"


WEIGHT_GRADIENTS = "weight gradients"


def build_comm_ledger(program: Any, mesh: Mesh, symbols: dict[sympy.Symbol, sympy.Symbol],
                      symbol_values: dict[sympy.Symbol, int]) -> CommLedger:
    """Every collective of every stage per step."""
    pipeline = program.pipeline
    micro = pipeline.microbatches if pipeline is not None else 1
    stage_index = 0

    def entry(phase: str, kind: str, axis: str, module: str, tensor: str, why: str, dtype: torch.dtype,
              logical: sympy.Expr, *, times: int = 1, stage: int | None = -1, behind: str = "") -> CommEntry:
        return CommEntry(phase=phase, kind=kind, axis=axis, link=mesh.link(axis), group_size=mesh.group_size(axis),
                         module=module, tensor=tensor, why=why, dtype=dtype,
                         logical_bytes=simplified(sympy.sympify(logical).subs(symbols)),
                         stage=stage_index if stage == -1 else stage, times=times, behind=behind)

    entries = []
    for stage in program.stages:
        stage_index = stage.index
        tapped = tapped_starts(stage.graph_module.graph)
        for node in stage.graph_module.graph.nodes:
            region = node.meta.get(RECOMPUTE)
            for info in node.meta.get(COLLECTIVE, []):
                for phase in _phases(info.phase, region):
                    behind = WEIGHT_GRADIENTS if node in tapped and phase == "backward" else ""
                    entries.append(entry(phase, info.kind, info.axis, info.module, info.tensor,
                                         _why(info.why, phase, info.phase, region), info.dtype, info.logical_bytes,
                                         times=micro, behind=behind))
            rule = node.meta.get(RULE)
            for internal in (rule.internal if rule is not None else []):
                for phase in _phases(internal.phase, region):
                    entries.append(entry(phase, internal.kind, internal.axis, module_path(node), node.name,
                                         _why(internal.why, phase, internal.phase, region), internal.dtype,
                                         internal.logical_bytes, times=micro * internal.calls))
        for index, bucket in enumerate(stage.buckets):
            name = f"bucket {index}" if pipeline is None else f"bucket {stage.index}.{index}"
            for axis in bucket.axes:
                entries.append(entry("grad_sync", "all_reduce", axis, name, ",".join(bucket.params[:3])
                                     + ("..." if len(bucket.params) > 3 else ""), "gradient synchronisation",
                                     bucket.dtype, bucket.numel * bucket.dtype.itemsize))
        for unit in stage.units:
            entries.extend(_unit_entries(unit, entry, pipelined=pipeline is not None))
        entries.extend(_refresh_entries(stage.units, entry))
    if pipeline is not None:
        loss = next(n for n in program.stages[-1].graph_module.graph.nodes if n.op == "output").args[0][0]
        dtype = loss.meta["val"].dtype
        entries.append(entry("step", "broadcast", pipeline.axis, "", "loss", "the step's loss from the last stage to "
                             "every pipeline rank", dtype, dtype.itemsize, stage=None))
    coordinates = ({s.index: pipeline.coordinate(s.index) for s in program.stages} if pipeline is not None else None)
    return CommLedger(entries=entries, symbol_values=symbol_values, stage_coordinates=coordinates,
                      pipeline_axis=pipeline.axis if pipeline is not None else None, mesh=mesh)
