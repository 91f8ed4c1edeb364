"""Local kernels for ops whose sharded form is not the plain aten op on the shard.

- `vocab_parallel_embedding`: lookup into a vocabulary shard; ids owned by other ranks give
  zero rows, so the output is Partial (sum) over the axis; `padding_idx` maps to the local row.
- `sharded_log_softmax`: log-softmax over a dimension sharded on the axis (the vocabulary):
  all-reduce of the row max and of the row sum of exponentials forward, one all-reduce of the
  row sum of the incoming gradient backward. Full logits are never gathered.
- `sharded_nll_loss`: nll_loss_forward on class shards and/or batch shards; over the batch axes
  the loss sum and the count of non-ignored targets are all-reduced together, so the mean
  matches one device and the loss is replicated there.
- `copy_values`: aten's functional `copy`, which has no derivative, as one that has.
- `split_equal_blocks`, `slice_blocks`: split / slice of a block-sharded fused projection (q|k|v)
  into its local blocks.
The collectives they issue are declared by their rules in `autopar.compiler.rules.op_rules` for the ledger.
"""
from __future__ import annotations

import torch

from autopar.core.ops.collective_calls import raw_all_reduce
from autopar.core.ops.collectives import all_reduce


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False, sparse: bool = False, *, index: int) -> torch.Tensor:
    """`aten.embedding` with every argument, on the vocabulary rows [index * rows, (index + 1) * rows).

    `padding_idx` (a global row; only backward reads it: that row's gradient stays zero) becomes
    the local row when this rank owns it. Foreign ids look up local row 0 and are zeroed after,
    which also zeroes their gradient. `scale_grad_by_freq` and `sparse` are refused by the rule."""
    rows = weight.shape[0]
    start = index * rows
    foreign = (indices < start) | (indices >= start + rows)
    local = (indices - start).masked_fill(foreign, 0)
    local_padding = padding_idx - start if 0 <= padding_idx - start < rows else -1  # aten: -1 is none
    looked_up = torch.ops.aten.embedding.default(weight, local, local_padding, scale_grad_by_freq, sparse)
    return looked_up.masked_fill(foreign.unsqueeze(-1), 0.0)


class _ShardedLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        row_max = raw_all_reduce(x.amax(dim=dim, keepdim=True).detach(), group, "max")
        shifted = x - row_max
        sum_exp = raw_all_reduce(shifted.exp().sum(dim=dim, keepdim=True), group, "sum")
        out = shifted - sum_exp.log()
        ctx.save_for_backward(out)
        ctx.dim, ctx.group = dim, group
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        grad_sum = raw_all_reduce(grad.sum(dim=ctx.dim, keepdim=True), ctx.group, "sum")
        return grad - out.exp() * grad_sum, None, None


def sharded_log_softmax(x: torch.Tensor, dim: int, half_to_float: bool = False, *, group: str) -> torch.Tensor:
    return _ShardedLogSoftmax.apply(x.float() if half_to_float else x, dim, group)


def sharded_nll_loss(log_probs: torch.Tensor, target: torch.Tensor, weight: None, reduction: int, ignore_index: int, *,
                     class_index: int | None, batch_groups: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """nll_loss_forward for log_probs [N, C_local] (C sharded when class_index is set) or batch shards."""
    valid = target != ignore_index
    owned = valid
    local_target = target.masked_fill(~valid, 0)
    if class_index is not None:
        classes = log_probs.shape[1]
        start = class_index * classes
        owned = valid & (target >= start) & (target < start + classes)
        local_target = (target - start).masked_fill(~owned, 0)
    picked = log_probs.gather(1, local_target.unsqueeze(1)).squeeze(1)
    losses = -picked.masked_fill(~owned, 0.0)
    count = valid.sum().to(log_probs.dtype)
    if reduction == 0:  # aten's Reduction enum: 0 none, 1 mean, 2 sum
        for group in batch_groups:
            count = raw_all_reduce(count, group, "sum")
        return losses, count
    stats = torch.stack([losses.sum(), count])
    for group in batch_groups:  # identity backward: each rank's share of the sum enters once
        stats = all_reduce(stats, group=group, size=1)
    total, count = stats[0], stats[1].detach()
    return (total if reduction == 2 else total / count), count


def split_equal_blocks(x: torch.Tensor, sizes: list[int], dim: int = 0, *, parts: int) -> list[torch.Tensor]:
    return list(torch.split(x, [size // parts for size in sizes], dim=dim))


def slice_blocks(x: torch.Tensor, dim: int, start: int | None = None, end: int | None = None, step: int = 1, *,
                 parts: int) -> torch.Tensor:
    """A slice of whole blocks of a block-sharded dimension: each rank holds 1/parts of every block."""
    size = x.shape[dim] * parts
    start, end = min(max(start or 0, 0), size), min(end if end is not None else size, size)
    return torch.ops.aten.slice.Tensor(x, dim, start // parts, end // parts, step)


class _CopyValues(torch.autograd.Function):
    """aten's derivative of `copy`: the gradient goes to `source` (summed over a broadcast), zeros to
    the overwritten `destination`."""

    @staticmethod
    def forward(ctx, destination, source):
        ctx.source_shape, ctx.source_dtype = source.shape, source.dtype
        return source.to(destination.dtype).expand(destination.shape).clone()

    @staticmethod
    def backward(ctx, grad):
        to_source = grad.sum_to_size(ctx.source_shape).to(ctx.source_dtype) if ctx.needs_input_grad[1] else None
        return (torch.zeros_like(grad) if ctx.needs_input_grad[0] else None), to_source


def copy_values(destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`aten.copy` (functional: `source` broadcast into `destination`'s shape and dtype), which aten
    gives no derivative, with aten's `copy_` derivative."""
    return _CopyValues.apply(destination, source)
