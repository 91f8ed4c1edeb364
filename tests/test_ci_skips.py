"""Under CI=true a skip is a failure (tests/conftest.py): a missing dependency fails the run.

A scratch test file with this suite's conftest runs in a subprocess, with CI=true and without:
a test skipped because a module is missing (as the `transformers` fixture does, and as the
browser test does without Chromium), and a whole module skipped at collection (which under CI
becomes a collection error that stops the run)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRATCH = {
    "test_needs_a_missing_module.py": (
        "import pytest\n\n"
        "def test_needs_it():\n"
        "    pytest.importorskip('a_module_nobody_installed')\n\n"
        "def test_needs_nothing():\n"
        "    assert True\n"),
    "test_skipped_at_collection.py": (
        "import pytest\n\n"
        "pytest.importorskip('another_module_nobody_installed')\n\n"
        "def test_never_collected():\n"
        "    assert True\n"),
}


def run_scratch_suite(tmp_path: Path, name: str, *, ci: str | None) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / name).write_text(SCRATCH[name])
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_skips_fail_under_ci(tmp_path):
    test_level = run_scratch_suite(tmp_path, "test_needs_a_missing_module.py", ci="true")
    assert test_level.returncode == 1, test_level.stdout
    assert "skipped under CI=true" in test_level.stdout and "a_module_nobody_installed" in test_level.stdout
    assert test_level.stdout.splitlines()[-1].startswith("1 failed, 1 passed")
    module_level = run_scratch_suite(tmp_path, "test_skipped_at_collection.py", ci="true")
    assert module_level.returncode == 2, module_level.stdout  # a collection error: the run stops
    assert "skipped under CI=true" in module_level.stdout and "another_module_nobody_installed" in module_level.stdout


def test_skips_stay_skips_outside_ci(tmp_path):
    # pytest's exit code 5: nothing was collected (the only module skipped)
    for name, code, last_line in [("test_needs_a_missing_module.py", 0, "1 passed, 1 skipped"),
                                  ("test_skipped_at_collection.py", 5, "1 skipped")]:
        result = run_scratch_suite(tmp_path, name, ci=None)
        assert result.returncode == code and result.stdout.splitlines()[-1].startswith(last_line), result.stdout
