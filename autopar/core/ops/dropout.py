"""Dropout on a shard that draws the single-device model's mask.

One device draws a dropout mask for the whole tensor from its generator; a rank that holds a
shard of that tensor must apply the same entries of the same mask, and must leave its generator
where one device's would be, so that every later draw agrees too. CPU generators (Mersenne
Twister) cannot skip ahead, so `sharded_dropout` draws the whole mask (`bernoulli_` on a bool
tensor of the global shape, as `aten.native_dropout` does) and keeps the rank's piece, cut as the
shard was cut (`cuts`: per mesh axis in order, the dimension, the axis size, the sequence layout
and the strided split factor — `runtime/sequence_chunks.take`). Replicated regions need nothing:
every rank runs `native_dropout` itself from the same generator state. The cost is drawing the
whole mask on every rank (time and a transient bool tensor of the global shape).
"""
from __future__ import annotations

import torch

from autopar.core.sequence_chunks import take


class _MaskedScale(torch.autograd.Function):
    """x * mask / (1 - p), saving the bool mask (as native_dropout's backward does)."""

    @staticmethod
    def forward(ctx, x, mask, scale):
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask * scale

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None, None


def sharded_dropout(x: torch.Tensor, p: float, train: bool | None, *, cuts: str, **indices: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout of the rank's shard `x` with the whole tensor's mask. `cuts`:
    "axis:dim:size:layout:blocks" per sharding axis, ';'-joined, outermost first; `indices`:
    `index_<axis>` = the rank's coordinate on each."""
    if not train or p == 0.0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    steps = [entry.split(":") for entry in cuts.split(";") if entry]
    shape = list(x.shape)
    for _, dim, size, _, _ in steps:
        shape[int(dim)] *= int(size)
    mask = torch.empty(shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - p)
    for axis, dim, size, layout, blocks in steps:
        mask = take(mask, int(dim), int(size), indices[f"index_{axis}"], layout, int(blocks))
    mask = mask.contiguous()
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    return _MaskedScale.apply(x, mask, scale), mask
