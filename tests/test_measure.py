"""The measuring tools themselves (`autopar.measure`), on plain PyTorch: they must see what they
claim to see, independently of autopar.

- The collective counter knows every communication op PyTorch 2.13 registers, counts classic,
  functional and point-to-point calls made through torch.distributed on 2 gloo processes (kind,
  group, logical bytes, peer, phase; creating a DeviceMesh moves nothing), and raises on an op
  it does not know.
- The live-storage tracker follows allocations, views, frees and `UntypedStorage.resize_`.
- The saved-activation window sees what autograd keeps even when a module's own saved-tensor
  hooks hide it from outer hooks (the measurement the suite used before could not).
- `held_bytes` files storages under parameters, gradients, optimizer state, buffers and other.
- The profiled peak (`profiled_memory.peak_rise`, the allocator's events) of a step equals the
  live-storage tracker's peak of the same step, eager; on a compiled step (which the tracker cannot
  watch) it sees inductor's own buffers.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.measure import comm_counter, profiled_collectives
from autopar.measure.activations import measure_saved_activations
from autopar.measure.comm_counter import CommCounter, MeasuredCollective, UnknownCollective
from autopar.measure.memory import held_bytes
from autopar.measure.profiled_memory import peak_rise
from autopar.measure.storages import LiveStorages
from autopar.runtime.launch import launch


def test_counter_knows_every_communication_op_of_this_pytorch():
    import torch.distributed._functional_collectives  # noqa: F401  (registers the functional ops)

    names = {name for name in torch._C._dispatch_get_all_op_names()
             if name.split("::")[0] in comm_counter.OPS_NAMESPACES}
    known = set(comm_counter._KINDS) | comm_counter.NOT_COMMUNICATION | {comm_counter.BATCH_P2P}
    assert len(names) >= 40 and names <= known, sorted(names - known)


def _every_kind(rank: int, world: int) -> dict:
    """Every way to communicate through torch.distributed, each in its own phase."""
    from torch.distributed.device_mesh import init_device_mesh

    fc, group, peer = torch.ops._c10d_functional, dist.group.WORLD.group_name, 1 - rank
    t = torch.ones(4)
    counter = CommCounter()
    with counter:
        with counter.phase("setup"):
            init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
            dist.broadcast(t, 0)
        with counter.phase("classic"):
            dist.all_reduce(t)
            dist.barrier()
            dist.all_gather_into_tensor(torch.empty(8), t)
            dist.reduce_scatter_tensor(torch.empty(2), t)
            dist.all_to_all_single(torch.empty(4), t)
        with counter.phase("p2p"):
            received = torch.empty(4)
            for work in [dist.isend(t, peer), dist.irecv(received, peer)]:
                work.wait()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t[:2].clone(), peer),
                                                dist.P2POp(dist.irecv, received[:2], peer)]):
                work.wait()
        with counter.phase("functional"):
            fc.wait_tensor(fc.all_reduce(t, "sum", group))
            fc.wait_tensor(fc.all_reduce_(t, "sum", group))
            fc.wait_tensor(fc.all_gather_into_tensor(t, 2, group))
            fc.wait_tensor(fc.reduce_scatter_tensor(t, "sum", 2, group))
            fc.wait_tensor(fc.all_to_all_single(t, [2, 2], [2, 2], group))
        unknown = None
        known = comm_counter._KINDS.pop("c10d::allreduce_")
        try:
            dist.all_reduce(t)  # both ranks raise before the op runs: nothing waits for a peer
        except UnknownCollective as error:
            unknown = str(error)
        finally:
            comm_counter._KINDS["c10d::allreduce_"] = known
    return {"calls": counter.calls, "group": group, "unknown": unknown}


def test_counter_counts_classic_functional_and_point_to_point_calls():
    for rank, result in enumerate(launch(_every_kind, 2, timeout_s=60)):
        group, peer = result["group"], 1 - rank
        expected = [("setup", "broadcast", 16, None),
                    ("classic", "all_reduce", 16, None), ("classic", "barrier", 0, None),
                    ("classic", "all_gather", 32, None), ("classic", "reduce_scatter", 16, None),
                    ("classic", "all_to_all", 16, None),
                    ("p2p", "send", 16, peer), ("p2p", "recv", 16, peer), ("p2p", "send", 8, peer),
                    ("p2p", "recv", 8, peer),
                    ("functional", "all_reduce", 16, None), ("functional", "all_reduce", 16, None),
                    ("functional", "all_gather", 32, None), ("functional", "reduce_scatter", 16, None),
                    ("functional", "all_to_all", 16, None)]
        calls = [(c.phase, c.kind, c.logical_bytes, c.peer) for c in result["calls"]]
        assert calls == expected, calls
        assert {c.group for c in result["calls"] if c.kind != "barrier"} == {group}
        assert "c10d.allreduce_" in result["unknown"] and "_KINDS" in result["unknown"]
        assert isinstance(result["calls"][0], MeasuredCollective)


def test_live_storages_follow_allocations_views_frees_and_resizes():
    storages = LiveStorages()
    with storages:
        a = torch.zeros(256)  # 1 KiB
        mark = storages.mark()
        view = a[:10]
        b = a * 2
    assert storages.live_bytes() == 2048 and storages.live_since(mark) == {b.untyped_storage()._cdata: 1024}
    del b
    assert storages.live_bytes() == 1024 and view.untyped_storage().nbytes() == 1024
    storages.reset_peak()
    with storages:
        c = torch.ones(512)
        del c
        a.untyped_storage().resize_(0)  # FSDP2's way of freeing: not a dispatched op
    assert storages.peak_bytes == 1024 + 2048 and storages.live_bytes() == 0


def test_live_storages_name_what_is_live_at_the_peak():
    """The diagnostic for a peak that a prediction misses: each storage live at the peak with the
    op that made it (a view or an in-place op makes none), its shape and its bytes."""
    weight = torch.randn(32, 16, requires_grad=True)
    storages = LiveStorages(producers=True)
    storages.track(weight)
    with storages:
        x = torch.ones(8, 32)
        y = (x @ weight).relu_()  # mm allocates [8, 16]; relu_ writes in place
        y.sum().backward()  # backward's [32, 16] weight gradient, alive with x and y
        del x
        torch.zeros(4)  # after the peak: not at it
    made = {(op, shape): nbytes for op, shape, _, nbytes in storages.at_peak()}
    assert made == {("(tracked)", (32, 16)): 2048, ("aten.ones", (8, 32)): 1024, ("aten.mm", (8, 16)): 512,
                    ("aten.mm", (32, 16)): 2048, ("aten.sum", ()): 4, ("aten.ones_like", ()): 4,
                    ("aten.threshold_backward", (8, 16)): 512}, made  # expand and t are views
    assert sum(made.values()) == storages.peak_bytes
    with pytest.raises(ValueError, match="producers=True"):
        LiveStorages().at_peak()


class _HidingModule(torch.nn.Module):
    """Keeps what autograd saves through its own saved-tensor hooks (as a runtime that swaps saved
    tensors for handles does); an outer hook sees none of those saves."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return (x @ self.weight).tanh().sum()


