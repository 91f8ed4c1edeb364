"""Bad input is refused at plan time with a message naming the node, op, module, source line and fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar import PlanError
from examples.gpt import GPT, GPTConfig, example_batch


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


def test_untraceable_model_is_a_plan_error():
    with pytest.raises(PlanError, match=r"DataDependent could not be traced by torch.export.*\n  fix:"):
        autopar.plan(DataDependent(), "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.ones(2, 4),))


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
    assert inserted == {"drop_empty_concats": 0, "lower_moe": 0, "propagate_placements": 0, "insert_collectives": 0,
                        "insert_grad_reductions": 0, "split_pipeline": 0, "shard_parameters": 0, "recompute": 0,
                        "chunk_collectives": 0, "schedule_collectives": 0}
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
