"""ZeRO-1/2/3, FSDP and HSDP on gloo processes equal the single-device model (loss, whole
gradients and parameters after each of 3 AdamW steps, fp32 rel err <= 1e-5); the communication
ledger equals the collectives each step hands to the process groups (every phase, setup too); the
memory ledger equals the bytes measured from outside: held after a step (parameters, gradients,
optimizer state, and what the runtime keeps aside), left by the forward, and at the peak
(`tests/numerics_checks.py` names every difference). Tests of Hugging Face models ask for the
`transformers` fixture."""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import autopar
from autopar.measure.memory import held_bytes
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from examples.hf_models import tiny_gpt2, tiny_llama, token_batch
from tests.numerics import (STEPS, Instruments, Probed, comparison_mesh, device_mesh_bytes,
                            distributed_rank, parallel_trainer, rank_summary, reference_trainer, settle_garbage,
                            single_device, train_step, whole_tensors)
from tests.numerics_checks import (assert_activations_equal_ledger, assert_held_equals_ledger,
                                   assert_ledger_equals_measured, assert_matches, assert_memory_equals_ledger,
                                   max_relative_error)

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
# vocabulary 126 and d_ff 66 do not divide by 4 ranks: embedding, lm_head and MLP rows are padded
UNEVEN = GPTConfig(vocab_size=126, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=66)
CASES = {
    "zero1_dp4": ("dp=4", [autopar.zero(stage=1)]),
    "zero2_dp4": ("dp=4", [autopar.zero(stage=2)]),
    "zero3_dp4": ("dp=4", [autopar.zero(stage=3)]),
    "hsdp_2x2": ("dp_rep=2,dp_shard=2", [autopar.hsdp()]),
    "zero3_tp_2x2": ("dp=2,tp=2", [autopar.fsdp(), autopar.tensor_parallel()]),
    # async TP under FSDP: each piece's linear reads the unit's gathered weight before its release
    "zero3_tp_sp_chunks_2x2": ("dp=2,tp=2", [autopar.fsdp(), autopar.sequence_parallel(),
                                             autopar.schedule(chunks=2)]),
}


def run_and_check(build, batches, mesh, strategies, reference, **kwargs) -> list[dict]:
    world = autopar.Mesh.parse(mesh).world_size
    results = launch(distributed_rank, world, build, batches, mesh, strategies, timeout_s=180)
    assert_matches(reference, results, **kwargs)
    assert_ledger_equals_measured(results)
    assert_memory_equals_ledger(results, reference)
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_example_gpt_sharded_state_matches_single_device(case):
    build = functools.partial(GPT, CONFIG)
    batches = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
    mesh, strategies = CASES[case]
    run_and_check(build, batches, mesh, strategies, single_device(build, batches))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,reduce,issued", [(2, "reduce_scatter", "reduce_scatter"), (1, "all_to_all", "all_to_all"),
                                                 (3, "auto", "all_to_all")])
def test_gradients_reach_their_owners_as_declared(stage, reduce, issued):
    """zero(reduce=...): a reduce-scatter, or an all-to-all of the rank-major pieces that each owner
    sums (what "auto" picks on gloo): the same loss, gradients and parameters as one device, the
    counted collectives equal the ledger's, and the ledger's gradient reduction is of that kind."""
    build = functools.partial(GPT, CONFIG)
    batches = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
    results = run_and_check(build, batches, "dp=4", [autopar.zero(stage=stage, reduce=reduce)],
                            single_device(build, batches))
    assert {kind for (phase, kind, axis) in results[0]["ledger"] if phase == "grad_sync"} == {issued}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,gather,mesh,issued", [(2, "all_gather", "dp=4", "all_gather"),
                                                      (1, "broadcast", "dp=2,tp=2", "broadcast"),
                                                      (2, "auto", "dp=2,tp=2", "broadcast"),
                                                      (3, "all_gather", "dp=2,tp=2", "all_gather"),
                                                      (3, "broadcast", "dp=4", "broadcast")])
