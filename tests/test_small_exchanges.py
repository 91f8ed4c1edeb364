"""The rank graph's small all-reduces through shared memory (`autopar/runtime/small_exchanges.py`).

Every numerics test that counts gloo's collectives against the ledger checks that the plan and
the run agree on which all-reduces take this path. Here, the exchange itself: many all-reduces
back to back (so the two slots alternate and a rank a barrier ahead writes the slot the others have
read), of mixed sizes, dtypes and reductions, equal on every rank to the same reduction of every
rank's tensor gathered through gloo; ranks exchanging the same bytes of other dtypes refused; and
which all-reduces the plan sends there."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.comm_kinds import SHARED_MEMORY, shared_memory_unsupported
from autopar.runtime import small_exchanges
from autopar.runtime.collectives import issue_all_reduce, wait
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16, d_ff=32)
pytestmark = pytest.mark.skipif(shared_memory_unsupported() is not None, reason="no shared-memory transport here")


def _exchanges(rank: int, world: int) -> list[str]:
    group = dist.new_group(list(range(world))).group_name
    exchanges = small_exchanges.open_small_exchanges({group: 256})
    small_exchanges.activate(exchanges)
    generator = torch.Generator().manual_seed(rank)
    wrong = []
    for step in range(60):
        dtype = (torch.float32, torch.float64, torch.int64, torch.bfloat16)[step % 4]
        reduce_op = ("sum", "max", "min")[step % 3]
        numel = 1 + step % (256 // torch.empty((), dtype=dtype).element_size())
        mine = (torch.randn(numel, generator=generator) * 100).to(dtype)
        assert small_exchanges.takes(mine, group, reduce_op)
        got = wait(issue_all_reduce(mine, group, reduce_op))
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)  # gloo: the reference, from outside the exchange
        stacked = torch.stack(every)
        expected = {"sum": lambda: sum(every[1:], every[0].clone()), "max": lambda: stacked.amax(0),
                    "min": lambda: stacked.amin(0)}[reduce_op]()
        if not torch.equal(got, expected):
            wrong.append(f"step {step} {reduce_op} {dtype}: {got} != {expected}")
    over = torch.zeros(65, dtype=torch.float32)  # 260 bytes: over the capacity, the process group's
    assert not small_exchanges.takes(over, group, "sum")
    small_exchanges.activate({})
    return wrong


@pytest.mark.timeout(120)
def test_small_all_reduces_through_shared_memory_equal_the_gathered_reduction():
    assert launch(_exchanges, 4, timeout_s=90) == [[], [], [], []]


def _out_of_step(rank: int, world: int) -> str:
    """Rank 0 sums 2 fp32 values, rank 1 one int64: the same 8 bytes, not the same exchange."""
    group = dist.new_group(list(range(world))).group_name
    small_exchanges.activate(small_exchanges.open_small_exchanges({group: 256}))
    mine = torch.ones(2) if rank == 0 else torch.ones(1, dtype=torch.int64)
    try:
        wait(issue_all_reduce(mine, group, "sum"))
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return f"{type(error).__name__}: {error}"
    finally:
        small_exchanges.activate({})
    return "no error"


@pytest.mark.timeout(120)
def test_ranks_exchanging_other_dtypes_of_the_same_size_fail_instead_of_mixing_bits():
    for outcome in launch(_out_of_step, 2, timeout_s=60):
        assert outcome.startswith("SharedMemoryPeerError") and "out of step" in outcome, outcome


def _released(rank: int, world: int) -> tuple[bool, bool]:
    """A module's exchange after the module (and its step's tensors) are gone and another module
    has opened one on the same group (a compiled backward's fallback, `OPENED`, held it until then)."""
    import gc
    import weakref

    batch = example_batch(CONFIG, batch=4)

    def module():
        return autopar.parallelize(GPT(CONFIG), "dp=2", strategies=[autopar.data_parallel()], example_inputs=batch)

    first = module()
    first(*first.local_batch(*batch)).backward()
    exchange = weakref.ref(next(iter(small_exchanges.ACTIVE.values())))
    del first
    gc.collect()
    inactive = small_exchanges.ACTIVE == {}
    second = module()  # noqa: F841 - it opens its own exchange on the group
    gc.collect()
    return inactive, exchange() is None


@pytest.mark.timeout(120)
def test_a_deleted_module_s_exchanges_are_released():
    assert launch(_released, 2, timeout_s=90) == [(True, True), (True, True)]


def test_the_plan_sends_small_all_reduces_on_a_shared_memory_axis_there():
    batch = example_batch(CONFIG, batch=4)

    def forward_entries(mesh, strategies, **options):
        plan = autopar.plan(GPT(CONFIG), mesh, strategies=strategies, example_inputs=batch, backend="gloo", **options)
        return {(e.kind, e.axis, e.transport) for e in plan.comm.entries if e.phase in ("forward", "backward")}

    # the loss's sum and count over dp: 8 bytes
    assert forward_entries("dp=2", [autopar.data_parallel()]) == {("all_reduce", "dp", SHARED_MEMORY)}
    # tp's axis keeps the process group (tensor_parallel declares no transport); dp's small one moves
    entries = forward_entries("dp=2,tp=2", [autopar.data_parallel(), autopar.tensor_parallel()])
    assert ("all_reduce", "dp", SHARED_MEMORY) in entries
    assert all(transport == "process_group" for _, axis, transport in entries if axis == "tp")
    # a size the plan does not know (dynamic_dims) stays on the process group
    assert forward_entries("dp=2", [autopar.data_parallel()], dynamic_dims={"b": 0}) == {
        ("all_reduce", "dp", "process_group")}
    # dp on the process group: its small all-reduces too
    assert forward_entries("dp=2", [autopar.data_parallel(transport="process_group")]) == {
        ("all_reduce", "dp", "process_group")}


def _student_and_teacher(rank: int, world: int) -> dict:
    """A student's backward after a teacher's forward (distillation): the student's backward
    all-reduces run under the student's exchanges, which its forward saw, not the teacher's."""
    from autopar.measure.comm_counter import CommCounter
    from examples.moe import MoEConfig, MoEGPT

    config = MoEConfig(vocab_size=128, seq_len=16, n_layer=1, n_head=4, d_model=32, n_experts=4, top_k=2, d_expert=32)
    batch = example_batch(config, batch=4)
    torch.manual_seed(0)
    student = autopar.parallelize(MoEGPT(config), "dp=2", strategies=[autopar.data_parallel()], example_inputs=batch)
    torch.manual_seed(0)
    teacher = autopar.parallelize(MoEGPT(config), "dp=2", strategies=[autopar.data_parallel(transport="process_group")],
                                  example_inputs=batch)
    local = student.local_batch(*batch)
    loss = student(*local)
    with torch.no_grad():
        teacher(*local)
    with CommCounter() as counter:
        loss.backward()
    measured = {kind: calls for (kind, _), (calls, _) in counter.by_key({}).items() if kind == "all_reduce"}
    planned = sum(calls for (phase, kind, _), (calls, _) in student.plan.comm.by_key().items()
                  if phase == "backward" and kind == "all_reduce")
    shared = sum(e.times for e in student.plan.comm.entries
                 if e.phase == "backward" and e.kind == "all_reduce" and e.transport == SHARED_MEMORY)
    return {"measured": measured.get("all_reduce", 0), "planned": planned, "shared": shared}


@pytest.mark.timeout(120)
def test_a_backward_after_another_module_s_forward_keeps_its_own_path():
    for result in launch(_student_and_teacher, 2, timeout_s=90):
        assert result["shared"] > 0, result  # the MoE statistics' gradient reductions
        assert result["measured"] == result["planned"], result  # gloo saw only the student's own
