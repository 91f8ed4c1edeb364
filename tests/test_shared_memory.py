"""`transport="shared_memory"`: data parallelism's gradient buckets and ZeRO-1/2's exchanges through
a shared-memory file instead of the process group (`autopar/runtime/shared_memory.py`).

On gloo processes: the same loss, whole gradients and parameters as one device after each of 3
AdamW steps (fp32 rel err <= 1e-5); the collectives counted at the process groups equal the
ledger's process-group entries, so the declared reductions and gathers (in the ledger as shared
memory) did not go through gloo: with them skipped, or summed into the wrong rows, the ranks'
gradients would differ from one device's. Setup issues no collective (the file is agreed through
the store) and leaves no file in /dev/shm. A rank that never reaches a barrier ends the job with an
error naming it; an axis across nodes, ZeRO-3 and an unknown transport are refused at plan time.
The memory ledger equals the bytes measured from outside, the files' rows included: a rank maps
every rank's rows (data parallelism's gradients are views of its own row of the buckets' file)."""
from __future__ import annotations

import functools
import os
import time

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.comm_kinds import SHARED_MEMORY
from autopar.runtime import shared_memory
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.numerics import STEPS, single_device
from tests.numerics_checks import assert_ledger_equals_measured, assert_matches, assert_memory_equals_ledger
from tests.test_zero_numerics import run_and_check

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
CASES = {
    "dp4": ("dp=4", lambda: [autopar.data_parallel(transport=SHARED_MEMORY)]),
    "zero1_dp4": ("dp=4", lambda: [autopar.zero(stage=1, transport=SHARED_MEMORY)]),
    "zero2_dp4": ("dp=4", lambda: [autopar.zero(stage=2, transport=SHARED_MEMORY)]),
    # the dp groups are {0, 2} and {1, 3}: an owner's rank in its group is not its global rank
    "zero2_dp2_tp2": ("dp=2,tp=2", lambda: [autopar.zero(stage=2, transport=SHARED_MEMORY),
                                            autopar.tensor_parallel()]),
    # the gradients are partial over dp and cp: one bucket over the flattened group dp+cp (Mesh.sync_keys)
    "dp2_cp2": ("dp=2,cp=2", lambda: [autopar.data_parallel(transport=SHARED_MEMORY),
                                      autopar.context_parallel()]),
}


def _files() -> set[str]:
    return {name for name in os.listdir(shared_memory.DIRECTORY) if name.startswith("autopar-")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_shared_memory_transport_matches_single_device(case):
    build = functools.partial(GPT, CONFIG)
    batches = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
    mesh, strategies = CASES[case]
    before = _files()
    # numerics, the process groups' collectives against the ledger's (CommLedger.by_key: the entries
    # through them only) and the memory ledger against the bytes measured
    run_and_check(build, batches, mesh, strategies(), single_device(build, batches))
    assert _files() == before, "a shared-memory file was left in /dev/shm"
    plan = autopar.plan(build(), mesh, strategies=strategies(), example_inputs=batches[0])
    shared = {(e.phase, e.kind) for e in plan.comm.entries if e.transport == SHARED_MEMORY}
    expected = {"dp4": {("grad_sync", "all_reduce")}, "dp2_cp2": {("grad_sync", "all_reduce")}}.get(
        case, {("grad_sync", "reduce_scatter"), ("optimizer", "all_gather")})
    # and the loss's small all-reduce over the batch axes (runtime/small_exchanges.py)
    assert shared == expected | {("forward", "all_reduce")}
    assert all(e.wire_bytes == 0 and e.path == "shm" for e in plan.comm.entries if e.transport == SHARED_MEMORY)
    assert not [e for e in plan.comm.entries if e.phase == "grad_sync" and e.transport != SHARED_MEMORY]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["dp4", "zero2_dp4"])
