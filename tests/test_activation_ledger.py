"""The activation ledger (`autopar.compiler.ledger.activations`).

1. Measured: the example GPT as a plain module and on gloo processes (dp=1, dp=2, tp=2); the
   bytes one real forward leaves alive for backward (`autopar.measure.activations`: storages
   allocated in the forward and alive after it, seen by a dispatch mode through any saved-tensor
   hooks; the inputs copied inside, the loss left out) equal the ledger's figure for that rank,
   exactly. (The numerics tests measure every forward of every case the same way.)
2. Korthikanti et al. 2022, plan-only and symbolic in b and s: the standard transformer layer
   (`examples/standard_transformer.py`, bf16, h=64, a=8) saves per layer
   s·b·h·(34 + 5·a·s/h) bytes without parallelism, s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor
   parallelism, s·b·h/t·(34 + 5·a·s/h) with sequence parallelism and 34·s·b·h/t with selective
   recomputation of the attention core on top, plus the remainders named below, each checked
   exactly against the ledger entries that make it up; on CPU kernels and on meta kernels (which
   save what CUDA's do for these ops).
"""
from __future__ import annotations

import pytest
import sympy
import torch

import autopar
from autopar.compiler.ledger.activations import saved_activations
from autopar.compiler.trace import reusing_traces
from autopar.measure.activations import measure_saved_activations
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from examples.standard_transformer import StandardConfig, example

GPT_CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
STANDARD = StandardConfig(n_layer=2, n_head=8, d_model=64, dropout=0.1)
b, s = sympy.symbols("b s", positive=True, integer=True)
h, a = STANDARD.d_model, STANDARD.n_head


def measured_and_ledger(rank: int, world_size: int, mesh: str, strategies: list) -> dict:
    torch.manual_seed(0)
    batch = example_batch(GPT_CONFIG, batch=4)
    module = autopar.parallelize(GPT(GPT_CONFIG), mesh, strategies=strategies, example_inputs=batch)
    with measure_saved_activations() as measured:
        loss = measured.call(module, *module.local_batch(*batch))
    loss.backward()
    ledger = saved_activations(module.plan, rank=rank)
    selective = saved_activations(module.plan, rank=rank, recompute="attention")
    return {"measured": measured.bytes, "ledger": ledger.number(), "selective": selective.number(),
            "table": ledger.table()}


@pytest.mark.timeout(60)
def test_single_device_ledger_equals_the_plain_model():
    """The original nn.Module (F.linear, F.cross_entropy, ...) saves what the dp=1 rank graph saves."""
    torch.manual_seed(0)
    model, batch = GPT(GPT_CONFIG), example_batch(GPT_CONFIG, batch=4)
    plan = autopar.plan(model, "dp=1", strategies=[autopar.data_parallel()], example_inputs=batch,
                        dynamic_dims={"b": 0, "s": 1})
    with measure_saved_activations() as measured:
        loss = measured.call(model, *batch)
    assert loss.grad_fn is not None  # the graph (what backward needs) was alive when the window closed
    ledger = saved_activations(plan)
    assert measured.bytes == ledger.number() > 0, ledger.table()
    # symbolic apart from SDPA's fp32 logsumexp [b, heads, s] per layer, allocated inside the kernel
    internal = [e for e in ledger.entries if e.internal]
    assert [e.op for e in internal] == ["aten.scaled_dot_product_attention.default"] * GPT_CONFIG.n_layer
    assert all(e.number == 4 * 4 * GPT_CONFIG.n_head * GPT_CONFIG.seq_len for e in internal)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mesh, strategies", [("dp=1", [autopar.data_parallel()]),
                                              ("dp=2", [autopar.data_parallel()]),
                                              ("tp=2", [autopar.tensor_parallel()])])
def test_ledger_equals_what_autograd_saves(mesh, strategies):
    results = launch(measured_and_ledger, autopar.Mesh.parse(mesh).world_size, mesh, strategies, timeout_s=150)
    for rank, result in enumerate(results):
        assert result["measured"] == result["ledger"], f"rank {rank}\n{result['table']}"
        # the example GPT uses fused SDPA: no explicit attention core, nothing to drop
        assert result["selective"] == result["ledger"]


