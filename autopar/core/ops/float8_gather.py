"""FP8 all-gathers of ZeRO-3/FSDP units: the weights of tensorwise FP8 linears travel as 8-bit
values with one scale each, as torchao's float8 all-gather under FSDP2 sends them.

A unit's `float8` parameters (`ShardUnit.float8`, chosen by `autopar/compiler/passes/shard_parameters.py`)
are gathered apart from the rest of the unit:
1. each rank casts its shards to the compute dtype (what the linear would read) and takes their
   largest magnitudes, all-reduced (max) over the unit's axis and every other axis that cuts the
   weight (`ShardUnit.float8_axes`), so each scale is the whole weight's, one device's;
2. casts each shard to e4m3 with its scale (`float8_matmul`'s cast) and all-gathers the bytes of
   all of them in one collective (viewed as uint8 on the wire: gloo has no 8-bit float; the ledger
   counts them as float8_e4m3fn, one byte each);
3. lays the gathered values out per weight and dequantizes them into the compute dtype.
The FP8 linear reading the weight takes its scale too (`float8_matmul(weight_scale=)`) and casts the
dequantized values back to the same 8-bit values exactly (a rounding error of 2^-9 at most, far
below e4m3's spacing), so its products equal one device's. The gathered weights are held in the
compute dtype; the bytes on the wire are one per element. The scales are kept from the forward's
gather for the backward's (the shards do not change in between): the re-gather moves bytes only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from autopar.core.ops.collective_calls import raw_all_reduce
from autopar.core.ops.collective_calls import on_lane
from autopar.core.ops.float8_matmul import RECIPES, cast_to_float8, scale_of
from autopar.core.zero_units import ShardUnit, gather_layout

_c10d = torch.ops._c10d_functional
_E4M3 = RECIPES["tensorwise"].weight_dtype


def split(unit: ShardUnit) -> tuple[ShardUnit, ShardUnit]:
    """(the unit's other parameters, its FP8 ones), each as a unit of its own flat layout."""
    chosen = set(unit.float8)
    rest = tuple(p for i, p in enumerate(unit.params) if i not in chosen)
    return (replace(unit, params=rest, float8=(), float8_axes=()),
            replace(unit, params=tuple(unit.params[i] for i in unit.float8), float8=(), float8_axes=()))


def scales(shards: list[torch.Tensor], unit: ShardUnit, groups: dict[str, str]) -> torch.Tensor:
    """One scale per FP8 parameter of the unit, from the whole weights' largest magnitudes."""
    low = [shards[i].detach().to(unit.dtype) for i in unit.float8]
    amax = torch.stack([t.abs().max() for t in low])
    for axis in (unit.axis, *unit.float8_axes):
        amax = raw_all_reduce(amax, groups[axis], "max")
    return scale_of(amax, _E4M3)


@dataclass
class Float8Gather:
    """An FP8 gather in flight: the gathered bytes, and the scales they were cast with."""

    pending: torch.Tensor
    scales: torch.Tensor
    unit: ShardUnit

    def landed(self) -> list[torch.Tensor]:
        """The unit's FP8 parameters, whole and dequantized into the compute dtype."""
        gathered = _c10d.wait_tensor(self.pending).view(_E4M3)
        _, chosen = split(self.unit)
        fulls = gather_layout(chosen, gathered)
        return [(full.to(torch.float32) / scale).to(self.unit.dtype) for full, scale in zip(fulls, self.scales)]


def issue(shards: list[torch.Tensor], unit: ShardUnit, groups: dict[str, str], known: torch.Tensor | None
          ) -> Float8Gather:
    """Cast this rank's shards of the unit's FP8 parameters and launch their all-gather; `known`: the
    scales of an earlier gather of the same shards (backward's re-gather), else reduced anew."""
    scale = scales(shards, unit, groups) if known is None else known
    cast = [cast_to_float8(shards[i].detach().to(unit.dtype), s, _E4M3, False).reshape(-1)
            for i, s in zip(unit.float8, scale)]
    send = torch.cat(cast).view(torch.uint8)
    return Float8Gather(_c10d.all_gather_into_tensor(send, unit.group_size, on_lane(groups[unit.axis])), scale, unit)
