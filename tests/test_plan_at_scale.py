"""Plan-only at scale: a Llama-shaped model on the meta device, dp=8 x tp=8 (64 ranks, 8 per
node) planned in one process with symbolic batch and sequence; the TP ledger equals Megatron's
formula exactly (2 all-reduces of b*s*h per layer forward, 2 backward; with SP an all-gather and
a reduce-scatter of the same volume for each), and the DP gradient sync moves the local
parameter bytes once."""
from __future__ import annotations

import re
from collections import defaultdict

import pytest
import sympy
import torch

import autopar
from examples.hf_models import CausalLMLoss

HIDDEN, LAYERS, DP, TP = 4096, 4, 8, 8
b, s = sympy.symbols("b s", positive=True, integer=True)
LOCAL_ACTIVATION = 4 * (b / DP) * s * HIDDEN  # fp32 bytes of one rank's b*s*h


def llama_on_meta(transformers) -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=11008, num_hidden_layers=LAYERS,
                                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                      max_position_embeddings=4096, use_cache=False, attn_implementation="sdpa",
                                      tie_word_embeddings=False)
    with torch.device("meta"):
        return CausalLMLoss(transformers.LlamaForCausalLM(config))


def plan_llama(transformers, tp_strategy) -> autopar.Plan:
    ids = torch.zeros(16, 256, dtype=torch.long)
    return autopar.plan(llama_on_meta(transformers), autopar.Mesh(dp=DP, tp=TP, ranks_per_node=8),
                        strategies=[autopar.data_parallel(), tp_strategy], example_inputs=(ids, ids),
                        dynamic_dims={"b": 0, "s": 1})


def per_layer(plan: autopar.Plan) -> dict[tuple[int, str, str], list]:
    layers = defaultdict(list)
    for entry in plan.comm.entries:
        match = re.search(r"layers\.(\d+)\.", entry.module + ".")
        if match and entry.axis == "tp":
            layers[(int(match.group(1)), entry.phase, entry.kind)].append(entry.logical_bytes)
    return layers


@pytest.fixture(scope="module")
def tp_plan(transformers):
    return plan_llama(transformers, autopar.tensor_parallel())


@pytest.fixture(scope="module")
def sp_plan(transformers):
    return plan_llama(transformers, autopar.sequence_parallel())


def test_tensor_parallel_ledger_is_megatron_formula(tp_plan):
    layers = per_layer(tp_plan)
    assert {key[0] for key in layers} == set(range(LAYERS))
    for layer in range(LAYERS):
        for phase in ("forward", "backward"):
            volumes = layers[(layer, phase, "all_reduce")]
            assert len(volumes) == 2, (layer, phase, volumes)
            assert all(sympy.simplify(v - LOCAL_ACTIVATION) == 0 for v in volumes)
        assert set(k for (l, _, k) in layers if l == layer) == {"all_reduce"}


def test_sequence_parallel_ledger_is_all_gather_plus_reduce_scatter(sp_plan):
    layers = per_layer(sp_plan)
    for layer in range(LAYERS):
        for phase in ("forward", "backward"):
            for kind in ("all_gather", "reduce_scatter"):
                volumes = layers[(layer, phase, kind)]
                assert len(volumes) == 2, (layer, phase, kind, volumes)
                assert all(sympy.simplify(v - LOCAL_ACTIVATION) == 0 for v in volumes)


def test_sequence_parallel_moves_the_same_tp_volume_in_half_the_wire_bytes(tp_plan, sp_plan):
    tp_total = sum(sum(v) for v in per_layer(tp_plan).values())
    sp_total = sum(sum(v) for v in per_layer(sp_plan).values())
    assert sympy.simplify(sp_total - 2 * tp_total) == 0  # each all-reduce of S became AG(S) + RS(S)
    tp_wire = sum(e.wire_bytes for e in tp_plan.comm.entries if re.search(r"layers\.\d+\.", e.module + "."))
    sp_wire = sum(e.wire_bytes for e in sp_plan.comm.entries if re.search(r"layers\.\d+\.", e.module + "."))
    assert sympy.simplify(sp_wire - tp_wire) == 0  # NCCL busbw: 2(N-1)/N*S == 2 * (N-1)/N*S


def test_data_parallel_syncs_every_local_parameter_byte_once_over_the_slow_link(tp_plan):
    local_bytes = 0
    for fqn, placements in tp_plan.parameter_placements().items():
        shape = tp_plan.traced.state[fqn].shape
        local_bytes += shape.numel() * 4 // (TP if any(isinstance(p, torch.distributed.tensor.Shard) for p in placements) else 1)
    assert tp_plan.comm.total(axis="dp", phase="grad_sync") == local_bytes
    # LEDGER.md: DDP moves one all-reduce of the gradients, 2(N-1)/N of their bytes on the wire
    assert tp_plan.comm.total(axis="dp", phase="grad_sync", wire=True) == sympy.Rational(2 * (DP - 1), DP) * local_bytes
    assert {e.link for e in tp_plan.comm.entries if e.axis == "dp"} == {"inter"}
    assert {e.link for e in tp_plan.comm.entries if e.axis == "tp"} == {"intra"}


def test_ledger_numbers_follow_the_traced_shapes(tp_plan):
    per_step = tp_plan.comm.number(LOCAL_ACTIVATION)
    assert per_step == 4 * (16 // DP) * 256 * HIDDEN


def test_planning_under_fake_tensor_mode():
    """A model whose parameters are fake tensors (no storage) plans like a real one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from examples.gpt import GPT, GPTConfig, example_batch

    config = GPTConfig(vocab_size=4096, seq_len=128, n_layer=2, n_head=16, d_model=2048, d_ff=8192)
    batch = example_batch(config, batch=16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        plan = autopar.plan(GPT(config), "dp=4,tp=8", strategies=[autopar.data_parallel(), autopar.tensor_parallel()],
                            example_inputs=batch)
    assert plan.comm.count(axis="tp", kind="all_reduce", phase="forward") == 2 * config.n_layer + 4
    assert plan.comm.total(axis="tp", phase="forward", kind="all_reduce") > 0
