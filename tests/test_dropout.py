"""Dropout that matches one device: the example GPT with dropout 0.1 (after the embeddings, the
attention and the MLP) trained on gloo processes equals the single-device model for the same seed
(loss, whole gradients and parameters after each of 3 AdamW steps, fp32 rel <= 1e-5) under data,
tensor + sequence (alone, inside and outside data parallelism), ZeRO-3 x tensor and context
parallelism: every rank's masks are one device's
masks, or its piece of them (`autopar/core/ops/dropout.py`). With masks drawn independently per
rank the losses would differ from the first step (`test_independent_masks_would_be_caught`).
Hugging Face GPT-2's dropouts sit inside the attention and MLP modules, after the row-parallel
projections: their input is a partial sum that DTensor reduce-scatters onto batch shards of both
axes under dp=2 x tp=2 + SP, and they draw one device's masks there too
(`test_dropout_after_a_row_parallel_projection`; its numerics are `tests/test_random_ops.py`'s)."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.core.ir import RULE
from autopar.core.ops.dropout import sharded_dropout
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.numerics import STEPS, distributed_rank, single_device
from tests.numerics_checks import assert_cases_match

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64, dropout=0.1)
build = functools.partial(GPT, CONFIG)
BATCHES = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]

CASES = {
    "dp2": ("dp=2", [autopar.data_parallel()]),
    "tp2_sp": ("tp=2", [autopar.sequence_parallel()]),
    # the batch cut by dp, then by SP (autopar/compiler/strategies/token_shard.py): masks cut on dim 0 by two axes
    "dp2_tp2_sp": ("dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()]),
    # tp outside dp: SP shards the sequence, not the batch dp cut first
    "tp2_dp2_sp": ("tp=2,dp=2", [autopar.data_parallel(), autopar.sequence_parallel()]),
    "dp2_tp2_zero3": ("dp=2,tp=2", [autopar.zero(stage=3), autopar.tensor_parallel()]),
    "cp2": ("cp=2", [autopar.context_parallel()]),
}


@pytest.fixture(scope="module")
def reference():
    return single_device(build, BATCHES)


def run_cases(rank: int, world: int, names: list[str]) -> list[dict]:
    return [distributed_rank(rank, world, build, BATCHES, *CASES[name]) for name in names]


@pytest.mark.parametrize("world", [2, 4])
def test_dropout_masks_equal_one_device(world, reference):
    names = [name for name, (mesh, _) in CASES.items() if autopar.Mesh.parse(mesh).world_size == world]
    per_rank = launch(run_cases, world, names, timeout_s=120 * len(names))
    assert_cases_match(names, per_rank, reference)


def test_independent_masks_would_be_caught(reference):
    """The comparison can fail: a reference whose generator is offset (as a rank drawing only its
    own shard's mask would leave it) differs from the first step's loss on."""
    def offset_build():
        model = build()
        torch.rand(1)  # one draw more than the reference before training starts
        return model
    shifted = single_device(offset_build, BATCHES)
    gap = (shifted["losses"][0] - reference["losses"][0]).abs() / reference["losses"][0].abs()
    assert gap > 1e-3, f"other masks moved the first loss by only {gap:.1e}: the comparison could not see them"


def test_dropout_under_a_pipeline_is_refused():
    deep = GPT(GPTConfig(vocab_size=128, seq_len=16, n_layer=4, n_head=4, d_model=32, d_ff=64, dropout=0.1))
    with pytest.raises(autopar.PlanError) as error:
        autopar.plan(deep, autopar.Mesh(pp=2), strategies=[autopar.pipeline_parallel(microbatches=2)],
                     example_inputs=BATCHES[0])
    assert "dropout" in str(error.value) and "examples/gpt.py" in str(error.value) and "fix:" in str(error.value)


def test_dropout_after_a_row_parallel_projection():
    """Every dropout of HF GPT-2 (attention dropout off) under dp=2 x tp=2 + SP draws the whole mask
    and keeps the piece of both axes' batch shards, the residual dropouts after the row-parallel
    projections included (their partial input is reduce-scattered by DTensor's choice)."""
    transformers = pytest.importorskip("transformers")
    from examples.hf_models import CausalLMLoss, token_batch  # an optional dependency: transformers

    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=128, n_positions=64, attn_pdrop=0.0,
                                     use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)
    plan = autopar.plan(CausalLMLoss(transformers.GPT2LMHeadModel(config)), "dp=2,tp=2",
                        strategies=[autopar.data_parallel(), autopar.sequence_parallel()],
                        example_inputs=token_batch(batch=8, seq=16))
    dropouts = [n for n in plan.graph_module.graph.nodes if n.target is torch.ops.aten.native_dropout.default]
    assert len(dropouts) == 5  # the embeddings', and per block the attention's and the MLP's residual dropout
    for node in dropouts:
        assert node.meta.get(RULE) is not None and node.meta[RULE].local_kernel is sharded_dropout, node.format_node()
        assert node.meta[RULE].kernel_kwargs["cuts"] == ("value", "dp:0:2:contiguous:1;tp:0:2:contiguous:1")
