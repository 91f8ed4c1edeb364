"""The ATen and c10d calls a block of code makes, by name, in order (a dispatch mode): what the
scheduling tests read to see which matmuls ran while a collective was in flight."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class CallNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
