"""`autopar <args>` run inside the test process: `autopar.tools.cli.main`, what `python -m autopar.tools.cli`
calls (tests/test_cli_and_launch.py runs that entry point as a subprocess once). Exit code and
output as a subprocess would give them, without ~5 s of imports per call."""
from __future__ import annotations

import contextlib
import io
import subprocess

from autopar.tools.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's own errors
            code = exit.code if isinstance(exit.code, int) else 2
    return subprocess.CompletedProcess(["autopar", *args], code, stdout.getvalue(), stderr.getvalue())
