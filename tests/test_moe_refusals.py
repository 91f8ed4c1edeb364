"""Mixture-of-experts models autopar refuses at plan time, each refusal naming the block (or axis)
and the fix: experts that do not divide over the expert-parallel ranks (folded ones too), an
expert axis that carries another strategy, experts folded onto sharded state or pipeline stages,
expert parallelism without experts, a block autopar cannot recognise, and a capacity factor that
would drop tokens unasked. The runs that train are `tests/test_moe.py`'s."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.errors import PlanError
from examples.gpt import example_batch
from examples.moe import MoEGPT
from tests.test_moe import EXAMPLE

def _plan_example(mesh: str, strategies: list, model: torch.nn.Module | None = None) -> None:
    model = model or MoEGPT(EXAMPLE)
    autopar.plan(model, mesh, strategies=strategies, example_inputs=example_batch(EXAMPLE, batch=8))


def test_experts_that_do_not_divide_over_ep_are_refused():
    with pytest.raises(PlanError) as error:
        _plan_example("ep=8", [autopar.expert_parallel()])
    text = str(error.value)
    assert "4 experts do not divide over expert-parallel axis 'ep' of size 8" in text
    assert "layers.0.moe.experts" in text and "examples/moe.py" in text and "fix:" in text


def test_an_ep_axis_that_also_carries_another_strategy_is_refused():
    with pytest.raises(PlanError, match="carved from the data axes"):
        _plan_example("tp=2", [autopar.expert_parallel(axis="tp"), autopar.tensor_parallel()])


def test_experts_that_do_not_divide_over_a_folded_group_are_refused():
    with pytest.raises(PlanError) as error:
        _plan_example("ep=4,tp=2", [autopar.expert_parallel(fold=("tp",)), autopar.tensor_parallel()])
    text = str(error.value)
    assert "4 experts do not divide over the 8 ranks of expert-parallel axes 'ep+tp' (folded)" in text
    assert "choose ep × tp sizes whose product divides 4" in text


@pytest.mark.parametrize("mesh,strategies,why", [
    ("dp=2,ep=2", [autopar.zero(stage=3), autopar.expert_parallel(fold=("dp",))], "zero3 shards the training state"),
    ("pp=2,ep=2", [autopar.pipeline_parallel(microbatches=2), autopar.expert_parallel(fold=("pp",))],
     "holds pipeline stages"),
], ids=["zero", "pipeline"])
def test_folding_experts_onto_sharded_state_or_stages_is_refused(mesh, strategies, why):
    with pytest.raises(PlanError) as error:
        _plan_example(mesh, strategies)
    text = str(error.value)
    assert "the experts cannot be folded onto" in text and why in text and "fix:" in text


def test_folding_the_expert_axis_into_itself_is_refused():
    with pytest.raises(PlanError, match="the expert axis not among the folded ones"):
        autopar.expert_parallel(axis="ep", fold=("ep",))


def test_expert_parallel_without_experts_is_refused():
    from examples.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=128, seq_len=16)
    with pytest.raises(PlanError, match="no mixture-of-experts block"):
        autopar.plan(GPT(config), "ep=2", strategies=[autopar.expert_parallel()],
                     example_inputs=example_batch(config, batch=4))


class MaxCombineExperts(torch.nn.Module):
    """Experts whose k outputs per token are combined by a maximum, not the weighted sum."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.inner = experts

    def forward(self, x, top_k_index, top_k_weights):
        tokens, top_k = top_k_index.shape
        inner = self.inner
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        rows = x[perm // top_k]
        counts = torch.histc(expert_ids.float(), bins=inner.n_experts, min=0, max=inner.n_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        from examples.moe import grouped_mm

        out = grouped_mm(rows, inner.gate_up[..., : inner.down.shape[1]], offsets)
        out = grouped_mm(out, inner.down, offsets) * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        return out[inverse].view(tokens, top_k, -1).amax(dim=1)


def test_an_moe_block_autopar_cannot_recognise_is_refused():
    model = MoEGPT(EXAMPLE)
    for layer in model.layers:
        layer.moe.experts = MaxCombineExperts(layer.moe.experts)
    with pytest.raises(PlanError) as error:
        _plan_example("dp=2", [autopar.data_parallel()], model)
    text = str(error.value)
    assert "mixture-of-experts block 'layers.0.moe.experts" in text and "cannot recognise" in text
    assert "test_moe_refusals.py" in text and "fix:" in text


def test_a_capacity_factor_that_drops_tokens_without_being_asked_is_refused():
    with pytest.raises(PlanError) as error:
        _plan_example("ep=2", [autopar.expert_parallel(capacity_factor=1.25)])
    text = str(error.value)
    assert "capacity factor 1.25" in text and "dropped" in text and "drop_tokens=True" in text
    assert "layers.0.moe.experts" in text
