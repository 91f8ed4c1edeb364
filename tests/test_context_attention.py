"""The context-parallel attention kernels (`autopar.core.ops.context_attention`) on real gloo
processes against one device's `scaled_dot_product_attention`: every method (ring, allgather,
alltoall) x layout (load-balanced, contiguous) x causal / not x grouped-query / not, output and
dQ/dK/dV of the rank's positions, fp32 rel <= 1e-5 (bf16: 2e-2, the format's 8 bits of mantissa
over a softmax of 64 positions). The whole tensors are cut with the same `sequence_chunks.take`
the runtime uses; that the cut is the single-device model's is the numerics tests' business
(`tests/test_context_parallel.py` reassembles from outside)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.core.ops.context_attention import context_attention
from autopar.runtime.launch import launch
from autopar.core.sequence_chunks import take

SEQ, HEADS, HEAD_DIM = 64, 4, 8
CASES = list(itertools.product(("ring", "allgather", "alltoall"), ("balanced", "contiguous"), (True, False),
                               (4, 2), (torch.float32, torch.bfloat16)))


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-12)).item()


def _rank(rank: int, world: int) -> list[tuple]:
    group = dist.group.WORLD.group_name
    errors = []
    for method, layout, causal, kv_heads, dtype in CASES:
        if method == "alltoall" and kv_heads % world:
            continue
        generator = torch.Generator().manual_seed(7)
        q = torch.randn(2, HEADS, SEQ, HEAD_DIM, generator=generator).to(dtype)
        k, v = (torch.randn(2, kv_heads, SEQ, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
        dout = torch.randn(2, HEADS, SEQ, HEAD_DIM, generator=generator).to(dtype)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*whole, is_causal=causal, enable_gqa=kv_heads != HEADS)
        expected.backward(dout)
        local = [take(t, 2, world, rank, layout).detach().requires_grad_() for t in (q, k, v)]
        out = context_attention(*local, None, 0.0, causal, enable_gqa=kv_heads != HEADS, group=group, size=world,
                                index=rank, method=method, layout=layout)
        out.backward(take(dout, 2, world, rank, layout))
        worst = max([_relative(out, take(expected, 2, world, rank, layout))]
                    + [_relative(t.grad, take(w.grad, 2, world, rank, layout)) for t, w in zip(local, whole)])
        errors.append((method, layout, causal, kv_heads, str(dtype), worst))
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_kernels_equal_one_device(world):
    results = launch(_rank, world, timeout_s=120)
    for errors in results:
        assert errors
        for method, layout, causal, kv_heads, dtype, worst in errors:
            bound = 1e-5 if dtype == "torch.float32" else 2e-2
            assert worst <= bound, f"{method} {layout} causal={causal} kv_heads={kv_heads} {dtype}: rel {worst:.2e}"
