"""Routing skew in the planner (issue 50): `SearchSpace(routing_skew=s)` prices the busiest
expert-parallel rank's activations made from the rows it received at that rank's load
(`autopar/planner/routing_skew.py`), not at uniform routing's."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from autopar import PlanError, SearchSpace
from autopar.compiler.ledger.activations import saved_activations
from autopar.compiler.ledger.fake_run import received_rows, saving_run
from autopar.compiler.trace import reusing_traces
from autopar.planner.block_ledgers import Layout, layout_plans, measure_layout
from autopar.planner.layout_pricer import BlockPricer
from autopar.planner.routing_skew import load_factor, skewed
from autopar.planner.search import search
from autopar.planner.search_space import Candidate
from examples.gpt import example_batch
from examples.moe import MoEGPT
from tests.test_composed_cost import NODE
from tests.test_moe import EXAMPLE


@pytest.mark.parametrize("experts,ranks", [(4, 2), (8, 4), (8, 8), (16, 4), (8, 1)])
def test_the_load_factor_is_the_busiest_ranks_rows_over_its_uniform_share(experts, ranks):
    """Brute force: every way to place the experts' loads (the busiest at s × the mean, the rest
    even) on ranks of E/g consecutive experts; the busiest rank's rows over the mean rank's."""
    for skew in (1.0, 1.5, 2.0, 3.0):
        mean = 1.0
        loads = [skew * mean] + [(experts - skew) * mean / (experts - 1)] * (experts - 1)
        per_rank = experts // ranks
        busiest = max(sum(loads[r * per_rank:(r + 1) * per_rank]) for r in range(ranks))
        assert load_factor(skew, experts, ranks) == pytest.approx(busiest / (per_rank * mean))
        assert sum(loads) == pytest.approx(experts * mean)  # the rows are conserved


def _qwen3_moe():
    from examples.hf_models import tiny_causal_lm, token_batch

    torch.manual_seed(0)
    return tiny_causal_lm("qwen3_moe"), token_batch(batch=8, seq=16, seed=0)


def _example():
    torch.manual_seed(0)
    return MoEGPT(EXAMPLE), example_batch(EXAMPLE, batch=8)


class _WithoutAuxiliaryLosses(MoEGPT):
    """The example MoE trained on its language-model loss alone: nothing outside its blocks reads
    each block, so they are a chain."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx) + self.embed_positions(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x, _, _ = layer(x)
        logits = self.lm_head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _chain():
    torch.manual_seed(0)
    return _WithoutAuxiliaryLosses(EXAMPLE), example_batch(EXAMPLE, batch=8)


@pytest.mark.parametrize("build", [_qwen3_moe, _example, _chain], ids=["qwen3_moe", "example", "chain"])
def test_the_received_rows_activations_are_told_apart(build, transformers):
    """Under ep=2 the block's activations made from received rows are a part of its activations,
    read off the ops run's autograd graph (blocks that are a chain: the example's without its
    auxiliary losses) or the saving run (the two plans differenced: the example's auxiliary loss
    reads every block; transformers' MoE blocks lift constants, `repeated_blocks.drop_last_block`);
    counted again from the one-block plan's saving run (the activation
    ledger's) they are the same bytes. Without expert parallelism nothing is received."""
    model, batch = build()
    with reusing_traces():
        ledgers = measure_layout(model, Layout(ep=2), example_inputs=batch)
        one, _, chain = layout_plans(model, Layout(ep=2), example_inputs=batch)
        local = measure_layout(model, Layout(tp=2), example_inputs=batch)
    assert chain == (build is _chain)
    block = ledgers.block
    assert 0 < block.received_activation_bytes < block.activation_bytes
    assert ledgers.rest.received_activation_bytes == 0
    run = saving_run(one, 0)
    rows = {node.name for node in received_rows(run.graph_module.graph)}
    counted = sum(e.number for e in saved_activations(one, rank=0).entries if e.node in rows)
    assert block.received_activation_bytes == counted
    assert (ledgers.experts, ledgers.expert_ranks) == (4, 2) and ledgers.top_k == 2
    if build is not _qwen3_moe:
        # by hand: one sequence of 16 tokens per rank, top 2: 32 rows received; saved of them, fp32,
        # the rows (d 32, the first grouped matmul's input), its gate|up output (2 · d_expert 64,
        # SiLU's and the product's inputs are views of it), SiLU's output (32) and the product (32,
        # the second grouped matmul's input); not its output, which goes back (`moe_combine`)
        assert block.received_activation_bytes == 32 * (32 + 64 + 32 + 32) * 4
    assert local.block.received_activation_bytes == 0 and local.expert_ranks == 1


