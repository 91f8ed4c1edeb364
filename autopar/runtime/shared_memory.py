"""Collectives through shared memory, for the ranks of a gloo group that share one host.

gloo moves every byte through loopback TCP even between processes of one machine: a 13.4 MiB
all-reduce over 4 ranks on this 2-core machine takes 24-28 ms alone and 45-55 ms inside a
training step, because the kernel copies each byte twice and gloo's threads compete with the
ranks' compute for the cores. NCCL reaches the ranks of one GPU host through shared memory or
NVLink; PyTorch ships no such path for CPU tensors, so this file is one. It runs where a
strategy declares it (`transport="shared_memory"` on `data_parallel` / `zero`) or where their
default, "auto", picks it (a gloo job: `comm_kinds.transport_kind`), on an axis whose groups stay
inside a node (checked at plan time, and here against the host and the file), for CPU tensors on
x86.

`SharedMemoryGroup` maps one file in /dev/shm into every rank of a process group: a cache line of
flags per rank and one row of `numel` elements per rank. Every exchange writes rows, passes a
barrier (after it, what every rank wrote before it is visible), reads, and passes a barrier
(after it, any row may be written again).
- `all_reduce(numel)`: every rank's row becomes the sum of all rows. Rank r adds chunk r of the
  other rows into rank 0's row, in rank order (`ordered_sum(into_first=True)`), and copies the sum into
  chunk r of the other rows: each chunk is summed once, so every replica gets the same bits (no
  separate sum buffer: in a back-to-back run, 4 ranks, 13.4 MiB, 8.0 against 10.5 ms with one).
  A data-parallel gradient bucket *is* its rank's slice of its row (backward writes the gradients
  where the others read them).
- `SharedExchanges`: ZeRO-1/2's reduce-scatter of a unit's gradients (each owner sums its shard's
  column of every row) and all-gather of the updated shards (every rank copies every row).
Measured alone (4 ranks, 13.4 MiB fp32, median of 15): the all-reduce 4.3 ms when the values are
already in the rows, 17 ms copying them in and out, against gloo's 24-27 ms.

The barrier is a generation counter per rank in the flags. A rank that arrives bumps its own and
wakes whoever sleeps on it; a waiting rank sleeps in the kernel on the counter of a rank not yet
arrived (`futex`), so it gives its core to the ranks still computing (polling with `sched_yield`
kept taking their time slices where ranks outnumber cores: a data-parallel step on this 2-core
machine, 4 ranks, 163-175 ms polling against 159-160 sleeping). Each rank also names what it
exchanges (a tag: the bucket file's size, the ZeRO unit), so ranks out of step fail instead of
reading rows meant for another exchange. x86's store order makes a rank's rows visible before its
flag (program-ordered stores; glibc ends its streaming copies with a fence); nothing here issues
a fence, so other machines are refused, as are systems other than Linux (no futex, no /dev/shm). A
rank whose process has exited ends the others' wait within 20 ms (each rank's pid is in its flags);
one that does not arrive within the group's timeout ends it then, with an error naming the ranks
missing. The file is created by rank 0 alone (mode 0600, allocated in full: a full /dev/shm is an
error at setup, not a SIGBUS at a first write) and unlinked as soon as every rank has mapped it or
one has failed to; only a rank 0 killed within those milliseconds leaves it behind.
"""
from __future__ import annotations

import os
import socket
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.comm_kinds import SHARED_MEMORY, shared_memory_unsupported
from autopar.runtime import futex
from autopar.zero_units import ShardUnit, refresh_groups

FLAG_BYTES = 64  # per rank's flags: one cache line each, so no two ranks' flags share one
_REDUCE_TAG, _GATHER_TAG = 1 << 40, 2 << 40  # + the unit's index: what a ZeRO barrier exchanges
_GENERATION, _PID = 0, 3  # int64 slots of a rank's line (1 and 2: the tags of odd and even generations)


class SharedMemoryError(RuntimeError):
    """A shared-memory exchange cannot go on: no file, no room, a host or device it cannot serve."""


class SharedMemoryPeerError(SharedMemoryError):
    """A barrier cannot complete: a rank of the group exited, did not arrive in time, or is out of
    step (a distributed failure: `runtime/progress.py` reports where every rank was)."""


