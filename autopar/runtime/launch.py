"""Start a local multi-process job without torchrun (tests, examples, benchmarks).

`launch(fn, world_size, *args)` spawns `world_size` processes on the local host, each with one
CPU thread, a gloo process group (one worker thread per group: `runtime/serial_gloo.py`) on a
free loopback port with a timeout, runs `fn(rank,
world_size, *args)` and returns every rank's return value (pickled through a temp file). If a
rank raises, the others are terminated and the error is re-raised here with the rank's traceback.
Whatever ends the wait here — a rank's error, `deadline_s` passing, a test runner's timeout or
Ctrl-C raised in this process — the ranks are killed before it propagates: nothing is left
running. Under torchrun use `init_from_env()` instead.

Ranks start from a fork server (`multiprocessing`'s "forkserver") that has imported torch,
autopar and, where installed, transformers once, and warmed up what every rank's first seconds
would repeat (`autopar/tools/forkserver_warmup.py`: transformers' lazy modules, one small
plan): a launch then starts its ranks without each importing torch, autopar and transformers
again (seconds per rank under "spawn"). The fork server is a fresh
interpreter (no threads of the caller's), started at the first launch; each rank takes the
caller's current environment variables and working directory at launch time, as a spawned one
would. `start_method="spawn"` is still accepted.
"""
from __future__ import annotations

import faulthandler
import importlib.util
import multiprocessing
import os
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.runtime.device import backend_for, rank_device
from autopar.runtime.serial_gloo import serial_gloo


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_from_env(*, timeout_s: float = 120.0, backend: str | None = None) -> torch.device:
    """Initialise the default process group from torchrun's environment variables; returns the
    rank's device (`runtime/device.py`: accelerator `LOCAL_RANK`, made current, or the CPU). The
    backend defaults to the device's (NCCL on CUDA, gloo on CPU); `backend="gloo"` keeps a job on
    the CPU on a host with GPUs. gloo is started with one worker thread per group
    (`runtime/serial_gloo.py`)."""
    torch.set_num_threads(int(os.environ.get("AUTOPAR_THREADS", "1")))
    device = torch.device("cpu") if backend == "gloo" else rank_device()
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    backend = backend or backend_for(device)
    # gloo with one worker thread per group (runtime/serial_gloo.py: two corrupted the heap)
    dist.init_process_group(serial_gloo() if backend == "gloo" else backend, timeout=timedelta(seconds=timeout_s))
    return device


# imported once by the fork server; every rank forks from it with these already loaded
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "sympy", "autopar",
                      "transformers", "autopar.tools.forkserver_warmup")
_preload_set = False


def _prepare_forkserver() -> None:
    """Name the fork server's preloads before it first starts (they cannot change after)."""
    global _preload_set
    if not _preload_set:
        multiprocessing.set_forkserver_preload(
            [name for name in FORKSERVER_PRELOAD if importlib.util.find_spec(name.split(".")[0]) is not None])
        _preload_set = True


