"""Bad input is refused at plan time with a message naming the node, op, module, source line and fix."""
from __future__ import annotations

import re
import sys

import pytest
import torch
from torch import nn

import autopar
from autopar import PlanError
from examples.gpt import GPT, GPTConfig, example_batch
from examples.hf_models import CausalLMLoss, token_batch


def plan_gpt(mesh: str, strategies: list, config: GPTConfig = GPTConfig()):
    torch.manual_seed(0)
    return autopar.plan(GPT(config), mesh, strategies=strategies, example_inputs=example_batch(config))


def test_strategy_on_an_axis_the_mesh_lacks():
    with pytest.raises(PlanError, match=r"unknown mesh axis 'tp' \(named by strategy 'tensor_parallel"):
        plan_gpt("dp=2", [autopar.tensor_parallel()])


def test_heads_not_divisible_by_tp_names_the_view_and_source_line():
    config = GPTConfig(n_head=2, d_model=32)
    with pytest.raises(PlanError) as error:
        plan_gpt("tp=4", [autopar.tensor_parallel()], config)
    text = str(error.value)
    assert "does not split evenly over its mesh axis" in text and "aten.view" in text and "heads % tp" in text
    assert "module: layers.0.attn" in text and "examples/gpt.py" in text and "fix:" in text


def test_batch_not_divisible_by_dp():
    with pytest.raises(PlanError, match=r"size 8 cannot be split evenly over mesh axis 'dp' of size 3"):
        plan_gpt("dp=3", [autopar.data_parallel()])


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear(x).sum() > 0:
            return x.sum()
        return x.mean()


def test_untraceable_model_is_a_plan_error_naming_the_module_and_line():
    with pytest.raises(PlanError, match=r"DataDependent could not be traced by torch.export.*\n  fix:") as error:
        autopar.plan(DataDependent(), "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.ones(2, 4),))
    text = str(error.value)
    assert "module: the model (DataDependent)" in text and "test_plan_errors.py:" in text, text
    assert "if self.linear(x).sum() > 0:" in text, text


def test_flex_attention_on_the_cpu_is_refused_with_the_attention_module_and_the_fix(transformers):
    """PyTorch's FlexAttention has no CPU backward: the refusal names the attention module and says sdpa."""
    from transformers import LlamaConfig, LlamaForCausalLM  # an optional dependency: the fixture skips without it

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=128, max_position_embeddings=64, attn_implementation="flex_attention")
    with pytest.raises(PlanError) as error:
        autopar.plan(CausalLMLoss(LlamaForCausalLM(config)), "dp=2", strategies=[autopar.data_parallel()],
                     example_inputs=token_batch())
    text = str(error.value)
    assert 'attn_implementation="sdpa"' in text and "module: model.model.layers.0.self_attn (LlamaAttention)" in text
    assert "line: " in text and "flex_attention" in text, text


