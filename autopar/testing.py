"""Pytest helpers: gate a test on a plan's communication volume.

    from autopar.testing import assert_comm_within_baseline
    def test_my_model_moves_no_more_bytes():
        plan = autopar.plan(model, "dp=2,tp=2", strategies=[...], example_inputs=batch)
        assert_comm_within_baseline(plan, "baselines/my_model.json", tolerance_pct=0)

The assertion fails with a table naming the axis and collective kind that grew. Set
`update=True`, or the environment variable AUTOPAR_UPDATE_BASELINES=1, to rewrite the baseline
deliberately (the test then passes and the diff shows in review).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from autopar.comm_gate import compare, comm_summary, load_baseline, save_baseline


def assert_comm_within_baseline(plan: Any, baseline: "str | Path", *, tolerance_pct: float = 0.0,
                                update: bool | None = None) -> None:
    current = comm_summary(plan)
    if update if update is not None else os.environ.get("AUTOPAR_UPDATE_BASELINES") == "1":
        save_baseline(current, baseline)
        return
    result = compare(load_baseline(baseline), current, tolerance_pct=tolerance_pct)
    assert result.passed, (f"communication grew against {baseline} (tolerance {tolerance_pct}%):\n"
                           f"{result.table()}\nIf intended: AUTOPAR_UPDATE_BASELINES=1 to rewrite the baseline.")
