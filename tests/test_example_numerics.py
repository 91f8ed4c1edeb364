"""Numerics on the example GPT: autopar on gloo processes equals the single-device model
(loss, gradients, parameters after 3 AdamW steps, fp32 rel err <= 1e-5), the ledger equals
the bytes each step hands to the process groups, and the memory ledger the bytes held (and
saved for backward)."""
from __future__ import annotations

import functools

import pytest

import autopar
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.numerics import (STEPS, assert_ledger_equals_measured, assert_matches, assert_memory_equals_ledger,
                            distributed_rank, single_device)

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
build = functools.partial(GPT, CONFIG)
BATCHES = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]

CASES = {
    "dp2": ("dp=2", [autopar.data_parallel()]),
    "tp2": ("tp=2", [autopar.tensor_parallel()]),
    "tp4_sp": ("tp=4", [autopar.sequence_parallel()]),
    "dp2_tp2_sp": ("dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()]),
    "tp4_sp_regather": ("tp=4", [autopar.sequence_parallel(regather_in_backward=True)]),
}


@pytest.fixture(scope="module")
def reference():
    return single_device(build, BATCHES)


@pytest.mark.parametrize("case", list(CASES))
def test_example_gpt_matches_single_device(case, reference):
    mesh, strategies = CASES[case]
    world = autopar.Mesh.parse(mesh).world_size
    results = launch(distributed_rank, world, build, BATCHES, mesh, strategies, timeout_s=120)
    assert_matches(reference, results, mesh)
    assert_ledger_equals_measured(results)
    assert_memory_equals_ledger(results)
