"""The public entry points: `plan` (single process, no process group) and `parallelize`
(under torchrun or any initialised process group: returns the rank's `ParallelModule`)."""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.mesh import Mesh
from autopar.plan import Plan, plan
from autopar.runtime.module import ParallelModule


def parallelize(model: torch.nn.Module, mesh: "Mesh | str | dict[str, int]", *, strategies: Sequence[Any],
                example_inputs: Sequence[Any], example_kwargs: dict | None = None,
                ranks_per_node: int | None = None, bucket_cap_mb: float = 25.0) -> ParallelModule:
    """Compile `model` for `mesh` and return this rank's module. `example_inputs` is a global batch."""
    if not dist.is_initialized():
        raise RuntimeError("autopar.parallelize needs an initialised process group (run under torchrun, or call "
                           "torch.distributed.init_process_group first); use autopar.plan to plan without one")
    if ranks_per_node is None and "LOCAL_WORLD_SIZE" in os.environ:  # torchrun knows the node size
        ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = Mesh.parse(mesh, ranks_per_node=ranks_per_node)
    mesh.check_world_size(dist.get_world_size())
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device_mesh = mesh.device_mesh(device_type=device_type)
    groups = {axis: device_mesh.get_group(axis).group_name for axis in mesh.names}
    the_plan = plan(model, mesh, strategies=strategies, example_inputs=example_inputs, example_kwargs=example_kwargs,
                    bucket_cap_mb=bucket_cap_mb)
    module = ParallelModule(the_plan, rank=dist.get_rank(), groups=groups, state=the_plan.traced.state)
    # the module holds its shards now; the plan must not keep the full weights alive (ZeRO's point)
    the_plan.traced.state = {}
    return module


__all__ = ["Plan", "ParallelModule", "parallelize", "plan"]
