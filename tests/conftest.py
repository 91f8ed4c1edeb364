"""Suite-wide pytest configuration: no silent skips under CI, and the optional dependencies as fixtures.

Under CI (`CI=true`, as `.ci/run` sets it) every skipped test or module is reported as a failure:
a missing dependency (transformers, Chromium) must fail the run, not thin it out. Locally a test
whose dependency is missing is skipped with the reason. Modules in `SERIAL_MODULES` get the
`serial` mark. Tests that need transformers ask for the
`transformers` fixture (or `pytestmark = pytest.mark.usefixtures("transformers")`); nothing
imports it at module level, so tests that do not need it run without it.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests that time themselves or measure CPU shares (and torchrun jobs): `scripts/test.sh` runs them
# alone, after the rest has run two files at a time (pytest-xdist), so that no other test's load
# moves their measurements.
SERIAL_MODULES = {"test_planning_growth.py", "test_faults.py", "test_cli_and_launch.py", "test_check_rank_graphs.py",
                  "test_plan_once.py", "test_cluster.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def transformers():
    """The transformers package (Hugging Face models), or a skip naming it."""
    return pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")


def _fail_skip(report) -> None:
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, where every test must run: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped:
        _fail_skip(report)
