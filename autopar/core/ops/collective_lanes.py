"""Lanes: a second set of process groups for collectives issued beside the main thread's.

A pipeline rank that runs a forward beside another micro-batch's backward (DualPipeV's
overlapped pairs, `autopar/runtime/pipeline.py`) issues collectives from two threads at once.
The collectives of one process group must reach it in the same order on every rank of the
group, and two threads interleave in no fixed order; so the side thread issues its collectives
on its lane: a copy of each group over the same ranks, made at setup (`runtime/lanes.py`).
Within one thread the order is the schedule's, and it is the same on every rank of a group:
ranks that share a tensor, expert, context or data group share their pipeline coordinate, so
they run the same list with the same pairs.

Every call site that hands a group name to torch.distributed resolves it through `on_lane`:
inside `lane(names)` the lane's copy, anywhere else the name itself. Point-to-point steps between
pipeline stages keep their group: their messages are matched by tag, not by order.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_lanes = threading.local()  # .names: this thread's group name -> its lane's copy (None: no lane)


def on_lane(name: str) -> str:
    """The group name this thread's collectives use for `name`."""
    names = getattr(_lanes, "names", None)
    return names.get(name, name) if names else name


@contextlib.contextmanager
def lane(names: dict[str, str]) -> Iterator[None]:
    """This thread issues its collectives on the copies `names` (group name -> copy's name)."""
    previous = getattr(_lanes, "names", None)
    _lanes.names = names
    try:
        yield
    finally:
        _lanes.names = previous
