"""pytree's `tree_map`, `tree_leaves` and `tree_flatten` for the arguments of fx nodes, at a
fraction of the cost, with the same results.

Planning walks every node's arguments several times (placement propagation turns them into
DTensor's schema arguments, keys its sharding decisions by them, lines them up with the
placements DTensor wants; the plan-time check keys each call by them). The arguments are
almost always tuples, lists and dicts (fx's immutable ones included) of nodes, numbers, dtypes
and specs, and `torch.utils._pytree` spends most of its time asking of every leaf whether it is
a container. Here the plain containers are walked directly and the values no pytree treats as a
container are leaves; any other value (a `torch.Size`, a named tuple, a registered node type) is
handed to pytree itself, so the result is pytree's in every case:
- `map_arguments(fn, tree)` is `pytree.tree_map(fn, tree)` (container types kept);
- `argument_leaves(tree)` is `pytree.tree_leaves(tree)` (None is a leaf, as pytree has it);
- `flatten_arguments(tree)` is `pytree.tree_flatten(tree)` with, in place of the TreeSpec, a
  hashable structure that is equal for two trees exactly when their TreeSpecs are.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils import _pytree as pytree

_SEQUENCES = (tuple, list, immutable_list)
_MAPPINGS = (dict, immutable_dict)
# values pytree never opens (none is a registered node type nor a named tuple)
_LEAVES = frozenset({int, float, bool, str, type(None), slice, torch.fx.Node, DTensorSpec, torch.dtype,
                     torch.device, torch.layout, torch.memory_format, torch.SymInt, torch.SymFloat, torch.SymBool,
                     torch.Tensor, torch.nn.Parameter})


def map_arguments(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`pytree.tree_map(fn, tree)` (module docstring)."""
    kind = type(tree)
    if kind in _LEAVES:
        return fn(tree)
    if kind in _SEQUENCES:
        return kind(map_arguments(fn, item) for item in tree)
    if kind in _MAPPINGS:
        return kind((key, map_arguments(fn, item)) for key, item in tree.items())
    return pytree.tree_map(fn, tree)


def argument_leaves(tree: Any) -> list[Any]:
    """`pytree.tree_leaves(tree)` (module docstring)."""
    leaves: list[Any] = []
    _collect(tree, leaves, None)
    return leaves


def flatten_arguments(tree: Any) -> tuple[list[Any], Any]:
    """`pytree.tree_flatten(tree)`, its TreeSpec replaced by a hashable structure (module docstring)."""
    leaves: list[Any] = []
    structure: list[Any] = []
    _collect(tree, leaves, structure)
    return leaves, tuple(structure)


def _collect(tree: Any, leaves: list[Any], structure: "list[Any] | None") -> None:
    kind = type(tree)
    if kind in _LEAVES:
        leaves.append(tree)
        if structure is not None:
            structure.append(None)
    elif kind in _SEQUENCES:
        if structure is not None:
            structure.append((kind, len(tree)))
        for item in tree:
            _collect(item, leaves, structure)
    elif kind in _MAPPINGS:
        if structure is not None:
            structure.append((kind, tuple(tree)))
        for item in tree.values():
            _collect(item, leaves, structure)
    else:
        found, spec = pytree.tree_flatten(tree)
        leaves.extend(found)
        if structure is not None:
            structure.append(spec)
