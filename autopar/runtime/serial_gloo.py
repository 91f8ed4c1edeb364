"""gloo process groups that run their collectives one at a time, in the order they are issued.

PyTorch's `ProcessGroupGloo` runs a group's collectives on two worker threads (two per device),
so two collectives of one group in flight together run at the same time. In PyTorch 2.13 that
corrupts the heap: the rank aborts inside a gloo worker thread with glibc's "malloc(): unaligned
tcache chunk detected" (a chunk of that thread's cache written after it was freed) or dies of
SIGSEGV; with one worker thread per group the same jobs did not (docs/known-limits.md has the
runs and the counts). autopar's runtime keeps several collectives of one group in flight on purpose
(gradient buckets during backward, deferred and chunked TP/SP collectives, ZeRO's prefetches), so
the gloo groups of the jobs autopar starts (`launch`, `init_from_env`) have one worker thread
each: a group's collectives still run asynchronously to the rank's compute, one after another in
issue order (as NCCL runs one stream's), while different groups' run side by side.

`torch.distributed.new_group` and `init_device_mesh` take no gloo options, so the backend is
registered under its own name (`SERIAL_GLOO`) through `torch.distributed.Backend.register_backend`:
the default group made with it hands it to every group made after (meshes, `new_group`). It is
gloo for everything autopar decides by backend (`autopar.core.comm_kinds.runtime_backend`).
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from autopar.core.comm_kinds import SERIAL_GLOO


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ProcessGroupGloo:
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_default_device()]
    options._threads = 1  # the module docstring: two threads ran two collectives of one group at once
    return ProcessGroupGloo(store, rank, size, options)


def serial_gloo() -> str:
    """The backend name to initialise a CPU job's default process group with (registered once)."""
    if not hasattr(dist.Backend, SERIAL_GLOO.upper()):
        dist.Backend.register_backend(SERIAL_GLOO, _create, devices=["cpu"])
    return SERIAL_GLOO