def test_saved_activations_are_seen_through_a_module_s_own_hooks():
    model, x = _HidingModule(), torch.randn(32, 64)
    seen_by_an_outer_hook = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen_by_an_outer_hook.append(t) or t, lambda t: t):
        model(x).backward()
    assert seen_by_an_outer_hook == []
    with measure_saved_activations() as saved:
        loss = saved.call(model, x)
    # mm saves its input x (the copy made inside the window) and weight (a parameter, older);
    # tanh saves its output: 32x64 floats each
    assert saved.bytes == 2 * 32 * 64 * 4
    loss.backward()


def test_held_bytes_by_public_interface():
    storages = LiveStorages()
    with storages:
        model = torch.nn.Linear(16, 8)
        model.register_buffer("scale", torch.ones(8))
        optimizer = torch.optim.AdamW(model.parameters())
        aside = torch.zeros(100)  # what a runtime keeps where no interface shows it
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
    held = held_bytes(storages, module=model, optimizer=optimizer)
    params = (16 * 8 + 8) * 4
    assert held == {"parameters": params, "gradients": params, "optimizer state": 2 * params + 2 * 4,
                    "model buffers": 32, "other": 400, "total": 4 * params + 8 + 32 + 400}
    assert aside.numel() == 100


@pytest.mark.parametrize("op", ["c10d::allreduce_", "_c10d_functional::all_gather_into_tensor", "c10d::send"])
def test_counter_rules_name_kind_and_group_argument(op):
    kind, _, group_index, _ = comm_counter._KINDS[op]
    schema = {"c10d::allreduce_": torch.ops.c10d.allreduce_.default,
              "_c10d_functional::all_gather_into_tensor": torch.ops._c10d_functional.all_gather_into_tensor.default,
              "c10d::send": torch.ops.c10d.send.default}[op]._schema
    assert schema.arguments[group_index].name in ("process_group", "group_name") and kind


