"""Suite-wide pytest configuration: no silent skips under CI, and the optional dependencies as fixtures.

Under CI (`CI=true`, as `.ci/run` sets it) every skipped test or module is reported as a failure:
a missing dependency (transformers, Chromium) must fail the run, not thin it out. Locally a test
whose dependency is missing is skipped with the reason. Modules in `SERIAL_MODULES` and tests in
`SERIAL_TESTS` get the `serial` mark; the files of `LONGEST_FIRST` are collected first. Tests that need transformers ask for the
`transformers` fixture (or `pytestmark = pytest.mark.usefixtures("transformers")`); nothing
imports it at module level, so tests that do not need it run without it.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests that time themselves or measure CPU shares: `scripts/test.sh` runs them alone, after the
# rest has run two files at a time (pytest-xdist), so that no other test's load moves their
# measurements. (torchrun jobs and deadlines run with the rest: they wait more than they compute,
# and their bounds are tens of seconds.)
SERIAL_MODULES = {"test_planning_growth.py"}
SERIAL_TESTS = {
    "test_check_rank_graphs.py::test_the_check_is_a_small_part_of_planning",
    "test_plan_once.py::test_rank_zero_plans_the_others_run_its_plan_or_a_plan_file_and_a_different_model_is_named",
    "test_cluster.py::test_calibration_predicts_an_all_reduce_timed_apart_from_it",
}
# The longest files first: pytest-xdist's loadfile hands out files in collection order, so the
# last files to start are short ones and neither worker waits long for the other at the end.
# (test_float8.py, test_composed_cost.py and the files after test_checkpoint_async.py: their
# durations in the CI run of 2026-12-07 15:10, benchmarks/RESULTS.md, where alphabetical order had
# left them to start late)
LONGEST_FIRST = ("test_compile.py", "test_zoo.py", "test_moe.py", "test_pipeline_numerics.py", "test_float8.py",
                 "test_composed_cost.py", "test_zero_numerics.py",
                 "test_context_parallel.py", "test_recompute.py", "test_hf_numerics.py",
                 "test_inspect_and_gate.py", "test_corpus.py", "test_checkpoint.py", "test_checkpoint_resharding.py",
                 "test_accumulation.py", "test_device_portability.py", "test_planner_moe.py", "test_checkpoint_async.py",
                 "test_faults.py", "test_packed_sequences.py", "test_repeated_blocks.py", "test_dualpipev_overlap.py",
                 "test_routing_skew.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = Path(str(item.fspath)).name
        if name in SERIAL_MODULES or f"{name}::{item.name}" in SERIAL_TESTS:
            item.add_marker(pytest.mark.serial)
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: the rest keep their order


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
