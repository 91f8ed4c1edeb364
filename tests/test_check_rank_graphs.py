"""Every accepted plan runs: `autopar.check_rank_graphs` runs the rank graphs forward and backward
on fake tensors at plan time, and a graph that would crash at run time is a PlanError naming the
node, its module and source line, before any process group exists."""
from __future__ import annotations

import sys
import time

import pytest
import torch
from torch import nn

import autopar
from autopar import PlanError
from autopar.op_rules import RuleResult, register
from autopar.passes import default_passes
from examples.gpt import GPT, GPTConfig, example_batch

transformers = pytest.importorskip("transformers")
from examples.hf_models import tiny_causal_lm, token_batch  # noqa: E402

plan_module = sys.modules["autopar.plan"]  # `autopar.plan` the attribute is the function


def test_the_empty_kv_cache_would_crash_at_run_time_and_is_caught_at_plan_time(monkeypatch):
    """Without `drop_empty_concats`, Llama's empty KV cache (use_cache's default) is sliced along a
    dimension it does not have: the IndexError users saw in their first forward."""
    monkeypatch.setattr(plan_module, "default_passes",
                        lambda: [p for p in default_passes() if p.__name__ != "drop_empty_concats"])
    torch.manual_seed(0)
    with pytest.raises(PlanError) as error:
        autopar.plan(tiny_causal_lm("llama"), "tp=2", strategies=[autopar.tensor_parallel()],
                     example_inputs=token_batch())
    text = str(error.value)
    assert "rank 0's graph fails on fake tensors of its local shapes (forward): IndexError" in text
    assert "shard_slice" in text and "module: model.model.layers.0.self_attn" in text
    assert "modeling_llama.py" in text and "fix:" in text


@torch.library.custom_op("autopar_test::leaky", mutates_args=())
def leaky(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.leaky_relu(x)


@leaky.register_fake
def _(x):
    return torch.empty_like(x)


class _WrongGradient(torch.autograd.Function):
    """A lowering whose backward returns a gradient of the wrong shape."""

    @staticmethod
    def forward(ctx, x):
        return torch.nn.functional.leaky_relu(x)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., :-1]


def wrong_gradient_kernel(x: torch.Tensor) -> torch.Tensor:
    return _WrongGradient.apply(x)


@register(torch.ops.autopar_test.leaky.default)
def leaky_rule(node, specs, ctx):
    return RuleResult(output=specs[0], required=[specs[0]], local_kernel=wrong_gradient_kernel)


class UsesLeaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return leaky(self.linear(x)).sum()


def test_a_backward_that_would_crash_names_the_node():
    with pytest.raises(PlanError) as error:
        autopar.plan(UsesLeaky(), "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.ones(2, 4),))
    text = str(error.value)
    assert "fails on fake tensors of its local shapes (backward)" in text and "invalid gradient" in text
    assert "%leaky" in text and "test_check_rank_graphs.py" in text


def test_the_check_is_a_small_part_of_planning():
    torch.manual_seed(0)
    model, batch = GPT(GPTConfig()), example_batch(GPTConfig())
    start = time.perf_counter()
    plan = autopar.plan(model, "dp=2,tp=2", strategies=[autopar.data_parallel(), autopar.sequence_parallel()],
                        example_inputs=batch)
    planning = time.perf_counter() - start
    from autopar.check_rank_graphs import check_rank_graphs

    start = time.perf_counter()
    check_rank_graphs(plan)
    assert time.perf_counter() - start < 0.5 * planning
