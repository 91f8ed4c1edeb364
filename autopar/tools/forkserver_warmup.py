"""What the launcher's fork server loads before it forks any rank (`autopar/runtime/launch.py`).

Importing this module, once per fork server, does the work every rank would otherwise repeat in
its first seconds: the lazy parts of transformers (its import structure and `modeling_utils`,
seconds per rank, where it is installed), and one `autopar.plan` of a
two-layer model, which loads and initialises what tracing, decomposition, sharding propagation
and the fake-tensor check use (~1 s off the first plan of each job's rank 0). Nothing it
creates is handed to a rank except through the fork: no process group, no thread (checked), no
file. One intra-op thread, as every rank has; tqdm's monitor thread off (a bar made while
tracing would start it). What it leaves is frozen out of the cyclic garbage collector.
"""
from __future__ import annotations

import gc
import importlib.util
import threading
import warnings

import torch

import autopar


def _load_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        return
    import transformers  # optional dependency (the test extra)
    import transformers.modeling_utils  # noqa: F401  (optional dependency: its lazy modules, loaded once here)

    transformers.AutoConfig, transformers.AutoModelForCausalLM  # resolve the lazy names


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).pow(2).mean()


def _plan_once() -> None:
    try:
        autopar.plan(_TwoLayers(), "tp=2", strategies=[autopar.tensor_parallel()], example_inputs=(torch.ones(4, 8),))
    except Exception as error:  # a warm-up only saves time: the ranks plan for themselves either way
        warnings.warn(f"autopar's fork-server warm-up plan failed ({type(error).__name__}: {error}); ranks start cold")


def warm_up() -> None:
    torch.set_num_threads(1)
    if importlib.util.find_spec("tqdm") is not None:  # a progress bar made while tracing starts tqdm's
        import tqdm  # optional dependency: its monitor thread is switched off below

        tqdm.tqdm.monitor_interval = 0
    _load_transformers()
    _plan_once()
    if threading.active_count() != 1:  # a fork would copy a process whose other threads vanish
        raise RuntimeError(f"the fork server's warm-up left {threading.active_count() - 1} threads running")
    # what the fork server holds now (torch, sympy, transformers: ~10^6 objects) lives as long as
    # every rank does: out of the cyclic collector, so that a rank's full collections do not walk
    # it (a full collection over them costs a receiving rank a large share of its plan decode,
    # tests/test_plan_once.py)
    gc.collect()
    gc.freeze()


warm_up()
