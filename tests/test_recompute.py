"""Activation recomputation as a strategy (`autopar.recompute`, `autopar/compiler/passes/recompute.py`).

Numerics (gloo): the example GPT under dp=2×tp=2+SP and ZeRO-3 on dp=4, each with selective and
with full recomputation, trained 3 AdamW steps: loss, whole gradients and parameters equal one
device (fp32 rel <= 1e-5); every collective counted from outside equals the comm ledger, whose
backward now holds each recomputed block's forward collectives a second time; the activations
a forward leaves alive, measured from outside, equal the activation ledger exactly, and the
held bytes the memory ledger. Dropout inside a recomputed block draws the same masks again
(the numerics would differ otherwise).

The same checks for HF Llama under dp=2×tp=2 with full recomputation, and for pipelines (pp=2
GPipe, pp=2×dp=2 1F1B with ZeRO-1) recomputing every stage's blocks.

Plans: what each policy keeps against no recomputation, the extra backward collectives equal
to the recomputed regions' forward ones, the rank graph calling checkpointed regions, the
recomputed FLOPs in the report, and the plan-time refusals.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.compiler.ledger.activations import saved_activations
from autopar.compiler.passes.recompute import RECOMPUTE, is_region_call, recomputed_flops
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.numerics import STEPS, distributed_rank, single_device
from tests.numerics_checks import (assert_cases_match, assert_ledger_equals_measured, assert_matches,
                                   assert_memory_equals_ledger)

# explicit attention: selective recomputation then drops the [b, h, s, s] scores and probabilities
CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64, dropout=0.1,
                   explicit_attention=True)
build = functools.partial(GPT, CONFIG)
BATCHES = [example_batch(CONFIG, batch=8, seed=step) for step in range(STEPS)]
PLAIN = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)

CASES = {
    f"{name}_{policy}": (mesh, strategies + [autopar.recompute(policy)])
    for name, (mesh, strategies) in {
        "dp2_tp2_sp": ("dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()]),
        "zero3_dp4": ("dp=4", [autopar.zero(stage=3)]),
    }.items()
    for policy in ("selective", "full")
}


@pytest.fixture(scope="module")
def reference():
    return single_device(build, BATCHES)


def run_cases(rank: int, world: int, names: list[str]) -> list[dict]:
    return [distributed_rank(rank, world, build, BATCHES, *CASES[name]) for name in names]


def test_recomputation_equals_one_device(reference):
    names = list(CASES)
    per_rank = launch(run_cases, 4, names, timeout_s=150 * len(names))
    assert_cases_match(names, per_rank, reference)


def _plan(policy, mesh="dp=2,tp=2", strategies=None, config=PLAIN):
    torch.manual_seed(0)
    strategies = [autopar.data_parallel(), autopar.sequence_parallel()] if strategies is None else strategies
    return autopar.plan(GPT(config), mesh, strategies=strategies + ([autopar.recompute(policy)] if policy else []),
                        example_inputs=example_batch(config, batch=8, seed=0))


def _forward_collectives(plan, regions):
    """(kind, axis) -> (calls, bytes) of the forward collectives inside recomputed regions."""
    found = {}
    for node in plan.stages[0].graph_module.graph.nodes:
        if node.meta.get(RECOMPUTE) is None:
            continue
        for info in node.meta.get("autopar_collective", []):
            if info.phase == "forward":
                calls, size = found.get((info.kind, info.axis), (0, 0))
                found[(info.kind, info.axis)] = (calls + 1, size + plan.comm.number(info.logical_bytes))
    return found


def test_full_recomputation_keeps_block_inputs_and_runs_the_forward_collectives_again():
    plain, full = _plan(None), _plan("full")
    kept, kept_full = saved_activations(plain, rank=0), saved_activations(full, rank=0)
    assert kept_full.number() < kept.number() / 3, (kept_full.number(), kept.number())
    # what a block's computation leaves kept: its output (the next block's, or the final norm's, input) only
    inside = [e for e in kept_full.entries if e.module.startswith("layers.")]
    assert sorted(e.module for e in inside) == ["layers.0", "layers.1"], [(e.module, e.node) for e in inside]
    # batch 8 over dp=2 leaves 4 rows a rank, which split over tp=2: SP shards the batch (its
    # copy-free token dimension, autopar/compiler/strategies/token_shard.py), [2, 16, 32] of the [8, 16, 32] stream
    assert all(e.op == "getitem" and e.shape == (2, 16, 32) for e in inside), inside
    before, after = plain.comm.by_key(rank=0), full.comm.by_key(rank=0)
    again = _forward_collectives(full, None)
    assert again, "the blocks hold no forward collective under tp=2+SP"
    for (kind, axis), (calls, size) in again.items():
        base = before.get(("backward", kind, axis), (0, 0))
        assert after[("backward", kind, axis)] == (base[0] + calls, base[1] + size)
    assert {k: v for k, v in after.items() if k[0] != "backward"} == {k: v for k, v in before.items() if k[0] != "backward"}
    graph = full.rank_graph(0)
    calls = [n for n in graph.graph.nodes if is_region_call(n)]
    assert [n.target.__self__.name for n in calls] == ["layers.0", "layers.1"]
    flops = recomputed_flops(full.stages[0].graph_module.graph)
    assert set(flops) == {"layers.0", "layers.1"} and all(f > 0 for f in flops.values())
    assert "Recomputation" in full.report() and "layers.0" in full.report()


def _only_inside(entries, core):
    """Bytes of the saved storages produced inside `core` and saved by its nodes alone."""
    return sum(e.number for e in entries if e.node in core and set(e.saved_by) <= core)


@pytest.mark.parametrize("explicit", [False, True], ids=["sdpa", "explicit"])
def test_selective_recomputation_drops_what_only_the_attention_core_keeps(explicit):
    config = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64,
                       explicit_attention=explicit)
    plain, selective = _plan(None, config=config), _plan("selective", config=config)
    core = {n.name for n in selective.stages[0].graph_module.graph.nodes if RECOMPUTE in n.meta}
    regions = {n.meta[RECOMPUTE] for n in selective.stages[0].graph_module.graph.nodes if RECOMPUTE in n.meta}
    assert regions == {"layers.0.attn attention core", "layers.1.attn attention core"}
    kept, kept_selective = saved_activations(plain, rank=0), saved_activations(selective, rank=0)
    dropped = _only_inside(kept.entries, core)
    # fused SDPA keeps its log-sum-exp only for itself (its output is o_proj's input); explicit attention
    # keeps the [b, h_local, s, s] scores and probabilities: at least two fp32 tensors of 4·2·16·16
    assert dropped >= (2 * 4 * 2 * 16 * 16 * 4 if explicit else 2 * 4 * 2 * 16 * 4), dropped
    # what the region saves that nothing saved before: its inputs that only its own nodes read (the -inf
    # scalar of masked_fill, 4 B a layer)
    before = {e.node for e in kept.entries}
    added = sum(e.number for e in kept_selective.entries if e.node not in before)
    assert added <= 4 * CONFIG.n_layer, [e for e in kept_selective.entries if e.node not in before]
    assert kept_selective.number() == kept.number() - dropped + added
    assert selective.comm.by_key(rank=0) == plain.comm.by_key(rank=0)  # no collective inside an attention core


def test_module_globs_recompute_the_matching_modules():
    plan = _plan(["layers.*.mlp"])
    regions = {n.meta[RECOMPUTE] for n in plan.stages[0].graph_module.graph.nodes if RECOMPUTE in n.meta}
    assert regions == {"layers.0.mlp", "layers.1.mlp"}


def test_bad_recompute_declarations_are_refused():
    with pytest.raises(autopar.PlanError, match="expected 'selective', 'full'"):
        autopar.recompute("attention")
    with pytest.raises(autopar.PlanError, match="found no region"):
        _plan(["decoder.*"])
    with pytest.raises(autopar.PlanError, match="declared 2 times"):
        _plan("full", strategies=[autopar.data_parallel(), autopar.tensor_parallel(), autopar.recompute("selective")])
    deep = GPTConfig(vocab_size=128, seq_len=16, n_layer=4, n_head=4, d_model=32, d_ff=64)
    with pytest.raises(autopar.PlanError, match="zb_h1 schedule is not supported yet"):
        _plan("full", mesh="pp=2", strategies=[autopar.pipeline_parallel(schedule="zb_h1", microbatches=2)],
              config=deep)
    with pytest.raises(autopar.PlanError, match="context parallelism is not supported yet"):
        _plan("full", mesh="cp=2", strategies=[autopar.context_parallel()])


def test_the_cli_plans_with_recomputation(capsys):
    from autopar.tools.cli import main

    assert main(["plan", "examples/gpt.py", "--mesh", "dp=2,tp=2", "--strategy", "dp,sp", "--recompute", "full"]) == 0
    printed = capsys.readouterr().out
    assert "Recomputation (full)" in printed and "layers.1" in printed
    assert main(["plan", "examples/gpt.py", "--mesh", "dp=2", "--recompute", "layers.*.mlp"]) == 0
    assert "layers.0.mlp" in capsys.readouterr().out


@pytest.mark.usefixtures("transformers")
def test_hf_llama_with_full_recomputation_under_tensor_parallelism_equals_one_device():
    """A Hugging Face Llama as shipped (rotary tables and the causal mask computed outside the blocks
    and entering each recomputed block as inputs), dp=2 x tp=2 with full recomputation."""
    from examples.hf_models import tiny_llama, token_batch

    batches = [token_batch(batch=8, seq=16, vocab=128, seed=step) for step in range(STEPS)]
    strategies = [autopar.data_parallel(), autopar.tensor_parallel(), autopar.recompute("full")]
    results = launch(distributed_rank, 4, tiny_llama, batches, "dp=2,tp=2", strategies, timeout_s=240)
    reference = single_device(tiny_llama, batches)
    assert_matches(reference, results)
    assert_ledger_equals_measured(results)
    assert_memory_equals_ledger(results, reference)


def test_recomputation_plans_with_symbolic_sizes_on_the_meta_device():
    """Under dynamic dims emission reads sizes off a region's tensors and computes later views' sizes
    from them (outside the planned region): the region takes that arithmetic in and stays one call;
    the plan-time fake run and the ledger pass through it, symbolic in b and s."""
    import sympy

    config = replace(PLAIN, explicit_attention=True)
    with torch.device("meta"):
        model = GPT(config)
    batch = tuple(t.to("meta") for t in example_batch(config, batch=8))
    kept = {}
    for policy in ("selective", "full"):
        plan = autopar.plan(model, "dp=2,tp=2", strategies=[autopar.fsdp(), autopar.sequence_parallel(),
                                                            autopar.recompute(policy)],
                            example_inputs=batch, dynamic_dims={"b": 0, "s": 1})
        ledger = saved_activations(plan, rank=0)
        assert {str(s) for s in sympy.sympify(ledger.total).free_symbols} == {"b", "s"}
        kept[policy] = ledger.number()
        assert sum(is_region_call(n) for n in plan.rank_graph(0).graph.nodes) == 2
    assert kept["full"] < kept["selective"]


def test_recomputation_under_a_pipeline_equals_one_device():
    """pp=2 (GPipe; 1F1B with ZeRO-1 on dp=2) with full recomputation of every block: numerics on
    the same micro-batches, every send/recv and collective counted == ledger (the recomputed ones
    once per micro-batch), held bytes == memory ledger; the stage graphs' sends and receives stay
    outside the regions (they would be sent twice)."""
    from tests import test_pipeline_numerics as pipeline

    cases = [pipeline.case("gpt", "pp=2", "gpipe"), pipeline.case("gpt", "pp=2,dp=2", "1f1b", data="zero1")]
    for one in cases:
        one["strategies"] = one["strategies"] + [autopar.recompute("full")]
        one["name"] += "-recompute_full"
    two = launch(pipeline.run_cases, 2, cases[:1], timeout_s=300)
    four = launch(pipeline.run_cases, 4, cases[1:], timeout_s=300)
    pipeline.check(cases[:1], two)
    pipeline.check(cases[1:], four)
