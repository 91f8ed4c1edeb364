"""Collectives as plain calls on a process group named by `group`: PyTorch's functional
collectives (`torch.ops._c10d_functional`, which work on gloo and NCCL and appear by name in traced
graphs), whole (`raw_*`) or in two halves. `issue_*` hands the tensor to the process group and
returns its output before it has arrived; `land_*` waits for it (`wait`) and lays it out. The
autograd steps (`collectives.py`) and the deferred steps (`in_flight.py`) are built on these.

Lanes: a pipeline rank that runs a forward beside another micro-batch's backward (DualPipeV's
overlapped pairs, `autopar/runtime/overlap.py`) issues collectives from two threads at once. The
collectives of one process group must reach it in the same order on every rank of the group, and
two threads interleave in no fixed order; so the side thread issues its collectives on its lane: a
copy of each group over the same ranks, made at setup. Within one thread the order is the
schedule's, the same on every rank of a group (ranks that share a tensor, expert, context or data
group share their pipeline coordinate, so they run the same list with the same pairs). Every call
site that hands a group name to torch.distributed resolves it through `on_lane`: inside
`lane(names)` the lane's copy, anywhere else the name itself. Point-to-point steps between
pipeline stages keep their group: their messages are matched by tag, not by order."""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator

import torch

_c10d = torch.ops._c10d_functional
_lanes = threading.local()  # .names: this thread's group name -> its lane's copy (None: no lane)


def on_lane(name: str) -> str:
    """The group name this thread's collectives use for `name` (module docstring: lanes)."""
    names = getattr(_lanes, "names", None)
    return names.get(name, name) if names else name


@contextlib.contextmanager
def lane(names: dict[str, str]) -> Iterator[None]:
    """This thread issues its collectives on the copies `names` (group name -> copy's name)."""
    previous = getattr(_lanes, "names", None)
    _lanes.names = names
    try:
        yield
    finally:
        _lanes.names = previous


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """The output of an issued collective, once it has arrived."""
    return _c10d.wait_tensor(tensor)


def raw_all_reduce(x: torch.Tensor, group: str, reduce_op: str = "sum") -> torch.Tensor:
    return wait(issue_all_reduce(x, group, reduce_op))


# Each collective in two halves: `issue_*` hands the tensor to the process group and returns its
# output before it has arrived; `land_*` waits for it and lays it out. The raw_* steps run both at
# once; `autopar.core.ops.in_flight` runs them apart (the scheduling pass's deferred steps).
def issue_all_reduce(x: torch.Tensor, group: str, reduce_op: str = "sum") -> torch.Tensor:
    return _c10d.all_reduce(x.contiguous(), reduce_op, on_lane(group))


# A collective's buffer is rank-major (the pieces of dim 0 are the ranks'). On any other dim the
# rank axis is moved next to `dim` with one copy on the gathered side: the shard itself goes out as
# it is (contiguous), and the reduce-scatter's output arrives in place. Where every dimension
# before `dim` has size 1 the move is a view and nothing is copied.
def raw_all_gather(x: torch.Tensor, group: str, size: int, dim: int) -> torch.Tensor:
    return land_all_gather(issue_all_gather(x, group, size), tuple(x.shape), size, dim)


def issue_all_gather(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return _c10d.all_gather_into_tensor(x.contiguous(), size, on_lane(group))


def land_all_gather(pending: torch.Tensor, shape: tuple, size: int, dim: int) -> torch.Tensor:
    """The gathered tensor from an issued all-gather of shards of `shape`."""
    gathered = wait(pending)
    if dim == 0:
        return gathered
    ranks_next_to_dim = gathered.view(size, *shape).movedim(0, dim)
    return ranks_next_to_dim.reshape(*shape[:dim], size * shape[dim], *shape[dim + 1:])


def raw_reduce_scatter(x: torch.Tensor, group: str, size: int, dim: int) -> torch.Tensor:
    return wait(issue_reduce_scatter(x, group, size, dim))


def issue_reduce_scatter(x: torch.Tensor, group: str, size: int, dim: int) -> torch.Tensor:
    if dim == 0:
        return _c10d.reduce_scatter_tensor(x.contiguous(), "sum", size, on_lane(group))
    shape = tuple(x.shape)
    pieces = x.reshape(*shape[:dim], size, shape[dim] // size, *shape[dim + 1:]).movedim(dim, 0)
    rank_major = pieces.contiguous().flatten(0, 1)
    return _c10d.reduce_scatter_tensor(rank_major, "sum", size, on_lane(group))


def raw_all_to_all(x: torch.Tensor, group: str, size: int, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split `x` into `size` chunks on split_dim, exchange, concatenate what arrives on concat_dim."""
    pending, chunk_shape = issue_all_to_all(x, group, size, split_dim)
    return land_all_to_all(pending, chunk_shape, concat_dim)


# An all-to-all sends and receives rank-major buffers too: the chunks of split_dim are laid out
# rank-major with one copy (none where split_dim is 0 or every dim before it has size 1), and
# what arrives is moved next to concat_dim by a view, copied only where that cannot be a view.
def issue_all_to_all(x: torch.Tensor, group: str, size: int, split_dim: int) -> tuple[torch.Tensor, tuple]:
    """The exchange of `x`'s `size` chunks on split_dim in flight, and the shape of one chunk."""
    shape = tuple(x.shape)
    chunks = x.reshape(*shape[:split_dim], size, shape[split_dim] // size, *shape[split_dim + 1:]).movedim(split_dim, 0)
    numel = math.prod(chunks.shape[1:])
    pending = _c10d.all_to_all_single(chunks.contiguous().view(-1), [numel] * size, [numel] * size, on_lane(group))
    return pending, tuple(chunks.shape[1:])


def land_all_to_all(pending: torch.Tensor, chunk_shape: tuple, concat_dim: int) -> torch.Tensor:
    received = wait(pending)
    size = received.numel() // math.prod(chunk_shape)
    ranks_next_to_dim = received.view(size, *chunk_shape).movedim(0, concat_dim)
    return ranks_next_to_dim.reshape(*chunk_shape[:concat_dim], size * chunk_shape[concat_dim], *chunk_shape[concat_dim + 1:])
