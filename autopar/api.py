"""The public entry points: `plan` (single process, no process group) and `parallelize`
(under torchrun or any initialised process group: returns the rank's `ParallelModule`). These are
the only functions that call both the compiler (`autopar/compiler/plan.py`: a given mesh and
strategies) and the planner (`autopar/planner/search.py`: `cluster=`, the planner chooses them).
`parallelize` logs the plan's per-strategy summary (`Plan.strategy_summary`) on rank 0 through the
"autopar" logger at INFO (`log_strategy_summary`; quiet it with that logger's level).
Where `parallelize`'s plan comes from — made on rank 0 and received by the others, read from a
runnable plan file, or made on every rank for dynamic sizes — is `autopar/artifacts/plan_once.py`."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.artifacts.plan_once import (
    agree_on_plan_file,
    fingerprint,
    load_runnable_plan,
    obtain_plan,
    save_runnable_plan,
    state_from_model,
)
from autopar.compiler.plan import Plan
from autopar.compiler.plan import plan as compile_plan
from autopar.compiler.plan import require_module
from autopar.core.errors import PlanError
from autopar.core.mesh import Mesh
from autopar.cost.calibration import SIZES, Calibration, calibration_rank, fit_calibration
from autopar.cost.cluster import Cluster
from autopar.planner.search import search, winner_plan
from autopar.runtime.compiled import compile_options as _compile_options
from autopar.runtime.compiled import refuse_uncompilable
from autopar.runtime.device import group_device
from autopar.runtime.job_hosts import job_node_size
from autopar.runtime.launch import launch
from autopar.runtime.module import ParallelModule
from autopar.runtime.optimizer_guard import retire

LOG = logging.getLogger("autopar")
BUCKET_CAP_MB = 25.0  # parallelize's default gradient bucket size (what plan(cluster=) plans with)


def calibrate(*, world_size: int = 4, sizes: tuple[int, ...] = SIZES, repeats: int = 9,
              timeout_s: float = 300.0) -> Calibration:
    """Measure the local host as a `Cluster`: `world_size` local gloo ranks run
    `calibration_rank` together and their timings are fitted (`autopar/cost/calibration.py`)."""
    if world_size < 2:
        raise ValueError("calibrating a link needs at least 2 ranks")
    results = launch(calibration_rank, world_size, tuple(sizes), repeats, timeout_s=timeout_s)
    return fit_calibration(results, world_size)


def plan(model: torch.nn.Module, mesh: "Mesh | str | dict[str, int] | None" = None, *,
         strategies: Sequence[Any] | None = None, example_inputs: Sequence[Any], example_kwargs: dict | None = None,
         cluster: Any = None, space: Any = None, **options: Any) -> Plan:
    """Plan `model` in this process, no process group needed: for the given mesh and strategies
    (`autopar.compiler.plan.plan`, whose keyword options `options` are), or, with `cluster=` (an
    `autopar.Cluster` or a preset's name) and neither mesh nor strategies, for the mesh and
    strategies the planner chooses (`autopar/planner/search.py`; `space=` narrows its search): the
    winner's plan, its `search` holding the ranking."""
    require_module(model)
    if mesh is None and strategies is None:
        if cluster is None:
            raise PlanError("plan needs a mesh and strategies, or cluster= to let the planner choose them "
                            "(autopar.plan(model, cluster='h100x8', example_inputs=...))")
        chosen = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
        result = search(model, chosen, example_inputs=example_inputs, example_kwargs=example_kwargs, space=space)
        return winner_plan(result, model, example_inputs=example_inputs, example_kwargs=example_kwargs)
    if cluster is not None or space is not None:
        raise PlanError("cluster= chooses the mesh and strategies; give either cluster= alone or a mesh and "
                        "strategies (price a given plan with autopar.estimate(plan, cluster))")
    return compile_plan(model, mesh, strategies=strategies, example_inputs=example_inputs,
                        example_kwargs=example_kwargs, **options)


def parallelize(model: torch.nn.Module, mesh: "Mesh | str | dict[str, int] | None" = None, *,
                strategies: Sequence[Any] | None = None, example_inputs: Sequence[Any] | None = None,
                example_kwargs: dict | None = None, dynamic_dims: dict[str, int] | None = None,
                plan_file: "str | Path | None" = None, ranks_per_node: int | None = None,
                bucket_cap_mb: float = BUCKET_CAP_MB, cluster: Any = None, space: Any = None,
                compile: "bool | dict" = False) -> ParallelModule:
    """Compile `model` for `mesh` and return this rank's module. `example_inputs` is a global batch.

    Rank 0 plans and the other ranks receive its plan (`autopar/artifacts/plan_once.py`); `plan_file=` runs
    a runnable plan file (`autopar.save_runnable_plan`) without planning (mesh, strategies and
    inputs then come from the file; any given are checked against it). `dynamic_dims={"b": 0,
    "s": 1}` lets those dimensions of every input differ from the example's at run time.
    `cluster=` (an `autopar.Cluster` or a preset name) instead of a mesh and strategies: rank 0's
    planner chooses them (`autopar.plan(model, cluster=...)`, `space=` narrows its search) and
    every rank runs the winner; the cluster must describe this job's world. `compile=True` runs each
    rank graph through `torch.compile` (inductor; a dict is passed to `torch.compile` as its
    options), collectives included (`runtime/compiled.py`)."""
    require_module(model)
    if not dist.is_initialized():
        raise RuntimeError("autopar.parallelize needs an initialised process group (run under torchrun, or call "
                           "torch.distributed.init_process_group first); use autopar.plan to plan without one")
    compile_options = _compile_options(compile, dynamic=bool(dynamic_dims))
    if mesh is not None and plan_file is None and cluster is None:
        parsed = _job_mesh(mesh, ranks_per_node)
    else:  # a plan file's mesh says its node size itself; a given mesh is only compared with it
        node = ranks_per_node if ranks_per_node is not None else _torchrun_node_size()
        parsed = Mesh.parse(mesh, ranks_per_node=node) if mesh is not None else None
    options = {"dynamic_dims": dynamic_dims, "bucket_cap_mb": bucket_cap_mb}
    if cluster is not None:
        return _parallelize_on(model, _job_cluster(cluster, parsed, strategies, plan_file, dynamic_dims, bucket_cap_mb),
                               space, example_inputs, example_kwargs, compile_options)
    local = fingerprint(model, world_size=dist.get_world_size(), mesh=parsed, strategies=strategies,
                        example_inputs=example_inputs, example_kwargs=example_kwargs,
                        options=options if plan_file is None else None)
    if plan_file is not None:
        agree_on_plan_file(local)
        the_plan, timing = load_runnable_plan(plan_file, local)
    else:
        if parsed is None or strategies is None or example_inputs is None:
            raise PlanError("parallelize needs a mesh, strategies and example_inputs to plan, or plan_file= to run "
                            "a saved plan")
        parsed.check_world_size(dist.get_world_size())
        the_plan, timing = obtain_plan(
            lambda: compile_plan(model, parsed, strategies=strategies, example_inputs=example_inputs,
                         example_kwargs=example_kwargs, dynamic_dims=dynamic_dims, bucket_cap_mb=bucket_cap_mb),
            local, dynamic=bool(dynamic_dims))
    return _module(the_plan, timing, model, dynamic_dims, compile_options)


def _torchrun_node_size() -> int | None:
    return int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None


def _job_mesh(mesh: "Mesh | str | dict[str, int]", ranks_per_node: int | None) -> Mesh:
    """The mesh with this job's node size: as declared (the mesh's `;node=`, `ranks_per_node=`,
    torchrun's LOCAL_WORLD_SIZE, in that order) and checked against the ranks' hosts, or, where
    none is declared, read off the hosts (`autopar/runtime/job_hosts.py`)."""
    sources = [(Mesh.parse(mesh).ranks_per_node, "the mesh's ;node=", "write ;node={size} in the mesh"),
               (ranks_per_node, "ranks_per_node=", "ranks_per_node={size}"),
               (_torchrun_node_size(), "torchrun's LOCAL_WORLD_SIZE", "ranks_per_node={size}, which overrides it")]
    declared, source, fix = next((found for found in sources if found[0] is not None), (None, "", ""))
    parsed = Mesh.parse(mesh, ranks_per_node=declared)
    parsed.check_world_size(dist.get_world_size())
    return Mesh.parse(parsed, ranks_per_node=job_node_size(declared, source, fix))


def _job_cluster(cluster: Any, mesh: "Mesh | None", strategies: Sequence[Any] | None, plan_file: Any,
                 dynamic_dims: dict | None, bucket_cap_mb: float) -> Any:
    """`cluster=`'s cluster, refused with what to change where it cannot describe this job (the
    planner plans with default options: one it would not honour is refused, not ignored)."""
    if mesh is not None or strategies is not None or plan_file is not None or dynamic_dims or \
            bucket_cap_mb != BUCKET_CAP_MB:
        raise PlanError("cluster= lets the planner choose the mesh and strategies; it takes no mesh, strategies, "
                        "plan_file, dynamic_dims or bucket_cap_mb\n  fix: give either cluster= alone, or a mesh and "
                        "strategies")
    chosen = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
    if chosen.world_size != dist.get_world_size():
        raise PlanError(f"cluster {chosen.label} has {chosen.world_size} ranks but this job has "
                        f"{dist.get_world_size()}\n  fix: describe the job's machines (autopar.Cluster(nodes=, "
                        f"gpus_per_node=, ...)), or launch {chosen.world_size} ranks")
    job_node_size(min(chosen.gpus_per_node, chosen.world_size), f"cluster {chosen.label}",
                  "describe the machines with autopar.Cluster(gpus_per_node={size}, ...)")
    return chosen


def _parallelize_on(model: torch.nn.Module, cluster: Any, space: Any, example_inputs: Sequence[Any] | None,
                    example_kwargs: dict | None, compile_options: dict | None) -> ParallelModule:
    """The planner's choice for `cluster`, made on rank 0 (its search) and run on every rank."""
    if example_inputs is None:
        raise PlanError("parallelize(cluster=...) needs example_inputs (a global batch) to search with")
    local = fingerprint(model, world_size=dist.get_world_size(), example_inputs=example_inputs,
                        example_kwargs=example_kwargs, options={"cluster": repr(cluster), "space": repr(space)})
    the_plan, timing = obtain_plan(lambda: plan(model, cluster=cluster, space=space, example_inputs=example_inputs,
                                                example_kwargs=example_kwargs), local, dynamic=False)
    return _module(the_plan, timing, model, None, compile_options)


def _module(the_plan: Plan, timing: Any, model: torch.nn.Module, dynamic_dims: dict | None,
            compile_options: dict | None) -> ParallelModule:
    """This rank's module for a plan it made or received."""
    the_plan.mesh.check_world_size(dist.get_world_size())
    if dynamic_dims and the_plan.pipeline is not None:
        raise PlanError("dynamic_dims with pipeline parallelism is not supported yet: a stage receives activations "
                        "into buffers of the traced micro-batch's shape (runtime/p2p.py)\n  fix: leave dynamic_dims "
                        "out (every batch then has the example's shape)")
    if compile_options is not None:
        refuse_uncompilable(the_plan)
    device = group_device()  # the rank's accelerator (LOCAL_RANK) under NCCL, the CPU under gloo
    device_mesh = the_plan.mesh.device_mesh(device_type=device.type)
    groups = {axis: device_mesh.get_group(axis).group_name for axis in the_plan.mesh.names}
    state = the_plan.traced.state if timing.source in ("planned", "local") else state_from_model(the_plan, model)
    state = {name: tensor.to(device) for name, tensor in state.items()}  # no copy where already there (gloo: CPU)
    module = ParallelModule(the_plan, rank=dist.get_rank(), groups=groups, state=state, compile_options=compile_options)
    module.plan_timing = timing
    log_strategy_summary(the_plan, rank=dist.get_rank())
    retire(model)  # an optimizer over the model's own parameters would train nothing: refused at its step
    # the module holds its shards now; the plan must not keep the full weights alive (ZeRO's point)
    the_plan.traced.state = {}
    return module


def log_strategy_summary(plan: Plan, *, rank: int) -> None:
    """The plan's per-strategy summary at INFO on the "autopar" logger, from rank 0 only (every rank
    holds the same plan): what each strategy sharded and what it left replicated, and why."""
    if rank == 0 and LOG.isEnabledFor(logging.INFO):  # not even built where nobody listens
        LOG.info("autopar plan on mesh %s:\n%s", plan.mesh, plan.strategy_summary())


__all__ = ["Plan", "ParallelModule", "calibrate", "parallelize", "plan", "save_runnable_plan"]
