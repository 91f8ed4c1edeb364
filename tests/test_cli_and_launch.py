"""The CLI prints plans and per-rank code and exits 2 on bad input; a failing rank ends a launched
job with its traceback instead of hanging."""
from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from autopar.runtime.launch import RankKilled, _crashed, launch
from tests.cli_in_process import run_cli


def run_cli_subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar.tools.cli", *args], capture_output=True, text=True, timeout=120)


def test_plan_prints_placements_and_ledger():
    """The entry point itself, as a user runs it; the other CLI tests call it in process."""
    result = run_cli_subprocess("plan", "examples/gpt.py", "--mesh", "dp=2,tp=2", "--strategy", "dp,sp", "--symbolic", "b=0,s=1")
    assert result.returncode == 0, result.stderr
    assert "placement (dp,tp)" in result.stdout and "reduce_scatter" in result.stdout and "b*s" in result.stdout


def test_graph_prints_rank_code():
    result = run_cli("graph", "examples.gpt:example", "--mesh", "tp=2", "--rank", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def forward(") and "vocab_parallel_embedding" in result.stdout


def test_compare_cp_prints_the_three_lowerings():
    """examples/gpt.py: 4 heads, sequence 16; on cp=4 every method plans, the ring moves the most."""
    result = run_cli("plan", "examples/gpt.py", "--mesh", "cp=4", "--compare-cp")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.split()[:1] in
            (["ring"], ["allgather"], ["alltoall"])}
    assert set(rows) == {"ring", "allgather", "alltoall"}
    wire = {method: int(row[3].replace(",", "")) for method, row in rows.items()}
    assert wire["ring"] > wire["allgather"] > wire["alltoall"] > 0


def test_graph_with_chunks_prints_the_pieces():
    """`--chunks 2`: async TP; each o_proj / down reduce-scatter of SP in two pieces of rows."""
    result = run_cli("graph", "examples.gpt:example", "--mesh", "tp=2", "--strategy", "sp", "--rank", "0",
                     "--chunks", "2")
    assert result.returncode == 0, result.stderr
    assert "row_chunks_rows" in result.stdout and "row_chunks_join" in result.stdout


@pytest.mark.parametrize("args, words", [
    (("plan", "examples/gpt.py", "--mesh", "tp=2", "--no-overlap", "--chunks", "2"), "needs the overlap"),
    (("plan", "examples/gpt.py", "--cluster", "cpu2x4", "--auto", "--chunks", "2"), "does not take --chunks"),
    (("plan", "examples/gpt.py", "--mesh", "dp=2", "--compare-stages", "--no-overlap", "--chunks", "2"),
     "needs the overlap"),
    (("plan", "examples/gpt.py", "--mesh", "dp=0"), "positive integer"),
    (("plan", "examples/gpt.py", "--mesh", "dp=2", "--strategy", "tp"), "unknown mesh axis 'tp'"),
    (("plan", "examples/gpt.py", "--mesh", "dp=2", "--strategy", "zz"), "unknown strategy 'zz'"),
    (("graph", "examples/gpt.py", "--mesh", "dp=2", "--rank", "5"), "outside the mesh"),
    (("plan", "examples/gpt.py", "--mesh", "cp=2", "--cp-method", "tree"), "unknown context-parallel method"),
    (("plan", "examples/gpt.py", "--mesh", "dp=2", "--compare-cp"), "declare context parallelism"),
])
def test_bad_input_exits_2_with_a_message(args, words):
    result = run_cli(*args)
    assert result.returncode == 2 and words in result.stderr


def fail_on_rank_one(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # would wait forever for rank 1


def test_a_failed_rank_ends_the_job_with_its_message():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank one is broken"):
        launch(fail_on_rank_one, 2, timeout_s=30)
    assert time.monotonic() - start < 60


def abort_on_rank_one(rank: int, world: int) -> int:
    print(f"rank {rank} was here", file=sys.stderr, flush=True)
    if rank == 1:
        os.abort()  # as a native library's std::terminate would: no Python exception, no error file
    return rank


def test_a_rank_killed_by_a_signal_is_reported_with_its_stderr_and_python_stack(capfd):
    """SIGABRT in rank 1: the error names the signal and carries each rank's stderr, rank 1's with
    faulthandler's stack of where Python was (this function); a clean job's stderr reaches the
    caller's, each line marked with its rank."""
    with pytest.raises(RankKilled) as crash:
        launch(abort_on_rank_one, 2, timeout_s=30)
    text = str(crash.value)
    assert "SIGABRT" in text and "rank 0 was here" in text and "rank 1 was here" in text
    assert "Fatal Python error: Aborted" in text and "in abort_on_rank_one" in text
    assert launch(print_rank, 2, timeout_s=30) == [0, 1]
    assert {"[rank 0] rank 0 prints", "[rank 1] rank 1 prints"} <= set(capfd.readouterr().err.splitlines())


def segfault_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        ctypes.string_at(0)  # a read through a null pointer, in native code (ctypes' memmove)
    return rank


def test_a_rank_killed_in_native_code_is_reported_with_the_faulting_threads_native_stack():
    """SIGSEGV inside native code on rank 1: the error ends with where rank 1 died, the C++ frames
    of the thread that took the signal (PyTorch's fatal-signal handler) and its innermost Python
    frames (faulthandler) — what names a crash in torch, gloo or libc."""
    with pytest.raises(RankKilled) as crash:
        launch(segfault_on_rank_one, 2, timeout_s=30)
    text = str(crash.value)
    where = text[text.index("--- where rank 1 died ---"):]
    assert "SIGSEGV" in where and "fatalSignalHandler" in where and "ffi_call" in where
    assert "Current thread" in where and "in segfault_on_rank_one" in where
    assert text.rindex("--- rank 1 stderr") > text.rindex("--- rank 0 stderr")  # the dead rank's last


def _exit_with(code: int) -> None:
    faulthandler.disable()  # pytest's, inherited: its stack dump would only be noise here
    if code < 0:
        os.kill(os.getpid(), -code)
    os._exit(code)


def test_the_launcher_names_the_rank_a_signal_killed_not_the_peers_it_took_down():
    """When a rank crashes, its peers raise too (gloo's "connection closed by peer") and the
    launcher may see a peer's error first; `_crashed` picks the rank that died of a signal the
    launcher did not send (SIGTERM and SIGKILL are how the launcher and torch stop the others)."""
    def ended(*codes: int) -> SimpleNamespace:
        processes = [multiprocessing.get_context("fork").Process(target=_exit_with, args=(code,)) for code in codes]
        for process in processes:
            process.start()
            process.join()
        return SimpleNamespace(processes=processes)

    assert _crashed(ended(1, -signal.SIGSEGV, -signal.SIGTERM)) == 1
    assert _crashed(ended(-signal.SIGTERM, 1, -signal.SIGABRT)) == 2
    assert _crashed(ended(1, -signal.SIGTERM, -signal.SIGKILL, 0)) is None


def print_rank(rank: int, world: int) -> int:
    print(f"rank {rank} prints", file=sys.stderr, flush=True)
    return rank


def sleep_forever(rank: int, world: int, directory: str) -> None:
    with open(os.path.join(directory, f"rank{rank}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    time.sleep(600)


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (read from /proc, not asked of autopar)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_job_past_its_deadline_is_killed_not_left_running(tmp_path):
    """A job stopped by its deadline (as by a test runner's timeout) leaves no rank alive: each
    rank writes its pid, and after the deadline's error none of those processes is running."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="deadline"):
        launch(sleep_forever, 2, str(tmp_path), timeout_s=30, deadline_s=10)
    assert time.monotonic() - start < 60
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in range(2)]
    assert [pid for pid in pids if alive(pid)] == []
