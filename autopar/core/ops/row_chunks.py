"""Pieces of a tensor's rows and their joining, for the async-TP pass (`autopar/compiler/passes/chunk_collectives.py`).

A collective on dimension 0 cuts (or joins) the rows into one block per rank; a piece of rows
that such a collective will gather or scatter is piece `index` of each block. `rows` takes it, and
`join` puts the pieces back in block order. With one block, a piece is a slice of consecutive
rows (a view) and joining is a concatenation.

Both are plain differentiable torch ops: autograd gives their backward, and `torch.compile`
traces them.
"""
from __future__ import annotations

import torch


def rows(x: torch.Tensor, *, blocks: int, chunks: int, index: int) -> torch.Tensor:
    """Piece `index` of `chunks` from each of x's `blocks` equal blocks of rows (dim 0), in block
    order: a view for one block, a copy otherwise."""
    return x.unflatten(0, (blocks, chunks, -1)).select(1, index).flatten(0, 1)


def join(pieces: list[torch.Tensor], *, blocks: int) -> torch.Tensor:
    """The inverse of `rows` over every index: each piece holds `blocks` blocks of rows; the result
    holds every piece's block 0, then every piece's block 1, and so on."""
    if blocks == 1:
        return torch.cat(pieces)
    return torch.stack([piece.unflatten(0, (blocks, -1)) for piece in pieces], dim=1).flatten(0, 2)
