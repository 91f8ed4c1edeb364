"""Which attention mask a graph computes from positions alone: "causal", "none" or unknown.

Hugging Face models build their causal mask in the graph from `arange`s (and, since
transformers 5, from the positions' document boundaries). `passes/causal_masks.py` turns a mask
read as causal or none into the flag (or no mask); context parallelism passes any other whole
to its kernels (`attention_rules.context_attention_rule`). Both read it here: the mask's
ancestors evaluated on constants at plan time, the result compared.

A mask of the example's size is evaluated as it is. A larger one (a 128K-token sequence makes a
mask of 2^34 entries per sequence) is evaluated at `_SMALL` positions instead: every integer in
its ancestors equal to the sequence length (or within 2 of it, or its negative) is replaced by
`_SMALL` (plus the same offset), every leading size (batch, heads) by 1. That is sound only where the mask's
shape is all the size enters: a constant that is neither a size nor below `_SMALL // 2` (a
sliding window of 4,096, say, which at `_SMALL` positions would look causal) makes the mask
unknown, and so kept as a tensor. A window below `_SMALL // 2` shows in
the smaller mask and is recognised for what it is.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from autopar.core.ir import hint

_EVALUATED_ENTRIES = 1 << 24  # masks up to this many entries are evaluated at their own size
_SMALL = 64  # the sequence length a larger mask is evaluated at
_INDEX_LIMITS = (2**63 - 1, -(2**63))  # slice ends meaning "to the end"


def static_mask_kind(mask: torch.fx.Node) -> str | None:
    """"causal" or "none" when `mask` is computed from constants alone and equals the causal
    lower triangle, or allows everything; None when it reads an input or parameter, fails to
    evaluate, or is anything else. Evaluated once per node, on CPU (module docstring)."""
    if "autopar_mask_kind" in mask.meta:
        return mask.meta["autopar_mask_kind"]
    kind = _evaluate_mask_kind(mask)
    if kind is not None:  # an unknown mask is refused where it matters, once: nothing to keep
        mask.meta["autopar_mask_kind"] = kind
    return kind


def _evaluate_mask_kind(mask: torch.fx.Node) -> str | None:
    ancestors, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node not in ancestors:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    if any(node.op != "call_function" for node in ancestors):
        return None
    shape = tuple(hint(size) for size in mask.meta["val"].shape)
    sizes: dict[int, int] = {}
    if len(shape) >= 2 and math.prod(shape) > _EVALUATED_ENTRIES:
        sizes = _smaller_sizes(shape, ancestors)
        if not sizes:
            return None
    values: dict[torch.fx.Node, Any] = {}

    def concrete(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return values[value]
        if isinstance(value, torch.device):
            return torch.device("cpu")
        value = hint(value)
        return sizes.get(value, value) if type(value) is int else value

    try:
        for node in (n for n in mask.graph.nodes if n in ancestors):
            args, kwargs = pytree.tree_map(concrete, (node.args, dict(node.kwargs)))
            values[node] = node.target(*args, **kwargs)
    except Exception:  # an op that does not run on constants here: not a mask we can read
        return None
    value = values[mask]
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    if sizes and tuple(value.shape[-2:]) != (_SMALL, _SMALL):
        return None
    if value.dtype == torch.bool:
        allowed = value
    else:
        allowed = value > torch.finfo(value.dtype).min / 2
        if bool((value[allowed] != 0).any()):
            return None  # an additive bias, not a mask
    rows, cols = value.shape[-2:]
    if bool(allowed.all()):
        return "none"
    causal = torch.ones(rows, cols, dtype=torch.bool).tril()
    return "causal" if bool((allowed == causal).all()) else None


def _smaller_sizes(shape: tuple, ancestors: set[torch.fx.Node]) -> dict[int, int]:
    """Each integer to replace and its replacement, or {} where the mask's integers are not only
    its sizes and small offsets (module docstring)."""
    rows, cols = shape[-2:]
    if rows != cols or rows <= 2 * _SMALL:
        return {}
    sizes = {sign * (rows + offset): sign * (_SMALL + offset) for offset in range(-2, 3) for sign in (1, -1)}
    for size in shape[:-2]:
        if size > 1 and size not in sizes:
            sizes[size] = 1
    for node in ancestors:
        for value in pytree.tree_leaves((node.args, dict(node.kwargs))):
            value = hint(value)
            if type(value) is int and value not in sizes and abs(value) >= _SMALL // 2 \
                    and value not in _INDEX_LIMITS:
                return {}
    return sizes