def _profiled_rise(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return peak_rise(prof)


def test_the_profiled_peak_of_a_step_equals_the_live_storages_peak():
    def made_and_freed():
        a = torch.empty(1000)
        b = torch.empty(2000)
        del a
        c = torch.empty(500)
        return b, c

    assert _profiled_rise(made_and_freed) == 4 * 3000  # a and b at once; c after a is gone

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)

    def step():
        model(x).square().sum().backward()

    step()  # the gradients exist from now on: a step allocates only its own
    storages = LiveStorages()
    with storages:
        storages.watch(storages.mark())
        step()
    assert storages.watched_peak > 32 * 256 * 4
    assert _profiled_rise(step) == storages.watched_peak
    compiled = torch.compile(step)
    compiled()
    compiled_rise = _profiled_rise(compiled)
    assert 0 < compiled_rise <= storages.watched_peak  # inductor's buffers seen, its fusions hold no more


def test_the_measuring_tools_import_nothing_of_autopar_but_themselves():
    """So that "measured" never means "asked the runtime": no import of the runtime, passes, plan or ledgers."""
    import ast
    from pathlib import Path

    import autopar.measure

    for path in Path(autopar.measure.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith("autopar") or name.startswith("autopar.measure"), (path.name, name)


def _profiled_and_counted(rank: int, world: int) -> tuple[dict, dict]:
    """The same collectives once under the profiler, once under CommCounter (not both at once: under
    a dispatch mode the profiler records each op twice, as the mode dispatches it again)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    fc, group = torch.ops._c10d_functional, dist.group.WORLD.group_name
    x, wide = torch.randn(4, 6), torch.randn(3, 2, dtype=torch.float64)

    def communicate() -> None:
        fc.wait_tensor(fc.all_reduce(x, "sum", group))
        fc.wait_tensor(fc.all_reduce(wide, "sum", group))
        fc.wait_tensor(fc.all_gather_into_tensor(x, world, group))
        fc.wait_tensor(fc.reduce_scatter_tensor(x, "sum", world, group))
        fc.wait_tensor(fc.all_to_all_single(x, [2, 2], [2, 2], group))
        fc.wait_tensor(fc.broadcast(x, 0, group))
        dist.broadcast(wide, src=0)  # classic ops: a pipeline's loss broadcast, its sends and receives
        if rank == 0:
            dist.isend(wide, dst=1, tag=7).wait()
        else:
            dist.irecv(torch.empty_like(wide), src=0, tag=7).wait()

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        communicate()
    with CommCounter() as counter:
        communicate()
    counted: dict = defaultdict(lambda: (0, 0))
    for call in counter.calls:
        calls, nbytes = counted[call.kind]
        counted[call.kind] = (calls + 1, nbytes + call.logical_bytes)
    return profiled_collectives.collectives(prof), dict(counted)


@pytest.mark.timeout(120)
def test_the_profiled_count_of_collectives_equals_the_dispatch_count():
    """The profiler-based counter (for compiled graphs, which no dispatch mode sees) totals each kind
    as CommCounter does, dtypes and the all-gather's group size included, functional and classic
    broadcasts alike, and each rank's side of a point-to-point transfer."""
    for rank, (profiled, counted) in enumerate(launch(_profiled_and_counted, 2)):
        assert profiled == counted
        assert set(profiled) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                 "send" if rank == 0 else "recv"}
