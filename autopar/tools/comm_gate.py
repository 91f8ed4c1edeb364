"""The CI gate on communication volume: summaries, baseline files, and the comparison.

`comm_summary(plan)` sums a plan's ledger per (axis, link, collective kind, dtype): calls and
logical bytes per step for the traced shapes (per rank; under a pipeline summed over the stages,
so a change in any stage shows). A baseline file (`autopar.comm/2`) stores that summary with the
mesh and strategies it came from. `compare(baseline, current, tolerance_pct)` lists every row
before and after and marks what changed: more bytes than the baseline allows or a row the
baseline did not have (GREW, NEW), fewer bytes than it allows or a row gone (SHRANK, GONE). A
collective whose dtype changed shows as a new row beside a gone one: WIDENED when the new dtype
has more bytes per element than the gone one (bf16 gathered where fp8 was planned: whatever the
tolerance, since the bytes may look explained), NARROWED when fewer; a gone row whose bytes went
into a wider dtype's row of the same collective that was already there (an FP8 all-gather
folded into a unit's bf16 one) is WIDENED too. Each fails the gate: a shrink nobody explained is as likely a bytes-dropping bug
(a ledger entry lost, a reduction skipped) as an improvement, and an improvement is accepted by
rewriting the baseline on purpose. `baseline_change` says what a rewrite would change and
`update_baseline` makes it. Used by `autopar check` and `autopar.tools.testing`.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from autopar.core.errors import PlanError

BASELINE_SCHEMA = "autopar.comm/2"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(name: str) -> int:
    return getattr(torch, name).itemsize


def comm_summary(plan: Any) -> dict[str, Any]:
    volumes: dict[tuple[str, str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for entry in plan.comm.entries:
        row = volumes[(entry.axis, entry.path, entry.kind, dtype_name(entry.dtype))]
        row[0] += entry.times
        row[1] += entry.times * int(plan.comm.number(entry.logical_bytes))
    return {
        "schema": BASELINE_SCHEMA,
        "mesh": str(plan.mesh),
        "strategies": [f"{s.name} on {s.axis}" for s in plan.strategy.strategies],
        "volumes": [{"axis": a, "link": l, "kind": k, "dtype": d, "calls": c, "bytes": b}
                    for (a, l, k, d), (c, b) in sorted(volumes.items())],
        "total_bytes": sum(b for _, b in volumes.values()),
    }


def save_baseline(summary: dict[str, Any], path: "str | Path") -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=1) + "\n")


def baseline_change(summary: dict[str, Any], path: "str | Path") -> str:
    """What rewriting the baseline at `path` with `summary` would change: "" when the file already
    holds it, else the before/after table (every row against the old baseline, or "new
    baseline"). Writes nothing."""
    path = Path(path)
    text = json.dumps(summary, indent=1) + "\n"
    old = path.read_text() if path.exists() else None
    if old == text:
        return ""
    if old is None:
        return f"new baseline: {summary['total_bytes']} bytes per rank per step"
    try:
        before = json.loads(old)
        table = compare(before, summary).table()
    except (ValueError, KeyError) as error:  # an unreadable or other-schema file: say so, do not guess
        return f"replaced an unreadable baseline ({error})"
    return f"{table}\ntotal bytes {before.get('total_bytes')} -> {summary['total_bytes']}"


def update_baseline(summary: dict[str, Any], path: "str | Path") -> str:
    """Rewrite the baseline at `path` with `summary` (an accepted change); return what changed
    (`baseline_change`)."""
    change = baseline_change(summary, path)
    if change:
        save_baseline(summary, path)
    return change


def load_baseline(path: "str | Path") -> dict[str, Any]:
    if not Path(path).exists():
        raise PlanError(f"no communication baseline at {path}; fix: create it deliberately with --update --accept "
                        f"(or AUTOPAR_UPDATE_BASELINES=1 in tests)")
    data = json.loads(Path(path).read_text())
    if data.get("schema") != BASELINE_SCHEMA:
        raise PlanError(f"baseline {path} has schema {data.get('schema')!r}, expected {BASELINE_SCHEMA!r}; "
                        f"fix: regenerate it with --update")
    return data


@dataclass(frozen=True)
class GateResult:
    rows: list[list[Any]]
    grew: list[list[Any]]  # GREW and NEW rows
    shrank: list[list[Any]] = field(default_factory=list)  # SHRANK and GONE rows

    @property
    def passed(self) -> bool:
        return not self.grew and not self.shrank

    def failures(self) -> str:
        """The failing rows in a line: kind on axis (status)."""
        return ", ".join(f"{row[2]} on {row[0]} ({row[-1]})" for row in self.grew + self.shrank)

    def table(self) -> str:
        headers = ["axis", "link", "collective", "dtype", "calls before", "calls now", "bytes before", "bytes now",
                   "change", "status"]
        return tabulate(self.rows, headers=headers, tablefmt="simple")


def _dtype_change(key: tuple[str, ...], gone: set[tuple[str, ...]]) -> str:
    """For a new row: WIDENED / NARROWED against the gone rows of the same collective, else NEW."""
    sizes = [_itemsize(other[3]) for other in gone if other[:3] == key[:3]]
    if any(size < _itemsize(key[3]) for size in sizes):
        return "WIDENED"
    return "NARROWED" if sizes else "NEW"


def compare(baseline: dict[str, Any], current: dict[str, Any], *, tolerance_pct: float = 0.0) -> GateResult:
    before = {(v["axis"], v["link"], v["kind"], v["dtype"]): v for v in baseline["volumes"]}
    now = {(v["axis"], v["link"], v["kind"], v["dtype"]): v for v in current["volumes"]}
    gone = set(before) - set(now)
    rows, grew, shrank = [], [], []
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key), now.get(key)
        old_bytes, new_bytes = (old or {}).get("bytes", 0), (new or {}).get("bytes", 0)
        if old is None:
            status = _dtype_change(key, gone)
        elif new is None:  # its bytes moved to a wider dtype of the same collective, which grew: WIDENED
            status = "WIDENED" if any(k[:3] == key[:3] and _itemsize(k[3]) > _itemsize(key[3]) and k in before
                                      and now[k]["bytes"] > before[k]["bytes"] for k in now) else "GONE"
        elif new_bytes > old_bytes * (1 + tolerance_pct / 100):
            status = "GREW"
        elif new_bytes < old_bytes * (1 - tolerance_pct / 100):
            status = "SHRANK"
        else:
            status = "ok"
        change = f"{(new_bytes - old_bytes) / old_bytes:+.1%}" if old_bytes else "new"
        row = [*key, (old or {}).get("calls", 0), (new or {}).get("calls", 0), old_bytes, new_bytes, change, status]
        rows.append(row)
        if status in ("NEW", "GREW", "WIDENED"):
            grew.append(row)
        elif status in ("GONE", "SHRANK", "NARROWED"):
            shrank.append(row)
    return GateResult(rows=rows, grew=grew, shrank=shrank)