def test_accumulated_micro_batches_are_reduced_once(case):
    """2 micro-batches under no_sync, one step: the gradients accumulate in this rank's rows and
    the synchronising backward reduces them once; equal to one device's accumulated step, and the
    process groups saw what the ledger's accumulation view expects of them."""
    from tests.test_zero_numerics import _accumulated_reference, _accumulating_rank

    build = functools.partial(GPT, CONFIG)
    batch = example_batch(CONFIG, batch=8, seed=7)
    mesh, strategies = CASES[case]
    results = launch(_accumulating_rank, 4, build, batch, mesh, strategies(), True, timeout_s=180)
    assert_matches(_accumulated_reference(build, batch), results)
    for result in results:
        assert result["comm"] == result["expected_comm"]
        # nothing over dp through the process group: the gradients and each micro-batch's forward
        # loss reduction (8 bytes, runtime/small_exchanges.py) go through shared memory
        assert ("all_reduce", "dp") not in result["comm"], result["comm"]


@pytest.mark.timeout(600)
def test_pipeline_stages_each_reduce_through_their_own_rows():
    """pp=2,dp=2: each pipeline stage's dp group of 2 has its own shared-memory file, data parallel
    and ZeRO-1 alike, the micro-batches' gradients accumulated before the one reduction."""
    from tests.test_pipeline_numerics import case, reference, run_cases

    cases = [case("gpt", "pp=2,dp=2", microbatches=2), case("gpt", "pp=2,dp=2", microbatches=2)]
    cases[0]["strategies"][1:] = [autopar.data_parallel(transport=SHARED_MEMORY)]
    cases[1]["strategies"][1:] = [autopar.zero(stage=1, transport=SHARED_MEMORY)]
    per_rank = launch(run_cases, 4, cases, timeout_s=500)
    for index, one in enumerate(cases):
        results = [rank_results[index] for rank_results in per_rank]
        expected = reference(one["model"], one["layers"], one["microbatches"])
        assert_matches(expected, results)
        assert_ledger_equals_measured(results)
        assert_memory_equals_ledger(results, expected, activations=False)
        assert not [key for key in results[0]["ledger"] if key[0] in ("grad_sync", "optimizer") and key[2] == "dp"]


def _one_rank_goes_astray(rank, world, how):
    group = dist.new_group(list(range(world)))
    rows = shared_memory.SharedMemoryGroup(group.group_name, 8, torch.float32, timeout_s=3.0 if how == "sleeps" else 60)
    if rank == 1 and how == "sleeps":
        time.sleep(60)
    if rank == 1 and how == "exits":
        os._exit(0)
    rows.barrier(tag=rank if how == "out_of_step" else 0)
    return rows.rows.sum().item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,message", [
    ("sleeps", r"ranks \[1\] of the group did not arrive within 3 s"),
    ("exits", r"rank 1 of the group \(pid \d+\) has exited"),
    ("out_of_step", r"the ranks are out of step, exchanging \[0, 1\]")])
def test_a_rank_gone_astray_ends_the_job_with_its_name(how, message):
    """A rank that never reaches the barrier (the group's timeout), whose process has exited (at
    once, well before the timeout), or that exchanges something else: an error, not a hang or
    rows read from another exchange."""
    started = time.monotonic()
    with pytest.raises(Exception, match=message):
        launch(_one_rank_goes_astray, 2, how, timeout_s=60, deadline_s=90)
    if how == "exits":  # found by its pid, not at the 60 s timeout
        assert time.monotonic() - started < 30


def _wakes_the_other(rank, world, late_s):
    from autopar.runtime import futex

    group = dist.new_group(list(range(world)))
    rows = shared_memory.SharedMemoryGroup(group.group_name, 8, torch.float32, timeout_s=60)
    word = rows.row().data_ptr() if rank == 1 else rows.rows[1].data_ptr()
    rows.barrier()
    if rank == 1:
        time.sleep(late_s)
        rows.row()[0] = 1.0  # the word's bits change
        futex.wake(word)
        return None
    started = time.monotonic()
    futex.wait(word, 0, 20.0)  # the word still holds 0.0's bits, unless rank 1 was quicker
    return time.monotonic() - started


@pytest.mark.timeout(120)
def test_futex_wakes_a_sleeper_in_another_process():
    """A rank sleeping on a word of the shared file with a 20 s timeout returns once the other
    process changes the word and wakes it (0.5 s later), not at the timeout: the two processes'
    futex keys match (a file mapping shared, not private)."""
    waited, _ = launch(_wakes_the_other, 2, 0.5, timeout_s=60)
    assert waited < 10.0, waited


