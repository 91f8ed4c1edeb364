"""Grouped expert matmuls on the rank's device: `torch._grouped_mm` where it runs, else the traced op.

A model traced on the CPU in fp32 carries the grouped matmul it chose there (transformers'
`grouped_mm_fallback`, a loop over the experts, or a custom op registered with
`autopar.register_grouped_matmul`). `emit_rank_graph` makes every such call go through
`grouped_matmul(rows, weight, offsets, traced=op)`, which decides when it runs, from the tensors it
gets: on CUDA, bf16 rows and weights whose inner sizes `torch._grouped_mm` takes (multiples of 8
elements: 16-byte strides) run the fused kernel in one launch, the offsets as int32; everything else
calls the traced op, as one device would. Both compute rows [N, K] grouped by expert times weights
[E, K, M] with cumulative row offsets [E] -> [N, M] (`tests/test_device_portability.py` checks that
the two agree on the CPU, where `torch._grouped_mm` also runs).
"""
from __future__ import annotations

from typing import Any

import torch

_ALIGN = 8  # elements: torch._grouped_mm needs 16-byte aligned strides, 8 bf16 values


def fused_applies(device_type: str, dtype: torch.dtype, inner: int, outer: int) -> bool:
    """Whether `torch._grouped_mm` runs rows [N, inner] x weights [E, inner, outer] of `dtype` on
    `device_type` in place of the traced op."""
    return device_type == "cuda" and dtype == torch.bfloat16 and inner % _ALIGN == 0 and outer % _ALIGN == 0


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, traced: Any) -> torch.Tensor:
    """rows [N, K] sorted by expert x weight [E, K, M], cumulative offsets [E] -> [N, M] (module docstring)."""
    if rows.dtype == weight.dtype and fused_applies(rows.device.type, rows.dtype, weight.shape[1], weight.shape[2]):
        return torch._grouped_mm(rows, weight, offs=offsets.to(torch.int32))
    return traced(rows, weight, offsets)
