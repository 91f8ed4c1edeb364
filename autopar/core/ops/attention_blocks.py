"""The attention block kernels context parallelism runs: one query block against one key/value block.

A block kernel gives the block's output and its row log-sum-exp (forward), and dQ, dK, dV of the
block given the *merged* output and log-sum-exp of the whole row (backward); the blockwise ring
and all-gather attention in `context_attention.py` only ever calls these two. `causal` is the
top-left causal mask of a square diagonal block; `scale` None means 1/sqrt(head_dim); `mask`
(keyword, default None) is the block's piece of an attention mask, additive in the query's dtype
(0 where allowed, -inf where not). A row the mask allows nothing of has log-sum-exp -inf; the
caller merges such rows accordingly and hands the backward a finite log-sum-exp for them.

`block_kernel(q, k, v, masked=False)` picks, per call:
- CPU: the flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward),
  with or without a mask (it takes an additive mask of the query's dtype).
- CUDA: memory-efficient attention (`aten._scaled_dot_product_efficient_attention` with
  `compute_log_sumexp=True` and its backward), which takes fp32, fp16 and bf16, when PyTorch's own
  SDPA dispatcher says it can run these inputs (`torch.backends.cuda.can_use_efficient_attention`);
  its log-sum-exp comes padded to a multiple of 32 rows, cut to the block's rows here and padded
  back for the backward. Masked blocks run `MATH` instead: what the efficient kernel gives for a
  row its bias allows nothing of is not documented, and `MATH` states it (-inf, a zero output).
- Anything else (another accelerator, or CUDA inputs the efficient kernel refuses): `MATH`, the
  same two functions written with matmuls and `logsumexp` in fp32. It materialises the block's
  score matrix, so it is slower and larger than a fused kernel, but it runs on every device
  PyTorch supports; a fused kernel for another device registers in `BLOCK_KERNELS`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class BlockKernel:
    """forward(q, k, v, causal, scale) -> (out, logsumexp [B, H, Lq] fp32);
    backward(dout, q, k, v, out, logsumexp, causal, scale) -> (dq, dk, dv)."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _cpu_forward(q, k, v, causal, scale, mask=None):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                     attn_mask=mask, scale=scale)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled scores of a block in fp32, the future masked out under a (square, top-left) causal
    mask, the additive `mask` added."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores if mask is None else scores + mask.float()


def _math_forward(q, k, v, causal, scale, mask=None):
    scores = _scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)  # a row allowed nothing: probabilities 0, not NaN
    out = torch.matmul(torch.exp(scores - finite.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    """Softmax backward with the row's merged log-sum-exp: this block's share of the gradients."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    probs = torch.exp(_scores(q, k, causal, scale, mask) - lse.unsqueeze(-1))
    dout32 = dout.float()
    dv = torch.matmul(probs.transpose(-2, -1), dout32)
    dprobs = torch.matmul(dout32, v.float().transpose(-2, -1))
    row_dot = (dout32 * out.float()).sum(-1, keepdim=True)
    dscores = probs * (dprobs - row_dot) * scale
    dq = torch.matmul(dscores, k.float())
    dk = torch.matmul(dscores.transpose(-2, -1), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_LSE_ALIGN = 32  # the efficient kernel's log-sum-exp rows are allocated in multiples of 32


def _efficient_forward(q, k, v, causal, scale, mask=None):  # never given a mask (module docstring)
    out, lse, _seed, _offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                             scale=scale)
    return out, lse[..., :q.shape[2]]


def _efficient_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    rows = q.shape[2]
    padded = F.pad(lse, (0, -rows % _LSE_ALIGN)).contiguous()
    no_seed = torch.zeros((), dtype=torch.long, device=q.device)  # dropout is 0: the seed is never read
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded, no_seed, no_seed, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


CPU = BlockKernel(_cpu_forward, _cpu_backward)
EFFICIENT = BlockKernel(_efficient_forward, _efficient_backward)
MATH = BlockKernel(_math_forward, _math_backward)


def _cuda_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> BlockKernel:
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    return EFFICIENT if torch.backends.cuda.can_use_efficient_attention(params, False) else MATH


# device type -> a fused kernel, or a chooser (q, k, v) -> kernel; every other device runs MATH
BLOCK_KERNELS: dict[str, BlockKernel | Callable[..., BlockKernel]] = {"cpu": CPU, "cuda": _cuda_kernel}


# device type -> a fused kernel that takes a block's mask; every other device runs MATH on masked blocks
MASKED_BLOCK_KERNELS: dict[str, BlockKernel] = {"cpu": CPU}


def block_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: bool = False) -> BlockKernel:
    """The kernel for blocks of these inputs' device, dtype and head size, given a mask or not
    (module docstring)."""
    if masked:
        return MASKED_BLOCK_KERNELS.get(q.device.type, MATH)
    chosen = BLOCK_KERNELS.get(q.device.type, MATH)
    return chosen if isinstance(chosen, BlockKernel) else chosen(q, k, v)
