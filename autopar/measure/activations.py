"""Measure what autograd saves on a real run, to check the activation ledger (`activations.py`).

`measure_saved_activations(exclude=tensors)` is a context manager that installs a
`saved_tensors_hooks` pack hook and records every storage autograd saves, identified by
`untyped_storage().data_ptr()` (unique among live storages, and everything saved in one
forward pass stays alive until backward), except the storages of the tensors in `exclude`
(parameters, buffers). Wrap one forward pass; `.bytes` is the sum of the unique storages'
sizes and `.storages` maps data pointer -> bytes. A runtime with its own saved-tensor hooks
reports through `observe_saved`.
"""
from __future__ import annotations

from typing import Iterable

import torch

_active: list["measure_saved_activations"] = []


def observe_saved(tensor: torch.Tensor) -> None:
    """For a runtime that installs its own pack hook inside forward (ZeRO-3's ShardedState): only
    the innermost hook sees a save, so it reports the tensors it saves as they are."""
    for measurement in _active:
        measurement._pack(tensor)


class measure_saved_activations:
    def __init__(self, *, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._excluded and pointer not in self.storages:
            self.storages[pointer] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "measure_saved_activations":
        self._hooks.__enter__()
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.remove(self)
        self._hooks.__exit__(*exc)