@pytest.fixture(scope="module")
def plans() -> dict[str, autopar.Plan]:
    model, batch = example(batch=3, seq=16, config=STANDARD)

    def one(mesh: str, strategies: list) -> autopar.Plan:
        return autopar.plan(model, mesh, strategies=strategies, example_inputs=batch, dynamic_dims={"b": 0, "s": 1})

    with reusing_traces():  # one model, traced once: each plan gets its own copy of the graph, as the planner's do
        return {"none": one("tp=1", []), "tp2": one("tp=2", [autopar.tensor_parallel()]),
                "tp4": one("tp=4", [autopar.tensor_parallel()]), "sp2": one("tp=2", [autopar.sequence_parallel()]),
                "sp4": one("tp=4", [autopar.sequence_parallel()]),
                "sp2_regather": one("tp=2", [autopar.sequence_parallel(regather_in_backward=True)]),
                "sp4_regather": one("tp=4", [autopar.sequence_parallel(regather_in_backward=True)])}


def per_layer(ledger) -> list[tuple[sympy.Expr, sympy.Expr]]:
    """Per layer: (all bytes, bytes of the LayerNorm statistics: native_layer_norm's outputs 1 and 2)."""
    totals = ledger.by_module(depth=2)
    layers = []
    for index in range(STANDARD.n_layer):
        prefix = f"layers.{index}"
        stats = [e for e in ledger.entries if (e.module + ".").startswith(prefix + ".")
                 and e.op == "aten.native_layer_norm.default" and e.output in (1, 2)]
        assert len(stats) == 4, "two LayerNorms, each saving mean and rstd"
        layers.append((totals[prefix], sympy.expand(sum(e.bytes for e in stats))))
    return layers


# The only remainder beyond Korthikanti's count, who counts LayerNorm's input only: its mean and rstd,
# one value each per token of the LayerNorm's input, i.e. O(s*b). The CPU kernel keeps them in the
# input's dtype (bf16, 2 bytes); the meta kernel, like CUDA's, in fp32 (4 bytes).
STATS_ITEMSIZE = {"cpu": 2, "meta": 4}


def layer_norm_statistics(device: str, tokens: sympy.Expr) -> sympy.Expr:
    return 2 * 2 * STATS_ITEMSIZE[device] * tokens  # 2 LayerNorms x (mean, rstd)


def assert_layers(ledger, formula: sympy.Expr, remainder: sympy.Expr) -> None:
    for total, stats in per_layer(ledger):
        assert stats == remainder
        assert sympy.Poly(total - formula - stats, b, s).is_zero, f"{total} != {formula} + {stats}"
    assert not any(e.internal for e in ledger.entries if e.module.startswith("layers."))


DEVICES = pytest.mark.parametrize("device", list(STATS_ITEMSIZE))


@pytest.mark.timeout(300)
@DEVICES
def test_korthikanti_no_parallelism(plans, device):
    ledger = saved_activations(plans["none"], device=device)
    stats = layer_norm_statistics(device, s * b)
    assert_layers(ledger, s * b * h * (34 + sympy.Rational(5 * a, h) * s), stats)
    # torch.export keeps dropout as aten.native_dropout, whose mask output is bool: 1 byte per element
    masks = [e for e in ledger.entries if e.op == "aten.native_dropout.default" and e.output == 1]
    assert len(masks) == 3 * STANDARD.n_layer and all(e.dtype == torch.bool for e in masks)
    assert_layers(saved_activations(plans["none"], recompute="attention", device=device), 34 * s * b * h, stats)


@pytest.mark.timeout(300)
@DEVICES
@pytest.mark.parametrize("t", [2, 4])
def test_korthikanti_tensor_parallel(plans, t, device):
    ledger = saved_activations(plans[f"tp{t}"], rank=t - 1, device=device)
    formula = s * b * h * (10 + sympy.Rational(24, t) + sympy.Rational(5 * a, h * t) * s)
    assert_layers(ledger, formula, layer_norm_statistics(device, s * b))  # LayerNorm runs replicated


