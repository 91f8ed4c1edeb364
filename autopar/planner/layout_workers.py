"""The planner at scale's in-node layouts measured by two processes: this one and one forked copy.

A composed search's cost is measuring its in-node layouts (`block_ledgers.measure_layout`: one
small plan and its fake run, 0.1–0.3 s each for the 8B shape), one after the other,
on however few cores the planning host has. `measured(measure, layouts)` measures the first
layout here (the search's one export and first calls, which the copy then inherits) — or runs
what it is given to warm up with (the planner: the export alone) — and forks once. This
process first measures the layouts without context parallelism (up to half of the estimated
cost, `split`: the search's second pass measures their recomputation variants here, with
DTensor's answers for their meshes and PyTorch's fake kernels for their shapes already made),
then the variants the second pass will ask for (`variants`, read lazily), while the copy works;
the other layouts, in groups of one mesh (they ask DTensor the same questions, and the stores
that answer them once, `context.sharing_sharding_decisions`, are not shared across the fork),
heaviest first, are claimed one group at a time by whichever process is free (`_Claims`: two-byte
records in a pipe both read), so that both finish together whatever a layout costs — the
estimate (`_weight`: a context-parallel layout runs its attention once per ring step) only
orders them. The copy sends its results back pickled over a pipe and exits.

It forks only where that is safe and pays: on Linux (macOS's system libraries are not
fork-safe, which is why Python spawns there), where this process runs no other Python
thread but tqdm's monitor (a fork copies the calling thread alone: a lock another thread held
would never be released in the copy; tqdm's monitor only takes tqdm's lock, which the copy
replaces, `_own_progress_lock`; the threads of an OpenMP pool this process started are not
Python's to see, and the copy runs its kernels on one thread, `_one_thread`), no process group is initialised here (gloo's and
NCCL's threads live in C++), more than one CPU is usable, and at least `MIN_FORKED`
layouts are left. The copy's numbers are the ones this process would compute (the fake runs are
deterministic; `tests/test_layout_workers.py` compares both ways). If the copy dies, or does not
answer within `timeout(own)` seconds, it is killed and this process measures what it did not
return: nothing is lost and nothing hangs.

Two processes split the first pass's layouts by claiming groups of them, the variants simulated
(`BlockPricer.prefetch`) and the hopeless selective ones skipped (`BlockPricer.cannot_fit`):
most of the gain comes from forking once, after the export, with the heap already warm (the
readings: benchmarks/RESULTS.md, `benchmarks/planner_at_scale.py`).
"""
from __future__ import annotations

import contextlib
import math
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
from typing import Callable, Hashable, Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist

Item = TypeVar("Item", bound=Hashable)

