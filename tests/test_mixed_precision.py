"""`autopar.mixed_precision()` under every parallelism: bf16 compute from fp32 masters, gradients
reduced in fp32, trained on gloo processes against the same recipe on one device (a bf16 copy of
the model computes, its gradients cast to fp32 update the fp32 masters: `tests/numerics.single_device`
with `param_dtype`), with the ledgers checked against what the processes move and hold. Plus the
plan-time side: dtypes in the ledger, the refusals."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import autopar
from autopar.core.errors import PlanError
from autopar.runtime.launch import launch
from autopar.tools.comm_gate import comm_summary
from examples.gpt import GPT, GPTConfig, example_batch
from examples.moe import MoEConfig, MoEGPT
from tests import test_moe
from tests.numerics import (STEPS, comparison_mesh, distributed_rank, parallel_trainer, single_device, train_step,
                            whole_tensors)
from tests.numerics_checks import (assert_held_equals_ledger, assert_ledger_equals_measured, assert_matches,
                                   assert_memory_equals_ledger)

CONFIG = GPTConfig(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=32, d_ff=64)
build = functools.partial(GPT, CONFIG)
BATCHES = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
BF16 = autopar.mixed_precision(param_dtype=torch.bfloat16)
MICROBATCHES = 2
# AdamW's first steps move an entry by lr*g/(|g|+eps): for |g| below eps the move is lr*g/eps, so the
# bf16 noise of a small gradient entry (~1e-4 absolute: partial sums rounded per rank) becomes
# lr*1e-4/eps of parameter, 10% of a zero-initialised bias's few-lr size at the harness's eps=1e-3
# (measured: norm.bias under tp2+SP, 7.7%). eps=1e-2 keeps that noise at about 1%; gradients
# themselves are compared before the optimizer sees them.
EPS = 1e-2


def pipeline_step(module: Any, local: list) -> torch.Tensor:
    return module.train_step(*local)


# name -> (mesh, strategies, micro-batches of the reference); every case on 2 ranks
CASES = {
    "dp2": ("dp=2", [autopar.data_parallel(), BF16], 1),
    "zero3_dp2": ("dp=2", [autopar.zero(stage=3), BF16], 1),
    "tp2_sp": ("tp=2", [autopar.sequence_parallel(), BF16], 1),
    # the loss handed back in fp32 (FSDP2's output_dtype): broadcast from the last stage in fp32
    "pp2": ("pp=2", [autopar.pipeline_parallel(microbatches=MICROBATCHES),
                     autopar.mixed_precision(param_dtype=torch.bfloat16, output_dtype=torch.float32)], MICROBATCHES),
    "cp2": ("cp=2", [autopar.context_parallel(), BF16], 1),
}

# the loss's dtype: the compute dtype, or the declared output_dtype
LOSS_DTYPES = {"pp2": torch.float32}
# context parallelism rounds each attention block's output to bf16 before merging them in fp32 (one
# device's kernel rounds the whole row once), and its gradients per block: measured 5.3% on
# layers.0.attn_norm.bias's gradient (2026-12-06), above the 5% of the others
BOUNDS = {"cp2": 8e-2}


def run_cases(rank: int, world: int, names: list[str]) -> list[dict]:
    """Every case in one set of processes, one after another."""
    results = []
    for name in names:
        mesh, strategies, micro = CASES[name]
        results.append(distributed_rank(rank, world, build, BATCHES, mesh, strategies,
                                        step=pipeline_step if micro > 1 else train_step, eps=EPS))
    return results


@pytest.mark.timeout(600)
def test_bf16_compute_fp32_masters_under_every_parallelism():
    """Each rank's losses, whole gradients and parameters after 3 AdamW steps against one device's
    bf16-copy recipe. The bound is bf16's, as in `tests/test_zero_numerics.py`'s ZeRO mixed-precision
    test (measured there: per-rank partial sums rounded to bf16 instead of one full-batch sum move
    gradients by up to 2.2% of their largest entry), hence 5e-2 with a 1e-3 noise floor. That bound
    alone would not tell bf16 from fp32 compute (bf16 vs fp32 differ by a few percent), so the case
    also checks what is bf16: the loss the rank graph returns, and the bytes of every activation
    collective and pipeline message (the ledger, checked against the outside counter), while the
    parameters the optimizer updates stay fp32. Under the pipeline the loss is handed back in fp32
    (`output_dtype`), and its broadcast from the last stage counted in fp32."""
    names = list(CASES)
    per_rank = launch(run_cases, 2, names, timeout_s=480)
    references: dict[int, dict] = {}
    for index, name in enumerate(names):
        mesh, _, micro = CASES[name]
        if micro not in references:
            references[micro] = single_device(build, BATCHES, param_dtype=torch.bfloat16, microbatches=micro,
                                               eps=EPS)
        reference = references[micro]
        results = [rank_results[index] for rank_results in per_rank]
        try:
            wanted = LOSS_DTYPES.get(name, torch.bfloat16)
            dtypes = {loss.dtype for r in results for loss in r["losses"]}
            assert dtypes == {wanted}, f"the rank graphs' losses are {dtypes}, not {wanted}"
            dtypes = {p.dtype for r in results for step in r["params"] for p in step.values()}
            assert dtypes == {torch.float32}, f"the parameters the optimizer updates are {dtypes}, not fp32 masters"
            for result in results:
                result["losses"] = [loss.float() for loss in result["losses"]]
            assert_matches(reference, results, tolerance=BOUNDS.get(name, 5e-2), noise_floor=1e-3)
            assert_ledger_equals_measured(results)
            assert_memory_equals_ledger(results, reference, activations=micro == 1)
        except AssertionError as error:
            raise AssertionError(f"{name} ({mesh}): {error}") from None


def moe_rank(rank: int, world: int) -> dict:
    test_moe._routing.clear()
    return distributed_rank(rank, world, MOE_BUILD, MOE_BATCHES, "ep=2", [autopar.expert_parallel(), BF16],
                            step=test_moe.routed_step, after=test_moe._after, eps=EPS)


MOE_CONFIG = MoEConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, n_experts=4, top_k=2, d_expert=32)
MOE_BUILD = functools.partial(MoEGPT, MOE_CONFIG)
MOE_BATCHES = [example_batch(MOE_CONFIG, batch=4, seed=step) for step in range(STEPS)]


@pytest.mark.timeout(300)
def test_bf16_experts_under_expert_parallelism():
    """The example MoE on ep=2 under mixed precision against one device's bf16-copy recipe (the
    bound above): the router, the experts and the all-to-alls compute and move bf16 (each step's
    all-to-all bytes equal what its routing implies at 2 bytes an element, counted from outside;
    every other collective equals the ledger), the optimizer updates fp32 masters, and the bytes
    held after each step equal the memory ledger."""
    results = launch(moe_rank, 2, timeout_s=240)
    reference = single_device(MOE_BUILD, MOE_BATCHES, param_dtype=torch.bfloat16, eps=EPS)
    # the example's router computes its logits in fp32 (`.float()`), so its auxiliary losses and the
    # loss they join are fp32 under the recipe too
    assert {loss.dtype for r in results for loss in r["losses"]} == {torch.float32}
    assert {p.dtype for r in results for step in r["params"] for p in step.values()} == {torch.float32}
    for result in results:
        result["losses"] = [loss.float() for loss in result["losses"]]
    assert_matches(reference, results, tolerance=5e-2, noise_floor=1e-3)
    test_moe.assert_comm_equals_ledger_and_routing(results, "example", "ep2", element_bytes=2)
    for result in results:
        assert_held_equals_ledger(result)


def _volumes(mesh: str, strategies: list) -> dict[tuple[str, str], int]:
    model, batch = build(), BATCHES[0]
    summary = comm_summary(autopar.plan(model, mesh, strategies=strategies, example_inputs=batch))
    return {(v["kind"], v["dtype"]): v["bytes"] for v in summary["volumes"]}


def test_the_ledger_counts_each_collective_in_its_dtype():
    """Data parallelism all-reduces fp32 gradients of fp32 masters (as many bytes as without mixed
    precision); sequence parallelism gathers and scatters bf16 activations (half the fp32 bytes)."""
    fp32 = _volumes("dp=2", [autopar.data_parallel()])
    mixed = _volumes("dp=2", [autopar.data_parallel(), BF16])
    # the gradients' bytes unchanged; only the loss's scalar all-reduces moved to bf16 (half their bytes)
    assert fp32[("all_reduce", "float32")] - mixed[("all_reduce", "float32")] == 2 * mixed[("all_reduce", "bfloat16")]
    assert mixed[("all_reduce", "float32")] > 1000 * mixed[("all_reduce", "bfloat16")]
    fp32 = _volumes("tp=2", [autopar.sequence_parallel()])
    mixed = _volumes("tp=2", [autopar.sequence_parallel(), BF16])
    for kind in ("all_gather", "reduce_scatter"):
        assert mixed[(kind, "bfloat16")] * 2 == fp32[(kind, "float32")]
        assert (kind, "float32") not in mixed


def test_reducing_a_replicated_gradient_in_bf16_is_refused_by_name():
    with pytest.raises(PlanError, match=r"(?s)parameter '.*' is replicated over \['dp'\].*fix: reduce_dtype=torch.float32"):
        autopar.plan(build(), "dp=2", strategies=[autopar.data_parallel(),
                                                   autopar.mixed_precision(reduce_dtype=torch.bfloat16)],
                     example_inputs=BATCHES[0])


def test_zero_and_mixed_precision_declaring_different_dtypes_is_refused():
    with pytest.raises(PlanError, match="declare different dtypes"):
        autopar.plan(build(), "dp=2", strategies=[autopar.zero(stage=3, param_dtype=torch.float16), BF16],
                     example_inputs=BATCHES[0])


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, "bf16"])
def test_a_dtype_that_is_not_a_16_or_32_bit_float_is_refused(dtype):
    with pytest.raises(PlanError, match="mixed_precision"):
        autopar.mixed_precision(param_dtype=dtype)



def compiled_rank(rank: int, world: int, mesh: str, strategies: list) -> dict:
    """Three steps of the compiled rank graphs (no dispatch mode watches them: dynamo would run eagerly)."""
    module, optimizer = parallel_trainer(build, BATCHES[0], mesh, strategies, eps=EPS, options={"compile": True})
    check = comparison_mesh(module)
    result: dict[str, list] = {"losses": [], "grads": [], "params": []}
    for batch in BATCHES:
        optimizer.zero_grad()
        loss = module.train_step(*module.local_batch(*batch))
        optimizer.step()
        result["losses"].append(loss.detach().clone())
        result["grads"].append(whole_tensors(module, check, grads=True))
        result["params"].append(whole_tensors(module, check, grads=False))
    return result


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh,strategies", [("dp=2", [autopar.data_parallel(), BF16]),
                                             ("tp=2", [autopar.sequence_parallel(), BF16])], ids=["dp2", "tp2_sp"])
def test_compiled_rank_graphs_keep_the_recipe(mesh, strategies):
    """`compile=True` with mixed precision: inductor compiles the masters' casts with the graph; the
    losses stay bf16 and the run matches the one-device recipe at the bound above (the ledgers of
    compiled graphs are `tests/test_compile.py`'s to check)."""
    results = launch(compiled_rank, 2, mesh, strategies, timeout_s=500)
    assert {loss.dtype for r in results for loss in r["losses"]} == {torch.bfloat16}
    for result in results:
        result["losses"] = [loss.float() for loss in result["losses"]]
    reference = single_device(build, BATCHES, param_dtype=torch.bfloat16, eps=EPS)
    assert_matches(reference, results, tolerance=5e-2, noise_floor=1e-3)