def test_parameters_are_gathered_as_declared(stage, gather, mesh, issued):
    """zero(gather=...): an all-gather, or one broadcast per owner into its row of the gathered
    buffer (what "auto" picks on gloo; on dp=2,tp=2 the owners' ranks in their dp group differ from
    their global ranks) — stages 1/2 every unit's updated shards after the step in one collective,
    stage 3 each unit before use and again for backward: the same loss, gradients and parameters as
    one device, the counted collectives equal the ledger's, and the ledger's gathers are that kind."""
    build = functools.partial(GPT, CONFIG)
    batches = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
    strategies = [autopar.zero(stage=stage, gather=gather)] + (
        [autopar.tensor_parallel()] if "tp" in mesh else [])
    results = run_and_check(build, batches, mesh, strategies, single_device(build, batches))
    gathers = {phase: (kind, calls) for (phase, kind, axis), (calls, _) in results[0]["ledger"].items()
               if axis == "dp" and kind in ("all_gather", "broadcast")}
    if stage < 3:  # one collective, or one broadcast per owner, for all the units
        assert gathers == {"optimizer": (issued, 2 if issued == "broadcast" and "tp" in mesh else 1)}
    else:  # each of the 3 units (2 blocks, the root) before use; the blocks again for backward
        owners = 4 if issued == "broadcast" else 1
        assert gathers == {"forward": (issued, 3 * owners), "backward": (issued, 2 * owners)}


def test_reduce_auto_resolves_by_backend_and_refuses_unknown_kinds():
    """Without a process group, "auto" plans the reduce-scatter and the all-gather (a plan for a
    cluster); on gloo the exchange and the owners' broadcasts; a kind that is not a way to reduce
    gradients or to gather parameters is refused at declaration."""
    from autopar.core.comm_kinds import gradient_exchange_kind

    assert gradient_exchange_kind("auto") == "reduce_scatter"  # pytest's process has no process group
    assert gradient_exchange_kind("auto", backend="gloo") == "all_to_all"
    assert gradient_exchange_kind("auto", backend="nccl") == "reduce_scatter"
    assert gradient_exchange_kind("reduce_scatter", backend="gloo") == "reduce_scatter"
    plan = autopar.plan(GPT(CONFIG), "dp=4", strategies=[autopar.zero(stage=2)],
                        example_inputs=example_batch(CONFIG, batch=8))
    assert {u.reduce_kind for stage in plan.stages for u in stage.units} == {"reduce_scatter"}
    with pytest.raises(autopar.PlanError, match="reduce='all_reduce'"):
        autopar.zero(stage=2, reduce="all_reduce")
    from autopar.core.comm_kinds import parameter_gather_kind

    assert parameter_gather_kind("auto") == "all_gather"
    assert parameter_gather_kind("auto", backend="gloo") == "broadcast"
    assert parameter_gather_kind("auto", backend="nccl") == "all_gather"
    assert {u.gather_kind for stage in plan.stages for u in stage.units} == {"all_gather"}
    with pytest.raises(autopar.PlanError, match="gather='all_to_all'"):
        autopar.zero(stage=2, gather="all_to_all")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("options", [{"backward_prefetch": True, "reshard_root": True},
                                     {"reshard_after_forward": False, "prefetch": False}],
                         ids=["reshard_all_prefetch_both_ways", "keep_gathered"])
def test_uneven_shards_are_padded_not_refused(options):
    build = functools.partial(GPT, UNEVEN)
    batches = [example_batch(UNEVEN, batch=8, seed=step) for step in range(STEPS)]
    results = run_and_check(build, batches, "dp=4", [autopar.zero(stage=3, **options)], single_device(build, batches))
    zero = results[0]["layout"]["lm_head.weight"][1]  # 126 rows -> 32 per rank, 2 padding rows on rank 3
    assert (zero.axis, zero.rows, zero.length) == ("dp", 32, 126)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_hf_llama_sharded_state_matches_single_device(case, transformers):
    batches = [token_batch(batch=8, seq=16, vocab=128, seed=step) for step in range(STEPS)]
    mesh, strategies = CASES[case]
    run_and_check(tiny_llama, batches, mesh, strategies, single_device(tiny_llama, batches))


