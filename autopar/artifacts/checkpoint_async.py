"""Saving a checkpoint in the background: the host snapshot, the checkpointing process group, and
the one background save a process has in flight.

`checkpoint.async_save` copies the rank's state to host memory (`host_snapshot`: every tensor
copied, every other object deep-copied, so that the training step that follows may change
parameters and optimizer state in place) and hands the rest of the save to this process's
checkpoint thread (`start`). The thread runs what a synchronous save runs — DCP's write into the
staging directory, the digest gather, rank 0's manifest and rename (`checkpoint._write_and_commit`,
`checkpoint_files.py`) — so the commit is the same: only when every rank's files are written, and
a crash at any point leaves the previous checkpoint where it was.

Collectives from two threads: gloo matches the collectives of one process group by their order, so
the thread's collectives (DCP's plan exchange, the digest gather, rank 0's verdict) must not share
a group with the training step's. They go over a process group of their own (`checkpoint_group`:
every rank, gloo, created collectively by the first background save under the default group, with
the default group's timeout), the arrangement DCP's own `async_save` documentation asks for.

Why not `torch.distributed.checkpoint.async_save` itself: its future ends with DCP's write, and the
commit must follow that write on the same thread and group; its stager copies tensors, not the
checkpointable `Boxes` a rank's pieces are written through (each copies itself: `host_copy`).

One save in flight per process (`wait_for_pending`): `save`, `async_save`, `load` and
`load_into_model` first wait for the previous background save, so saves commit in the order they
were started, every rank issues the checkpoint group's collectives in one order, and a load sees
what was committed. A failure nobody collected with `result()` is raised there.
"""
from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.core.errors import CheckpointError


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory that shares no storage with it."""
    return tensor.detach().to("cpu", copy=True)


def host_snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (what `checkpoint.state_dict` returns) with nothing shared with the live training
    state: tensors copied to host memory, checkpointable pieces copied by their `host_copy()`,
    other objects (hyper-parameters, a scheduler's state, RNG states) deep-copied."""
    snapshot = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            snapshot[key] = host_tensor(value)
        elif hasattr(value, "host_copy"):
            snapshot[key] = value.host_copy()
        else:
            snapshot[key] = copy.deepcopy(value)
    return snapshot


class _Background:
    """This process's checkpoint thread, its process group, and the save it has in flight."""

    def __init__(self) -> None:
        self.executor: ThreadPoolExecutor | None = None
        self.group: tuple[Any, Any] | None = None  # (the default group it was made under, the group)
        self.in_flight: AsyncSave | None = None


_background = _Background()


def _default_group_timeout() -> timedelta | None:
    """The timeout the default group was initialised with, so that a background save waits for a
    lost rank as long as a synchronous one. torch keeps it only in the group's backend options (a
    private field); None (torch's default for new groups) where it is not found there."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def checkpoint_group() -> Any:
    """The process group of background saves (module docstring); None without a process group.
    Collective the first time under each default group: every rank calls it in the same order."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _background.group is None or _background.group[0] is not world:
        _background.group = (world, dist.new_group(backend="gloo", timeout=_default_group_timeout()))
    return _background.group[1]


class AsyncSave:
    """A save running in the background (`checkpoint.async_save`). `result(timeout=None)` waits
    until it is committed (every rank's files written, rank 0's rename done) and raises its
    `CheckpointError` if it failed; `done()` says whether it has ended. `path`: where it commits;
    `save_id`: the id of its staging directory `<path>.tmp-<save_id>` (`checkpoint_files.py`)."""

    def __init__(self, path: Path, save_id: str, future: Future) -> None:
        self.path, self.save_id, self._future, self.collected = path, save_id, future, False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        error = self._future.exception(timeout)  # TimeoutError if still running after `timeout` seconds
        self.collected = True
        if error is not None:
            raise error


def start(path: Path, save_id: str, write_and_commit: Callable[[], None]) -> AsyncSave:
    """Run `write_and_commit` on this process's checkpoint thread; the handle of that save. The
    caller has waited for the previous one (`wait_for_pending`)."""
    if _background.executor is None:
        _background.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-checkpoint")
    _background.in_flight = AsyncSave(path, save_id, _background.executor.submit(write_and_commit))
    return _background.in_flight


def wait_for_pending() -> None:
    """Wait for this process's background save, if one is in flight (module docstring); raise its
    failure if its `result()` was never called. Local: no collective."""
    pending, _background.in_flight = _background.in_flight, None
    if pending is None:
        return
    error = pending._future.exception()
    if error is not None and not pending.collected:
        pending.collected = True
        raise CheckpointError(f"the background save into {pending.path} (async_save) failed and its result() "
                              f"was never called: {error}") from error
