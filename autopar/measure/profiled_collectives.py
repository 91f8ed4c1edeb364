"""Count the collectives a compiled program issues, from PyTorch's profiler.

A dispatch mode cannot watch a compiled graph: dynamo runs a frame eagerly while a (non-infra)
dispatch mode is active, so `CommCounter` sees the eager program only. `torch.profiler` records
every op the dispatcher runs, with input shapes, dtypes and scalar arguments — inductor's
generated code calls the functional collectives through the dispatcher, and so do AOT autograd's
backward and the eager pieces between compiled graphs. `collectives(profile)` totals them per
kind with `CommCounter`'s logical-bytes convention (all-reduce, reduce-scatter, all-to-all: the
input; all-gather: the output, the input times the group size).

The functional ops are counted (`_c10d_functional::*`) where they are the only record with
shapes: each calls a classic `c10d::` op inside it, which the profiler records too, without the
shapes of its tensor lists. Broadcasts and point-to-point transfers are also issued as classic
ops (a pipeline's loss broadcast and its sends and receives, ring attention's), so those three
kinds are counted from the process group's own event, one per transfer whichever API issued it
(`gloo:broadcast`, `gloo:send`, `gloo:recv`, with the tensor's shape and dtype; gloo is the only
backend checked here). The profiler keeps no string arguments, so the process group of a call is
unknown: the totals are per kind, not per axis.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

# functional op -> (kind, index of a group-size argument multiplying the input's bytes, or None);
# kind None: counted at the process group's event (BACKEND)
FUNCTIONAL: dict[str, tuple[str, int | None]] = {
    "_c10d_functional::all_reduce": ("all_reduce", None),
    "_c10d_functional::all_reduce_": ("all_reduce", None),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 1),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", 1),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", None),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", None),
    "_c10d_functional::all_to_all_single": ("all_to_all", None),
    "_c10d_functional::broadcast": (None, None),
    "_c10d_functional::broadcast_": (None, None),
}
NOT_COMMUNICATION = ("_c10d_functional::wait_tensor",)
BACKEND = {"gloo:broadcast": "broadcast", "gloo:send": "send", "gloo:recv": "recv"}

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in
           (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)}
_PROFILER_NAMES = {"float": torch.float32, "double": torch.float64, "c10::Half": torch.float16,
                   "c10::BFloat16": torch.bfloat16, "long int": torch.int64, "int": torch.int32, "bool": torch.bool}


class UnknownProfiledCollective(RuntimeError):
    """A functional collective this counter has no rule for."""


def _itemsize(name: str) -> int:
    dtype = _PROFILER_NAMES.get(name) or _DTYPES.get(name)
    if dtype is None:
        raise UnknownProfiledCollective(f"profiler dtype {name!r} not known to autopar.measure.profiled_collectives")
    return dtype.itemsize


def collectives(profile: Any) -> dict[str, tuple[int, int]]:
    """kind -> (calls, logical bytes) over the events of a finished `torch.profiler.profile`
    (recorded with `record_shapes=True`)."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in profile.events():
        if event.name in BACKEND:
            totals[BACKEND[event.name]][0] += 1
            totals[BACKEND[event.name]][1] += math.prod(event.input_shapes[0]) * _itemsize(event.input_dtypes[0])
            continue
        if not event.name.startswith("_c10d_functional::") or event.name in NOT_COMMUNICATION:
            continue
        if event.name not in FUNCTIONAL:
            raise UnknownProfiledCollective(f"{event.name}: add it to autopar.measure.profiled_collectives.FUNCTIONAL")
        kind, times = FUNCTIONAL[event.name]
        if kind is None:
            continue
        nbytes = math.prod(event.input_shapes[0]) * _itemsize(event.input_dtypes[0])
        if times is not None:
            nbytes *= int(event.concrete_inputs[times])
        totals[kind][0] += 1
        totals[kind][1] += nbytes
    return {kind: (calls, nbytes) for kind, (calls, nbytes) in totals.items()}
