"""The propagation pass answers an op whose inputs already match one of its single-mesh-dimension
strategies on every axis without DTensor's full expansion (`autopar/compiler/dtensor_matching.py`).
Here every such answer is checked against the expansion's (`dtensor_matching.VERIFY`) on plans
that reach the shortcut's edges: three-axis meshes, experts folded onto tensor parallelism,
sequence and context parallelism, ZeRO-3, a fused q|k|v projection cut in blocks (`_StridedShard`
inputs, which fall back), symbolic batch and sequence sizes."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

import autopar
from autopar.compiler import dtensor_matching
from examples.gpt import GPT, GPTConfig, example_batch
from examples.hf_models import tiny_causal_lm, token_batch
from tests.test_context_parallel import LLAMA_BATCHES, gqa_llama
from tests.test_moe import hf_moe


@pytest.fixture
def counted(monkeypatch):
    """Every matched decision checked against DTensor's expansion; the matches and the ops that
    fell back are counted."""
    monkeypatch.setattr(dtensor_matching, "VERIFY", True)
    counts = {"matched": 0, "expanded": 0, "symbolic matched": 0, "symbolic expanded": 0}
    inner = dtensor_matching._matched

    def matched(mesh, op_schema, strategy_info, output_tensor_meta):
        found = inner(mesh, op_schema, strategy_info, output_tensor_meta)
        symbolic = any(isinstance(size, torch.SymInt) for arg in op_schema.args_schema if isinstance(arg, OpStrategy)
                       for size in arg.strategies[0].output_spec.tensor_meta.shape)
        counts[("symbolic " if symbolic else "") + ("matched" if found is not None else "expanded")] += 1
        return found

    monkeypatch.setattr(dtensor_matching, "_matched", matched)
    return counts


def _token_batch() -> tuple:
    return token_batch(batch=4, seq=16, seed=0)


PLANS = {
    "qwen3_moe ep2 x tp2+sp folded on dp2": (
        lambda: hf_moe("qwen3_moe"), _token_batch, "dp=2,ep=2,tp=2",
        [autopar.data_parallel(), autopar.expert_parallel(fold=("tp",)),
         autopar.tensor_parallel(sequence_parallel=True)]),
    "qwen3_moe ep2 x etp2 on dp2": (
        lambda: hf_moe("qwen3_moe"), _token_batch, "dp=2,ep=2,tp=2",
        [autopar.data_parallel(), autopar.expert_parallel(), autopar.tensor_parallel()]),
    "llama dp2 fsdp x cp2 x tp2+sp": (
        gqa_llama, lambda: LLAMA_BATCHES[0], "dp=2,cp=2,tp=2",
        [autopar.fsdp(), autopar.context_parallel(), autopar.tensor_parallel(), autopar.sequence_parallel()]),
    "gpt2 zero3 x tp2 (fused q|k|v)": (
        lambda: tiny_causal_lm("gpt2"), _token_batch, "dp=2,tp=2", [autopar.zero(stage=3), autopar.tensor_parallel()]),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_every_matched_decision_is_the_one_dtensor_expands_to(name, counted, transformers):
    build, batch, mesh, strategies = PLANS[name]
    torch.manual_seed(0)
    autopar.plan(build(), mesh, strategies=strategies, example_inputs=batch())
    assert counted["matched"] > 0 and counted["expanded"] > 0, counted


def test_a_plan_with_symbolic_batch_and_sequence_matches_the_expansion_too(counted, transformers):
    config = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32)
    autopar.plan(GPT(config), "dp=2,tp=2", strategies=[autopar.data_parallel(), autopar.tensor_parallel()],
                 example_inputs=example_batch(config, batch=4), dynamic_dims={"b": 0, "s": 1})
    assert counted["matched"] > 0 and counted["symbolic matched"] == 0, counted


def test_a_matched_decision_that_differs_from_the_expansion_fails_the_check(monkeypatch, transformers):
    """The check itself: a shortcut answering Replicate where the inputs are sharded is caught."""
    inner = dtensor_matching._matched

    def wrong(mesh, op_schema, strategy_info, output_tensor_meta):
        found = inner(mesh, op_schema, strategy_info, output_tensor_meta)
        if found is None or all(p == Replicate() for p in found.strategies[0].output_specs.placements):
            return found
        spec = found.strategies[0].output_specs
        replicated = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.tensor_meta)
        return OpStrategy([OpSpec(replicated, found.strategies[0].input_specs, found.strategies[0].redistribute_cost)])

    monkeypatch.setattr(dtensor_matching, "VERIFY", True)
    monkeypatch.setattr(dtensor_matching, "_matched", wrong)
    config = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32)
    with pytest.raises(autopar.PlanError, match="differs from DTensor's expansion"):
        autopar.plan(GPT(config), "dp=2", strategies=[autopar.data_parallel()],
                     example_inputs=example_batch(config, batch=4))
