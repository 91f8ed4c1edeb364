"""The peak of a step's allocations, from PyTorch's profiler: compiled programs included.

`storages.LiveStorages` is a dispatch mode, and no dispatch mode may watch a compiled graph
(dynamo runs the frame eagerly under one). With `profile_memory=True` the profiler records each
allocation and free the CPU allocator makes on the profiling thread (`[memory]` events: the
address, the signed bytes, in order), whoever asks for it — inductor's kernels, AOT autograd's
backward, the eager pieces between compiled graphs. `peak_rise(profile)` replays them: the most
bytes allocated during the profiled region and alive at once, beyond what was alive when it
began (the parameters and optimizer state made before stay uncounted, as do frees of them).

What it cannot see: allocations and frees on other threads. A collective's tensors are
sometimes dropped last by gloo's worker thread, a moment after `wait()` returns; that free is
not recorded, so the block counts as alive until the allocator hands its address out again on
this thread (then it is taken as freed). Programs whose collectives' buffers outlive the wait
only in gloo's hands (ZeRO's concatenated sends) can read higher than they hold, by up to those
buffers, and differently from run to run; programs whose collectives the graph waits on and keeps
(data, tensor, sequence, context parallelism) read the same every step of a run, and within ~4%
from run to run (dp×tp+SP: 0.838 and 0.879 of the ledger's peak on two machines). On an eager step it reads
`LiveStorages`' peak of the same step: byte for byte on `tests/test_measure.py`'s model, 768 B
apart (of 316 KB) on a dp=2 rank of the example GPT.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def memory_events(profile: Any) -> list[tuple[int, int]]:
    """(address, signed bytes) of every recorded allocation and free, in the order made."""
    handle, path = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        profile.export_chrome_trace(path)  # the only public view of the events' addresses
        with open(path) as trace:
            events = json.load(trace)["traceEvents"]
    finally:
        os.unlink(path)
    memory = sorted((e["args"] for e in events if e.get("name") == "[memory]"), key=lambda a: a["Ev Idx"])
    return [(a["Addr"], a["Bytes"]) for a in memory]


def peak_rise(profile: Any) -> int:
    """The most bytes allocated in the profiled region alive at once (module docstring)."""
    live: dict[int, int] = {}
    total = peak = 0
    for address, nbytes in memory_events(profile):
        total -= live.pop(address, 0)  # a free, or an address handed out again: its last block is gone
        if nbytes > 0:
            live[address] = nbytes
            total += nbytes
        peak = max(peak, total)
    return peak
