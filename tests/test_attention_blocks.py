"""The block kernels of context parallelism (`autopar/core/ops/attention_blocks.py`).

- The matmul kernel (`MATH`, what every device without a fused kernel runs) equals the CPU flash
  kernel block by block: output, log-sum-exp and the backward given a merged row (rel <= 1e-5).
- Ring attention on 2 gloo ranks with `MATH` registered for the CPU equals one device (loss,
  gradients, parameters over 3 steps): the merge and the backward with the merged log-sum-exp work
  with it, not only with the flash kernel.
- A ring of one rank (cp=1, what a world-1 GPU check runs) equals one device, and its ledger the
  messages measured: none (dK/dV are home already; a send to oneself fails on gloo).
- The CUDA kernel's calls (memory-efficient attention, its log-sum-exp padded to 32 rows) checked
  for their shapes on the meta device, where PyTorch's meta kernels of those ops run without a GPU.
  Its numbers are checked only on a GPU (`scripts/gpu_check.sh`).
"""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.core.ops import attention_blocks
from autopar.core.ops.attention_blocks import CPU, EFFICIENT, MATH, block_kernel
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.numerics import STEPS, distributed_rank, single_device
from tests.numerics_checks import assert_ledger_equals_measured, assert_matches


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(seed: int, heads: int = 3, rows: int = 24, dim: int = 16):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, rows, dim, generator=generator) for _ in range(4)]  # q, k, v, dout


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_the_matmul_kernel_equals_the_flash_kernel(causal, scale):
    q, k, v, dout = _inputs(0)
    out, lse = MATH.forward(q, k, v, causal, scale)
    flash_out, flash_lse = CPU.forward(q, k, v, causal, scale)
    assert _rel(out, flash_out) <= 1e-5 and _rel(lse, flash_lse) <= 1e-5

    # the backward of one block given the merged row: this block and another key block merged
    k2, v2 = _inputs(1)[1:3]
    out2, lse2 = CPU.forward(q, k2, v2, False, scale)
    merged_lse = torch.logaddexp(flash_lse, lse2)
    merged_out = torch.lerp(out2, flash_out, torch.sigmoid(flash_lse - lse2).unsqueeze(-1))
    mine = MATH.backward(dout, q, k, v, merged_out, merged_lse, causal, scale)
    theirs = CPU.backward(dout, q, k, v, merged_out, merged_lse, causal, scale)
    for a, b in zip(mine, theirs):
        assert _rel(a, b) <= 1e-5


def test_a_device_without_a_fused_kernel_runs_the_matmul_kernel():
    q, k, v, _ = _inputs(0)
    assert block_kernel(q, k, v) is CPU
    meta = [t.to("meta") for t in (q, k, v)]
    assert block_kernel(*meta) is MATH


@pytest.mark.parametrize("rows", [24, 64])
def test_the_cuda_kernel_calls_have_the_shapes_the_merge_needs(rows):
    """On the meta device: the log-sum-exp cut to the block's rows; the backward takes the merged
    one padded back and gives gradients shaped like q, k, v."""
    q, k, v, dout = (t.to("meta") for t in _inputs(0, rows=rows))
    out, lse = EFFICIENT.forward(q, k, v, True, None)
    assert out.shape == q.shape and lse.shape == (2, 3, rows) and lse.dtype == torch.float32
    dq, dk, dv = EFFICIENT.backward(dout, q, k, v, out, lse, True, None)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


CONFIG = GPTConfig(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=32, d_ff=64)
BUILD = functools.partial(GPT, CONFIG)
BATCHES = [example_batch(CONFIG, batch=2, seed=step) for step in range(STEPS)]


def _ring_with_the_matmul_kernel(rank: int, world: int) -> dict:
    attention_blocks.BLOCK_KERNELS["cpu"] = MATH
    return distributed_rank(rank, world, BUILD, BATCHES, "cp=2", [autopar.context_parallel()], memory=False)


def test_ring_attention_with_the_matmul_kernel_equals_one_device():
    results = launch(_ring_with_the_matmul_kernel, 2, timeout_s=180)
    assert_matches(single_device(BUILD, BATCHES), results)


def _ring_of_one(rank: int, world: int) -> dict:
    return distributed_rank(rank, world, BUILD, BATCHES, "cp=1", [autopar.context_parallel()], memory=False)


def test_a_ring_of_one_rank_equals_one_device():
    results = launch(_ring_of_one, 1, timeout_s=180)
    assert_matches(single_device(BUILD, BATCHES), results)
    assert_ledger_equals_measured(results)
