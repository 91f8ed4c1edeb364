"""Graph-only tests of the passes on traced example graphs: placements, inserted nodes, their
deduplication and conjugates, and golden per-rank code (AUTOPAR_UPDATE_GOLDEN=1 rewrites it,
prints the diff and fails unless AUTOPAR_ACCEPT=1 accepts it; a change to the golden files must
say why)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.core.ir import SPEC
from autopar.compiler.passes.insert_grad_reductions import GRAD_SYNC
from autopar.core.ops import collectives, in_flight
from autopar.tools.testing import rewrite_reference
from examples.gpt import GPT, GPTConfig, example_batch

CONFIG = GPTConfig(n_layer=2)
GOLDEN = Path(__file__).parent / "golden"


def plan_for(mesh: str, strategies: list) -> autopar.Plan:
    torch.manual_seed(0)
    return autopar.plan(GPT(CONFIG), mesh, strategies=strategies, example_inputs=example_batch(CONFIG))


def calls(plan: autopar.Plan, target) -> list[torch.fx.Node]:
    return [n for n in plan.graph_module.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.fixture(scope="module")
def tp_plan():
    return plan_for("tp=2", [autopar.tensor_parallel()])


@pytest.fixture(scope="module")
def sp_plan():
    return plan_for("tp=2", [autopar.sequence_parallel()])


def test_megatron_parameter_placements(tp_plan):
    placements = tp_plan.parameter_placements()
    assert placements["layers.0.attn.q_proj.weight"] == (Shard(0),)
    assert placements["layers.0.attn.q_proj.bias"] == (Shard(0),)
    assert placements["layers.0.attn.o_proj.weight"] == (Shard(1),)
    assert placements["layers.0.attn.o_proj.bias"] == (Replicate(),)
    assert placements["embed_tokens.weight"] == (Shard(0),) == placements["lm_head.weight"]
    assert placements["layers.0.attn_norm.weight"] == (Replicate(),)


def test_tp_inserts_g_forward_and_one_shared_f_per_block(tp_plan):
    # g: embedding + o_proj + down_proj per layer + the loss; f: attention and MLP input per layer + lm_head input
    assert len(calls(tp_plan, collectives.all_reduce)) == 1 + 2 * CONFIG.n_layer + 1
    f_nodes = calls(tp_plan, collectives.grad_all_reduce)
    assert len(f_nodes) == 2 * CONFIG.n_layer + 1
    attention_f = [n for n in f_nodes if "attn_norm" in str(n.meta.get("nn_module_stack"))]
    # q, k, v share it (through its finish: the scheduling pass deferred it, autopar/compiler/passes/schedule_collectives.py)
    landed = [next((u for u in n.users if u.target is in_flight.finish), n) for n in attention_f]
    assert len(attention_f) == CONFIG.n_layer and all(len(n.users) == 3 for n in landed)


def test_tp_activations_are_head_sharded_inside_attention(tp_plan):
    sdpa = [n for n in tp_plan.graph_module.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == CONFIG.n_layer and all(n.meta[SPEC].placements == (Shard(1),) for n in sdpa)


def test_sp_all_gathers_reduce_scatter_their_gradients(sp_plan):
    gathers = calls(sp_plan, collectives.all_gather)
    assert len(gathers) == 2 * CONFIG.n_layer + 1
    assert all(n.kwargs["grad_partial"] for n in gathers)
    assert not calls(sp_plan, collectives.grad_all_reduce)
    assert len(calls(sp_plan, collectives.reduce_scatter)) == 2 * CONFIG.n_layer + 1
    norms = [fqn for fqn, axes in sp_plan.grad_sync_axes().items() if axes]
    assert "layers.0.attn_norm.weight" in norms and "embed_positions.weight" in norms


@pytest.mark.parametrize("mesh, batch, sequence_dim, dim", [
    ("tp=2", 4, None, 0),  # the batch splits over tp: each rank's tokens are one contiguous block
    ("tp=2", 1, None, 1),  # one sequence: its chunks are contiguous blocks
    ("dp=2,tp=2", 2, None, 1),  # one row a dp rank: the sequence, as above
    ("dp=2,tp=2", 8, None, 0),
    ("tp=2,dp=2", 8, None, 1),  # dp, the inner axis, cut the batch: tp's piece of it would be out of mesh order
    ("tp=2", 3, None, 1),  # the batch does not split: the sequence, one layout copy per gather
    ("tp=2", 4, 1, 1),  # pinned
])
def test_sp_shards_the_token_dimension_that_needs_no_copies(mesh, batch, sequence_dim, dim):
    torch.manual_seed(0)
    strategies = [autopar.data_parallel()] if "dp" in mesh else []
    plan = autopar.plan(GPT(CONFIG), mesh, strategies=strategies + [autopar.sequence_parallel(sequence_dim=sequence_dim)],
                        example_inputs=example_batch(CONFIG, batch=batch))
    moved = calls(plan, collectives.all_gather) + calls(plan, collectives.reduce_scatter)
    assert len(moved) == 2 * (2 * CONFIG.n_layer + 1)
    assert {n.kwargs["dim"] for n in moved} == {dim}
    block_output = next(n for n in plan.graph_module.graph.nodes if n.target is collectives.reduce_scatter)
    assert block_output.meta[SPEC].placements[plan.mesh.names.index("tp")] == Shard(dim)


def test_dp_syncs_every_parameter_in_buckets_and_inserts_no_f():
    plan = plan_for("dp=2", [autopar.data_parallel()])
    assert set(plan.grad_sync_axes().values()) == {("dp",)}
    assert not calls(plan, collectives.grad_all_reduce)
    bucketed = sorted(fqn for bucket in plan.buckets for fqn in bucket.params)
    assert bucketed == sorted(plan.parameter_placements())
    params = [n for n in plan.graph_module.graph.nodes if n.op == "placeholder" and GRAD_SYNC in n.meta]
    assert len(params) == len(bucketed)


def test_rank_graphs_differ_only_in_rank_constants(tp_plan):
    rank0, rank1 = tp_plan.rank_graph(0).code, tp_plan.rank_graph(1).code
    differing = [(a, b) for a, b in zip(rank0.splitlines(), rank1.splitlines()) if a != b]
    assert differing and all("index = 0" in a and "index = 1" in b for a, b in differing)


@pytest.mark.parametrize("name, mesh, strategy", [
    ("example_gpt_tp2_rank1", "tp=2", "tp"),
    ("example_gpt_dp2_tp2_sp_rank3", "dp=2,tp=2", "dp+sp"),
])
def test_golden_rank_code(name, mesh, strategy):
    makers = {"dp": autopar.data_parallel, "tp": autopar.tensor_parallel, "sp": autopar.sequence_parallel}
    plan = plan_for(mesh, [makers[s]() for s in strategy.split("+")])
    code = plan.rank_graph(int(name[-1])).code.strip() + "\n"
    path = GOLDEN / f"{name}.py.txt"
    if os.environ.get("AUTOPAR_UPDATE_GOLDEN") == "1":
        rewrite_reference(path, code)
    assert code == path.read_text(), (f"emitted code of {name} changed; AUTOPAR_UPDATE_GOLDEN=1 rewrites it and "
                                      f"shows the diff, AUTOPAR_ACCEPT=1 accepts it")
