"""Which part of a sharded dimension a rank holds: contiguous chunks, or the load-balanced pairs
of context parallelism.

A `Shard(d)` on most axes means rank i holds the i-th of N contiguous chunks. On a context-
parallel axis declared with `load_balance=True` (`autopar/compiler/strategies/context.py`) the dimension is cut
into 2N chunks and rank i holds chunks i and 2N-1-i, concatenated: with a causal mask the early
chunks attend to little and the late ones to much, and pairing one of each gives every rank the
same attention work (the lecture's load-balancing rule; `LEDGER.md`). Every step that cuts or
joins a dimension on such an axis (the input slice, `shard_slice`, `all_gather`, their backward
steps, the attention kernels) goes through these functions, so the layout is one choice in one
place. All other ops on a sequence shard are position-wise and do not care which positions a rank
holds.

`layout` is "contiguous" or "balanced". `blocks` > 1 is DTensor's `_StridedShard` (split factor):
the dimension is `blocks` equal blocks (rows of a flattened [batch, seq], one block per batch row)
and each is cut as above; a rank's part is its piece of every block, concatenated.
"""
from __future__ import annotations

import torch

CONTIGUOUS, BALANCED = "contiguous", "balanced"


def chunk_ids(index: int, size: int, layout: str) -> list[int]:
    """The chunk numbers rank `index` of `size` holds, in its local order."""
    return [index, 2 * size - 1 - index] if layout == BALANCED else [index]


def chunks_total(size: int, layout: str) -> int:
    return 2 * size if layout == BALANCED else size


def take(x: torch.Tensor, dim: int, size: int, index: int, layout: str, blocks: int = 1) -> torch.Tensor:
    """Rank `index`'s part of the whole tensor `x` along `dim`."""
    if blocks > 1:
        return torch.cat([take(b, dim, size, index, layout) for b in torch.chunk(x, blocks, dim=dim)], dim=dim)
    pieces = torch.chunk(x, chunks_total(size, layout), dim=dim)
    return torch.cat([pieces[c] for c in chunk_ids(index, size, layout)], dim=dim)


def natural_order(gathered: torch.Tensor, dim: int, size: int, layout: str, blocks: int = 1) -> torch.Tensor:
    """The whole tensor from the ranks' parts concatenated in rank order (what an all-gather gives)."""
    if blocks > 1:
        parts = [torch.chunk(p, blocks, dim=dim) for p in torch.chunk(gathered, size, dim=dim)]
        return torch.cat([natural_order(torch.cat([parts[r][b] for r in range(size)], dim=dim), dim, size, layout)
                          for b in range(blocks)], dim=dim)
    if layout != BALANCED:
        return gathered
    pieces = torch.chunk(gathered, 2 * size, dim=dim)  # piece 2r: chunk r; piece 2r+1: chunk 2N-1-r
    position = {c: p for p, c in enumerate(c for r in range(size) for c in chunk_ids(r, size, layout))}
    return torch.cat([pieces[position[c]] for c in range(2 * size)], dim=dim)


def rank_order(whole: torch.Tensor, dim: int, size: int, layout: str, blocks: int = 1) -> torch.Tensor:
    """The inverse of `natural_order`: the ranks' parts of `whole`, concatenated in rank order
    (what a reduce-scatter cuts into contiguous pieces)."""
    if layout != BALANCED and blocks == 1:
        return whole
    return torch.cat([take(whole, dim, size, r, layout, blocks) for r in range(size)], dim=dim)


def zero_padded(part: torch.Tensor, dim: int, size: int, index: int, layout: str, blocks: int = 1) -> torch.Tensor:
    """The whole-sized tensor holding `part` at rank `index`'s positions and zeros elsewhere."""
    pieces = [torch.zeros_like(part) for _ in range(size)]
    pieces[index] = part
    return natural_order(torch.cat(pieces, dim=dim), dim, size, layout, blocks)
