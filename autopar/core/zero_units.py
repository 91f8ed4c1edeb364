"""Units of sharded training state (ZeRO / FSDP) and their flat layout.

A `ShardUnit` is a group of parameters gathered and reduced together (one collective each way),
normally one transformer block. Each parameter is sharded on dim 0 of its compute tensor (the
tensor-parallel shard when TP is on another axis): with N ranks each rank keeps `rows =
ceil(d0 / N)` rows, the last ranks padded with zero rows when d0 does not divide (uneven shards
work; the padding is counted in the ledgers). The unit's flat layout puts each rank's shards
side by side, so one all_gather_into_tensor / reduce_scatter_tensor moves the whole unit:

    flat = [rank 0: p0 rows | p1 rows | ...][rank 1: p0 rows | p1 rows | ...] ...   (N * shard_numel)

`gather_layout` / `shard_of` / `grad_layout` are the only functions that know this layout.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class UnitParam:
    fqn: str
    placeholder: str  # the planned graph's placeholder name
    shape: tuple[int, ...]  # compute (full, after tensor parallelism) shape on one rank
    rows: int  # dim-0 rows each rank keeps (padded)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def shard_numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.rows, *self.shape[1:])


@dataclass(frozen=True)
class ShardUnit:
    index: int
    name: str  # module path of the block, "" for the root unit
    axis: str
    group_size: int
    stage: int
    dtype: torch.dtype  # compute dtype: what is gathered and what the graph reads
    params: tuple[UnitParam, ...]
    extra_axes: tuple[str, ...]  # gradient still partial on these after the reduce-scatter (HSDP, SP norms)
    reshard: bool  # stage 3: freed after forward, gathered again in backward
    prefetch: bool  # forward: the next unit's all-gather is launched when this one is gathered
    master_dtype: torch.dtype = torch.float32  # the shards the optimizer updates (mixed precision: fp32)
    reduce_dtype: torch.dtype = torch.float32  # gradients are reduce-scattered in this dtype
    backward_prefetch: bool = False  # backward: the previous block's all-gather is launched early
    pipeline_stage: int = 0  # the pipeline stage whose graph gathers it (0 without a pipeline)
    # how the gradients reach their owners: "reduce_scatter", or "all_to_all" of the rank-major
    # pieces, each owner summing the n it receives (`comm_kinds.gradient_exchange_kind`)
    reduce_kind: str = "reduce_scatter"
    # how the shards are gathered (stage 3 before use; stages 1/2 after the step, one collective for
    # all the units of a pipeline stage): "all_gather", or one "broadcast" per owner into its row
    # of the gathered buffer (`comm_kinds.parameter_gather_kind`)
    gather_kind: str = "all_gather"
    # stage 3: the positions of the parameters gathered in FP8 (weights of tensorwise FP8 linears,
    # `autopar/core/ops/float8_gather.py`), and the other mesh axes that cut them (their scale is
    # the whole weight's)
    float8: tuple[int, ...] = ()
    float8_axes: tuple[str, ...] = ()

    @property
    def shard_numel(self) -> int:
        return sum(p.shard_numel for p in self.params)

    @property
    def gathered_numel(self) -> int:
        return self.group_size * self.shard_numel

    def offsets(self) -> list[int]:
        offsets, offset = [], 0
        for param in self.params:
            offsets.append(offset)
            offset += param.shard_numel
        return offsets


def rows_per_rank(d0: int, group_size: int) -> int:
    return -(-d0 // group_size)


def shard_of(full: torch.Tensor, rows: int, index: int) -> torch.Tensor:
    """Rank `index`'s dim-0 shard of a full (compute) parameter, zero-padded to `rows` rows."""
    piece = full[index * rows:(index + 1) * rows]
    if piece.shape[0] == rows:
        return piece.clone(memory_format=torch.contiguous_format)  # its own storage, not a view of `full`
    padded = full.new_zeros((rows, *full.shape[1:]))
    padded[:piece.shape[0]] = piece
    return padded


