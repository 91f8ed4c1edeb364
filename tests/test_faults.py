"""Faults under torchrun end the whole job: a rank that raises, is SIGKILLed mid-step, or stalls
inside a step takes the job down within the process-group timeout, torchrun's report names the
failed rank, the ranks that see the failure as a distributed error print where every rank was last
(`autopar/runtime/progress.py`), no process of the job is left (`tests/jobs/faulty_training.py`) and
no shared-memory file of a dead process is left in /dev/shm. A rank killed by a signal is seen dead at
once (torchrun's agent waits on its children: a dead rank is never a live one to its peers, zombie
or not), so the job ends well inside the process-group timeout, not after it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopar.runtime.launch import free_port

JOB = Path(__file__).parent / "jobs" / "faulty_training.py"
PG_TIMEOUT_S = 20
SHM = Path("/dev/shm")


def _orphaned_shm(before: set[str]) -> list[str]:
    """Entries of /dev/shm made since `before` whose maker (the pid in the name torch and glibc give
    them, e.g. torch_<pid>_...) is no longer running."""
    if not SHM.is_dir():
        return []
    orphans = []
    for name in {entry.name for entry in SHM.iterdir()} - before:
        pids = [int(part) for part in name.replace("-", "_").split("_") if part.isdigit()]
        if not pids or not any(Path(f"/proc/{pid}").exists() for pid in pids):
            orphans.append(name)
    return orphans


def _job_processes(tag: str) -> list[int]:
    """PIDs of processes whose command line carries this job's tag (its unique master port)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(JOB) in command and tag in command:
                found.append(int(entry.name))
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault, words", [
    ("raise", "rank 1 broke in step 1"),
    ("kill", "Signal 9 (SIGKILL)"),
    ("stall", "rank 1: step 2, forward done (backward next)"),  # rank 0's report: where rank 1 stopped
])
def test_a_failed_rank_ends_the_torchrun_job(fault, words):
    port = str(free_port())
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=0",
               "--monitor-interval=0.5", "--master-addr=127.0.0.1", f"--master-port={port}", str(JOB), fault,
               str(PG_TIMEOUT_S), port]
    shm_before = {entry.name for entry in SHM.iterdir()} if SHM.is_dir() else set()
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=240,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert words in output, output[-3000:]
    if fault != "stall":  # torchrun's failure report names the rank that failed
        assert "rank: 1" in output or "local_rank: 1" in output, output[-3000:]
    else:  # the rank that timed out names where each rank was, the stalled one first
        report = output[output.index("where every rank was last"):]
        assert report.index("rank 1: step 2, forward done") < report.index("rank 0: step 2, in backward"), \
            output[-3000:]
    assert elapsed < PG_TIMEOUT_S + 60, f"the job took {elapsed:.0f} s to end"
    if fault == "kill":  # the peer waiting on the killed rank is stopped, not left to its timeout
        assert "Timed out" not in output and "timed out" not in output, output[-3000:]
    time.sleep(1)
    left = _job_processes(port)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job still running: {left}"
    assert _orphaned_shm(shm_before) == [], "shared-memory files of dead processes left in /dev/shm"
