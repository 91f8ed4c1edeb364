"""Sequence parallelism's shard of a block output, on the token dimension that needs no copies.

Megatron-SP splits the tokens of what leaves a block (the residual stream, LayerNorm and dropout
inputs) over the tensor axis; every token-wise op gives the same result whichever tokens a rank
holds. A collective's buffer is rank-major, so gathering or reduce-scattering a dimension costs
no layout copy only where each rank's piece is one contiguous block of the tensor: on dim 0, or on
a later dim when every dim before it has (local) size 1. Megatron gets this by laying activations
out [s, b, h] and sharding s; a traced PyTorch model is [b, s, h], so `TokenShard` resolves, per
tensor, to the first token dimension (any dim but the last) that gives contiguous pieces:
- dim 0 (the batch) when its local size — after the other mesh axes' shards of it (data,
  expert parallelism) — splits evenly over the axis;
- dim 1 (the sequence) when the local batch is 1, as in most LLM training;
- else `sequence_dim` (the sequence dimension, declared): correct, with one layout copy on each
  gathered side (`core/ops/collective_calls.land_all_gather`) and one before each reduce-scatter. A
  dynamic size (`dynamic_dims`) is never chosen, nor passed over: its run-time size is unknown.
Only a dimension no later mesh axis shards is chosen: several axes sharding one dimension cut it
outermost axis first (DTensor's order, which dropout's masks and every shard follow), while the
data was cut by the axis that sharded it first — on a mesh "tp=2,dp=2" that is dp, the inner one,
so tp shards the sequence there. Every tensor of the same shape and placements resolves alike, so
block outputs, the embedding output and the residual stream they meet agree. Bytes on the wire and per-rank memory are the
same on any token dimension; only the copies differ (`benchmarks/copies.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class TokenShard:
    """A module layout's output placement (`ModuleLayout.outputs`): Shard of a token dimension,
    chosen per tensor by `resolve`."""

    sequence_dim: int = 1

    def __str__(self) -> str:
        return f"S(tokens; else {self.sequence_dim})"

    def resolve(self, *, shape: "tuple[int, ...] | None", placements: "tuple[Placement, ...]", axis_index: int,
                sizes: "tuple[int, ...]") -> Shard:
        """The Shard this declaration means on mesh axis `axis_index` for a tensor of global
        `shape` whose other axes hold `placements` (mesh `sizes`)."""
        if shape is None:
            return Shard(self.sequence_dim)
        size = sizes[axis_index]
        for dim in range(len(shape) - 1):
            if not isinstance(shape[dim], int):  # a dynamic size (`dynamic_dims`): its local size is not known
                break
            if any(i > axis_index and isinstance(p, Shard) and p.dim == dim for i, p in enumerate(placements)):
                break  # an inner axis cut it first (data parallelism on a mesh "tp=2,dp=2"): this axis' piece
                # of it would not be the one its place in the mesh says (module docstring)
            local = shape[dim] // math.prod(sizes[i] for i, p in enumerate(placements)
                                            if i != axis_index and isinstance(p, Shard) and p.dim == dim)
            if local % size == 0 and local >= size:
                return Shard(dim)
            if local != 1:
                break
        return Shard(self.sequence_dim)
