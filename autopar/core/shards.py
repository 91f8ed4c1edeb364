"""The piece of a global tensor a rank holds under its placements: `shard` (each mesh axis's
`Shard` cut as that axis lays it out, `autopar/core/sequence_chunks.py`). A plan's inputs and
the runtime's parameters are cut here."""
from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Placement

from autopar.core import sequence_chunks
from autopar.core.ir import shard_dim
from autopar.core.mesh import Mesh


def shard(tensor: torch.Tensor, placements: Sequence[Placement], mesh: Mesh, rank: int, *,
          layouts: "dict[str, str] | None" = None) -> torch.Tensor:
    """The piece of a global tensor that `rank` holds under `placements` (outermost axis first);
    `layouts`: axis -> how a Shard cuts its dimension there (`autopar/core/sequence_chunks.py`; contiguous
    where absent)."""
    for axis, placement in zip(mesh.names, placements):
        if shard_dim(placement) is not None:  # Shard, or _StridedShard's blocks each cut alike
            tensor = sequence_chunks.take(tensor, placement.dim, mesh.size(axis), mesh.coordinate(rank, axis),
                                          (layouts or {}).get(axis, "contiguous"), getattr(placement, "split_factor", 1))
    return tensor.contiguous()


