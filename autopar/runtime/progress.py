"""Where each rank was when a job failed: progress marks in the process group's store, read back
into the error a failing rank prints.

A distributed failure is seen by the ranks that are still alive, as a timeout or a closed
connection inside some collective, with no word of which rank failed or where. `mark(phase)`
writes one short line per rank (`autopar/progress/<rank>`: when, which step, which phase of it) to
the store every job already has (torchrun's or `launch`'s TCPStore): entering and leaving each
forward, at the start of each step's gradient synchronisation and at its end. `install()` (called
by ParallelModule under a process group) wraps `sys.excepthook`: an uncaught exception that comes
from torch.distributed (a `DistError`, or a RuntimeError naming gloo/NCCL, a timeout or a closed
connection) is printed followed by every rank's last mark, the rank furthest behind (by step, then
phase) first, so a rank that stopped is named with where it was ("rank 1: step 2, forward done (backward next), 20.9 s ago"). A
rank that raised an ordinary error prints its own traceback as usual (torchrun's report names it);
one that was killed leaves its last mark. Writing a mark is one store `set` (a round trip on the
loopback, tens of microseconds), a few per step.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import torch.distributed as dist

_PREFIX = "autopar/progress/"
_state: dict[str, Any] = {"installed": False, "step": 0}


def _store() -> Any:
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


# a step's phases in the order a rank passes them: the report sorts ranks by (step, phase)
PHASES = ("in forward", "forward done (backward next)", "in backward: gradient all-reduce under way",
          "backward done: gradients synchronised")


def mark(phase: int, step: int | None = None) -> None:
    """Record that this rank entered PHASES[phase] of `step` (default: the step of the last
    forward). No-op without a process group."""
    if step is not None:
        _state["step"] = step
    store = _store()
    if store is None:
        return
    try:
        store.set(f"{_PREFIX}{dist.get_rank()}", f"{time.time():.3f} {_state['step']} {phase}")
    except RuntimeError:  # the store is gone (the job is ending): nothing to record
        pass


def report(world: int | None = None) -> str:
    """Every rank's last mark, the rank furthest behind first (empty if the store cannot be read)."""
    store = _store()
    if store is None:
        return ""
    world = world or dist.get_world_size()
    lines = []
    now = time.time()
    for rank in range(world):
        key = f"{_PREFIX}{rank}"
        try:
            if not store.check([key]):
                lines.append(((-1, -1, 0.0), f"rank {rank}: no progress recorded"))
                continue
            stamp, step, phase = store.get(key).decode().split()
        except RuntimeError:
            return ""
        lines.append(((int(step), int(phase), float(stamp)),
                      f"rank {rank}: step {step}, {PHASES[int(phase)]}, {now - float(stamp):.1f} s ago"))
    return "\n".join(text for _, text in sorted(lines))


def _distributed(error: BaseException) -> bool:
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "timed out", "timeout", "connection closed", "connection reset"))


def install() -> None:
    """Append every rank's last mark to an uncaught distributed error (once per process)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    previous = sys.excepthook

    def hook(kind: type, error: BaseException, trace: Any) -> None:
        previous(kind, error, trace)
        if _distributed(error):
            where = report()
            if where:
                print(f"autopar: rank {dist.get_rank()} stopped on a distributed error; where every rank was "
                      f"last (furthest behind first):\n{where}", file=sys.stderr, flush=True)

    sys.excepthook = hook