MICRO_BATCHES = 2


def micro_batch(batch, micro: int) -> list[torch.Tensor]:
    return [t[micro * 4:(micro + 1) * 4] for t in batch]


def _accumulating_rank(rank: int, world: int, build, batch, mesh: str, strategies: list, no_sync: bool) -> dict:
    """One AdamW step over MICRO_BATCHES micro-batches (no_sync around all but the last), every
    phase counted and its memory measured as in `tests.numerics.distributed_rank`."""
    instruments = Instruments()
    with instruments.phase("setup"):
        module, optimizer = parallel_trainer(build, micro_batch(batch, 0), mesh, strategies)
    result = rank_summary(module, rank, world, instruments.next_counter())
    meshes = settle_garbage()
    check = comparison_mesh(module)
    instruments.storages.track(batch)
    losses = []
    for micro in range(MICRO_BATCHES):
        with instruments.phase("local_batch"):
            local = module.local_batch(*micro_batch(batch, micro))
        synchronising = not no_sync or micro == MICRO_BATCHES - 1
        with contextlib.nullcontext() if synchronising else module.no_sync(), instruments.phase("step"):
            loss = train_step(Probed(module, instruments), local)
        losses.append(loss.detach().clone())
    with instruments.phase("optimizer"):
        optimizer.step()
    result["held"] = [held_bytes(instruments.storages, module=module, optimizer=optimizer,
                                 exclude=[batch, local, loss])]
    result["device_mesh_bytes"] = [device_mesh_bytes(instruments.storages, meshes)]
    result["comm"] = instruments.next_counter().by_key(result["group_to_axis"])
    expected: dict = {}
    for (phase, kind, axis), (calls, nbytes) in module.plan.comm.accumulation(
            micro_batches=MICRO_BATCHES, no_sync=no_sync).items():
        old = expected.get((kind, axis), (0, 0))
        expected[(kind, axis)] = (old[0] + calls, old[1] + nbytes)
    result.update(losses=losses, expected_comm=expected, activations=instruments.activations,
                  grads=[whole_tensors(module, check, grads=True)], params=[whole_tensors(module, check, grads=False)])
    return result


def _accumulated_reference(build, batch) -> dict:
    """One device: both micro-batches' losses, the accumulated gradients, the parameters after the step."""
    model, optimizer = reference_trainer(build)
    losses = []
    for micro in range(MICRO_BATCHES):
        loss = model(*micro_batch(batch, micro))
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    return {"losses": losses, "grads": [grads], "params": [{n: p.detach().clone() for n, p in model.named_parameters()}]}


def corrupted(results: list[dict]) -> list[dict]:
    """The results that passed before the accumulation numerics were compared: gradients x 1e6,
    parameters negated (losses untouched)."""
    return [dict(r, grads=[{n: g * 1e6 for n, g in step.items()} for step in r["grads"]],
                 params=[{n: -p for n, p in step.items()} for step in r["params"]]) for r in results]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,no_sync", [("zero3_dp4", True), ("zero3_dp4", False), ("zero1_dp4", True),
                                          ("zero3_tp_2x2", True)])
