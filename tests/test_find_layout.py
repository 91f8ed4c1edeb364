"""Graph-only tests of the tensor-parallel layout finder (`autopar/compiler/strategies/find_layout.py`): the
Megatron pattern is found by the graph's structure whatever the modules are called, the report
says which pattern decided each parameter, and what cannot be sharded stays replicated with the
reason or is refused by name."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import autopar
from autopar import PlanError
from autopar.compiler.strategies.layouts import EXAMPLE_GPT
from examples.gpt import GPT, GPTConfig, example_batch


def tp_plan(model: nn.Module, batch: tuple, mesh: str = "tp=2", **kwargs) -> autopar.Plan:
    return autopar.plan(model, mesh, strategies=[autopar.tensor_parallel(**kwargs)], example_inputs=batch)


def tp_strategy(plan: autopar.Plan):
    return next(s for s in plan.strategy.strategies if s.axis == "tp")


def test_example_gpt_found_equals_the_declared_layout():
    torch.manual_seed(0)
    model, batch = GPT(GPTConfig()), example_batch(GPTConfig())
    found, declared = tp_plan(model, batch), tp_plan(model, batch, layout=EXAMPLE_GPT)
    assert found.parameter_placements() == declared.parameter_placements()
    assert found.comm.by_key() == declared.comm.by_key()
    origin = found.strategy.param_origin("layers.1.mlp.down_proj.weight")
    assert "row of mlp pattern in layers.1.mlp: up_proj -> gelu -> down_proj" in origin
    origin = found.strategy.param_origin("layers.0.attn.k_proj.bias")
    assert "column of attention pattern in layers.0.attn" in origin and "scaled_dot_product_attention" in origin
    assert "vocabulary-parallel embedding" in found.strategy.param_origin("embed_tokens.weight")
    assert "vocabulary-parallel head" in found.strategy.param_origin("lm_head.weight")


class Mixer(nn.Module):
    """Projections named like no built-in layout; a fused gate|up taken apart with chunk."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(width, 4 * width)
        self.w_out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * value)


class Mixing(nn.Module):
    """A normalisation over all features between the projections: not a Megatron pattern."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(width, 2 * width)
        self.w_out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.layer_norm(self.w_in(x), (x.shape[-1] * 2,)))


class Net(nn.Module):
    def __init__(self, block: type, width: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.trunk = nn.ModuleList([block(width), Mixer(width)])
        self.readout = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        for layer in self.trunk:
            x = x + layer(x)
        return F.cross_entropy(self.readout(x).flatten(0, 1), targets.flatten())


def net_batch(vocab: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 8), generator=generator)
    return ids, ids.roll(1, dims=1)


def test_pattern_found_by_structure_with_a_fused_column():
    torch.manual_seed(0)
    plan = tp_plan(Net(Mixer), net_batch())
    placements = plan.parameter_placements()
    assert placements["trunk.0.w_in.weight"] == (_StridedShard(0, split_factor=2),)
    assert placements["trunk.0.w_in.bias"] == (_StridedShard(0, split_factor=2),)
    assert placements["trunk.0.w_out.weight"] == (Shard(1),) and placements["trunk.0.w_out.bias"] == (Replicate(),)
    assert placements["tokens.weight"] == placements["readout.weight"] == (Shard(0),)
    assert "column of mlp pattern in trunk.0: w_in -> mul, silu" in plan.strategy.param_origin("trunk.0.w_in.weight")


def test_a_mixing_op_between_projections_leaves_that_block_replicated_with_the_reason():
    torch.manual_seed(0)
    plan = tp_plan(Net(Mixing), net_batch())
    placements = plan.parameter_placements()
    assert placements["trunk.0.w_in.weight"] == (Replicate(),) == placements["trunk.0.w_out.weight"]
    assert placements["trunk.1.w_in.weight"] == (_StridedShard(0, split_factor=2),)
    (note,) = [n for n in tp_strategy(plan).notes if "trunk.0" in n]
    assert "mlp pattern in trunk.0 (w_in -> native_layer_norm -> w_out) not sharded" in note
    assert "communication inside the pattern" in note
    assert "not sharded: " in plan.strategy.param_origin("trunk.0.w_in.weight")


class NoPattern(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).pow(2).mean()


def test_a_model_without_the_pattern_is_refused_with_the_fix():
    with pytest.raises(PlanError, match=r"no tensor-parallel pattern found in the traced graph[\s\S]*fix: declare"):
        tp_plan(NoPattern(), (torch.randn(4, 8),))


transformers = pytest.importorskip("transformers")
from examples.hf_models import tiny_causal_lm, tiny_gpt2, tiny_llama, token_batch  # noqa: E402


def test_hf_gpt2_fused_qkv_is_block_sharded():
    torch.manual_seed(0)
    placements = tp_plan(tiny_gpt2(), token_batch()).parameter_placements()
    assert placements["model.transformer.h.0.attn.c_attn.weight"] == (_StridedShard(1, split_factor=3),)
    assert placements["model.transformer.h.0.mlp.c_fc.weight"] == (Shard(1),)
    assert placements["model.transformer.h.0.mlp.c_proj.weight"] == (Shard(0),)


def test_key_value_heads_fewer_than_the_axis_are_replicated():
    torch.manual_seed(0)
    plan = tp_plan(tiny_llama(kv_heads=2), token_batch(), mesh="tp=4")
    placements = plan.parameter_placements()
    assert placements["model.model.layers.0.self_attn.q_proj.weight"] == (Shard(0),)
    assert placements["model.model.layers.0.self_attn.k_proj.weight"] == (Replicate(),)
    assert placements["model.model.layers.0.self_attn.o_proj.weight"] == (Shard(1),)
    assert "fewer heads than the axis" in plan.strategy.param_origin("model.model.layers.0.self_attn.v_proj.weight")


def test_a_full_width_query_norm_leaves_attention_replicated_and_shards_the_mlp():
    """OLMo-2 normalises q over all heads' features (RMSNorm of num_heads * head_dim)."""
    torch.manual_seed(0)
    plan = tp_plan(tiny_causal_lm("olmo2"), token_batch())
    placements = plan.parameter_placements()
    assert placements["model.model.layers.0.self_attn.q_proj.weight"] == (Replicate(),)
    assert placements["model.model.layers.0.mlp.up_proj.weight"] == (Shard(0),)
    assert any("attention pattern in model.model.layers.0.self_attn" in n for n in tp_strategy(plan).notes)
