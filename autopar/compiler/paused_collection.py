"""Planning with Python's cyclic garbage collector paused.

A plan of a deep model makes and keeps hundreds of thousands of objects (the traced graph's nodes
and their metadata, fake tensors, sympy sizes) on top of the modules torch and transformers
imported, and every full collection of the cyclic collector walks all of them again, to find
almost nothing: most of planning's objects live as long as the plan, and the rest are freed by
reference counting as soon as they are dropped (on a Llama-3-8B plan, dp=8 x tp=8, the collector
took about an eighth of planning's CPU time: `benchmarks/planning_time.py`). `paused_collection()`
turns the collector off while planning and back on after, as it was; the garbage cycles made
meanwhile (fx nodes erased by a pass, tracing's frames) wait for the next collection after
planning, which frees them. The cost is that wait and that first collection, which walks what
planning made once per generation and is paid by whatever runs next, and a slightly higher peak
resident memory while planning. A collector the caller turned off stays off.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused_collection() -> Iterator[None]:
    """The cyclic garbage collector off within, on again after if it was on (module docstring)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
