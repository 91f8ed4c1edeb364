"""Repeated blocks traced once (autopar/compiler/repeated_blocks.py) give the plan a full trace gives.

Each case plans a model with 4-6 equal blocks twice — exporting every block (`reuse_blocks=False`)
and exporting three and copying the third — and compares, node for node in graph order: the op,
the module path, the placements (`SPEC`), the placements each argument must have (`ARG_SPECS`),
the inserted collectives; then the placeholders (names, parameters, positions), every
parameter's placements and gradient-sync axes, the ZeRO units, the gradient buckets and the
communication ledger. The only difference allowed is the name fx gives a copied node: the
reused plan's records are compared with its node names read as the full plan's. Concrete-shape cases also run each plan's rank graphs on
fake tensors at plan time (`check_rank_graphs`): every block of the full plan's, the distinct
blocks of the reused plan's, whose copies are compared with block 2 node by node.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import autopar
from autopar.core.ir import ARG_SPECS, COLLECTIVE, SPEC, module_stack
from autopar.compiler.repeated_blocks import find_repeated_blocks


def _target(node: torch.fx.Node) -> str:
    return getattr(node.target, "__qualname__", str(node.target)) if node.op == "call_function" else str(node.target)


def _renamed(record, names: dict[str, str]):
    """A collective record (or a list of them) with the reused plan's node names read as the full
    plan's (in `tensor` and in the `why` text)."""
    if isinstance(record, (list, tuple)):
        return [_renamed(r, names) for r in record]
    if not dataclasses.is_dataclass(record):
        return record
    why = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda word: names.get(word.group(0), word.group(0)), record.why)
    return dataclasses.replace(record, tensor=names.get(record.tensor, record.tensor), why=why)


def assert_same_plan(full: autopar.Plan, reused: autopar.Plan) -> None:
    full_nodes, reused_nodes = list(full.graph_module.graph.nodes), list(reused.graph_module.graph.nodes)
    assert len(full_nodes) == len(reused_nodes)
    names = {b.name: a.name for a, b in zip(full_nodes, reused_nodes)}
    for a, b in zip(full_nodes, reused_nodes):
        where = f"{a.format_node()} vs {b.format_node()}"
        assert (a.op, _target(a), module_stack(a)) == (b.op, _target(b), module_stack(b)), where
        assert a.meta.get(SPEC) == b.meta.get(SPEC), where
        assert a.meta.get(ARG_SPECS) == b.meta.get(ARG_SPECS), where
        assert a.meta.get(COLLECTIVE) == _renamed(b.meta.get(COLLECTIVE), names), where
        if a.op == "placeholder":
            assert a.name == b.name
    assert full.traced.placeholders == reused.traced.placeholders
    assert list(full.traced.state) == list(reused.traced.state)
    assert full.parameter_placements() == reused.parameter_placements()
    assert full.grad_sync_axes() == reused.grad_sync_axes()
    assert [(u.index, u.params) for u in full.units] == [(u.index, u.params) for u in reused.units]
    assert full.buckets == reused.buckets
    assert full.comm.entries == _renamed(reused.comm.entries, names)


def _both(model: torch.nn.Module, mesh: str, strategies: list, inputs: tuple, **options) -> tuple:
    full = autopar.plan(model, mesh, strategies=strategies, example_inputs=inputs, reuse_blocks=False, **options)
    reused = autopar.plan(model, mesh, strategies=strategies, example_inputs=inputs, **options)
    assert reused.traced.copied_blocks and not full.traced.copied_blocks
    return full, reused


def test_llama_fsdp_tp_symbolic_is_the_full_plan(transformers):
    from examples.hf_models import tiny_llama, token_batch

    torch.manual_seed(0)
    model = tiny_llama(layers=5, kv_heads=2)
    full, reused = _both(model, "dp=2,tp=2", [autopar.fsdp(), autopar.tensor_parallel()], token_batch(),
                         dynamic_dims={"b": 0, "s": 1})
    assert_same_plan(full, reused)


def test_example_gpt_dp_sp_is_the_full_plan_and_its_rank_graphs_run():
    from examples.gpt import GPT, GPTConfig, example_batch

    config = GPTConfig(n_layer=5)
    torch.manual_seed(0)
    full, reused = _both(GPT(config), "dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()],
                         example_batch(config))
    assert_same_plan(full, reused)
    assert reused.rank_graph(3).code.count("layers_4") > 0


def test_example_gpt_pipeline_zero_is_the_full_plan():
    from examples.gpt import GPT, GPTConfig, example_batch

    config = GPTConfig(n_layer=6)
    torch.manual_seed(0)
    full, reused = _both(GPT(config), "pp=2,dp=2", [autopar.pipeline_parallel(schedule="1f1b", microbatches=2),
                                                    autopar.zero(stage=2)], example_batch(config))
    assert_same_plan(full, reused)
    assert [s.graph_module.code for s in full.stages] != []
    assert [len(s.graph_module.graph.nodes) for s in full.stages] == [len(s.graph_module.graph.nodes)
                                                                       for s in reused.stages]


def test_blocks_that_differ_are_traced_whole(transformers):
    from examples.hf_models import tiny_llama

    model = tiny_llama(layers=5)
    assert find_repeated_blocks(model) == ("model.model.layers", 5)
    model.model.model.layers[3].mlp.act_fn = torch.nn.ReLU()
    assert find_repeated_blocks(model) is None
    assert find_repeated_blocks(tiny_llama(layers=3)) is None  # three traced: nothing to save


