"""Gradient buckets: the parameters whose gradients are reduced together, decided at plan time and
read by the communication ledger and by the runtime's `GradSynchronizer`.

`plan_buckets` groups parameters (in reverse graph order, roughly the order backward produces
their gradients) by the axes they reduce over and by dtype, up to `cap_bytes` per bucket. A
bucket's `axes` are group keys (`Mesh.sync_keys`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bucket:
    axes: tuple[str, ...]
    dtype: torch.dtype
    params: tuple[str, ...]
    numel: int


def plan_buckets(params: list[tuple[str, int, torch.dtype, tuple[str, ...]]], *, cap_bytes: int) -> list[Bucket]:
    """params: (fqn, local numel, dtype, axes) in graph order. Returns buckets in launch order."""
    buckets: list[Bucket] = []
    open_buckets: dict[tuple, list[tuple[str, int]]] = {}

    def close(key: tuple) -> None:
        members = open_buckets.pop(key)
        buckets.append(Bucket(axes=key[0], dtype=key[1], params=tuple(n for n, _ in members),
                              numel=sum(c for _, c in members)))

    for fqn, numel, dtype, axes in reversed(params):
        if not axes:
            continue
        key = (tuple(axes), dtype)
        members = open_buckets.setdefault(key, [])
        members.append((fqn, numel))
        if sum(c for _, c in members) * dtype.itemsize >= cap_bytes:
            close(key)
    for key in list(open_buckets):
        close(key)
    return buckets