_SUM_BLOCK = 1 << 16  # elements of an all-reduce summed and copied out at a time (`all_reduce`)
_WAIT_SLICE_S = 0.02  # a sleeping rank wakes at least this often to look for exited ranks and its timeout
DIRECTORY = "/dev/shm"


class SharedMemoryGroup:
    """One row of `numel` elements of `dtype` per rank of the process group `group_name`."""

    def __init__(self, group_name: str, numel: int, dtype: torch.dtype, *, timeout_s: float | None = None) -> None:
        unsupported = shared_memory_unsupported()
        if unsupported:
            raise RuntimeError(f"transport='shared_memory' cannot run here: {unsupported}; use "
                               f"transport='process_group'")
        group = _resolve_process_group(group_name)
        self.rank, self.size, self.numel = dist.get_rank(group), group.size(), numel
        self.timeout_s = timeout_s if timeout_s is not None else _group_timeout(group)
        header = self.size * FLAG_BYTES
        total = header + self.size * numel * dtype.itemsize
        whole = _map_shared_file(group_name, self.rank, self.size, total, self.timeout_s)
        # each rank's cache line: [generation, tag of odd generations, tag of even ones, pid]
        self._flags = whole[:header].view(torch.int64).view(self.size, FLAG_BYTES // 8)
        self._flags[self.rank, _PID] = os.getpid()
        try:  # a system without futex (a sandbox that filters it) fails here, at setup, not mid-step
            futex.wake(self._generation_word(self.rank))
        except OSError as error:
            raise SharedMemoryError(f"transport='shared_memory' sleeps on futex and this system refuses it ({error}); "
                                    f"use transport='process_group'") from None
        self.rows = whole[header:].view(dtype).view(self.size, numel)
        self._generation = 0

    def row(self) -> torch.Tensor:
        """This rank's row: write what the others will read here."""
        return self.rows[self.rank]

    def barrier(self, tag: int = 0) -> None:
        """Wait until every rank has reached this barrier; each must name the same `tag` (what it
        is exchanging), else a rank out of step would read rows meant for another exchange. A
        rank's tag sits in one of two slots by the generation's parity: a rank ahead can only be
        one barrier ahead, so it never overwrites the tag the others are still checking."""
        self._generation += 1
        slot = 1 + self._generation % 2
        self._flags[self.rank, slot] = tag
        self._flags[self.rank, _GENERATION] = self._generation
        futex.wake(self._generation_word(self.rank))
        deadline = None
        while True:
            generations = self._flags[:, _GENERATION].tolist()
            behind = next((r for r, g in enumerate(generations) if g < self._generation), None)
            if behind is None:
                break
            futex.wait(self._generation_word(behind), generations[behind], _WAIT_SLICE_S)
            deadline = self._check_waiting(deadline)
        tags = self._flags[:, slot].tolist()
        if any(t != tag for t in tags):
            raise SharedMemoryPeerError(f"shared-memory barrier {self._generation}: the ranks are out of step, "
                                        f"exchanging {tags} (rank order); every rank must run the same exchanges "
                                        f"in the same order")

    def _generation_word(self, rank: int) -> int:
        """The address of `rank`'s generation (its low 32 bits: the futex word it is woken on)."""
        return self._flags.data_ptr() + rank * FLAG_BYTES + _GENERATION * 8

    def _check_waiting(self, deadline: float | None) -> float:
        """While waiting: fail at once when a missing rank's process has exited, else at the timeout."""
        now = time.monotonic()
        deadline = deadline or now + self.timeout_s
        missing = [r for r in range(self.size) if int(self._flags[r, _GENERATION]) < self._generation]
        for rank in missing:
            pid = int(self._flags[rank, _PID])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise SharedMemoryPeerError(f"shared-memory barrier {self._generation}: rank {rank} of the group "
                                            f"(pid {pid}) has exited") from None
            except PermissionError:
                pass
        if now > deadline:
            raise SharedMemoryPeerError(f"shared-memory barrier {self._generation}: ranks {missing} of the group "
                                        f"did not arrive within {self.timeout_s:.0f} s (one failed or is stuck)")
        return deadline

    def all_reduce(self, numel: int | None = None) -> None:
        """Every rank's row (its first `numel` elements) becomes the sum of all ranks' rows."""
        numel = self.numel if numel is None else numel
        self.barrier(numel)
        chunk = -(-numel // self.size)
        start = min(self.rank * chunk, numel)
        count = min(chunk, numel - start)
        # summed into rank 0's piece of the chunk and copied into the others', a block at a time: a
        # block's sum is still in cache when it is copied out (4 ranks, 3.4 MiB chunks: 0.88 against
        # 1.31 ms in one pass, and the same bits)
        for block in range(start, start + count, _SUM_BLOCK):
            columns = self.rows[:, block:min(block + _SUM_BLOCK, start + count)]
            total = ordered_sum(columns, into_first=True)
            columns[1:].copy_(total.expand(self.size - 1, columns.shape[1]))
        self.barrier(numel)


def require_cpu(tensor: torch.Tensor, what: str) -> None:
    if tensor.device.type != "cpu":
        raise SharedMemoryError(f"transport='shared_memory' for {what}: its tensors are on {tensor.device}, and the "
                                f"shared rows are CPU memory; use transport='process_group' (NCCL reaches a GPU "
                                f"host's ranks through shared memory or NVLink itself)")


def ordered_sum(rows: torch.Tensor, *, into_first: bool = False) -> torch.Tensor:
    """Σ of `rows` (one per rank) in rank order: the same bits whichever rank computes it; into
    `rows[0]` itself with `into_first` (no buffer of its own), else into a new tensor."""
    total = rows[0] if into_first else rows[0].clone()
    for other in range(1, rows.shape[0]):
        total.add_(rows[other])
    return total


_created: dict[str, int] = {}  # group name -> files mapped so far (the same order on each of its ranks)


def _map_shared_file(group_name: str, rank: int, size: int, nbytes: int, timeout_s: float) -> torch.Tensor:
    """A zeroed file of `nbytes` mapped into every rank of the group, agreed through the job's
    store (as process groups rendezvous: no collective is issued): rank 0 creates it (its own,
    allocated in full so a full /dev/shm fails here and not with SIGBUS at a first write) and names
    it with its host; the others check the host and that the very file exists there, map it and
    say so, or leave the reason in the store; rank 0 unlinks it once all have mapped it."""
    store = dist.distributed_c10d._get_default_store()
    serial = _created[group_name] = _created.get(group_name, 0) + 1
    key = f"autopar/shared_memory/{group_name}/{serial}"
    if rank == 0:
        path = os.path.join(DIRECTORY, f"autopar-{uuid.uuid4().hex}")
        _create(path, nbytes)
        store.set(key, f"{socket.gethostname()}\n{path}")
    host, path = store.get(key).decode().split("\n")  # waits (the store's timeout) until rank 0 has set it
    if rank != 0:
        problem = _not_shared(path, nbytes, host)
        if problem:
            store.set(key + "/failed", problem)
            raise SharedMemoryError(f"rank {rank} of group {group_name}: {problem}")
    mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    store.add(key + "/mapped", 1)
    if rank == 0:
        try:
            _wait_for_mappings(store, key, size, timeout_s)
        finally:
            os.unlink(path)
    return mapped


def _create(path: str, nbytes: int) -> None:
    handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(handle, 0, nbytes)
    except OSError as error:
        os.unlink(path)
        raise SharedMemoryError(f"transport='shared_memory' needs {nbytes} bytes in {DIRECTORY} ({error}); make "
                                f"it larger (docker run --shm-size=...) or use transport='process_group'") from None
    finally:
        os.close(handle)


def _not_shared(path: str, nbytes: int, host: str) -> str:
    """Why this rank cannot map rank 0's file, or "" when it can."""
    if host != socket.gethostname():
        return (f"transport='shared_memory' joins host {socket.gethostname()!r} with rank 0's {host!r}: the plan "
                f"took the axis to stay inside one node (a plan file made for other hosts? parallelize checks a "
                f"node size against the hosts only when it plans); plan in this job, or declare "
                f"transport='process_group'")
    try:
        found = os.stat(path).st_size
    except FileNotFoundError:
        found = None
    if found != nbytes:
        return (f"rank 0's file {path} is not in this process' {DIRECTORY} (same host name, another /dev/shm: a "
                f"container without a shared IPC namespace?); use transport='process_group'")
    return ""


def _wait_for_mappings(store: dist.Store, key: str, size: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while store.add(key + "/mapped", 0) < size:
        if store.check([key + "/failed"]):
            reason = store.get(key + "/failed").decode()
            raise SharedMemoryError(f"a rank could not map the shared-memory file: {reason}")
        if time.monotonic() > deadline:
            raise SharedMemoryError(f"not every rank of the group mapped the shared-memory file within "
                                    f"{timeout_s:.0f} s")
        time.sleep(0.001)


def _group_timeout(group: dist.ProcessGroup) -> float:
    """The process group's own timeout (what `init_process_group(timeout=)` set), in seconds."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return 300.0


class SharedExchanges:
    """ZeRO-1/2's exchanges for the units declared `transport="shared_memory"` (`ShardUnit.transport`):
    one file per axis, whose row per rank is as long as the largest of what goes through it (a
    unit's laid-out gradients, a refresh group's shards). Every exchange writes this rank's row,
    passes a barrier, reads, and passes a barrier, after which any row may be written again.
    - `reduce`: a unit's gradients laid out in the row (`gradient_row`; ZeRO-1 copies its
      full-gradient buffer in), and each owner sums its shard's column of every row (a reduce-scatter).
    - `gather`: after the step each owner writes its updated shards of a refresh group
      (`zero_units.refresh_groups`) into its row, side by side as the process-group path's gathered
      buffer, and every rank copies the rows into its parameters (`gathered` ends it)."""

    def __init__(self, units: "list[ShardUnit]", groups: dict[str, str]) -> None:
        # in the order of the units, the same on every rank: each creation waits for its whole group
        self._groups = {axis: SharedMemoryGroup(groups[axis], size, torch.uint8)
                        for axis, size in unit_row_bytes(units).items()}

    def _rows(self, axis: str, dtype: torch.dtype) -> torch.Tensor:
        return self._groups[axis].rows.view(dtype)

    def gradient_row(self, unit: ShardUnit) -> torch.Tensor | None:
        """Where to lay out `unit`'s gradients for its `reduce` (None: not a shared-memory unit)."""
        if unit.transport != SHARED_MEMORY:
            return None
        group = self._groups[unit.axis]
        return self._rows(unit.axis, unit.reduce_dtype)[group.rank, :unit.gathered_numel]

    def reduce(self, unit: ShardUnit, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the sum over ranks of `unit`'s laid-out gradients `flat`."""
        group, rows = self._groups[unit.axis], self._rows(unit.axis, unit.reduce_dtype)
        mine = rows[group.rank, :unit.gathered_numel]
        if flat.data_ptr() != mine.data_ptr():
            mine.copy_(flat.view(-1))
        tag = _REDUCE_TAG + unit.index
        group.barrier(tag)
        start = group.rank * unit.shard_numel
        shard = ordered_sum(rows[:, start:start + unit.shard_numel])
        group.barrier(tag)
        return shard

    def gather(self, units: tuple[ShardUnit, ...], shards: list[torch.Tensor]) -> torch.Tensor:
        """The refresh group's gathered buffer, rank-major, from this rank's updated `shards`."""
        group, rows = self._groups[units[0].axis], self._rows(units[0].axis, units[0].dtype)
        row, column = rows[group.rank], 0
        for shard in shards:
            row[column:column + shard.numel()].copy_(shard.detach().reshape(-1))
            column += shard.numel()
        group.barrier(_GATHER_TAG + units[0].index)
        return rows[:, :column]

    def gathered(self, units: tuple[ShardUnit, ...]) -> None:
        """Every rank has copied the rows out: they may be written again."""
        self._groups[units[0].axis].barrier(_GATHER_TAG + units[0].index)


def unit_row_bytes(units: "list[ShardUnit]") -> dict[str, int]:
    """Axis -> the bytes of each rank's row of `SharedExchanges`' file on it: the largest unit's
    laid-out gradients or refresh group's shards, rounded up to 8 (any dtype's view starts aligned)."""
    shared = [u for u in units if u.transport == SHARED_MEMORY]
    row_bytes: dict[str, int] = {}
    for unit in shared:
        row_bytes[unit.axis] = max(row_bytes.get(unit.axis, 0), unit.gathered_numel * unit.reduce_dtype.itemsize)
    for group in refresh_groups(shared):
        row = sum(u.shard_numel for u in group) * group[0].dtype.itemsize
        row_bytes[group[0].axis] = max(row_bytes[group[0].axis], row)
    return {axis: -(-size // 8) * 8 for axis, size in row_bytes.items()}
