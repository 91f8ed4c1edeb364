"""Whole tensors from the pieces ranks hold, reassembled by PyTorch, not by the code that cut them.

A program's claim about a parameter's layout is data: one DTensor placement per mesh axis
(`Shard`, `Replicate`, `_StridedShard` for block-sharded fused weights) and, for a ZeRO/FSDP
parameter, a `Dim0Shard`: each rank of `axis` keeps `rows` rows of dim 0 of the tensor the
placements describe, the last ranks zero-padded past `length` rows. `full_tensors` turns a rank's
local tensors back into whole tensors:

1. the `Dim0Shard`s are undone by a plain `torch.distributed.all_gather_into_tensor` over the
   axis' group (one for all the rank's shards of that axis, laid side by side) and a cut to
   `length` rows;
2. the placements are undone by DTensor: `DTensor.from_local(local, mesh, placements)
   .full_tensor()` — DTensor's own redistribution decides which pieces go where.

`check_mesh(axes)` builds the DeviceMesh for this with `init_device_mesh` over the world, from
the axis names and sizes alone (its groups are torch's, not the program's). Every rank of a
sharding axis' group must call `full_tensors` for the same tensors in the same order; ranks that
hold other tensors (another pipeline stage) use other groups and are not waited for. If a
program cut its pieces differently from what it claims (heads swapped, a parameter left whole),
the reassembled tensor differs from the single-device one, or has another shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class Dim0Shard:
    axis: str
    rows: int  # rows each rank of the axis keeps (padded)
    length: int  # rows of the tensor before padding


def check_mesh(*, axes: Sequence[tuple[str, int]]) -> DeviceMesh:
    """A DeviceMesh over the whole world with these (name, size) axes, outermost first."""
    return init_device_mesh("cpu", tuple(size for _, size in axes), mesh_dim_names=tuple(name for name, _ in axes))


def _undo_dim0_shards(pieces: dict[str, torch.Tensor], shards: dict[str, Dim0Shard],
                      mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """One plain all-gather per (axis, dtype) of every dim-0 shard, flattened side by side; each
    tensor is then its rows from every rank, in rank order, cut to its length."""
    groups: dict[tuple[str, torch.dtype], list[str]] = {}
    for fqn, shard in shards.items():
        if pieces[fqn].shape[0] != shard.rows:
            raise AssertionError(f"{fqn}: a dim-0 shard of {shard.rows} rows was claimed, the rank holds "
                                 f"{tuple(pieces[fqn].shape)}")
        groups.setdefault((shard.axis, pieces[fqn].dtype), []).append(fqn)
    whole = {}
    for (axis, dtype), fqns in groups.items():
        group = mesh.get_group(axis)
        size = dist.get_world_size(group)
        flat = torch.cat([pieces[fqn].reshape(-1) for fqn in fqns])
        gathered = flat.new_empty(size * flat.numel())
        dist.all_gather_into_tensor(gathered, flat, group=group)
        per_rank = gathered.view(size, flat.numel())
        offset = 0
        for fqn in fqns:
            piece, numel = pieces[fqn], pieces[fqn].numel()
            rows = per_rank[:, offset:offset + numel].reshape(size * piece.shape[0], *piece.shape[1:])
            whole[fqn] = rows[:shards[fqn].length]
            offset += numel
    return whole


def full_tensors(pieces: dict[str, torch.Tensor], *, mesh: DeviceMesh,
                 layout: dict[str, tuple[Sequence[Placement], Dim0Shard | None]]) -> dict[str, torch.Tensor]:
    """The whole tensor of every piece (name -> this rank's tensor), in the order given (see module
    docstring); `layout` maps each name to its placements and its dim-0 shard, if any."""
    pieces = {fqn: piece.detach() for fqn, piece in pieces.items()}
    shards = {fqn: layout[fqn][1] for fqn in pieces if layout[fqn][1] is not None}
    pieces.update(_undo_dim0_shards(pieces, shards, mesh))
    result = {}
    for fqn, local in pieces.items():
        placements = tuple(layout[fqn][0])
        if len(placements) != mesh.ndim:
            raise AssertionError(f"{fqn}: {len(placements)} placements for a mesh of {mesh.ndim} axes")
        if all(isinstance(p, Replicate) for p in placements):
            result[fqn] = local.clone()  # the rank's own copy is the whole tensor: nothing to gather
        else:
            result[fqn] = DTensor.from_local(local.contiguous(), mesh, placements, run_check=False).full_tensor()
    return result
