"""The registry of autopar's own sharding rules: what a rule returns (`RuleResult`, with the
`InternalCollective`s its local kernel issues), what it is told (`RuleContext`), `register` (one
rule per op; registering an op twice is an error) and `lookup`. The rules themselves are
`op_rules.py` (generic ops), `attention_rules.py` and `expert_rules.py`; importing
`autopar.compiler.rules` registers all of them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement

from autopar.core.ir import tensor_meta


@dataclass(frozen=True)
class InternalCollective:
    """A collective a local kernel issues: kind, axis, phase, logical bytes per call (sympy) and calls
    per use; `operand`: which of the op's arguments it concerns, where a later pass may take it over
    (an FP8 product's weight scale, computed by its ZeRO unit's FP8 all-gather instead)."""

    kind: str
    axis: str
    phase: str
    logical_bytes: sympy.Expr
    dtype: torch.dtype
    why: str
    calls: int = 1
    operand: str = ""


@dataclass
class RuleResult:
    """`required[i]`: spec positional argument i must arrive with (None: not a tensor / as is).
    `unread_args`: positions the emitter passes as None, so what computed them can be dropped
    (a mask the planner read as causal). `kernel_kwargs`: keyword arguments the emitter binds per rank, name -> (kind, axis) with kind
    "index" (the rank's coordinate on axis), "size" (the axis size), "group" (its process-group
    name), "groups" (names for the comma-separated axes) or "none" (None)."""

    output: Any
    required: list[DTensorSpec | None]
    local_kernel: Callable[..., Any] | None = None
    kernel_kwargs: dict[str, tuple[str, str]] = field(default_factory=dict)
    internal: list[InternalCollective] = field(default_factory=list)
    unread_args: tuple[int, ...] = ()  # positional arguments the local kernel ignores: passed as None


@dataclass(frozen=True)
class RuleContext:
    mesh_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    context_axes: tuple = ()  # (axis, strategies.context.ContextDeclaration) per context-parallel axis

    def layout(self, axis: str) -> str:
        """How a dimension sharded on `axis` is cut (`autopar/core/sequence_chunks.py`)."""
        return next((d.layout for a, d in self.context_axes if a == axis), "contiguous")


_RULES: dict[Any, Callable[..., RuleResult | None]] = {}


def register(op: Any) -> Callable[[Callable[..., RuleResult | None]], Callable[..., RuleResult | None]]:
    def decorate(rule: Callable[..., RuleResult | None]) -> Callable[..., RuleResult | None]:
        if op in _RULES:
            raise ValueError(f"a sharding rule for {op} is already registered ({_RULES[op].__name__})")
        _RULES[op] = rule
        return rule

    return decorate


def lookup(op: Any) -> Callable[..., RuleResult | None] | None:
    """The rule for `op`; ops of libraries registered when imported (transformers' custom ops) are
    registered by their name."""
    return _RULES.get(op) or _RULES.get(str(op))


def spec_like(spec: DTensorSpec, placements: tuple[Placement, ...], value: torch.Tensor | None = None) -> DTensorSpec:
    meta = spec.tensor_meta if value is None else tensor_meta(value)
    return DTensorSpec(spec.mesh, placements, meta)