MIN_FORKED = 4  # fewer layouts left than this: not worth a fork


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def can_fork() -> bool:
    """Whether a fork is safe here (module docstring) and a second CPU would run it."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    return (sys.platform.startswith("linux") and all(t.name == TQDM_MONITOR for t in others)
            and not _in_process_group() and usable_cpus() > 1)


def _in_process_group() -> bool:
    """A rank of an initialised process group (a search planned on every rank) runs its backend's
    threads in C++, which the thread check does not see: it measures in one process."""
    return dist.is_available() and dist.is_initialized()


# fx's Interpreter makes a (disabled) tqdm progress bar per run, which starts tqdm's monitor thread:
# it only ever takes tqdm's lock, and the copy takes a lock of its own (`_own_progress_lock`)
TQDM_MONITOR = "tqdm_monitor"


def _own_progress_lock() -> None:
    """tqdm's lock holds a multiprocessing semaphore the fork shares with the parent: a copy
    killed while holding it (every fx Interpreter run takes it) would leave the parent waiting on
    it for ever. The copy takes a lock of its own."""
    try:
        from tqdm import tqdm  # optional dependency (transformers brings it)
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _one_thread() -> None:
    """The copy runs its kernels on its own thread: a fork copies the calling thread alone, and
    an OpenMP pool the parent started (any earlier multi-threaded tensor op in this process) is
    gone in the copy, whose first parallel region would wait for its workers for ever (the parent
    then waited out the copy's timeout, over a minute). Each of the two processes runs one thread."""
    torch.set_num_threads(1)


def timeout(own_seconds: float) -> float:
    """How long the copy may take after this process finished its share of about the same cost."""
    return 30.0 + 4.0 * own_seconds


def _weight(layout: object) -> float:
    """A layout's relative measuring cost: a ring of N ranks runs the attention N times (about
    +40% per doubling on the 8B shape), recomputation runs a second forward."""
    cp = getattr(layout, "cp", 1)
    recompute = getattr(layout, "recompute", None)
    return (1.0 + 0.4 * math.log2(cp)) * (1.3 if recompute else 1.0)


def _group(layout: object) -> object:
    """Layouts that share a mesh (sequence parallelism on and off, recomputation) go together."""
    return getattr(layout, "mesh_spec", layout)


def _stays_here(layout: object) -> bool:
    """Layouts without context parallelism are measured by this process: the search's second pass
    measures their recomputation variants here (context-parallel ones with recomputation are
    refused at once), and finds DTensor's answers for their mesh and PyTorch's fake kernels for
    their shapes already made."""
    return getattr(layout, "cp", None) == 1


def split(items: Sequence[Item]) -> tuple[list[Item], list[list[Item]]]:
    """(what this process measures first: the groups that stay here, `_stays_here`, up to half of
    the estimated cost; the other groups of one mesh, the heaviest first, for either process to
    claim)."""
    groups: dict[object, list[Item]] = {}
    for item in items:
        groups.setdefault(_group(item), []).append(item)
    half = sum(_weight(item) for item in items) / 2
    here: list[Item] = []
    load = 0.0
    shared = []
    for members in groups.values():
        weight = sum(_weight(item) for item in members)
        if _stays_here(members[0]) and (load + weight <= half or not here):
            here.extend(members)
            load += weight
        else:
            shared.append(members)
    return here, sorted(shared, key=lambda g: -sum(_weight(i) for i in g))


class _Claims:
    """The shared groups' indices, each taken once by whichever process asks first: two-byte
    records in a pipe both processes read (a pipe's read of two bytes is whole: the kernel
    serialises readers), closed for writing once filled, so that an empty pipe reads as the end.

    The records are written before anyone reads, without blocking: a pipe holds 64 KiB (32,768
    groups), but as little as one page where the user is over `pipe-user-pages-soft`. The
    groups that do not fit are never claimed: `measured` measures them here at the end. Each
    write is at most PIPE_BUF bytes, which a non-blocking pipe takes whole or not at all, so no
    record is ever cut in two."""

    def __init__(self, count: int) -> None:
        self.reader, writer = os.pipe()
        os.set_blocking(writer, False)
        data = b"".join(struct.pack("<H", index) for index in range(min(count, 1 << 16)))
        try:
            for start in range(0, len(data), select.PIPE_BUF):
                os.write(writer, data[start:start + select.PIPE_BUF])
        except BlockingIOError:  # the pipe is full: the rest stay unclaimed
            pass
        finally:
            os.close(writer)

    def next(self) -> int | None:
        record = os.read(self.reader, 2)
        return struct.unpack("<H", record)[0] if len(record) == 2 else None

    def close(self) -> None:
        os.close(self.reader)


def measured(measure: Callable[[Item], object], items: Sequence[Item], *, fork: bool | None = None,
             variants: Callable[[dict], Iterable[Item]] | None = None,
             warm: Callable[[], object] | None = None) -> dict:
    """Each item's `measure(item)`, with a forked copy where `fork` (default: `can_fork()`) and at
    least `MIN_FORKED` items are given (module docstring). Before the fork `warm()` runs (what
    both processes would otherwise each do first: the search's export) or, without it, the first
    item is measured here.

    This process measures the items that stay here (`split`), then — given `variants(results)`,
    an iterable read lazily, each item after the one before it was measured (the search's
    recomputation variants its second pass will ask for, found from what this process measured)
    — those, as long as the copy is still at work; then both processes claim the other groups
    one at a time (`_Claims`) until none is left, so that they finish together, whatever each
    layout costs."""
    items = list(dict.fromkeys(items))
    results: dict = {}
    if not items:
        return results
    if warm is not None:
        warm()
        rest = items
    else:
        results[items[0]] = measure(items[0])
        rest = items[1:]
    here, shared = split(rest)
    if not (can_fork() if fork is None else fork) or len(rest) < MIN_FORKED or not shared:
        results.update((item, measure(item)) for item in rest)
        return results
    with contextlib.ExitStack() as opened:  # the copy never leaves `_serve`: only this process closes them
        claims = _Claims(len(shared))
        opened.callback(claims.close)
        reader, writer = os.pipe()
        opened.callback(os.close, reader)
        try:
            pid = os.fork()
        except BaseException:
            os.close(writer)
            raise
        if pid == 0:  # the copy: claim groups, send what it has, leave without the parent's exit handlers
            os.close(reader)
            _own_progress_lock()
            _one_thread()
            _serve(measure, shared, claims, writer)
        os.close(writer)
        start = time.perf_counter()
        try:
            results.update((item, measure(item)) for item in here)
            for variant in variants(results) if variants is not None else ():
                if variant in results:
                    continue
                if select.select([reader], [], [], 0)[0]:  # the copy has answered (or died): nothing left to claim
                    break
                results[variant] = measure(variant)
            while (index := claims.next()) is not None:
                results.update((item, measure(item)) for item in shared[index])
        except BaseException:
            _stopped(pid)
            raise
        returned = _received(reader, pid, timeout(time.perf_counter() - start))  # the copy reaped, whatever happens
    results.update((item, value) for item, value in returned.items() if item in rest and item not in results)
    results.update((item, measure(item)) for item in rest if item not in results)  # what the copy did not return
    return results


def _serve(measure: Callable[[Item], object], shared: list[list[Item]], claims: _Claims, writer: int) -> None:
    answered: dict = {}
    try:
        while (index := claims.next()) is not None:
            for item in shared[index]:
                answered[item] = measure(item)
    except BaseException:  # the parent measures the rest itself, and sees the error there
        pass
    try:
        data = pickle.dumps(answered, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        while view:
            view = view[os.write(writer, view):]
    finally:
        os._exit(0)


def _stopped(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _received(reader: int, pid: int, seconds: float) -> dict:
    """What the copy sent, read until it closes the pipe; {} if it sent nothing whole in `seconds`
    (it is killed) or died. The copy is reaped on every way out (killed first where this read was
    interrupted), so that nobody signals its pid again."""
    deadline = time.monotonic() + seconds
    chunks = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([reader], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)  # reaped below
                return {}
            chunk = os.read(reader, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    except BaseException:  # interrupted: the copy is not waited for
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.waitpid(pid, 0)
    try:
        return pickle.loads(b"".join(chunks))
    except Exception:  # cut short: the copy died while writing
        return {}
