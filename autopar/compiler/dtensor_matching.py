"""DTensor's sharding decision, with the inputs' own placements tried first.

For an op registered with single-mesh-dimension strategies (pointwise ops, `_to_copy`, `mm`, ...),
PyTorch 2.13's `propagate_op_sharding_non_cached` expands the strategies over every mesh
dimension (S^N combinations, each priced by `redistribute_cost`) and keeps the cheapest: about
60 ms for one `mul` on a three-axis mesh, most of a composed search's time on expert × tensor
layouts. When the inputs already match a strategy on every mesh dimension, that expansion picks a
strategy that moves nothing, and the output is fixed by the match. PyTorch has that check
(`_PreparedSingleDimStrategy.try_propagate`, the first step of its Dijkstra search, which 2.13 does
not call from the propagator yet); `exact_matches_first()` makes the propagator run it before the
expansion, and falls back to the expansion wherever the answer could differ:

- an input that is not a plain `OpStrategy` tensor argument (tuples, tensor keyword arguments), an
  in-place or `out=` op, arguments on another mesh, `_StridedShard` placements, symbolic sizes;
- a match whose input placements name two different outputs in the op's strategies (the
  expansion keeps the last such combination, the lookup the first) or whose output mixes
  Partial kinds (the expansion drops those).

Everything after the strategy is chosen (shape arguments made local, strided flags, the
output specs) is still DTensor's own code. `VERIFY` (tests) makes every matched decision also
run the full expansion and raises where the two disagree.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import _sharding_prop
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _PreparedSingleDimStrategy
from torch.distributed.tensor.placement_types import Partial, _StridedShard

# tests set this: each matched decision is checked against the full expansion
VERIFY = False

_expand = _sharding_prop._expand_single_dim_strategy_to_mesh


@contextlib.contextmanager
def exact_matches_first() -> Iterator[None]:
    """While open, DTensor's propagator tries the inputs' own placements before expanding."""
    previous = _sharding_prop._expand_single_dim_strategy_to_mesh
    _sharding_prop._expand_single_dim_strategy_to_mesh = _matching_first
    try:
        yield
    finally:
        _sharding_prop._expand_single_dim_strategy_to_mesh = previous


def _matching_first(mesh: Any, op_schema: Any, strategy_info: Any, output_tensor_meta: Any) -> Callable:
    expanded = _expand(mesh, op_schema, strategy_info, output_tensor_meta)

    def strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
        matched = _matched(mesh, op_schema, strategy_info, output_tensor_meta)
        if matched is None:
            return expanded(op, args_schema, kwargs_schema)
        if VERIFY:
            _check_same(op, matched, expanded(op, args_schema, kwargs_schema), op_schema)
        return matched

    return strategy


def _matched(mesh: Any, op_schema: Any, strategy_info: Any, output_tensor_meta: Any) -> OpStrategy | None:
    """The strategy that moves nothing, where the inputs match one on every mesh dimension and
    the expansion would choose the same (module docstring); None otherwise."""
    op = op_schema.op
    if op._schema.is_mutable or op_schema.is_out_variant_op() or getattr(strategy_info, "different_mesh_args", None):
        return None
    if any(isinstance(value, (OpStrategy, TupleStrategy)) for value in op_schema.kwargs_schema.values()):
        return None
    specs = []
    for arg in op_schema.args_schema:
        if isinstance(arg, TupleStrategy):
            return None
        if isinstance(arg, OpStrategy):
            if len(arg.strategies) != 1:
                return None
            specs.append(arg.strategies[0].output_spec)
    if not specs or any(spec.mesh != mesh for spec in specs):
        return None
    for spec in specs:
        if any(isinstance(p, _StridedShard) for p in spec.placements):
            return None
        if spec.tensor_meta is None or any(isinstance(size, torch.SymInt) for size in spec.tensor_meta.shape):
            return None
    prepared = _PreparedSingleDimStrategy(strategy_info, op_schema, output_tensor_meta, num_inputs=len(specs))
    outputs_of: dict[tuple, set] = {}
    for single in prepared.expanded_strategies:
        outputs_of.setdefault(tuple(single[prepared.num_outputs:]), set()).add(tuple(single[:prepared.num_outputs]))
    for dim in range(mesh.ndim):
        if len(outputs_of.get(tuple(spec.placements[dim] for spec in specs), ())) > 1:
            return None
    found = prepared.try_propagate(mesh, tuple(spec.placements for spec in specs), specs)
    if found is None:
        return None
    outputs = found.strategies[0].output_specs
    for output in outputs if isinstance(outputs, tuple) else (outputs,):
        kinds = {(type(p), p.reduce_op) for p in getattr(output, "placements", ()) if isinstance(p, Partial)}
        if len(kinds) > 1:
            return None
    return found


def _check_same(op: Any, matched: OpStrategy, expanded: Any, op_schema: Any) -> None:
    specs = [arg.strategies[0].output_spec for arg in op_schema.args_schema if isinstance(arg, OpStrategy)]
    chosen = _sharding_prop._select_min_cost_strategy(expanded, OpSchema(op, tuple(specs), {}))
    mine = matched.strategies[0]

    def placements(specs: Any) -> Any:
        if isinstance(specs, (tuple, list)):
            return tuple(None if s is None else s.placements for s in specs)
        return None if specs is None else specs.placements

    if placements(mine.output_specs) != placements(chosen.output_specs) or \
            placements(mine.input_specs) != placements(chosen.input_specs):
        raise AssertionError(f"{op}: the matched strategy {mine} differs from DTensor's expansion's {chosen}")
