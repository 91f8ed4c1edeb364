"""Attention priced as an accelerator runs it (`Plan.fused_attention`, `Cluster.fuses_attention`):
value heads narrower than the query heads (multi-head latent attention) send PyTorch's CPU
attention down its math path, which keeps every query-key probability for backward; a GPU's
fused kernels do not. The planner's fake runs for a cluster that fuses attention run such
attention as `ledger/fake_tensors.padded_attention` (the values zero-padded to the query's head
size, as FlashAttention-2's callers pad them)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from autopar.compiler.ledger.activations import saved_activations
from autopar.compiler.trace import reusing_traces
from autopar.cost.cluster import Cluster
from autopar.planner.block_ledgers import Layout, measure_layout
from autopar.planner.search import search
from autopar.planner.search_space import SearchSpace
from tests.test_composed_cost import NODE


class _LatentAttention(torch.nn.Module):
    """Four heads of query/key size 24 and value size 16; `padded`: the values zero-padded to 24 by
    the model itself and the output cut back (what the fused pricing stands for)."""

    def __init__(self, padded: bool = False) -> None:
        super().__init__()
        self.padded = padded
        self.q, self.k = torch.nn.Linear(32, 96), torch.nn.Linear(32, 96)
        self.v, self.o = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = (proj(x).view(b, s, 4, 24).transpose(1, 2) for proj in (self.q, self.k))
        v = self.v(x).view(b, s, 4, 16).transpose(1, 2)
        if self.padded:
            out = F.scaled_dot_product_attention(q, k, F.pad(v, (0, 8)), is_causal=True)[..., :16]
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, 64)).sum()


def _saved(model: torch.nn.Module, fused: bool) -> tuple[int, list]:
    torch.manual_seed(0)
    plan = autopar.plan(model, "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.randn(2, 64, 32),))
    if fused:
        plan.fuse_attention()
    ledger = saved_activations(plan, rank=0)
    return ledger.number(), [e.shape for e in ledger.entries]


def test_narrower_values_are_priced_as_the_padded_fused_kernel():
    """Fused: exactly what the model padding its values itself saves on the CPU's fused kernel;
    unfused: the math path's, with the [1, 4, 64, 64] probabilities. Equal head sizes are not
    touched."""
    fused, fused_shapes = _saved(_LatentAttention(), fused=True)
    padded, _ = _saved(_LatentAttention(padded=True), fused=False)
    math, math_shapes = _saved(_LatentAttention(), fused=False)
    assert fused == padded
    assert (1, 4, 64, 64) in math_shapes and (1, 4, 64, 64) not in fused_shapes
    assert math > fused
    assert _saved(_LatentAttention(padded=True), fused=True)[0] == padded


def test_the_planner_prices_attention_as_its_cluster_runs_it(transformers):
    """A GPU cluster's plans and block ledgers price the fused kernel, a gloo cluster's the CPU's:
    transformers' DeepSeek-V3 (multi-head latent attention) saves less per block on the first."""
    from examples.hf_models import tiny_causal_lm, token_batch

    torch.manual_seed(0)
    # query/key heads of 16 + 8 (no rotary part, rotary part), value heads of 16
    model = tiny_causal_lm("deepseek_v3", qk_nope_head_dim=16, first_k_dense_replace=0)
    batch = token_batch(batch=4, seq=32, seed=0)
    gloo = Cluster.preset("cpu2x4")
    assert NODE.fuses_attention and not gloo.fuses_attention
    with reusing_traces():
        fused = measure_layout(model, Layout(), example_inputs=batch, fused_attention=True)
        math = measure_layout(model, Layout(), example_inputs=batch)
    assert fused.block.activation_bytes < math.block.activation_bytes
    space = SearchSpace(axes=("dp",), zero_stages=(0,))
    for cluster in (NODE, gloo):
        best = search(model, cluster, example_inputs=batch, space=space, method="plans").best
        assert best.plan.fused_attention == cluster.fuses_attention
