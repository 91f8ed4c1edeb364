"""Data parallelism as data: every user input sharded on its batch dimension along one axis.

Parameters stay replicated; the planner finds their gradients partial over the axis and the
runtime all-reduces them in buckets after backward, through the job's process group
(`autopar.runtime.grad_sync`). `replicated(axis)` is the same without the split: an axis on which
every rank computes the same step, declared on purpose.
"""
from __future__ import annotations

from torch.distributed.tensor import Shard

from autopar.compiler.strategies import InputRule, Strategy


def data_parallel(*, axis: str = "dp", batch_dim: int = 0) -> Strategy:
    return Strategy(name="data_parallel", axis=axis, inputs=(InputRule(index=None, placement=Shard(batch_dim)),))


def replicated(axis: str) -> Strategy:
    """Declare mesh axis `axis` replicated on purpose: every rank along it gets the whole batch and
    computes the same thing (a plan refuses an axis of size > 1 that no strategy claims otherwise,
    `autopar.compiler.strategies.check_axes`)."""
    return Strategy(name="replicated", axis=axis)
