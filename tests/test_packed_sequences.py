"""Packed sequences (issue 47): several documents in one row, as Hugging Face trains them
(`position_ids` restarting at each document; transformers turns them into a document mask), under
data, tensor, sequence, context (ring, all-gather, all-to-all, and cp x tp) and pipeline
parallelism, equal to one device after each of 3 AdamW steps (whole gradients and parameters), the
ledger equal to the collectives measured and the memory ledger to the bytes measured (without a
pipeline). Every row holds 3 documents of random, uneven lengths: under context parallelism a
rank's chunks hold pieces of several documents, some pairs of chunks share none (the ring skips
those blocks) and some query rows of a block meet no key of their document. The balanced case
trains on the batch's documents reordered by the document balancer (`autopar/core/document_balance.py`),
against one device on the batch as it was: equal, since no label crosses a document boundary."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.runtime.launch import launch
from autopar.core.document_balance import balance_documents
from examples.hf_models import packed_llama, packed_token_batch
from tests.numerics import STEPS, distributed_rank, single_device, train_step
from tests.numerics_checks import assert_ledger_equals_measured, assert_matches, assert_memory_equals_ledger

pytestmark = pytest.mark.usefixtures("transformers")

BATCHES = [packed_token_batch(batch=8, seq=16, seed=step) for step in range(STEPS)]
# documents' first labels ignored (DataCollatorWithFlattening's): one device trains on these, a
# balanced case's ranks on the same documents reordered by the document balancer
SEPARATED = [packed_token_batch(batch=8, seq=16, seed=step, separated=True) for step in range(STEPS)]
BALANCED = [tuple(t.gather(1, balance_documents(batch[1], size=2)) for t in batch) for batch in SEPARATED]
DATA = {"packed": (BATCHES, BATCHES), "balanced": (SEPARATED, BALANCED)}  # (one device's, the ranks')
# name -> (mesh, strategies, micro-batches, data)
CASES = {
    "dp2": ("dp=2", [autopar.data_parallel()], 1, "packed"),
    "tp2": ("tp=2", [autopar.tensor_parallel()], 1, "packed"),
    "pp2": ("pp=2", [autopar.pipeline_parallel(schedule="1f1b", microbatches=2)], 2, "packed"),
    "cp2_ring": ("cp=2", [autopar.context_parallel()], 1, "packed"),
    "cp2_allgather": ("cp=2", [autopar.context_parallel(method="allgather")], 1, "packed"),
    "cp2_alltoall": ("cp=2", [autopar.context_parallel(method="alltoall")], 1, "packed"),
    "cp2_ring_balanced": ("cp=2", [autopar.context_parallel()], 1, "balanced"),
    "dp2_tp2_sp": ("dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()], 1, "packed"),
    "cp2_tp2": ("cp=2,tp=2", [autopar.context_parallel(), autopar.tensor_parallel()], 1, "packed"),
}

def pipeline_step(module, local):
    """The step body of a pipelined module: every micro-batch's forward and backward."""
    return module.train_step(*local)


def run_cases(rank: int, world: int, names: list[str]) -> list[dict]:
    """Every case of one world size in one set of processes, one after another."""
    results = []
    for name in names:
        mesh, strategies, microbatches, data = CASES[name]
        step = pipeline_step if microbatches > 1 else train_step
        results.append(distributed_rank(rank, world, packed_llama, DATA[data][1], mesh, strategies, step))
    return results


def test_the_batches_are_packed():
    """Each row restarts its positions twice, and the documents change the loss (the mask is not causal alone)."""
    for _, positions, _ in BATCHES:
        assert ((positions == 0).sum(dim=1) == 3).all()
    ids, positions, labels = BATCHES[0]
    torch.manual_seed(0)
    model = packed_llama()
    whole = torch.arange(ids.shape[1]).expand_as(ids)
    assert not torch.allclose(model(ids, positions, labels), model(ids, whole, labels))


@pytest.mark.timeout(480)
@pytest.mark.parametrize("world", [2, 4])
def test_a_packed_batch_trains_as_on_one_device(world):
    names = [name for name, (mesh, *_) in CASES.items() if autopar.Mesh.parse(mesh).world_size == world]
    per_rank = launch(run_cases, world, names, timeout_s=150 * len(names))
    references = {(m, data): single_device(packed_llama, DATA[data][0], microbatches=m)
                  for m, data in {CASES[n][2:] for n in names}}
    for index, name in enumerate(names):
        results = [rank_results[index] for rank_results in per_rank]
        microbatches = CASES[name][2]
        reference = references[CASES[name][2:]]
        try:
            assert_matches(reference, results)
            assert_ledger_equals_measured(results)
            # a schedule's forward is not the harness's to measure (tests/test_pipeline_numerics.py)
            if microbatches == 1:
                assert_memory_equals_ledger(results, reference)
        except AssertionError as error:
            raise AssertionError(f"{name} ({CASES[name][0]}): {error}") from None