def test_gradient_accumulation_without_regathering(case, no_sync):
    """2 micro-batches, one step: losses, whole gradients and parameters equal one device's
    accumulated step; with no_sync, ZeRO-3 gathers each unit once for both micro-batches and
    reduces once (the ledger's `accumulation` view, compared with what the process groups saw over
    the whole step). Gradients x 1e6 and negated parameters fail the comparison (they passed when
    the reference had no losses: nothing was compared)."""
    build = functools.partial(GPT, CONFIG)
    batch = example_batch(CONFIG, batch=8, seed=7)
    mesh, strategies = CASES[case]
    results = launch(_accumulating_rank, autopar.Mesh.parse(mesh).world_size, build, batch, mesh, strategies,
                     no_sync, timeout_s=180)
    reference = _accumulated_reference(build, batch)
    assert_matches(reference, results)
    for kind in ("grads", "params"):
        with pytest.raises(AssertionError, match=f"step 0 {kind} .* rel err"):
            assert_matches(reference, [dict(r, **{kind: c[kind]}) for r, c in zip(results, corrupted(results))])
    with pytest.raises(AssertionError, match="reference has no losses"):
        assert_matches(dict(reference, losses=[]), corrupted(results))
    for result in results:
        assert result["setup_comm"] == {} and result["comm"] == result["expected_comm"]
        assert_held_equals_ledger(result)
        # no_sync keeps every ZeRO-3 unit gathered from the first forward on: the first forward leaves
        # all of them alive (unpadded), the second finds them gathered already
        kept = [result["all_units_unpadded"], 0] if no_sync else [result["kept_units"]["unpadded"]] * MICRO_BATCHES
        for micro, measured in enumerate(result["activations"]):
            assert_activations_equal_ledger(dict(result, activations=[measured]), kept=kept[micro])
    expected, owners = results[0]["expected_comm"], autopar.Mesh.parse(mesh).size("dp")
    gathers = expected.get(("all_gather", "dp"), (0, 0))[0] + expected.get(("broadcast", "dp"), (0, 0))[0] // owners
    units = 3  # root + 2 blocks; a gather is an all-gather or (gloo) one broadcast per owner
    if case.startswith("zero3"):
        assert gathers == (units if no_sync else MICRO_BATCHES * (2 * units - 1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,stage,reduce_dtype", [("gpt", 3, "float32"), ("gpt", 2, "bfloat16"),
                                                      ("llama", 3, "float32")])
def test_mixed_precision_bf16_compute_fp32_masters(model, stage, reduce_dtype, request):
    """bf16 parameters, activations and all-gathers; fp32 shards, gradients and AdamW state.

    Compared with one device running the same recipe, the bound is bf16's, not fp32's: each rank
    rounds its partial gradient sums (a quarter of the batch) to bf16 where one device rounds the
    full sum once. Measured on one device (same model, same batch): summing four quarter-batch bf16
    backwards instead of one full-batch backward moves gradients by up to 2.2% of their largest
    entry (norm biases), and bf16 vs fp32 by 4.7%; hence 5e-2 on losses and gradients. Parameters
    get the same bound: zero-initialised biases are only a few lr steps large after 3 steps, so
    their relative error is their gradients' (measured: 1.7e-2, i.e. 1.7e-4 absolute against lr 1e-2).
    The key-bias gradient is mathematically zero (softmax cancels it) and bf16 noise (~1e-5) in
    practice, so errors are relative to at least 1e-3 here, not fp32's 1e-4."""
    if model == "gpt":
        build = functools.partial(GPT, CONFIG)
        batches = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
    else:  # HF Llama: its RMSNorm computes in fp32 and casts back to the (traced) bf16 input dtype
        request.getfixturevalue("transformers")
        build = tiny_llama
        batches = [token_batch(batch=8, seq=16, vocab=128, seed=step) for step in range(STEPS)]
    strategies = [autopar.zero(stage=stage, param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))]
    results = launch(distributed_rank, 4, build, batches, "dp=4", strategies, timeout_s=180)
    for result in results:
        result["losses"] = [loss.float() for loss in result["losses"]]
    reference = single_device(build, batches, param_dtype=torch.bfloat16)
    assert_matches(reference, results, tolerance=5e-2, noise_floor=1e-3)
    assert_ledger_equals_measured(results)
    assert_memory_equals_ledger(results, reference)


