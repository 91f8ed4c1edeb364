"""Bytes a training process holds, split by category through PyTorch's public interfaces only.

`held_bytes(storages, module=, optimizer=, exclude=)` takes the live storages a `LiveStorages`
mode has seen (after a cyclic garbage collection — objects kept only by reference cycles are
garbage, not state — and once finished collectives' worker threads let go of their tensors,
`LiveStorages.settle`) and files each under the first category that claims it:

- parameters: storages of `module.parameters()`;
- gradients: storages of their `.grad` (a gradient that is a view of a flat buffer claims the
  whole buffer, which is what it keeps alive);
- optimizer state: storages of the tensors in `optimizer.state`;
- model buffers: storages of `module.buffers()`;
- other: every other live storage — what the program keeps where these interfaces cannot see it
  (replicated compute copies, gradient buffers of a sharded optimizer, caches, leaks).

Storages behind `exclude` (the caller's batch, loss) are left out, and `total` is the sum. The
program is never asked what it holds; tensors reached through the interfaces above that the mode
has not seen yet are recorded first, so nothing they own is missed.
"""
from __future__ import annotations

import gc
from typing import Any, Iterable

import torch

from autopar.measure.storages import LiveStorages, storage_key

CATEGORIES = ("parameters", "gradients", "optimizer state", "model buffers", "other")


def _claims(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    params = list(module.parameters())
    state = [t for per_param in optimizer.state.values() for t in per_param.values() if isinstance(t, torch.Tensor)]
    return {"parameters": params, "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer state": state, "model buffers": list(module.buffers())}


def held_bytes(storages: LiveStorages, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
               exclude: Iterable[Any] = ()) -> dict[str, int]:
    """Live bytes by category (see module docstring), plus "total"."""
    gc.collect()
    storages.settle()
    claims = _claims(module, optimizer)
    storages.track(*claims.values())
    excluded = {storage_key(t) for t in torch.utils._pytree.tree_leaves(list(exclude)) if isinstance(t, torch.Tensor)}
    live = {key: nbytes for key, nbytes in storages.live().items() if key not in excluded}
    result = dict.fromkeys(CATEGORIES, 0)
    for category, tensors in claims.items():
        for key in {storage_key(t) for t in tensors}:
            if key in live:
                result[category] += live.pop(key)
    result["other"] = sum(live.values())
    result["total"] = sum(result[c] for c in CATEGORIES)
    return result