@torch.library.custom_op("autopar_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


class UsesMystery(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mystery(self.linear(x)).sum()


def test_op_without_a_rule_names_the_op_module_and_how_to_register():
    with pytest.raises(PlanError) as error:
        autopar.plan(UsesMystery(), "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.ones(2, 4),))
    text = str(error.value)
    assert "autopar_test.mystery" in text and "@autopar.compiler.rules.registry.register" in text
    assert "test_plan_errors.py" in text


def test_unknown_strategy_object_is_refused():
    with pytest.raises(PlanError, match="is not a Strategy"):
        plan_gpt("dp=2", ["dp"])


def test_size_one_axes_insert_nothing():
    plan = plan_gpt("dp=1", [autopar.data_parallel()])
    inserted = {r.name: r.nodes_after - r.nodes_before for r in plan.pass_records}
    assert inserted == {"drop_empty_concats": 0, "causal_masks": 0, "lower_moe": 0, "float8_linears": 0,
                        "propagate_placements": 0, "insert_collectives": 0, "insert_grad_reductions": 0,
                        "split_pipeline": 0, "shard_parameters": 0, "cast_parameters": 0, "cast_outputs": 0,
                        "recompute": 0, "chunk_collectives": 0, "schedule_collectives": 0}
    assert plan.comm.entries == []


def test_a_plan_file_with_shared_memory_collectives_is_refused(tmp_path):
    """Plan files written while autopar had a shared-memory transport: those that moved something
    through it are refused (their ledger would not describe a run); the others read as before."""
    import json

    from autopar.compiler.plan_file import SCHEMA, load_plan

    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": SCHEMA, "collectives": [{"transport": "shared_memory"}]}))
    with pytest.raises(PlanError, match=r"shared-memory transport, which autopar no longer has(.|\n)*fix: regenerate"):
        load_plan(path)
    path.write_text(json.dumps({"schema": SCHEMA, "collectives": [{"kind": "all_reduce"}]}))
    assert load_plan(path).data["collectives"] == [{"kind": "all_reduce"}]


@pytest.mark.parametrize("mesh, strategies", [("dp=2,tp=2", [autopar.tensor_parallel()]), ("tp=2", [])])
def test_a_mesh_axis_no_strategy_uses_is_refused_with_the_fix(mesh, strategies):
    """The batch would be replicated on it: every rank on the axis computing the same thing."""
    unused = "dp" if mesh.startswith("dp") else "tp"
    with pytest.raises(PlanError) as error:
        plan_gpt(mesh, strategies)
    text = str(error.value)
    assert f"mesh axis {unused!r} (size 2) is used by no strategy" in text
    assert f"fix: add a strategy on {unused!r}" in text and f"autopar.replicated({unused!r})" in text


def test_an_axis_declared_replicated_and_size_one_axes_plan():
    config = GPTConfig(n_layer=1)
    replicated = plan_gpt("dp=2,tp=2", [autopar.tensor_parallel(), autopar.replicated("dp")], config)
    assert replicated.comm.count(axis="dp") == 0 and replicated.comm.count(axis="tp") > 0
    assert not any("dp" in axes for axes in replicated.grad_sync_axes().values())
    plan_gpt("dp=2,tp=1", [autopar.data_parallel()], config)


@pytest.mark.parametrize("mesh, strategies, names", [
    ("dp=2", [autopar.data_parallel(), autopar.zero(stage=3)], "data_parallel and zero3"),
    ("dp=2", [autopar.fsdp(), autopar.data_parallel()], "zero3 and data_parallel"),
    ("tp=2", [autopar.data_parallel(axis="tp"), autopar.tensor_parallel()], "data_parallel and tensor_parallel"),
    ("tp=2", [autopar.replicated("tp"), autopar.sequence_parallel()], "replicated and tensor_parallel+sp"),
])
def test_two_strategies_claiming_one_axis_are_refused(mesh, strategies, names):
    axis = mesh.split("=")[0]
    with pytest.raises(PlanError, match=rf"strategies {re.escape(names)} both claim mesh axis '{axis}'(.|\n)*fix:"):
        plan_gpt(mesh, strategies, GPTConfig(n_layer=1))


def test_tensor_and_sequence_parallel_may_share_their_axis():
    plan_gpt("tp=2", [autopar.tensor_parallel(), autopar.sequence_parallel()], GPTConfig(n_layer=1))


def test_a_function_instead_of_a_module_is_refused():
    weight = torch.ones(4, 4, requires_grad=True)
    for model in (lambda x: (x @ weight).sum(), torch.nn.functional.relu):
        with pytest.raises(PlanError, match=r"autopar plans a torch.nn.Module(.|\n)*fix: wrap it in an nn.Module"):
            autopar.plan(model, "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.ones(2, 4),))


class DataDependentRows(nn.Module):
    """Rows picked by value (a mixture of experts' dispatch): an unbacked size in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.nonzero(x[:, 0] > 0).squeeze(1)
        picked = self.linear(x.index_select(0, rows))
        return picked.sum() + torch.cat([picked, picked.new_zeros(0, 4)]).mean()


def test_an_internal_failure_while_planning_is_a_plan_error_in_autopars_words():
    with pytest.raises(PlanError) as error:
        autopar.plan(DataDependentRows(), "tp=2", strategies=[autopar.tensor_parallel()],
                     example_inputs=(torch.randn(8, 4),))
    text = str(error.value)
    print(text)
    assert "module:" in text and "fix:" in text and "internal error:" in text
    assert isinstance(error.value.__cause__, Exception) and not isinstance(error.value.__cause__, PlanError)


def _failing_pass(error: BaseException):
    def explode_at_the_first_linear(program, ctx):
        for node in program.graph_module.graph.nodes:
            if node.target is torch.ops.aten.linear.default or "addmm" in str(node.target):
                raise error
        return program

    return explode_at_the_first_linear


def test_a_pass_failing_inside_is_a_plan_error_naming_the_pass_node_module_and_source(monkeypatch):
    plan_module = sys.modules["autopar.compiler.plan"]
    monkeypatch.setattr(plan_module, "default_passes", lambda: [_failing_pass(RuntimeError("boom\nsecond line"))])
    with pytest.raises(PlanError) as error:
        autopar.plan(UsesMystery(), "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.ones(2, 4),))
    text = str(error.value)
    assert text.startswith("autopar does not support aten.") and "(pass explode_at_the_first_linear failed)" in text
    assert "module: linear" in text and "test_plan_errors.py" in text and "fix:    plan this model without" in text
    assert "  internal error: RuntimeError: boom\n      second line" in text
    assert isinstance(error.value.__cause__, RuntimeError)
    monkeypatch.setattr(plan_module, "default_passes", lambda: [_failing_pass(KeyboardInterrupt())])
    with pytest.raises(KeyboardInterrupt):
        autopar.plan(UsesMystery(), "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.ones(2, 4),))