@pytest.mark.parametrize("kind", ["gpt2"])
def test_hf_gpt2_tp_is_the_full_plan(transformers, kind):
    from examples.hf_models import tiny_gpt2, token_batch

    torch.manual_seed(0)
    full, reused = _both(tiny_gpt2(layers=4), "tp=2", [autopar.tensor_parallel()], token_batch())
    assert_same_plan(full, reused)


def test_hf_qwen3_moe_with_its_lifted_constants_is_the_full_plan(transformers):
    """Qwen3-MoE's attention lifts two empty KV-cache tensors per block, numbered over the whole
    model: the blocks are still copied, the copies' constants numbered on as export numbers them."""
    from examples.hf_models import tiny_causal_lm, token_batch

    torch.manual_seed(0)
    full, reused = _both(tiny_causal_lm("qwen3_moe", num_hidden_layers=5), "ep=2", [autopar.expert_parallel()],
                         token_batch())
    assert reused.traced.copied_blocks == "model.model.layers.3-4"
    assert_same_plan(full, reused)


class _Numbered(torch.nn.Module):
    """A block adding its own index, made in forward: a lifted constant whose value differs per block."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.tensor([float(self.layer_idx)])


class _NumberedBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Numbered(i) for i in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_blocks_whose_lifted_constants_differ_are_traced_whole():
    """Blocks alike but for `layer_idx` (`find_repeated_blocks` lets it differ) that make a constant
    from it in forward: copying the third block would give every later block its constant 2."""
    model = _NumberedBlocks()
    assert find_repeated_blocks(model) == ("layers", 5)
    plan = autopar.plan(model, "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.randn(4, 8),))
    assert not plan.traced.copied_blocks
    values = sorted(float(v) for k, v in plan.traced.state.items() if "lifted_tensor" in k)
    assert values == [0.0, 1.0, 2.0, 3.0, 4.0]


def _dropped_and_exported(model: torch.nn.Module, path: str, mesh: str, strategies: list, inputs: tuple) -> tuple:
    """The one-block plan twice: its trace the two-block trace less its last block (what the planner at
    scale does, `block_ledgers.measure_layout`), and exported."""
    from autopar.compiler.repeated_blocks import truncated
    from autopar.compiler.trace import reuse_shortened, reused_trace, reusing_traces

    def one_block() -> autopar.Plan:
        return autopar.plan(model, mesh, strategies=strategies, example_inputs=inputs, reuse_blocks=False)

    with reusing_traces():
        with truncated(model, path, 2):
            one_block()
            longer = reused_trace(model, inputs, reuse_blocks=False)
        with truncated(model, path, 1):
            if not reuse_shortened(model, inputs, None, longer, path=path, count=2, reuse_blocks=False):
                return None, None
            assert reused_trace(model, inputs, reuse_blocks=False).seconds == {"export (last block dropped)": 0.0}
            dropped = one_block()
    with truncated(model, path, 1):
        exported = one_block()
    return exported, dropped


@pytest.mark.parametrize("case", ["gpt_dp_sp", "llama_tp", "moe_ep", "qwen3_moe_ep"])
def test_a_block_dropped_from_a_trace_is_the_shorter_models_plan(case, transformers):
    """The planner at scale's one-block plans read the two-block trace less its last block; where
    the blocks are not a chain (the MoE's auxiliary loss, after the blocks, reads every block's
    router statistics) the block is not dropped and the one-block model is exported, nor where the
    blocks lift constants (Qwen3-MoE's attention: two empty KV-cache tensors per block)."""
    from examples.gpt import GPT, GPTConfig, example_batch
    from examples.hf_models import tiny_causal_lm, tiny_llama, token_batch
    from examples.moe import MoEConfig, MoEGPT

    torch.manual_seed(0)
    if case == "gpt_dp_sp":
        config = GPTConfig(n_layer=4)
        model, path, mesh, strategies, inputs = (GPT(config), "layers", "dp=2,tp=2",
                                                 [autopar.data_parallel(), autopar.sequence_parallel()],
                                                 example_batch(config))
    elif case == "llama_tp":
        model, path, mesh, strategies, inputs = (tiny_llama(layers=4, kv_heads=2), "model.model.layers", "tp=2",
                                                 [autopar.tensor_parallel()], token_batch())
    elif case == "qwen3_moe_ep":
        model, path, mesh, strategies, inputs = (tiny_causal_lm("qwen3_moe", num_hidden_layers=4), "model.model.layers",
                                                 "ep=2", [autopar.expert_parallel()], token_batch())
    else:
        config = MoEConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, d_model=32, n_experts=4, top_k=2, d_expert=32)
        model, path, mesh, strategies, inputs = (MoEGPT(config), "layers", "ep=2", [autopar.expert_parallel()],
                                                 example_batch(config, batch=4))
    exported, dropped = _dropped_and_exported(model, path, mesh, strategies, inputs)
    if case in ("moe_ep", "qwen3_moe_ep"):
        assert dropped is None
        return
    assert_same_plan(exported, dropped)
    assert exported.traced.state_keys == dropped.traced.state_keys
    assert exported.traced.aliases == dropped.traced.aliases
    assert exported.memory(rank=0).by_category() == dropped.memory(rank=0).by_category()
