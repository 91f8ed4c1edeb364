"""`transport="auto"`, the default of `data_parallel()` and `zero()`: shared memory where the job's
process group is gloo, the axis stays inside one node and the machine runs the transport
(`autopar.comm_kinds.transport_kind`, `ResolvedStrategy.shared_memory_axes`); the process group
otherwise — NCCL, an axis across nodes, ZeRO-3 or a declared `reduce`/`gather`, and planning
without a process group (the CLI, gate baselines), where it is not refused but resolved.

The default's numerics are those of every data-parallel and ZeRO-1/2 numerics test, which now run
through it; here one dp=4 job of the default `data_parallel()` against one device, with gloo's
collectives counted from outside equal to the job plan's process-group entries, of which no
gradient reduction is one: the gradients were summed, and not through gloo."""
from __future__ import annotations

import functools

import pytest

import autopar
from autopar.comm_kinds import PROCESS_GROUP, SHARED_MEMORY, shared_memory_unsupported, transport_kind
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.cli_in_process import run_cli
from tests.numerics import STEPS, single_device
from tests.test_zero_numerics import run_and_check

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
HERE = SHARED_MEMORY if shared_memory_unsupported() is None else PROCESS_GROUP  # what auto picks on gloo here


def _transports(mesh, strategies, **options) -> set[tuple[str, str, str]]:
    plan = autopar.plan(GPT(CONFIG), mesh, strategies=strategies, example_inputs=example_batch(CONFIG, batch=8),
                        **options)
    return {(e.phase, e.kind, e.transport) for e in plan.comm.entries if e.phase in ("grad_sync", "optimizer")}


def test_auto_resolves_by_backend_and_machine():
    assert transport_kind("auto", backend="gloo") == HERE
    assert transport_kind("auto", backend="nccl") == PROCESS_GROUP
    # init_process_group()'s default on a GPU machine: its parameters may be on the GPU
    assert transport_kind("auto", backend="cpu:gloo,cuda:nccl") == PROCESS_GROUP
    assert transport_kind(PROCESS_GROUP, backend="gloo") == PROCESS_GROUP
    assert transport_kind(SHARED_MEMORY, backend="nccl") == SHARED_MEMORY
    assert autopar.data_parallel().transport == autopar.zero(stage=2).transport == "auto"
    # what shared memory cannot carry stays on the process group instead of being refused
    assert autopar.zero(stage=3).transport == PROCESS_GROUP
    assert autopar.zero(stage=2, reduce="all_to_all").transport == PROCESS_GROUP
    assert autopar.zero(stage=1, gather="all_gather").transport == PROCESS_GROUP
    # planning without a process group: the process group
    assert _transports("dp=2", [autopar.data_parallel()]) == {("grad_sync", "all_reduce", PROCESS_GROUP)}


def test_a_plan_made_for_a_backend_resolves_auto_as_a_job_on_it():
    """`plan(backend=)` and the CLI's `--backend`: the plan (and ledger) a job on that backend would
    make, without a process group; expert parallelism's buckets take "auto" as data parallelism's."""
    assert _transports("dp=2", [autopar.data_parallel()], backend="gloo") == {("grad_sync", "all_reduce", HERE)}
    assert _transports("dp=2", [autopar.data_parallel()], backend="nccl") == {
        ("grad_sync", "all_reduce", PROCESS_GROUP)}
    assert _transports("dp=4", [autopar.zero(stage=2)], backend="gloo") == {
        ("grad_sync", "reduce_scatter", HERE), ("optimizer", "all_gather", HERE)}
    assert _transports(autopar.Mesh.parse("dp=2,tp=2", ranks_per_node=2),  # dp across nodes
                       [autopar.data_parallel(), autopar.tensor_parallel()], backend="gloo") == {
        ("grad_sync", "all_reduce", PROCESS_GROUP)}
    # ZeRO's "auto" exchanges too: owners' broadcasts and an all-to-all on gloo, NCCL's collectives without one
    zero3 = {backend: {e.kind for e in autopar.plan(GPT(CONFIG), "dp=4", strategies=[autopar.zero(stage=3)],
                                                  example_inputs=example_batch(CONFIG, batch=8),
                                                  backend=backend).comm.entries} for backend in ("gloo", None)}
    assert {"all_to_all", "broadcast"} <= zero3["gloo"] and not {"reduce_scatter", "all_gather"} & zero3["gloo"]
    assert {"reduce_scatter", "all_gather"} <= zero3[None] and not {"all_to_all", "broadcast"} & zero3[None]
    assert autopar.expert_parallel().transport == "auto"
    with pytest.raises(autopar.PlanError, match="expert_parallel"):
        autopar.expert_parallel(transport="tcp")
    shown = run_cli("plan", "examples.gpt:example", "--mesh", "dp=2", "--strategy", "dp", "--backend", "gloo")
    assert shown.returncode == 0, shown.stderr
    bucket = next(line for line in shown.stdout.splitlines() if line.startswith("grad_sync"))
    assert bucket.split()[5] == ("shm" if HERE == SHARED_MEMORY else "intra"), bucket


def _job_transports(rank: int, world: int) -> dict[str, set]:
    """Plans made inside a gloo job (what `parallelize`'s rank 0 plans)."""
    across = autopar.Mesh.parse("dp=2,tp=2", ranks_per_node=2)  # tp inside a node, dp across nodes
    return {"dp": _transports("dp=4", [autopar.data_parallel()]),
            "zero2": _transports("dp=4", [autopar.zero(stage=2)]),
            "zero3": _transports("dp=4", [autopar.zero(stage=3)]),
            "dp_across_nodes": _transports(across, [autopar.data_parallel(), autopar.tensor_parallel()])}


@pytest.mark.timeout(120)
def test_a_gloo_job_plans_shared_memory_inside_a_node_only():
    found = launch(_job_transports, 2, timeout_s=90)[0]
    assert found["dp"] == {("grad_sync", "all_reduce", HERE)}
    assert found["zero2"] == {("grad_sync", "reduce_scatter", HERE), ("optimizer", "all_gather", HERE)}
    assert {transport for _, _, transport in found["zero3"]} == {PROCESS_GROUP}
    assert {transport for _, _, transport in found["dp_across_nodes"]} == {PROCESS_GROUP}


@pytest.mark.timeout(300)
def test_the_default_data_parallel_matches_single_device_without_gloo_gradients():
    build = functools.partial(GPT, CONFIG)
    batches = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
    results = run_and_check(build, batches, "dp=4", [autopar.data_parallel()], single_device(build, batches))
    on_gloo = {key for result in results for key in result["ledger"] if key[0] == "grad_sync"}
    assert on_gloo == (set() if HERE == SHARED_MEMORY else {("grad_sync", "all_reduce", "dp")})
