"""Every accepted plan runs: `autopar.compiler.check_rank_graphs` runs the rank graphs forward and backward
on fake tensors at plan time, and a graph that would crash at run time is a PlanError naming the
node, its module and source line, before any process group exists. Copied blocks are compared
with their template rather than run (counted here: the nodes run do not grow with the layer
count), and a copy that differs from its template is run, forward and backward."""
from __future__ import annotations

import sys
import time

import pytest
import torch
from torch import nn

import autopar
from autopar import PlanError
from autopar.compiler.check_rank_graphs import check_rank_graphs
from autopar.core.ir import module_path
from autopar.compiler.rules.registry import RuleResult, register
from autopar.compiler.passes import default_passes
from examples.gpt import GPT, GPTConfig, example_batch

transformers = pytest.importorskip("transformers")
from examples.hf_models import tiny_causal_lm, tiny_llama, token_batch  # noqa: E402

plan_module = sys.modules["autopar.compiler.plan"]  # `autopar.plan` the attribute is the function


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
    start = time.perf_counter()
    check_rank_graphs(plan)
    assert time.perf_counter() - start < 0.5 * planning


def _llama_plan(layers: int, **options) -> autopar.Plan:
    """FSDP + TP as `benchmarks/planning_time.py` plans Llama: unit gathers, TP collectives, gradient reductions."""
    torch.manual_seed(0)
    return autopar.plan(tiny_llama(layers=layers), "dp=2,tp=2", strategies=[autopar.fsdp(), autopar.tensor_parallel()],
                        example_inputs=token_batch(), **options)


def test_the_nodes_the_check_runs_do_not_grow_with_the_layer_count():
    """Blocks 3.. are copies of block 2 (autopar/compiler/repeated_blocks.py): at 4 and at 8 layers the check
    runs the same nodes forward and sees the same gradients arrive; every further block is
    compared node by node instead. Traced whole, the 8-layer plan runs each of those nodes."""
    four, eight, whole = (check_rank_graphs(plan) for plan in (_llama_plan(4), _llama_plan(8),
                                                              _llama_plan(8, reuse_blocks=False)))
    assert [c.rank for c in eight] == [0, 3]
    for at_four, at_eight, traced_whole in zip(four, eight, whole):
        assert at_four.reused > 0 and at_eight.reused == 5 * at_four.reused  # blocks 3..7 against block 3 alone
        assert (at_eight.executed, at_eight.backward) == (at_four.executed, at_four.backward)
        assert traced_whole.reused == 0 and traced_whole.executed == at_eight.executed + at_eight.reused
        assert traced_whole.backward > at_eight.backward


def test_a_later_pipeline_stage_compares_its_blocks_with_its_own_first():
    """Stage 1 of a two-stage pipeline holds no block 2: its first block is its template, and
    what each stage runs is the same at 8 and at 12 layers."""
    def checked(layers: int) -> list:
        torch.manual_seed(0)
        return check_rank_graphs(autopar.plan(
            tiny_llama(layers=layers), "pp=2,dp=2", strategies=[autopar.pipeline_parallel(microbatches=4),
                                                                 autopar.fsdp()], example_inputs=token_batch(batch=16)))

    eight, twelve = checked(8), checked(12)
    assert [(c.stage, c.rank) for c in twelve] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    for at_eight, at_twelve in zip(eight, twelve):
        assert (at_eight.executed, at_eight.backward) == (at_twelve.executed, at_twelve.backward)
        assert at_twelve.reused > at_eight.reused > 0


def _alter_copied_block(monkeypatch, alter) -> None:
    """Every rank graph the plan emits with `alter(node)` applied to a node of block 3 or 4 (copies
    of block 2): a copy that no longer matches its template."""
    original = plan_module.Plan.rank_graph

    def rank_graph(self, rank, groups=None, *, stage=None):
        gm = original(self, rank, groups, stage=stage)
        alter(gm)
        return gm

    monkeypatch.setattr(plan_module.Plan, "rank_graph", rank_graph)


def _first(gm: torch.fx.GraphModule, target, block: int) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target is target and f".layers.{block}." in module_path(n))


def test_a_copied_block_that_differs_is_run_and_its_failure_caught(monkeypatch):
    """Block 4's first reshape asks for one column more than its input holds: its call no longer
    matches block 2's, so it runs, and fails."""
    def alter(gm):
        node = _first(gm, torch.ops.aten.reshape.default, 4)
        shape = list(node.args[1])
        node.args = (node.args[0], [*shape[:-1], shape[-1] + 1])

    _alter_copied_block(monkeypatch, alter)
    with pytest.raises(PlanError) as error:
        _llama_plan(5)
    text = str(error.value)
    assert "rank 0's graph fails on fake tensors of its local shapes (forward): RuntimeError" in text
    assert "module: model.model.layers.4.self_attn.q_proj" in text


def test_the_nodes_after_a_differing_copy_run_so_its_backward_is_checked(monkeypatch):
    """Block 3's SiLU becomes a kernel whose backward is broken and whose forward keeps the
    shape: every node after it matches its counterpart in block 2, but reads what it computed, so
    runs too; backward then reaches the broken kernel. (Were those nodes given their counterparts'
    results, nothing would read the kernel's output and its backward would never run.)"""
    def alter(gm):
        _first(gm, torch.ops.aten.silu.default, 3).target = wrong_gradient_kernel

    _alter_copied_block(monkeypatch, alter)
    with pytest.raises(PlanError) as error:
        _llama_plan(5)
    text = str(error.value)
    assert "fails on fake tensors of its local shapes (backward)" in text and "invalid gradient" in text
    assert "module: model.model.layers.3.mlp" in text
