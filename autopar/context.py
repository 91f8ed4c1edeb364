"""The compile context handed to every pass: mesh, strategy, and what each placeholder is."""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
from torch.distributed.device_mesh import DeviceMesh

from autopar.mesh import Mesh
from autopar.strategies import ResolvedStrategy


@dataclass(frozen=True)
class PlaceholderInfo:
    """A graph input: kind is 'parameter', 'buffer', 'constant' or 'input'; `target` the FQN or input index."""

    kind: str
    target: str
    index: int
    requires_grad: bool = False


@dataclass
class CompileContext:
    mesh: Mesh
    device_mesh: DeviceMesh
    strategy: ResolvedStrategy
    placeholders: dict[str, PlaceholderInfo]
    symbols: dict[sympy.Symbol, sympy.Symbol] = field(default_factory=dict)
    units: list = field(default_factory=list)
    master_dtypes: dict = field(default_factory=dict)  # mixed precision: FQN -> dtype of the master weights  # ShardUnits of ZeRO/FSDP (passes/shard_parameters.py)
    explain: bool = False  # record the alternatives DTensor weighed for each op (autopar explain)
    # DTensor's decision per (op, argument specs and values): repeated layers ask the same question
    # (passes/propagate_placements.py, `_dtensor_decision`)
    sharding_decisions: dict = field(default_factory=dict)

    def axis_size(self, axis_index: int) -> int:
        return self.mesh.shape[axis_index]