MAX_NORM = 0.05  # below the example's gradient norms (measured 0.54-0.55): every step clips


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["zero2_dp4", "zero3_tp_2x2", "hsdp_2x2"])
def test_clip_grad_norm_over_shards_equals_one_device(case):
    """clip_grad_norm_ on shards would see a quarter of the gradient; ParallelModule.clip_grad_norm_
    reduces the norm over the sharded axes (not the replicated ones): the norms, clipped gradients
    and parameters equal torch.nn.utils.clip_grad_norm_ on one device. The clip phase moves only
    4-byte scalar all-reduces (the ledger does not model clipping); every other phase is the ledger's."""
    build = functools.partial(GPT, CONFIG)
    batches = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
    mesh, strategies = CASES[case]
    results = launch(distributed_rank, autopar.Mesh.parse(mesh).world_size, build, batches, mesh, strategies,
                     train_step, MAX_NORM, timeout_s=180)
    reference = single_device(build, batches, clip_norm=MAX_NORM)
    assert_matches(reference, results)
    assert_ledger_equals_measured(results, extra_phases=("clip",))
    assert_memory_equals_ledger(results, reference)
    for result in results:
        assert all(max_relative_error(n, r) <= 1e-5 for n, r in zip(result["norms"], reference["norms"], strict=True))
        for step in result["comm"]:
            assert step["clip"] and all(kind == "all_reduce" and nbytes == 4 * calls
                                        for (kind, _), (calls, nbytes) in step["clip"].items())


@pytest.mark.timeout(300)
def test_hsdp_with_sequence_parallel_on_a_3d_mesh():
    """8 ranks: FSDP within dp_shard, replicated over dp_rep, Megatron TP+SP on tp."""
    build = functools.partial(GPT, CONFIG)
    batches = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
    run_and_check(build, batches, "dp_rep=2,dp_shard=2,tp=2", [autopar.hsdp(), autopar.sequence_parallel()],
                  single_device(build, batches))


def _trained_full_state(rank: int, world: int, build, batches, mesh: str, strategies: list) -> dict:
    module, optimizer = parallel_trainer(build, batches[0], mesh, strategies)
    for batch in batches:
        optimizer.zero_grad()
        module(*module.local_batch(*batch)).backward()
        optimizer.step()
    return module.full_state_dict()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["zero3_tp_2x2", "zero1_dp4", "gpt2_zero3_tp_2x2"])
def test_full_state_dict_gathers_the_trained_model(case, request):
    """After 3 steps every rank can rebuild the whole model: equal to the one-device parameters
    (GPT-2's fused q|k|v is block-sharded on tp: its gather regroups the blocks)."""
    build = functools.partial(GPT, UNEVEN)  # uneven rows: the padding must not leak into the result
    batches = [example_batch(UNEVEN, batch=8, seed=step) for step in range(STEPS)]
    mesh, strategies = ("dp=4", [autopar.zero(stage=1)]) if case == "zero1_dp4" else (
        "dp=2,tp=2", [autopar.fsdp(), autopar.tensor_parallel()])
    if case == "zero3_tp_2x2":
        build = functools.partial(GPT, CONFIG)
        batches = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
    if case == "gpt2_zero3_tp_2x2":
        request.getfixturevalue("transformers")
        build, batches = tiny_gpt2, [token_batch(batch=8, seq=16, vocab=128, seed=step) for step in range(STEPS)]
    reference = single_device(build, batches)["params"][-1]
    for state in launch(_trained_full_state, autopar.Mesh.parse(mesh).world_size, build, batches, mesh, strategies,
                        timeout_s=180):
        assert set(state) == set(reference)
        for name, expected in reference.items():
            assert state[name].shape == expected.shape and state[name].dtype == torch.float32
            assert max_relative_error(state[name], expected) <= 1e-5, name
