"""Pytest helpers: gate a test on a plan's communication volume, and rewrite reference files loudly.

    from autopar.tools.testing import assert_comm_within_baseline
    def test_my_model_moves_no_more_bytes():
        plan = autopar.plan(model, "dp=2,tp=2", strategies=[...], example_inputs=batch)
        assert_comm_within_baseline(plan, "baselines/my_model.json", tolerance_pct=0)

The assertion fails with a table naming the axis and collective kind that grew or shrank (a
shrink nobody explained fails as well: `autopar.tools.comm_gate`).

Update modes never pass silently and write nothing until accepted. `update=True`, or
AUTOPAR_UPDATE_BASELINES=1, prints what a rewrite of the baseline would change (the gate's
before/after table) and fails without writing; with AUTOPAR_ACCEPT=1 (or `accept=True`) it
rewrites the baseline and passes. An unchanged baseline passes. `rewrite_reference(path, text)`
does the same for any text reference file (golden code: the tests' AUTOPAR_UPDATE_GOLDEN=1),
with a unified diff.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from autopar.tools.comm_gate import baseline_change, comm_summary, compare, load_baseline, save_baseline

ACCEPT = "AUTOPAR_ACCEPT"


def accepted(accept: bool | None = None) -> bool:
    """An explicit accept: `accept=True`, or the environment variable AUTOPAR_ACCEPT=1."""
    return accept if accept is not None else os.environ.get(ACCEPT) == "1"


def _refuse_unaccepted(path: "str | Path", change: str, accept: bool | None) -> None:
    """Fail, writing nothing, unless the printed change is accepted."""
    if not accepted(accept):
        print(f"{path} would change (not rewritten):\n{change}")
        raise AssertionError(f"{path} would change (printed above; nothing was written):\n{change}\n"
                             f"Review it; rerun with {ACCEPT}=1 to accept it.")
    print(f"rewrote {path}; what changed:\n{change}")


def rewrite_reference(path: "str | Path", text: str, *, accept: bool | None = None) -> None:
    """Write `text` to the reference file `path`; if that changed it, print the unified diff and
    fail unless accepted (see module docstring)."""
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    if old == text:
        return
    diff = "".join(difflib.unified_diff(old.splitlines(keepends=True), text.splitlines(keepends=True),
                                        fromfile=f"{path} (before)", tofile=f"{path} (now)"))
    _refuse_unaccepted(path, diff, accept)
    path.write_text(text)


def assert_comm_within_baseline(plan: Any, baseline: "str | Path", *, tolerance_pct: float = 0.0,
                                update: bool | None = None, accept: bool | None = None) -> None:
    current = comm_summary(plan)
    if update if update is not None else os.environ.get("AUTOPAR_UPDATE_BASELINES") == "1":
        change = baseline_change(current, baseline)
        if change:
            _refuse_unaccepted(baseline, change, accept)
            save_baseline(current, baseline)
        return
    result = compare(load_baseline(baseline), current, tolerance_pct=tolerance_pct)
    assert result.passed, (f"communication changed against {baseline} (tolerance {tolerance_pct}%): "
                           f"{result.failures()}\n"
                           f"{result.table()}\nIf intended: AUTOPAR_UPDATE_BASELINES=1 AUTOPAR_ACCEPT=1 to rewrite "
                           f"the baseline.")
