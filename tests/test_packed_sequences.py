"""Packed sequences (issue 47): several documents in one row, as Hugging Face trains them
(`position_ids` restarting at each document; transformers turns them into a document mask), under
data, tensor, sequence and pipeline parallelism, equal to one device after each of 3 AdamW steps (whole
gradients and parameters), the ledger equal to the collectives measured and the memory ledger to
the bytes measured (without a pipeline); under context
parallelism, where autopar cannot yet localise a document mask to a rank's chunks, a refusal in
its own words at plan time. Every row holds 3 documents of random, uneven lengths."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.errors import PlanError
from autopar.runtime.launch import launch
from examples.hf_models import packed_llama, packed_token_batch
from tests.numerics import STEPS, distributed_rank, single_device, train_step
from tests.numerics_checks import assert_ledger_equals_measured, assert_matches, assert_memory_equals_ledger

pytestmark = pytest.mark.usefixtures("transformers")

BATCHES = [packed_token_batch(batch=8, seq=16, seed=step) for step in range(STEPS)]
CASES = {
    "dp2": ("dp=2", lambda: [autopar.data_parallel()], 1),
    "tp2": ("tp=2", lambda: [autopar.tensor_parallel()], 1),
    "dp2_tp2_sp": ("dp=2,tp=2", lambda: [autopar.data_parallel(), autopar.sequence_parallel()], 1),
    "pp2": ("pp=2", lambda: [autopar.pipeline_parallel(schedule="1f1b", microbatches=2)], 2),
}


def pipeline_step(module, local):
    """The step body of a pipelined module: every micro-batch's forward and backward."""
    return module.train_step(*local)


def test_the_batches_are_packed():
    """Each row restarts its positions twice, and the documents change the loss (the mask is not causal alone)."""
    for _, positions, _ in BATCHES:
        assert ((positions == 0).sum(dim=1) == 3).all()
    ids, positions, labels = BATCHES[0]
    torch.manual_seed(0)
    model = packed_llama()
    whole = torch.arange(ids.shape[1]).expand_as(ids)
    assert not torch.allclose(model(ids, positions, labels), model(ids, whole, labels))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_batch_trains_as_on_one_device(case):
    mesh, strategies, microbatches = CASES[case]
    world = autopar.Mesh.parse(mesh).world_size
    reference = single_device(packed_llama, BATCHES, microbatches=microbatches)
    step = pipeline_step if microbatches > 1 else train_step
    results = launch(distributed_rank, world, packed_llama, BATCHES, mesh, strategies(), step, timeout_s=180)
    assert_matches(reference, results)
    assert_ledger_equals_measured(results)
    if microbatches == 1:  # a schedule's forward is not the harness's to measure (tests/test_pipeline_numerics.py)
        assert_memory_equals_ledger(results, reference)


@pytest.mark.timeout(120)
def test_context_parallelism_refuses_a_document_mask_at_plan_time():
    torch.manual_seed(0)
    with pytest.raises(PlanError, match="is not the causal mask or no mask") as refused:
        autopar.plan(packed_llama(), "cp=2", strategies=[autopar.context_parallel()], example_inputs=BATCHES[0])
    assert "model.model.layers.0.self_attn" in str(refused.value)
