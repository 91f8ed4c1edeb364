"""Count what a process hands to torch.distributed: every collective and point-to-point op, by phase.

`CommCounter` is a `TorchDispatchMode`. Every op of the namespaces PyTorch registers its
communication in (`OPS_NAMESPACES`: classic `c10d` ops, functional `_c10d_functional` ops and
their autograd and DTensor variants) is looked up in `_KINDS`, which knows every such op of
PyTorch 2.13; an op of those namespaces it does not know raises `UnknownCollective` (a new
PyTorch op is counted after someone says how, never silently dropped; `tests/test_measure.py`
checks the table against every op PyTorch registers). `NOT_COMMUNICATION` lists the ops of those
namespaces that move nothing (waits, autograd wrappers, NaN checks, DTensor's group lookup).

Each call is recorded as a `MeasuredCollective`: the phase it ran in (`with counter.phase(
"forward"): ...`; "unphased" outside any), kind, process-group name, logical bytes S with the
ledger's convention (all-reduce, reduce-scatter, all-to-all, broadcast, reduce: input; all-gather
and gather: output; scatter: the root's input; send/recv: the tensor; barrier: 0), the dtype of
the first tensor it was handed and, for point-to-point ops, the peer's rank in the group. Point-to-point wire bytes equal logical bytes.
Classic ops name their group by a `ProcessGroup` script object (unboxed for its name); functional
ops by the group name string. Ops on fake tensors (shape-only runs, such as the planner's check
that a plan's rank graphs run) move nothing and are not counted. The counter sees what torch.distributed receives, not what the
program says it sends: it never asks the program.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

OPS_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
NOT_COMMUNICATION = {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd",
                     "c10d::check_for_nan", "_dtensor::mesh_get_process_group"}
POINT_TO_POINT = ("send", "recv")


class UnknownCollective(RuntimeError):
    """A communication op the counter does not know how to count."""


@dataclass(frozen=True)
class MeasuredCollective:
    phase: str
    kind: str
    group: str
    logical_bytes: int
    peer: int | None = None  # point-to-point: the other rank, in the group
    dtype: str = ""  # the element type handed over ("float32", "uint8", ...): its first tensor's


def _dtype(value: Any) -> str:
    """The dtype of the first tensor in `value` (a tensor, or nested lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    for item in value if isinstance(value, (list, tuple)) else ():
        found = _dtype(item)
        if found:
            return found
    return ""


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(item) for item in value)
    return 0


def _group_name(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, torch.ScriptObject):
        value = dist.ProcessGroup.unbox(value)
    return str(getattr(value, "group_name", value))


# op name -> (kind, bytes(args, kwargs), group argument index, peer(args) or None)
_Rule = tuple[str, Callable[[tuple, dict], int], int, Callable[[tuple], int] | None]
_FIRST = (lambda a, k: _bytes(a[0]))
_SECOND = (lambda a, k: _bytes(a[1]))
_KINDS: dict[str, _Rule] = {
    # classic c10d (torch.distributed.* calls), arguments as in their schemas
    "c10d::allreduce_": ("all_reduce", _FIRST, 1, None),
    "c10d::allreduce_coalesced_": ("all_reduce", _FIRST, 1, None),
    "c10d::broadcast_": ("broadcast", _FIRST, 1, None),
    "c10d::reduce_": ("reduce", _FIRST, 1, None),
    "c10d::_allgather_base_": ("all_gather", _FIRST, 2, None),
    "c10d::allgather_": ("all_gather", _FIRST, 2, None),
    "c10d::allgather_coalesced_": ("all_gather", _FIRST, 2, None),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", _FIRST, 2, None),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", _SECOND, 2, None),
    "c10d::reduce_scatter_": ("reduce_scatter", _SECOND, 2, None),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", _SECOND, 2, None),
    "c10d::alltoall_base_": ("all_to_all", _SECOND, 2, None),
    "c10d::alltoall_": ("all_to_all", _SECOND, 2, None),
    "c10d::gather_": ("gather", lambda a, k: _bytes(a[1]) * dist.get_world_size(dist.ProcessGroup.unbox(a[2])), 2,
                      None),
    "c10d::scatter_": ("scatter", lambda a, k: _bytes(a[0]) * dist.get_world_size(dist.ProcessGroup.unbox(a[2])), 2,
                       None),
    "c10d::barrier": ("barrier", lambda a, k: 0, 1, None),
    "c10d::monitored_barrier_": ("barrier", lambda a, k: 0, 1, None),
    "c10d::send": ("send", _FIRST, 1, lambda a: a[2]),
    "c10d::recv_": ("recv", _FIRST, 1, lambda a: a[2]),
    "c10d::recv_any_source_": ("recv", _FIRST, 1, lambda a: -1),
    # functional collectives (what autopar's runtime and DTensor issue)
    "_c10d_functional::all_reduce": ("all_reduce", _FIRST, 2, None),
    "_c10d_functional::all_reduce_": ("all_reduce", _FIRST, 2, None),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", _FIRST, 2, None),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", _FIRST, 2, None),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", lambda a, k: _bytes(a[0]) * a[1], 2, None),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", lambda a, k: _bytes(a[0]) * a[1], 2, None),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", lambda a, k: _bytes(a[0]) * a[1], 2, None),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", _FIRST, 3, None),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", _FIRST, 3, None),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", _FIRST, 3, None),
    "_c10d_functional::all_to_all_single": ("all_to_all", _FIRST, 3, None),
    "_c10d_functional::broadcast": ("broadcast", _FIRST, 2, None),
    "_c10d_functional::broadcast_": ("broadcast", _FIRST, 2, None),
    "_c10d_functional::isend": ("send", _FIRST, 3, lambda a: a[1]),
    "_c10d_functional::irecv": ("recv", _FIRST, 3, lambda a: a[1]),
    "_c10d_functional_autograd::all_gather_into_tensor": ("all_gather", lambda a, k: _bytes(a[0]) * a[1], 2, None),
    "_c10d_functional_autograd::reduce_scatter_tensor": ("reduce_scatter", _FIRST, 3, None),
    "_c10d_functional_autograd::all_to_all_single": ("all_to_all", _FIRST, 3, None),
    "_dtensor::shard_dim_alltoall": ("all_to_all", _FIRST, 3, None),
}
BATCH_P2P = "_c10d_functional::batch_p2p_ops"  # one call per (op, peer, tensor) of the batch


