"""The peak bytes of each training step, measured from outside the program.

`step_peaks(module, optimizer, batch, storages, steps=4)` runs `steps` training steps (zero_grad,
the module's `train_step` on its local slice of `batch`, the optimizer's step) under a
`LiveStorages` the caller entered before making the module, and returns each step's most live
bytes with the global batch and its local slices taken out: nothing asked of the runtime. A
caller reads the lowest after the first: the first step has no optimizer state yet, and gloo's
worker threads let a finished collective's tensors go a moment late, at random, which only ever
raises a step's reading.
"""
from __future__ import annotations

import gc
from typing import Any

from autopar.measure.storages import LiveStorages, distinct_storage_bytes


def step_peaks(module: Any, optimizer: Any, batch: tuple, storages: LiveStorages, steps: int = 4) -> list[int]:
    """Each step's peak live bytes, the batches taken out (module docstring)."""
    local = module.local_batch(*batch)
    peaks = []
    for _ in range(steps):
        gc.collect()
        storages.reset_peak()
        optimizer.zero_grad(set_to_none=True)
        module.train_step(*local)
        optimizer.step()
        peaks.append(storages.peak_bytes - distinct_storage_bytes(list(batch) + list(local)))
    return peaks