def _worker(rank: int, world_size: int, port: int, out_dir: str, timeout_s: float, fn: Callable, args: tuple,
            environment: dict[str, str], directory: str, backend: str | None = None) -> None:
    # a forked rank writes to the fork server's stderr, which is whatever the first launch's caller
    # had (under pytest: that test's capture file). Each rank's goes to a file of this job instead,
    # shown by launch() when the rank dies, with faulthandler's Python stacks on a fatal signal
    # (SIGABRT, SIGSEGV): a rank killed by a signal otherwise leaves no trace of where it was.
    stderr_file = os.open(os.path.join(out_dir, f"rank{rank}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(stderr_file, 2)
    os.close(stderr_file)
    faulthandler.enable(all_threads=True)
    # faulthandler shows Python frames only; a crash inside torch, gloo or libc (a heap corruption
    # detected by malloc, a bad pointer) is named by its native frames. PyTorch's own fatal-signal
    # handler prints every thread's C++ stack (the faulting thread's through `fatalSignalHandler`)
    # and then hands the signal on to faulthandler; no public interface exposes it.
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    # a forked rank has the fork server's environment and directory: take the caller's
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(directory)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    dist.init_process_group(backend or serial_gloo(), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as handle:
            handle.write(traceback.format_exc())
        dist.destroy_process_group()
        raise
    # no rank tears its process group down while a peer is still inside a collective; then leave
    # without interpreter finalisation: a gloo worker thread destroyed during static destruction
    # aborted one rank ("terminate called without an active exception") once in CI, after a
    # clean run whose result was already saved
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankKilled(RuntimeError):
    """A rank ended by a signal or a non-zero exit without raising a Python exception (a crash in
    native code, an abort, the OOM killer); the message holds every rank's stderr tail."""


def _kill(context: Any) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()
    for process in context.processes:
        process.join(5)


def _stderr(out_dir: str, rank: int, missing: str = "(no stderr file)") -> str:
    path = os.path.join(out_dir, f"rank{rank}.stderr")
    if not os.path.exists(path):
        return missing
    with open(path, errors="replace") as handle:
        return handle.read()


def _stderr_tails(out_dir: str, world_size: int, limit: int = 6000, *, last: int | None = None) -> str:
    """The last `limit` characters each rank wrote to its stderr (faulthandler's stacks included),
    rank `last`'s at the end (a log cut in the middle keeps its end)."""
    order = [rank for rank in range(world_size) if rank != last] + ([last] if last is not None else [])
    return "\n".join(f"--- rank {rank} stderr (last {limit} characters) ---\n{_stderr(out_dir, rank)[-limit:]}"
                     for rank in order)


_FAULTING = "fatalSignalHandler"  # the frame PyTorch's handler runs in on the thread that took the signal


def crash_summary(text: str, frames: int = 24) -> str:
    """From a crashed rank's stderr: the native stack of the thread that took the fatal signal
    (PyTorch's handler prints one block per thread, `SIGSEGV(11), PID: p, Thread t:`) and the
    innermost Python frames faulthandler printed for it. Empty when the stderr holds neither."""
    blocks = [block for block in text.split("\n\n") if _FAULTING in block]
    native = ""
    if blocks:
        # "frame #4: fn + 0x86 (0x7f65ea1a7608 in /path/to/libx.so)" -> "frame #4: fn + 0x86 [libx.so]"
        lines = [re.sub(r"\(0x[0-9a-f]+ in (?:.*/)?([^/)]+)\)$", r"[\1]", line.strip())
                 for line in blocks[-1].strip().splitlines()]
        native = "\n".join(lines[:frames + 1] + ([f"... ({len(lines) - frames - 1} more frames)"]
                                                   if len(lines) > frames + 1 else []))
    python = ""
    if "Fatal Python error" in text:
        python_lines = text[text.rindex("Fatal Python error"):].splitlines()
        current = next((i for i, line in enumerate(python_lines) if line.startswith("Current thread")), None)
        if current is not None:
            python = "\n".join(python_lines[current:current + 9])
    return "\n".join(part for part in (native, python) if part)


_STOPPED_BY_LAUNCH = (signal.SIGTERM, signal.SIGKILL)  # how torch's join and `_kill` stop the other ranks


def _crashed(context: Any) -> int | None:
    """The first rank that died of a signal nobody here sent (a crash: SIGSEGV, SIGABRT, ...), if any."""
    for index, process in enumerate(context.processes):
        process.join(5)
        code = process.exitcode
        if code is not None and code < 0 and -code not in _STOPPED_BY_LAUNCH:
            return index
    return None


def _signal_name(context: Any, rank: int) -> str:
    try:
        return signal.Signals(-context.processes[rank].exitcode).name
    except ValueError:
        return f"signal {-context.processes[rank].exitcode}"


def _rank_killed(headline: str, out_dir: str, world_size: int, rank: int) -> RankKilled:
    """The error for `rank` killed by a signal: every rank's stderr tail, the dead rank's last, then
    where it died (`crash_summary`)."""
    summary = crash_summary(_stderr(out_dir, rank))
    return RankKilled(f"{headline}\n{_stderr_tails(out_dir, world_size, last=rank)}"
                      + (f"\n--- where rank {rank} died ---\n{summary}" if summary else ""))


def _forward_stderr(out_dir: str, world_size: int) -> None:
    """A finished job's rank stderr (warnings, prints) on the caller's stderr, rank by rank."""
    for rank in range(world_size):
        sys.stderr.writelines(f"[rank {rank}] {line}\n" for line in _stderr(out_dir, rank, "").splitlines())


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
           deadline_s: float | None = None, start_method: str = "forkserver", backend: str | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` local gloo processes; return the results by rank.

    `timeout_s` bounds each collective (the process group's timeout); `deadline_s` (default: none
    beyond the caller's own) bounds the whole job, after which the ranks are killed. `backend`:
    the process groups' (default: gloo with one worker thread per group, `runtime/serial_gloo.py`;
    "gloo" is PyTorch's own, two threads per group)."""
    if start_method == "forkserver":
        _prepare_forkserver()
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world_size, free_port(), out_dir, timeout_s, fn, args,
                                                    dict(os.environ), os.getcwd(), backend),
                                     nprocs=world_size, join=False, start_method=start_method)
        started = time.monotonic()
        try:
            while not context.join(timeout=1.0):
                if deadline_s is not None and time.monotonic() - started > deadline_s:
                    raise TimeoutError(f"the {world_size}-rank job of {getattr(fn, '__name__', fn)} ran past its "
                                       f"deadline of {deadline_s:.0f} s; its ranks were killed\n"
                                       f"{_stderr_tails(out_dir, world_size)}")
        except mp.ProcessRaisedException as error:
            details = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
            crashed = _crashed(context)
            if crashed is not None:  # its peers' errors ("connection closed by peer") only follow from it
                raise _rank_killed(f"rank {crashed} was killed by {_signal_name(context, crashed)}; its peers then "
                                   f"raised:\n" + "\n".join(details), out_dir, world_size, crashed) from error
            raise RuntimeError("a rank failed:\n" + "\n".join(details)) from error
        except mp.ProcessExitedException as error:
            raise _rank_killed(f"a rank exited abnormally: {error}", out_dir, world_size, error.error_index) from error
        finally:
            _kill(context)
        _forward_stderr(out_dir, world_size)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
