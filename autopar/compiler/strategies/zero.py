"""ZeRO-1/2/3, FSDP and HSDP as data: a data-parallel axis that also shards the training state.

`zero(stage=k, axis=...)` is `data_parallel` on `axis` (inputs sharded on their batch dimension)
plus a `ShardedState` declaration that the `shard_parameters` pass turns into units of
parameters and the runtime (`autopar.core.ops.sharded_state`) executes:

| stage | sharded over the axis                        | per step on the axis                        |
|-------|----------------------------------------------|---------------------------------------------|
| 1     | optimizer state                              | reduce-scatter grads, all-gather params     |
| 2     | optimizer state, gradients                   | the same, each unit's gradient freed early  |
| 3     | optimizer state, gradients, parameters       | all-gather fwd (+ bwd), reduce-scatter grads|

`fsdp()` is stage 3; `hsdp()` shards over one axis and replicates (data parallel) over another.
Units default to the model's repeated blocks (a module path ending in a number, e.g. `layers.3`)
plus one root unit for the remaining parameters; `units=` takes module-path globs instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Shard

from autopar.compiler.strategies import InputRule, Strategy
from autopar.compiler.strategies.data_parallel import data_parallel
from autopar.compiler.strategies.mixed_precision import check_precision_dtype
from autopar.core.errors import PlanError

REDUCTIONS = ("auto", "reduce_scatter", "all_to_all")
REFRESHES = ("auto", "all_gather", "broadcast")
STAGES = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}


@dataclass(frozen=True)
class ShardedState:
    """What `zero()` declares beyond data parallelism; read by autopar/compiler/passes/shard_parameters.py."""

    stage: int
    reshard_after_forward: bool = True  # stage 3: free gathered blocks after forward, re-gather in backward
    prefetch: bool = True  # stage 3: launch the next unit's all-gather while this one computes (forward)
    backward_prefetch: bool = False  # stage 3: in backward, gather the previous block while this one runs
    reshard_root: bool = False  # stage 3: free the root unit after forward too (3 Psi exactly; FSDP2 keeps it)
    units: tuple[str, ...] | None = None  # module-path globs, one unit each; None: repeated blocks + root
    param_dtype: torch.dtype | None = None  # mixed precision: compute and all-gather in this dtype
    reduce_dtype: torch.dtype | None = None  # gradients reduce-scattered in this dtype (default param_dtype)
    reduce: str = "auto"  # how gradients reach their owners: "reduce_scatter", "all_to_all" or "auto"
    gather: str = "auto"  # how shards are gathered: "all_gather", "broadcast" or "auto"


def zero(*, stage: int, axis: str = "dp", batch_dim: int = 0, reshard_after_forward: bool = True,
         prefetch: bool = True, backward_prefetch: bool = False, reshard_root: bool = False,
         units: tuple[str, ...] | list[str] | None = None,
         param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
         reduce: str = "auto", gather: str = "auto") -> Strategy:
    """ZeRO stage 1, 2 or 3 on `axis` (which is then also the data-parallel axis).

    Mixed precision: `param_dtype=torch.bfloat16` traces and runs the model with bf16 parameters
    (all-gathered in bf16), while the shards the optimizer updates, their gradients and the
    optimizer state stay in the model's dtype (fp32 master weights); `reduce_dtype` is the dtype
    gradients are reduce-scattered in (default: param_dtype; float32 for exact sums).

    `reduce`: how each unit's gradients reach their owners. "reduce_scatter"; "all_to_all" sends
    every owner its piece of the unit's gradients and the owner sums the n pieces it receives (the
    same wire bytes; a receive buffer of the whole unit instead of 1/n while in flight); "auto"
    (default) chooses the all-to-all where the process group's backend reduce-scatters slowly
    (gloo: `autopar.core.comm_kinds.EXCHANGE_FOR_REDUCE_SCATTER`, 2.1x faster for a 13 MiB unit on 4
    CPU ranks) and the reduce-scatter otherwise, or when planning without a process group.

    `gather`: how parameters are gathered from their shards: at stages 1/2 the updated shards
    after the optimizer step, in one collective for all the units of a pipeline stage; at stage 3
    each unit before its use in forward (and again in backward). "all_gather"; "broadcast": each
    owner copies its shards into its row of the gathered buffer and broadcasts the row (n calls,
    no separate send buffer); "auto" (default) broadcasts where the backend's all-gather is slower
    (gloo: `autopar.core.comm_kinds.BROADCASTS_FOR_ALL_GATHER`, 1.4-1.8x faster on 2-4 CPU ranks) and
    all-gathers otherwise.

    `backward_prefetch` is off by default: it holds two gathered blocks at the start of backward,
    where activations peak, and bought no time on CPU gloo (benchmarks/compare_fsdp.py: peak
    memory 1.02x FSDP2's with it, 0.94x without, the same step time)."""
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None:
            check_precision_dtype(f"zero(stage={stage})", name, dtype)
    if reduce not in REDUCTIONS:
        raise PlanError(f"zero(reduce={reduce!r}): choose one of {', '.join(REDUCTIONS)}")
    if gather not in REFRESHES:
        raise PlanError(f"zero(gather={gather!r}): choose one of {', '.join(REFRESHES)}")
    if stage not in STAGES:
        raise PlanError(f"unknown ZeRO stage {stage!r}: choose 1 (shards {STAGES[1]}), 2 ({STAGES[2]}) or "
                        f"3 ({STAGES[3]}); plain data parallelism is data_parallel()")
    state = ShardedState(stage=stage, reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                         backward_prefetch=backward_prefetch, reshard_root=reshard_root,
                         units=tuple(units) if units is not None else None, param_dtype=param_dtype,
                         reduce_dtype=reduce_dtype or param_dtype, reduce=reduce, gather=gather)
    return Strategy(name=f"zero{stage}", axis=axis, inputs=(InputRule(index=None, placement=Shard(batch_dim)),),
                    sharded_state=state)


def fsdp(*, axis: str = "dp", **options) -> Strategy:
    """Fully sharded data parallelism: ZeRO stage 3."""
    return zero(stage=3, axis=axis, **options)


def hsdp(*, shard_axis: str = "dp_shard", replicate_axis: str = "dp_rep", **options) -> tuple[Strategy, Strategy]:
    """Hybrid sharding: FSDP inside `shard_axis`, plain data parallelism across `replicate_axis`."""
    if shard_axis == replicate_axis:
        raise PlanError(f"hsdp() needs two different axes, got shard_axis = replicate_axis = {shard_axis!r}")
    return fsdp(axis=shard_axis, **options), data_parallel(axis=replicate_axis)