def gather_layout(unit: ShardUnit, gathered: torch.Tensor) -> list[torch.Tensor]:
    """Full parameters (fresh contiguous tensors) from the all-gathered flat buffer."""
    by_rank = gathered.view(unit.group_size, unit.shard_numel)
    fulls = []
    for param, offset in zip(unit.params, unit.offsets()):
        block = by_rank[:, offset:offset + param.shard_numel].reshape(unit.group_size * param.rows, *param.shape[1:])
        fulls.append(block[:param.shape[0]].clone() if block.shape[0] != param.shape[0] else block.contiguous())
    return fulls


def copy_gathered(unit: ShardUnit, gathered: torch.Tensor, fulls: list[torch.Tensor]) -> None:
    """`gather_layout` into existing parameters (ZeRO-1/2's compute copies): each block copied
    straight from the gathered buffer, no fresh tensor in between (uneven rows: the padding cut off)."""
    by_rank = gathered.view(unit.group_size, unit.shard_numel)
    for param, offset, full in zip(unit.params, unit.offsets(), fulls):
        block = by_rank[:, offset:offset + param.shard_numel].view(unit.group_size, param.rows, *param.shape[1:])
        if full.shape[0] == unit.group_size * param.rows and full.is_contiguous():
            full.view(block.shape).copy_(block)
        else:  # uneven (or strided) parameter: each owner's real rows
            for owner in range(-(-param.shape[0] // param.rows)):  # the ranks that own real rows
                start = owner * param.rows
                count = min(param.rows, param.shape[0] - start)
                full[start:start + count].copy_(block[owner, :count])


def grad_layout(unit: ShardUnit, grads: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
    """The reduce-scatter input: full gradients padded and laid out like `gather_layout` reads them."""
    flat = torch.empty(unit.group_size, unit.shard_numel, dtype=dtype, device=_device(grads))
    for param, offset, grad in zip(unit.params, unit.offsets(), grads):
        target = flat[:, offset:offset + param.shard_numel].view(unit.group_size, param.rows, *param.shape[1:])
        if grad is None:  # no gradient: zeros, written once (the buffer is not zero-filled first)
            target.zero_()
        elif grad.shape[0] == unit.group_size * param.rows:
            target.copy_(grad.view(target.shape))
        else:  # uneven: the ranks with whole shards, the one with part of one, then the padding zeroed
            whole, part = divmod(grad.shape[0], param.rows)
            target[:whole].copy_(grad[:whole * param.rows].view(whole, param.rows, *param.shape[1:]))
            if part:
                target[whole, :part].copy_(grad[whole * param.rows:])
                target[whole, part:].zero_()
            target[whole + bool(part):].zero_()
    return flat.view(-1)


def refresh_groups(units: Iterable[ShardUnit]) -> list[tuple[ShardUnit, ...]]:
    """ZeRO-1/2 units re-gathered together after the optimizer step: one collective (all-gather)
    or one round of owner broadcasts per (pipeline stage, axis, compute dtype, kind), units in index
    order. Their gathered buffer is rank-major: row r holds rank r's shards of each unit side by side."""
    groups: dict[tuple, list[ShardUnit]] = {}
    for unit in sorted(units, key=lambda u: u.index):
        if unit.stage < 3:
            key = (unit.pipeline_stage, unit.axis, unit.dtype, unit.gather_kind)
            groups.setdefault(key, []).append(unit)
    return [tuple(group) for group in groups.values()]


def shard_views(unit: ShardUnit, flat_shard: torch.Tensor) -> list[torch.Tensor]:
    """Per-parameter views of one rank's flat shard (a reduce-scatter output)."""
    return [flat_shard[offset:offset + p.shard_numel].view(p.shard_shape) for p, offset in zip(unit.params, unit.offsets())]


def _device(tensors: list[torch.Tensor | None]) -> torch.device:
    return next((t.device for t in tensors if t is not None), torch.device("cpu"))