def _waits_for_a_late_rank(rank, world, late_s):
    group = dist.new_group(list(range(world)))
    rows = shared_memory.SharedMemoryGroup(group.group_name, 8, torch.float32, timeout_s=60)
    rows.barrier()
    if rank == 1:
        time.sleep(late_s)
        rows.row().fill_(1.0)
    cpu, wall = time.process_time(), time.monotonic()
    rows.barrier()
    waited = {"cpu_s": time.process_time() - cpu, "wall_s": time.monotonic() - wall}
    seen = rows.rows[1].sum().item()
    rows.barrier()
    return {**waited, "seen": seen}


@pytest.mark.timeout(120)
def test_a_waiting_rank_sleeps_and_wakes_when_the_last_one_arrives():
    """Rank 0 waits 2 s in a barrier for rank 1: it sleeps (its process CPU time, counted by the
    OS, is a small part of the wait; polling with sched_yield spent all 2 s on the CPU) and then
    sees what rank 1 wrote before arriving."""
    first, _ = launch(_waits_for_a_late_rank, 2, 2.0, timeout_s=60)
    assert first["wall_s"] > 1.5
    assert first["cpu_s"] < 0.1 * first["wall_s"], first
    assert first["seen"] == 8.0


def _all_reduces_rows(rank, world, numel):
    group = dist.new_group(list(range(world)))
    rows = shared_memory.SharedMemoryGroup(group.group_name, numel, torch.float32, timeout_s=60)
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    rows.row().copy_(mine)
    rows.all_reduce()
    return rows.row().clone()


@pytest.mark.timeout(120)
def test_an_all_reduce_of_many_blocks_gives_every_rank_the_rank_order_sum():
    """3 ranks, a row of 2.5 blocks' worth per rank's chunk, not a multiple of 3: every rank ends with
    the same bits, those of the rows summed in rank order (a block summed or copied twice, skipped,
    or cut at the wrong end would differ)."""
    numel = 3 * shared_memory._SUM_BLOCK * 5 // 2 + 7
    results = launch(_all_reduces_rows, 3, numel, timeout_s=60)
    rows = torch.stack([torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(3)])
    expected = shared_memory.ordered_sum(rows)
    for result in results:
        assert torch.equal(result, expected)


def test_a_chain_of_groups_stays_on_the_process_group():
    """dp inside a node, cp across nodes: a gradient partial over both is reduced over dp, then cp
    (two groups on different links, `Mesh.sync_keys`); shared memory joins one host's ranks only,
    so neither goes through it, and the ledger says so."""
    mesh = autopar.Mesh.parse("cp=2,dp=2", ranks_per_node=2)
    plan = autopar.plan(GPT(CONFIG), mesh, strategies=[autopar.data_parallel(transport=SHARED_MEMORY),
                                                       autopar.context_parallel()],
                        example_inputs=example_batch(CONFIG, batch=8))
    syncs = [e for e in plan.comm.entries if e.phase == "grad_sync"]
    assert {e.axis for e in syncs} == {"dp", "cp"}
    assert all(e.transport != SHARED_MEMORY for e in syncs)


def test_shared_memory_is_refused_where_it_cannot_run():
    batch = example_batch(CONFIG, batch=8)
    across = autopar.Mesh.parse("dp=4", ranks_per_node=2)
    with pytest.raises(autopar.PlanError, match="axis 'dp', whose groups cross nodes"):
        autopar.plan(GPT(CONFIG), across, strategies=[autopar.data_parallel(transport=SHARED_MEMORY)],
                     example_inputs=batch)
    with pytest.raises(autopar.PlanError, match="stages 1 and 2"):
        autopar.zero(stage=3, transport=SHARED_MEMORY)
    with pytest.raises(autopar.PlanError, match="reduce and gather left 'auto'"):
        autopar.zero(stage=2, transport=SHARED_MEMORY, reduce="all_to_all")
    with pytest.raises(autopar.PlanError, match="choose one of auto, process_group, shared_memory"):
        autopar.data_parallel(transport="shm")
