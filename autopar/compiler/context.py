"""The compile context handed to every pass: mesh, strategy, and what each placeholder is.

`sharing_sharding_decisions()`: within it, every compile context made shares one store of
DTensor's sharding decisions (`autopar/compiler/passes/propagate_placements.py`), so that the planner's measured-
only plans of one model under many layouts (`autopar/planner/block_ledgers.py`: one and two blocks, with
and without recomputation, the same tensor-parallel degree) ask DTensor each question once. A
decision is keyed by the op and its argument specs, mesh included (equal meshes, equal keys).
The same store keeps each tensor-parallel layout found in a traced graph (`shared_store`): every
layout of one tensor-parallel degree finds the same one in the same graph.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import sympy
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.mesh import Mesh

if TYPE_CHECKING:  # strategies sit above the passes: what the passes read of them comes through the context
    from autopar.compiler.strategies import ResolvedStrategy


@dataclass(frozen=True)
class PlaceholderInfo:
    """A graph input: kind is 'parameter', 'buffer', 'constant' or 'input'; `target` the FQN or input index."""

    kind: str
    target: str
    index: int
    requires_grad: bool = False


_SHARED_DECISIONS: "dict | None" = None


@contextlib.contextmanager
def sharing_sharding_decisions(store: "dict | None" = None) -> Iterator[None]:
    """One store of sharding decisions (`store`, or a new one) for every compile context made
    within (module docstring)."""
    global _SHARED_DECISIONS
    outer, _SHARED_DECISIONS = _SHARED_DECISIONS, {} if store is None else store
    try:
        yield
    finally:
        _SHARED_DECISIONS = outer


def _sharding_decisions() -> dict:
    return {} if _SHARED_DECISIONS is None else _SHARED_DECISIONS


def shared_store() -> "dict | None":
    """The store `sharing_sharding_decisions()` shares, None outside it: besides DTensor's
    decisions it keeps the tensor-parallel layouts found in a traced graph
    (`autopar/compiler/strategies/find_layout.py`), keyed apart from them."""
    return _SHARED_DECISIONS


@dataclass
class CompileContext:
    mesh: Mesh
    device_mesh: DeviceMesh
    strategy: ResolvedStrategy
    placeholders: dict[str, PlaceholderInfo]
    symbols: dict[sympy.Symbol, sympy.Symbol] = field(default_factory=dict)
    units: list = field(default_factory=list)  # ShardUnits of ZeRO/FSDP (autopar/compiler/passes/shard_parameters.py)
    float8_linears: dict = field(default_factory=dict)  # float8(): module path -> weight FQN of each FP8 linear
    master_dtypes: dict = field(default_factory=dict)  # mixed precision: FQN -> dtype of the master weights
    explain: bool = False  # record the alternatives DTensor weighed for each op (autopar explain)
    # DTensor's decision per (op, argument specs and values): repeated layers ask the same question
    # (autopar/compiler/passes/propagate_placements.py, `_dtensor_decision`)
    sharding_decisions: dict = field(default_factory=_sharding_decisions)

    def axis_size(self, axis_index: int) -> int:
        return self.mesh.shape[axis_index]
