"""Redistribution steps as autograd functions, each with its conjugate backward.

Every function moves one tensor along one mesh axis (a process group named `group`, of `size`
ranks; `index` is this rank's coordinate on the axis). The forward/backward pairs are the ones
Megatron calls f and g, generalised to any dimension:

| forward                      | backward                                  |
|------------------------------|-------------------------------------------|
| all_reduce (Partial -> R)    | identity                                  |
| reduce_scatter (P -> S(d))   | all_gather on d                           |
| all_gather (S(d) -> R)       | slice (grad replicated) or reduce_scatter (grad partial) |
| shard_slice (R -> S(d))      | all_gather on d, or zero-pad (grad partial) |
| all_to_all (S(a) -> S(b))    | all_to_all (S(b) -> S(a))                 |
| partial_from_replicate       | identity                                  |
| grad_all_reduce (identity)   | all_reduce                                |

They call PyTorch's functional collectives (`torch.ops._c10d_functional`), which work on gloo
and NCCL and appear by name in traced graphs.
"""
from __future__ import annotations

import torch

_c10d = torch.ops._c10d_functional


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(tensor)


def raw_all_reduce(x: torch.Tensor, group: str, reduce_op: str = "sum") -> torch.Tensor:
    return _wait(_c10d.all_reduce(x.contiguous(), reduce_op, group))


def raw_all_gather(x: torch.Tensor, group: str, size: int, dim: int) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    gathered = _wait(_c10d.all_gather_into_tensor(moved, size, group))
    return gathered.movedim(0, dim).contiguous()


def raw_reduce_scatter(x: torch.Tensor, group: str, size: int, dim: int) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    scattered = _wait(_c10d.reduce_scatter_tensor(moved, "sum", size, group))
    return scattered.movedim(0, dim).contiguous()


def raw_all_to_all(x: torch.Tensor, group: str, size: int, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split `x` into `size` chunks on split_dim, exchange, concatenate what arrives on concat_dim."""
    chunks = [c.contiguous() for c in torch.chunk(x, size, dim=split_dim)]
    send = torch.cat([c.reshape(-1) for c in chunks])
    received = _wait(_c10d.all_to_all_single(send, [chunks[0].numel()] * size, [c.numel() for c in chunks], group))
    pieces = received.split(chunks[0].numel())
    return torch.cat([p.view(chunks[0].shape) for p in pieces], dim=concat_dim)


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
    def forward(ctx, x, group, size, index, dim, grad_partial):
        ctx.args = (group, size, index, dim, grad_partial)
        return raw_all_gather(x, group, size, dim)

    @staticmethod
    def backward(ctx, grad):
        group, size, index, dim, grad_partial = ctx.args
        if grad_partial:
            return raw_reduce_scatter(grad, group, size, dim), None, None, None, None, None
        return torch.chunk(grad, size, dim=dim)[index].contiguous(), None, None, None, None, None


class _ShardSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, index, dim, grad_partial):
        ctx.args = (group, size, index, dim, grad_partial)
        return torch.chunk(x, size, dim=dim)[index].contiguous()

    @staticmethod
    def backward(ctx, grad):
        group, size, index, dim, grad_partial = ctx.args
        if grad_partial:  # zero-padded: the input's gradient stays Partial, reduced later with the parameters
            pieces = [grad if i == index else torch.zeros_like(grad) for i in range(size)]
            return torch.cat(pieces, dim=dim), None, None, None, None, None
        return raw_all_gather(grad, group, size, dim), None, None, None, None, None


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


def all_reduce(x: torch.Tensor, *, group: str, size: int, reduce_op: str = "sum") -> torch.Tensor:
    return _AllReduce.apply(x, group, size, reduce_op)


def reduce_scatter(x: torch.Tensor, *, group: str, size: int, dim: int) -> torch.Tensor:
    return _ReduceScatter.apply(x, group, size, dim)


def all_gather(x: torch.Tensor, *, group: str, size: int, index: int, dim: int, grad_partial: bool) -> torch.Tensor:
    return _AllGather.apply(x, group, size, index, dim, grad_partial)


def shard_slice(x: torch.Tensor, *, group: str, size: int, index: int, dim: int, grad_partial: bool) -> torch.Tensor:
    return _ShardSlice.apply(x, group, size, index, dim, grad_partial)


def all_to_all(x: torch.Tensor, *, group: str, size: int, from_dim: int, to_dim: int) -> torch.Tensor:
    return _AllToAll.apply(x, group, size, from_dim, to_dim)


def partial_from_replicate(x: torch.Tensor, *, group: str, index: int) -> torch.Tensor:
    return _PartialFromReplicate.apply(x, index)


def grad_all_reduce(x: torch.Tensor, *, group: str) -> torch.Tensor:
    return _GradAllReduce.apply(x, group)
