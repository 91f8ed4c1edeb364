"""Redistribution steps as autograd functions, each with its conjugate backward.

Every function moves one tensor along one mesh axis (a process group named `group`, of `size`
ranks; `index` is this rank's coordinate on the axis). The forward/backward pairs are the ones
Megatron calls f and g, generalised to any dimension:

| forward                      | backward                                  |
|------------------------------|-------------------------------------------|
| all_reduce (Partial -> R)    | identity                                  |
| reduce_scatter (P -> S(d))   | all_gather on d                           |
| all_gather (S(d) -> R)       | slice (grad replicated) or reduce_scatter (grad partial); with `regather`, its output is saved as the shard and gathered again |
| shard_slice (R -> S(d))      | all_gather on d, or zero-pad (grad partial) |
| all_to_all (S(a) -> S(b))    | all_to_all (S(b) -> S(a))                 |
| partial_from_replicate       | identity                                  |
| grad_all_reduce (identity)   | all_reduce                                |

On a load-balanced context-parallel axis (`layout="balanced"`) a shard is two chunks of the
dimension, and a `_StridedShard` (`blocks` = its split factor) is a piece of each of equal blocks
(`autopar.core.sequence_chunks`): slices take them, gathers put them back in order.

They call PyTorch's functional collectives through `collective_calls.py` (plain calls, whole
or in two halves); a deferred step (`deferred=True`) starts in flight (`in_flight.py`).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.core.ops import in_flight
from autopar.core.ops.collective_calls import raw_all_gather, raw_all_reduce, raw_all_to_all, raw_reduce_scatter
from autopar.core.sequence_chunks import CONTIGUOUS, natural_order, rank_order, take, zero_padded


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, reduce_op):
        ctx.scale = 1.0 / size if reduce_op == "avg" else 1.0
        if reduce_op == "avg":
            return raw_all_reduce(x, group, "sum") / size
        return raw_all_reduce(x, group, reduce_op)

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.scale if ctx.scale != 1.0 else grad), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, dim):
        ctx.args = (group, size, dim)
        return raw_reduce_scatter(x, group, size, dim)

    @staticmethod
    def backward(ctx, grad):
        return raw_all_gather(grad, *ctx.args), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, index, dim, grad_partial, regather=False, layout=CONTIGUOUS, blocks=1):
        ctx.args = (group, size, index, dim, grad_partial, layout, blocks)
        gathered = natural_order(raw_all_gather(x, group, size, dim), dim, size, layout, blocks)
        if regather:
            if layout != CONTIGUOUS or blocks != 1:
                raise NotImplementedError("re-gathering in backward is for contiguous (sequence-parallel) shards")
            _remember_shard(gathered, x.detach(), (group, size, dim))
        return gathered

    @staticmethod
    def backward(ctx, grad):
        group, size, index, dim, grad_partial, layout, blocks = ctx.args
        if grad_partial:
            local = raw_reduce_scatter(rank_order(grad, dim, size, layout, blocks), group, size, dim)
        else:
            local = take(grad, dim, size, index, layout, blocks).contiguous()
        return local, None, None, None, None, None, None, None, None


class _ShardSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, index, dim, grad_partial, layout=CONTIGUOUS, blocks=1):
        ctx.args = (group, size, index, dim, grad_partial, layout, blocks)
        return take(x, dim, size, index, layout, blocks).contiguous()

    @staticmethod
    def backward(ctx, grad):
        group, size, index, dim, grad_partial, layout, blocks = ctx.args
        if grad_partial:  # zero-padded: the input's gradient stays Partial, reduced later with the parameters
            whole = zero_padded(grad, dim, size, index, layout, blocks)
        else:
            whole = natural_order(raw_all_gather(grad, group, size, dim), dim, size, layout, blocks)
        return whole, None, None, None, None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, from_dim, to_dim):
        ctx.args = (group, size, from_dim, to_dim)
        return raw_all_to_all(x, group, size, split_dim=to_dim, concat_dim=from_dim)

    @staticmethod
    def backward(ctx, grad):
        group, size, from_dim, to_dim = ctx.args
        return raw_all_to_all(grad, group, size, split_dim=from_dim, concat_dim=to_dim), None, None, None, None


class _PartialFromReplicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index):
        return x.clone() if index == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return raw_all_reduce(grad, ctx.group, "sum"), None


def _starts(deferred: bool) -> bool:
    """A deferred step starts in flight, except while dynamo traces it (`autopar/core/ops/in_flight.py`)."""
    return deferred and not torch.compiler.is_compiling()


def all_reduce(x: torch.Tensor, *, group: str, size: int, reduce_op: str = "sum", deferred: bool = False
               ) -> torch.Tensor:
    """`deferred`: return the buffer in flight, landed by `in_flight.finish` (every step below)."""
    if _starts(deferred):
        return in_flight.start(x, "all_reduce", group=group, size=size, reduce_op=reduce_op)
    return _AllReduce.apply(x, group, size, reduce_op)


def reduce_scatter(x: torch.Tensor, *, group: str, size: int, dim: int, deferred: bool = False) -> torch.Tensor:
    if _starts(deferred):
        return in_flight.start(x, "reduce_scatter", group=group, size=size, dim=dim)
    return _ReduceScatter.apply(x, group, size, dim)


def all_gather(x: torch.Tensor, *, group: str, size: int, index: int, dim: int, grad_partial: bool,
               regather: bool = False, layout: str = CONTIGUOUS, blocks: int = 1, deferred: bool = False
               ) -> torch.Tensor:
    """`layout`, `blocks`: which positions of `dim` each rank holds (`autopar.core.sequence_chunks`).
    A re-gathering all-gather is never deferred (the scheduling pass leaves it in place)."""
    if _starts(deferred) and not regather:
        return in_flight.start(x, "all_gather", group=group, size=size, index=index, dim=dim,
                               grad_partial=grad_partial, layout=layout, blocks=blocks)
    if regather:
        return _regathering_all_gather(x, group, size, index, dim, grad_partial, layout, blocks)
    return _AllGather.apply(x, group, size, index, dim, grad_partial, regather, layout, blocks)


# Under `parallelize(compile=True)` this runs eagerly between compiled pieces: which storage to swap
# for its shard is recorded when it runs (`_remember_shard`), every step, where dynamo would trace
# that bookkeeping once; the compiled piece after it saves the gathered tensor through the
# saved-tensor hooks, which swap it as they do eagerly.
@torch._dynamo.disable
def _regathering_all_gather(x, group, size, index, dim, grad_partial, layout, blocks) -> torch.Tensor:
    return _AllGather.apply(x, group, size, index, dim, grad_partial, True, layout, blocks)


# Megatron's sequence-parallel memory saving (`regather=True`): autograd keeps the shard an
# all-gather took in, not the gathered tensor, and backward gathers it again. `_AllGather`
# remembers its output's storage; the saved-tensor hooks ParallelModule installs
# (`pack_regathered` / `unpack_regathered`) swap a saved view of it for the shard + geometry.
class _Regatherable:
    """One re-gatherable all-gather output: the shard, how to gather it, and the gathered tensor
    while backward still has saved views of it to unpack (gathered once, however many users)."""

    def __init__(self, gathered: torch.Tensor, shard: torch.Tensor, how: tuple[str, int, int]) -> None:
        self.alive = weakref.ref(gathered)
        self.shard, self.how = shard, how
        self.packed = 0
        self.regathered: torch.Tensor | None = None

    def unpack(self, shape: tuple, stride: tuple, offset: int) -> torch.Tensor:
        if self.regathered is None:
            self.regathered = raw_all_gather(self.shard, *self.how)
        view = torch.as_strided(self.regathered, shape, stride, offset)
        self.packed -= 1
        if self.packed <= 0:
            self.regathered = None
        return view


# keyed by storage identity (StorageWeakRef works for fake tensors too, whose data pointers are all 0)
_regatherable: dict[StorageWeakRef, _Regatherable] = {}


def _remember_shard(gathered: torch.Tensor, shard: torch.Tensor, how: tuple[str, int, int]) -> None:
    # a copy of the items: a pipeline's side thread (runtime/overlap.py) may add to the registry meanwhile
    for key in [k for k, entry in list(_regatherable.items()) if entry.alive() is None]:
        _regatherable.pop(key, None)
    _regatherable[StorageWeakRef(gathered.untyped_storage())] = _Regatherable(gathered, shard, how)


def _regatherable_entry(tensor: torch.Tensor) -> _Regatherable | None:
    if not _regatherable or not tensor.numel():
        return None
    entry = _regatherable.get(StorageWeakRef(tensor.untyped_storage()))
    return entry if entry is not None and entry.alive() is not None else None


def regathered_source(tensor: torch.Tensor) -> torch.Tensor | None:
    """The shard a saved tensor can be gathered again from, if it is (a view of) a re-gatherable output."""
    entry = _regatherable_entry(tensor)
    return entry.shard if entry is not None else None


def pack_regathered(tensor: torch.Tensor) -> Any:
    """(entry, shape, stride, offset) for a saved view of a re-gatherable output, else None."""
    entry = _regatherable_entry(tensor)
    if entry is None:
        return None
    entry.packed += 1
    return (entry, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())


def unpack_regathered(saved: tuple) -> torch.Tensor:
    entry, shape, stride, offset = saved
    return entry.unpack(shape, stride, offset)


def shard_slice(x: torch.Tensor, *, group: str, size: int, index: int, dim: int, grad_partial: bool,
                layout: str = CONTIGUOUS, blocks: int = 1) -> torch.Tensor:
    return _ShardSlice.apply(x, group, size, index, dim, grad_partial, layout, blocks)


def all_to_all(x: torch.Tensor, *, group: str, size: int, from_dim: int, to_dim: int, deferred: bool = False
               ) -> torch.Tensor:
    if _starts(deferred):
        return in_flight.start(x, "all_to_all", group=group, size=size, from_dim=from_dim, to_dim=to_dim)
    return _AllToAll.apply(x, group, size, from_dim, to_dim)


def partial_from_replicate(x: torch.Tensor, *, group: str, index: int) -> torch.Tensor:
    return _PartialFromReplicate.apply(x, index)


def grad_all_reduce(x: torch.Tensor, *, group: str, deferred: bool = False) -> torch.Tensor:
    if _starts(deferred):
        return in_flight.start(x, "grad_all_reduce", group=group)
    return _GradAllReduce.apply(x, group)