@pytest.mark.parametrize("build", [_example, _chain], ids=["example", "chain"])
def test_a_recomputed_block_saves_its_received_rows_again_in_backward(build):
    """Recomputed whole, the block saves nothing of its received rows, and its forward run again in
    backward saves the same 20,480 bytes as the layout without recomputation (the transient the
    skew grows); recomputing the attention cores only keeps them saved."""
    model, batch = build()
    with reusing_traces():
        full = measure_layout(model, Layout(ep=2, recompute="full"), example_inputs=batch)
        selective = measure_layout(model, Layout(ep=2, recompute="selective"), example_inputs=batch)
    assert full.block.received_activation_bytes == 0
    assert full.block.received_transient_bytes + full.rest.received_transient_bytes == 32 * (32 + 64 + 32 + 32) * 4
    assert selective.block.received_activation_bytes == 32 * (32 + 64 + 32 + 32) * 4
    assert selective.block.received_transient_bytes + selective.rest.received_transient_bytes == 0
    grown = skewed(full, 2.0)
    assert grown.rest.transient_bytes - full.rest.transient_bytes == round(
        (load_factor(2.0, 4, 2) - 1) * full.rest.received_transient_bytes)


def test_a_skewed_search_prices_the_busiest_ranks_received_rows(transformers):
    """The same candidates priced under uniform routing and under skew 2 (the example MoE's 4
    experts, top 2: at most 2): ep=2's peak grows by exactly what the busiest rank's received rows
    add (f = 1.333 at 2 experts a rank), ep=4's by more (f = 2), data parallelism's not at all."""
    model, batch = _example()
    candidates = {ep: Candidate(tuple((a, n) for a, n in (("dp", 4 // ep), ("ep", ep)) if n > 1)) for ep in (1, 2, 4)}
    with reusing_traces():
        uniform, skewed_pricer = (BlockPricer(model, NODE, batch, routing_skew=s) for s in (1.0, 2.0))
        peaks = {ep: (uniform(c).estimate.peak_bytes, skewed_pricer(c).estimate.peak_bytes)
                 for ep, c in candidates.items()}
        ledgers = {ep: uniform.ledgers(replace(Layout(), ep=ep)) for ep in (2, 4)}
    assert peaks[1][1] == peaks[1][0]
    for ep in (2, 4):
        grown = skewed(ledgers[ep], 2.0).block
        assert grown.activation_bytes - ledgers[ep].block.activation_bytes == round(
            (load_factor(2.0, 4, ep) - 1) * ledgers[ep].block.received_activation_bytes)
        assert peaks[ep][1] > peaks[ep][0]
    assert (peaks[4][1] - peaks[4][0]) / ledgers[4].block.received_activation_bytes > \
        (peaks[2][1] - peaks[2][0]) / ledgers[2].block.received_activation_bytes


@pytest.mark.parametrize("skew,why", [(0.5, "at least the mean"), (2.5, "at most one row per token")])
def test_a_skew_no_router_can_produce_is_refused(skew, why, transformers):
    model, batch = _example()
    space = SearchSpace(axes=("dp", "ep"), zero_stages=(0,), routing_skew=skew)
    with pytest.raises(PlanError, match=why):
        search(model, NODE, example_inputs=batch, space=space, method="blocks")


def test_a_skew_is_refused_where_candidates_are_planned_whole(transformers):
    model, batch = _example()
    with pytest.raises(PlanError, match="priced by the composed search"):
        search(model, NODE, example_inputs=batch, space=SearchSpace(axes=("dp", "ep"), routing_skew=1.5),
               method="plans")


def test_load_factor_edges():
    assert load_factor(3.0, 8, 8) == pytest.approx(3.0)  # an expert per rank: the rank is the expert
    assert load_factor(3.0, 8, 1) == 1.0  # every rank holds every expert: it routes its own tokens only
    assert all(load_factor(1.0, e, g) == 1.0 for e, g in itertools.product((4, 8), (1, 2, 4)))