# autopar's sequence parallelism saves the all-gathered (full-sequence) input of the QKV and MLP-up linears
# for backward, where Megatron saves the sequence shard and all-gathers it again in backward: per layer
# 2 linears x 2 bytes x s*b*h*(1 - 1/t) more than Korthikanti's count
def sp_gathered_inputs(t: int) -> sympy.Expr:
    return 2 * 2 * s * b * h * (1 - sympy.Rational(1, t))


@pytest.mark.timeout(300)
@DEVICES
@pytest.mark.parametrize("t", [2, 4])
def test_korthikanti_sequence_parallel(plans, t, device):
    ledger = saved_activations(plans[f"sp{t}"], rank=t - 1, device=device)
    formula = s * b * h / t * (34 + sympy.Rational(5 * a, h) * s) + sp_gathered_inputs(t)
    assert_layers(ledger, formula, layer_norm_statistics(device, s * b / t))
    gathered = [e for e in ledger.entries if e.op == "all_gather" and e.module.startswith("layers.")]
    assert len(gathered) == 2 * STANDARD.n_layer and all(e.bytes == 2 * s * b * h for e in gathered)


@pytest.mark.timeout(300)
@DEVICES
@pytest.mark.parametrize("t", [2, 4])
def test_korthikanti_selective_recomputation(plans, t, device):
    ledger = saved_activations(plans[f"sp{t}"], rank=0, recompute="attention", device=device)
    assert_layers(ledger, 34 * s * b * h / t + sp_gathered_inputs(t), layer_norm_statistics(device, s * b / t))
    # dropped: softmax output, the probabilities' dropout mask and output (5*a*s^2*b/t); kept: the copies
    # of q, k and v that the two bmms save and the o_proj input
    assert not any(e.op == "aten._softmax.default" or e.module.endswith("attn.attn_dropout") for e in ledger.entries)
    assert len([e for e in ledger.entries if e.op == "aten.clone.default"]) == 4 * STANDARD.n_layer


@pytest.mark.timeout(300)
@DEVICES
@pytest.mark.parametrize("t", [2, 4])
def test_korthikanti_sequence_parallel_regathering_like_megatron(plans, t, device):
    """With `regather_in_backward` autopar saves the sequence shard and gathers it again in backward,
    as Megatron does: the ledger is Korthikanti's TP+SP formula exactly (plus LayerNorm statistics),
    and 34·s·b·h/t with selective recomputation; one backward all-gather per block input appears."""
    plan = plans[f"sp{t}_regather"]
    ledger = saved_activations(plan, rank=t - 1, device=device)
    assert_layers(ledger, s * b * h / t * (34 + sympy.Rational(5 * a, h) * s), layer_norm_statistics(device, s * b / t))
    recomputed = saved_activations(plan, rank=0, recompute="attention", device=device)
    assert_layers(recomputed, 34 * s * b * h / t, layer_norm_statistics(device, s * b / t))
    regathers = [e for e in plan.comm.entries if e.why == "the shard saved for backward gathered again"]
    gathers = [e for e in plan.comm.entries if e.phase == "forward" and e.kind == "all_gather"]
    assert len(regathers) == len(gathers) == 2 * STANDARD.n_layer  # attention and MLP inputs of each block
    assert all(r.kind == "all_gather" and r.logical_bytes == g.logical_bytes for r, g in zip(regathers, gathers))


def test_backward_working_memory_does_not_inherit_a_freed_gradients_address():
    """`LiveFakeStorages` numbers allocations: a storage given the address of a freed weight
    gradient is not a weight gradient (by address, the split of backward's working memory into
    weight gradients and the rest, and the composed peak that scales the rest with the batch,
    changed from run to run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.compiler.ledger.working_memory import LiveFakeStorages

    tracker = LiveFakeStorages()
    with FakeTensorMode(), tracker:
        tracker.backward_starts()
        gradient = torch.ones(1024)
        tracker.mark_weight_gradient(gradient)
        address = gradient.untyped_storage()._cdata
        del gradient
        kept = []
        while not kept or kept[-1].untyped_storage()._cdata != address:  # until one lands at that address
            kept.append(torch.ones(1024))
            assert len(kept) < 100, "no storage was given the freed gradient's address"
        kept.append(torch.ones(1024))  # the most alive at once: now, with no weight gradient among it
        working = tracker.working()
    assert working.bytes == 4096 * len(kept) > 4096
    assert working.weight_gradients == 0
