"""Measure what a run hands to the process groups: a dispatch mode that records every c10d call.

`CommCounter` is independent of the planner: it sees the functional collectives
(`_c10d_functional.*`) and classic c10d ops (`c10d.allreduce_`, ...) as they are dispatched,
in forward and backward, and records kind, process-group name and the logical size S with the
same convention as the ledger (all-reduce input, all-gather output, reduce-scatter input,
all-to-all input). Compare `CommCounter.by_key(group_to_axis)` with `CommLedger.by_key()`.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_functional = torch.ops._c10d_functional
_KINDS = {
    _functional.all_reduce.default: "all_reduce",
    _functional.all_reduce_.default: "all_reduce",
    _functional.all_gather_into_tensor.default: "all_gather",
    _functional.reduce_scatter_tensor.default: "reduce_scatter",
    _functional.all_to_all_single.default: "all_to_all",
}


@dataclass(frozen=True)
class MeasuredCollective:
    kind: str
    group: str
    logical_bytes: int


class CommCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[MeasuredCollective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _KINDS.get(func)
        if kind is not None:
            tensor = args[0]
            nbytes = tensor.numel() * tensor.element_size()
            if kind == "all_gather":
                nbytes *= args[1]
            group = args[-1] if kind != "all_to_all" else args[3]
            self.calls.append(MeasuredCollective(kind, str(group), nbytes))
        elif func.namespace == "c10d" and func.__name__.split(".")[0] in ("allreduce_", "allgather_", "reduce_scatter_",
                                                                           "alltoall_", "broadcast_"):
            raise RuntimeError(f"unexpected classic c10d collective {func}: autopar issues functional collectives only")
        return func(*args, **kwargs)

    def by_key(self, group_to_axis: dict[str, str]) -> dict[tuple[str, str], tuple[int, int]]:
        """(kind, axis) -> (calls, logical bytes)."""
        result: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for call in self.calls:
            row = result[(call.kind, group_to_axis.get(call.group, call.group))]
            row[0] += 1
            row[1] += call.logical_bytes
        return {k: (v[0], v[1]) for k, v in result.items()}
