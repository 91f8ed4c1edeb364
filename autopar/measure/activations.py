"""Measure what a forward pass leaves alive for backward, without saved-tensor hooks.

A program may install its own `saved_tensors_hooks` (autopar's runtime does: for sequence
shards to re-gather and for ZeRO-3 handles); an outer hook then sees nothing of what the inner
one packs. So this measurement does not ask autograd what it saves: it watches storages.

    with measure_saved_activations() as saved:
        loss = saved.call(model, *inputs)
    saved.bytes      # storages allocated in the window and alive at its end, outputs excluded

`call` copies the tensor inputs inside the window (so that only what the forward keeps can hold
them: an embedding's token ids, a loss's targets), runs `fn`, and excludes the storages of what
`fn` returns (the loss). When the window closes (after a cyclic garbage collection), every
storage a `LiveStorages` mode saw allocated inside it and still alive is what the forward left behind: the tensors autograd saved
for backward, plus whatever else the program keeps from forward to backward (e.g. ZeRO-3 units
it keeps gathered; a test names such differences). `.storages` maps storage key -> bytes.
"""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from autopar.measure.storages import LiveStorages, storage_key


class measure_saved_activations:
    def __init__(self) -> None:
        self._tracker = LiveStorages()
        self._mark = 0
        self._outputs: set[int] = set()
        self.storages: dict[int, int] = {}

    def call(self, fn: Callable[..., Any], *inputs: Any) -> Any:
        """fn(*copies of inputs); the storages of its outputs do not count."""
        outputs = fn(*tree_map_only(torch.Tensor, lambda t: t.clone(), list(inputs)))
        self._outputs |= {storage_key(t) for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)}
        return outputs

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "measure_saved_activations":
        self._tracker.__enter__()
        self._mark = self._tracker.mark()
        return self

    def __exit__(self, *exc: object) -> None:
        self._tracker.__exit__(*exc)
        gc.collect()  # a storage that only a reference cycle keeps is garbage, not kept for backward
        self._tracker.settle()  # nor is a collective's input its worker thread has not let go of yet
        alive = self._tracker.live_since(self._mark)
        self.storages = {key: nbytes for key, nbytes in alive.items() if key not in self._outputs}
