"""Random ops on a shard that draw the single-device model's values.

One device draws a random tensor (a dropout mask, `uniform_` jitter, `randn_like` noise, an
attention-dropout mask) for the whole tensor from its generator; a rank that holds a shard of
that tensor must use the same entries of the same draw, and must leave its generator where one
device's would be, so that every later draw agrees too. CPU generators (Mersenne Twister) cannot
skip ahead, so every kernel here draws the whole tensor, with the op one device runs, on a
tensor of the global shape and memory layout, and keeps the rank's piece, cut as the shard was
cut (`cuts`: per mesh axis in order, the dimension, the axis size, the sequence layout and the
strided split factor — `core/sequence_chunks.take`):
- `sharded_dropout`: `aten.native_dropout` (`bernoulli_` on a bool tensor of the global shape, as
  native_dropout does), the mask's piece applied;
- `drawn_like`: an op whose values depend on its input's shape only (`uniform`, `normal`,
  `exponential`, `bernoulli(x, p)`, `rand_like`, `randn_like`, `randint_like`);
- `bernoulli_of_shard`: `bernoulli(p)` with a tensor of probabilities: drawn on the global shape
  with the rank's probabilities in place and zeros elsewhere (the CPU kernel draws one uniform
  per entry, whatever its probability, so the other entries do not change the rank's);
- `attention_dropout`: `scaled_dot_product_attention(dropout_p > 0)` on batch or head shards: the
  CPU kernel is the math path, which draws `bernoulli_(1 - p)` on a float tensor of the scores'
  global shape [batch, heads, q, k]; the rank's piece is passed to the math kernel as its mask.
Replicated regions need nothing: every rank runs the op itself from the same generator state.
The cost is drawing the whole tensor on every rank (time and a transient tensor of the global
shape). The planner decides which ops get these kernels (`compiler/rules/random_rules.py`).
"""
from __future__ import annotations

import warnings

import torch

from autopar.core.sequence_chunks import take, zero_padded

aten = torch.ops.aten


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


def _steps(cuts: str) -> list[tuple[str, int, int, str, int]]:
    """`cuts` ("axis:dim:size:layout:blocks" per sharding axis, ';'-joined, outermost first) parsed."""
    steps = []
    for entry in cuts.split(";"):
        if entry:
            axis, dim, size, layout, blocks = entry.split(":")
            steps.append((axis, int(dim), int(size), layout, int(blocks)))
    return steps


def _global_shape(local: torch.Size, cuts: str) -> list[int]:
    shape = list(local)
    for _, dim, size, _, _ in _steps(cuts):
        shape[dim] *= size
    return shape


def _piece(whole: torch.Tensor, cuts: str, indices: dict[str, int]) -> torch.Tensor:
    """The rank's piece of the whole tensor: each axis' cut in mesh order (DTensor's)."""
    for axis, dim, size, layout, blocks in _steps(cuts):
        whole = take(whole, dim, size, indices[f"index_{axis}"], layout, blocks)
    return whole.contiguous()


def _placed(part: torch.Tensor, cuts: str, indices: dict[str, int]) -> torch.Tensor:
    """The whole-shaped tensor holding `part` where the rank's piece lies, zeros elsewhere
    (`_piece` undone: innermost cut first)."""
    for axis, dim, size, layout, blocks in reversed(_steps(cuts)):
        part = zero_padded(part, dim, size, indices[f"index_{axis}"], layout, blocks)
    return part


def _split(kwargs: dict) -> tuple[dict[str, int], dict]:
    """The rank's coordinates (`index_<axis>`) apart from the op's own keyword arguments."""
    indices = {k: v for k, v in kwargs.items() if k.startswith("index_")}
    return indices, {k: v for k, v in kwargs.items() if not k.startswith("index_")}


def sharded_dropout(x: torch.Tensor, p: float, train: bool | None, *, cuts: str, **indices: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout of the rank's shard `x` with the whole tensor's mask; `indices`:
    `index_<axis>` = the rank's coordinate on each sharding axis of `cuts`."""
    if not train or p == 0.0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    mask = torch.empty(_global_shape(x.shape, cuts), dtype=torch.bool, device=x.device).bernoulli_(1.0 - p)
    mask = _piece(mask, cuts, indices)
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    return _MaskedScale.apply(x, mask, scale), mask


def drawn_like(x: torch.Tensor, *args: object, draw: str, order: str, cuts: str, **kwargs: object) -> torch.Tensor:
    """`aten.<draw>(x, *args, **op kwargs)` for the whole tensor `x` is a shard of, the rank's piece
    kept. The op reads `x`'s shape, dtype and layout only; `order` is the one-device output's
    memory layout (dims outermost first, `torch.empty_permuted`)."""
    indices, op_kwargs = _split(kwargs)
    layout = [int(d) for d in order.split(",")] if order else []
    whole = torch.empty_permuted(_global_shape(x.shape, cuts), layout, dtype=x.dtype, device=x.device)
    op = getattr(aten, draw.split(".")[0])
    overload = getattr(op, draw.split(".")[1]) if "." in draw else op.default
    return _piece(overload(whole, *args, **op_kwargs), cuts, indices)


def bernoulli_of_shard(p: torch.Tensor, *, cuts: str, **kwargs: object) -> torch.Tensor:
    """`aten.bernoulli(p)` for the rank's shard `p` of the probabilities: one device's draws."""
    indices, op_kwargs = _split(kwargs)
    return _piece(aten.bernoulli.default(_placed(p.detach(), cuts, indices), **op_kwargs), cuts, indices)


def attention_dropout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False, *,
                      scale: float | None = None, enable_gqa: bool = False, cuts: str, **indices: int) -> torch.Tensor:
    """`scaled_dot_product_attention` with dropout on batch (dim 0) / head (dim 1) shards of q, k, v,
    with the rank's piece of the mask one device's math kernel draws for the whole batch and heads."""
    scores = _global_shape(query.shape[:-1] + key.shape[-2:-1], cuts)
    mask = torch.empty(scores, dtype=query.dtype, device=query.device).bernoulli_(1.0 - dropout_p)
    mask = _piece(mask, cuts, indices).bool()
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA hands a boolean mask to its kernels
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(attn_mask.logical_not(), -float("inf"))
    with warnings.catch_warnings():  # "Dropout mask should only be used for testing purposes": it is one device's
        warnings.simplefilter("ignore")
        out, _ = aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, mask,
                                                         scale=scale, enable_gqa=enable_gqa)
    return out
