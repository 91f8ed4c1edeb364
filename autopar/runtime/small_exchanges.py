"""Small all-reduces of the rank graph through shared memory, on the axes whose gradients go there.

A loss's sum and count, the auxiliary losses' statistics of a mixture-of-experts block, one_hot's
range checks: a few bytes each, reduced where the graph computes them. Through gloo each is a point
where the ranks wait for each other by loopback TCP and gloo's threads: measured on this 2-core
machine (a 256² matmul ×3 and an 8-float all-reduce, 200 times): +4.8 ms per all-reduce at 4 ranks
and +1.2 ms at 2, against +1.0 and +0.2 ms through a shared-memory file with one barrier
(`SmallExchange`). The plan decides which ones (`comm_kinds.small_through_shared_memory`: an
all-reduce of at most `SMALL_EXCHANGE_BYTES`, known when the plan is made, on a group key whose axis
the plan sends through shared memory, inside one node), its ledger says so (link `shm`), and
`ParallelModule` opens one exchange per such group (`open_small_exchanges`), sized for the largest,
and makes its own the active ones when its forward runs (`activate`: another module in the process
may plan the same process group differently); a backward all-reduce runs under the exchanges its
forward saw (`bound`, kept by the autograd function).
`collectives.issue_all_reduce` takes this path for a tensor of at most that size on a group that has
one; the result has arrived when it returns (its `wait` is a no-op).

`SmallExchange`: each rank's row holds two slots; exchange g writes this rank's tensor into slot g
mod 2, passes one barrier and reduces every rank's slot, in rank order (every rank computes the same
bits). One barrier suffices: exchange g+2 writes slot g mod 2 again only after barrier g+1, which
every rank passes only once it has read exchange g. The barrier's tag names the exchange (bytes,
dtype, reduction), so ranks out of step on any of these fail instead of reducing each other's bits
(two consecutive exchanges alike in all three are not told apart). The reduction runs as the custom op
`autopar::shm_all_reduce`, which torch.compile keeps as one opaque call (`compile=True`).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

# what a barrier's tag says, with the bytes: ranks out of step fail instead of reading each other's slots
_OPS = {"sum": 1, "max": 2, "min": 3}
_DTYPES = {dtype: code for code, dtype in enumerate(
    (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
     torch.int8, torch.uint8, torch.bool), start=1)}  # another dtype: 0
# process group name -> its exchange, of the module that ran the last forward (`activate`): process
# group names repeat across meshes of the same ranks, and each module's plan decides for itself. A
# backward all-reduce runs under the exchanges its forward saw (`bound`, from the autograd functions).
ACTIVE: dict[str, "SmallExchange"] = {}
# the last exchange opened per group name, whichever module's: a compiled backward's fallback, so held
# (a deleted module's exchange stays mapped until another module opens one on its group)
OPENED: dict[str, "SmallExchange"] = {}


class SmallExchange:
    """All-reduces of up to `capacity` bytes over the process group `group_name`."""

    def __init__(self, group_name: str, capacity: int) -> None:
        # imported here: collectives imports this file, and comm_kinds (which shared_memory reads) the collectives
        from autopar.runtime.shared_memory import SharedMemoryGroup, ordered_sum

        self._ordered_sum = ordered_sum  # the buckets' rank-order sum: the same bits on every rank

        self.capacity = _slot_bytes(capacity)
        self.group_name = group_name
        self._group = SharedMemoryGroup(group_name, 2 * self.capacity, torch.uint8)
        self._exchanges = 0

    def all_reduce(self, x: torch.Tensor, reduce_op: str) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        if nbytes > self.capacity:  # never planned so (every rank alike): the process group, not a slot overrun
            return torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(x.contiguous(), reduce_op, self.group_name))
        start = (self._exchanges % 2) * self.capacity
        self._exchanges += 1
        rows = self._group.rows[:, start:start + nbytes]
        rows[self._group.rank].copy_(x.detach().contiguous().view(-1).view(torch.uint8))
        self._group.barrier((nbytes << 6) | (_DTYPES.get(x.dtype, 0) << 2) | _OPS[reduce_op])
        values = rows.view(x.dtype)
        if reduce_op == "sum":
            total = self._ordered_sum(values)
        else:
            total = values.amax(dim=0) if reduce_op == "max" else values.amin(dim=0)
        return total.view(x.shape)


@torch.library.custom_op("autopar::shm_all_reduce", mutates_args=())
def shm_all_reduce(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    # a compiled backward decided at trace time; run after another module's forward, the group's
    # last opened exchange serves it (every rank alike)
    return (ACTIVE.get(group_name) or OPENED[group_name]).all_reduce(x, reduce_op)


@shm_all_reduce.register_fake
def _(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def plan_capacities(entries: "list[Any]") -> dict[str, int]:
    """Group key -> the largest of the plan's rank-graph all-reduces through its exchange (every
    stage's: the same on every rank, so each group's ranks all open it)."""
    from autopar.comm_kinds import SHARED_MEMORY  # (see SmallExchange.__init__)

    capacities: dict[str, int] = {}
    for entry in entries:
        if entry.transport == SHARED_MEMORY and entry.kind == "all_reduce" and entry.phase in ("forward", "backward"):
            capacities[entry.axis] = max(capacities.get(entry.axis, 0), int(entry.logical_bytes))
    return capacities


def file_bytes(capacity: int, ranks: int) -> int:
    """The bytes of one exchange's file, which every rank of its group maps: two slots a rank, and flags."""
    from autopar.runtime.shared_memory import FLAG_BYTES

    return ranks * (2 * _slot_bytes(capacity) + FLAG_BYTES)


def _slot_bytes(capacity: int) -> int:
    return -(-capacity // 8) * 8  # a slot starts aligned for any dtype


def takes(x: torch.Tensor, group_name: str, reduce_op: str) -> bool:
    """Whether this all-reduce goes through the group's exchange (the plan's rule, at run time)."""
    exchange = ACTIVE.get(group_name)
    return (exchange is not None and reduce_op in _OPS and x.device.type == "cpu"
            and x.numel() * x.element_size() <= exchange.capacity)


def open_small_exchanges(capacities: dict[str, int]) -> dict[str, SmallExchange]:
    """One exchange per process group name, for all-reduces of up to its bytes (the plan's largest
    on that group). Every rank of each group opens it, in the same order."""
    opened = {group_name: SmallExchange(group_name, capacity) for group_name, capacity in capacities.items()}
    OPENED.update(opened)
    return opened


def activate(exchanges: dict[str, SmallExchange]) -> None:
    """The exchanges of the module whose forward runs now (and whose backward follows it)."""
    global ACTIVE
    ACTIVE = exchanges


def deactivate(exchanges: dict[str, SmallExchange]) -> None:
    """A module's exchanges leave `ACTIVE` when the module is deleted (`ParallelModule` registers
    this as its finalizer): held only by `OPENED` then, until another module opens one on the group."""
    global ACTIVE
    if ACTIVE is exchanges:
        ACTIVE = {}


@contextlib.contextmanager
def bound(exchanges: dict[str, SmallExchange]):
    """Run a backward collective under the exchanges its forward saw (`ACTIVE` then), whichever
    module ran a forward since. Traced code (torch.compile) decides at trace time instead."""
    global ACTIVE
    if torch.compiler.is_compiling():
        yield
        return
    previous, ACTIVE = ACTIVE, exchanges
    try:
        yield
    finally:
        ACTIVE = previous
