"""The gloo process groups of the jobs autopar starts run one collective at a time
(`autopar/runtime/serial_gloo.py`): PyTorch's two worker threads per gloo group ran two collectives
of one group at once and corrupted the heap (docs/known-limits.md; `scripts/stress_heap.py
--variants pp2_tp2_sp_chunks --model gpt --torch-gloo` reproduces it). Checked on real ranks: the default
group, a DeviceMesh's groups and `new_group`'s each have one worker thread, autopar takes them for
gloo, and several collectives of one group in flight still land with the right values in issue
order."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.core.comm_kinds import runtime_backend
from autopar.runtime.device import group_device
from autopar.runtime.launch import launch
from examples.gpt import example

_c10d = torch.ops._c10d_functional


def _threads(group: dist.ProcessGroup) -> int:
    return group._get_backend(torch.device("cpu")).options._threads


def groups_rank(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    pair = pairs[rank // 2]
    threads = [_threads(dist.group.WORLD), _threads(mesh.get_group("dp")), _threads(mesh.get_group("tp")),
               _threads(pair)]
    tp = mesh.get_group("tp").group_name
    pending = [_c10d.all_reduce(torch.full((3,), float(rank + k)), "sum", tp) for k in range(6)]
    gathered = _c10d.all_gather_into_tensor(torch.full((2,), float(rank)), 2, tp)
    sums = [_c10d.wait_tensor(p)[0].item() for p in reversed(pending)]  # waited out of issue order
    return {"threads": threads, "backend": runtime_backend(), "device": str(group_device()), "sums": sums,
            "gathered": _c10d.wait_tensor(gathered).tolist()}


def test_every_group_of_a_launched_job_has_one_worker_thread():
    results = launch(groups_rank, 4, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["threads"] == [1, 1, 1, 1]
        assert result["backend"] == "gloo" and result["device"] == "cpu"
        partner = rank ^ 1  # tp pairs: (0, 1), (2, 3)
        assert result["sums"] == [float(rank + partner + 2 * k) for k in reversed(range(6))]
        assert result["gathered"] == [float(min(rank, partner))] * 2 + [float(max(rank, partner))] * 2


def test_pytorchs_own_gloo_is_still_available_to_the_launcher():
    """`launch(backend="gloo")` starts PyTorch's gloo (two worker threads a group): what the stress
    script uses to show the corruption."""
    results = launch(default_group_threads, 2, timeout_s=60, backend="gloo")
    assert results == [2, 2]


def default_group_threads(rank: int, world: int) -> int:
    return _threads(dist.group.WORLD)


def test_a_planned_job_uses_serial_gloo_for_its_groups():
    """`parallelize` under a launched job: its mesh's groups are the serial ones."""
    assert launch(parallel_threads, 2, timeout_s=120) == [[1], [1]]


def parallel_threads(rank: int, world: int) -> list[int]:
    model, batch = example()
    module = autopar.parallelize(model, "dp=2", strategies=[autopar.data_parallel()], example_inputs=batch)
    return [_threads(dist.distributed_c10d._resolve_process_group(name)) for name in module.groups.values()]