class CommCounter(TorchDispatchMode):
    """Records every communication op dispatched while active (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[MeasuredCollective] = []
        self._phase = "unphased"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator["CommCounter"]:
        """Label the calls made inside (the counter itself must be active: `with counter:`)."""
        previous, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = previous

    def relabel(self, name: str) -> None:
        """Label the calls from now on (until the enclosing `phase` ends)."""
        self._phase = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor issues its collectives as ops that come back here
        kwargs = kwargs or {}
        if func.namespace in OPS_NAMESPACES and not any(issubclass(t, FakeTensor) for t in types):
            self._count(func, args, kwargs)  # on fake tensors (a plan-time check run) nothing moves
        return func(*args, **kwargs)

    def _count(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = func._schema.name
        if name in NOT_COMMUNICATION:
            return
        if name == BATCH_P2P:
            ops, peers, _, tensors, group = args
            for op, peer, tensor in zip(ops, peers, tensors, strict=True):
                kind = "send" if "send" in op else "recv"
                self.calls.append(MeasuredCollective(self._phase, kind, _group_name(group), _bytes(tensor), peer,
                                                     _dtype(tensor)))
            return
        if name not in _KINDS:
            raise UnknownCollective(f"{func} is a communication op the counter does not know; add it to "
                                    f"autopar.measure.comm_counter._KINDS with its kind and logical bytes")
        kind, nbytes, group_index, peer = _KINDS[name]
        self.calls.append(MeasuredCollective(self._phase, kind, _group_name(args[group_index]), nbytes(args, kwargs),
                                             peer(args) if peer is not None else None, _dtype(args)))

    # ---- reading
    def phases(self) -> list[str]:
        return sorted({call.phase for call in self.calls})

    def by_key(self, group_to_axis: dict[str, str], *, phase: str | None = None) -> dict[tuple[str, str], tuple[int, int]]:
        """(kind, axis) -> (calls, logical bytes) of one phase (all phases when None). Groups that
        are no mesh axis keep their name."""
        result: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for call in self.calls:
            if phase is None or call.phase == phase:
                row = result[(call.kind, group_to_axis.get(call.group, call.group))]
                row[0] += 1
                row[1] += call.logical_bytes
        return {key: (calls, nbytes) for key, (calls, nbytes) in result.items()}

    def by_dtype(self, group_to_axis: dict[str, str]) -> dict[tuple[str, str, str], int]:
        """(kind, axis, dtype handed over) -> logical bytes, over every phase."""
        result: dict[tuple[str, str, str], int] = defaultdict(int)
        for call in self.calls:
            result[(call.kind, group_to_axis.get(call.group, call.group), call.dtype)] += call.logical_bytes
        return dict(result)

    def by_phase(self, group_to_axis: dict[str, str]) -> dict[str, dict[tuple[str, str], tuple[int, int]]]:
        return {phase: self.by_key(group_to_axis, phase=phase) for phase in self.phases()}

    def total_bytes(self) -> int:
        return sum(call.logical_bytes for call in self.calls)
