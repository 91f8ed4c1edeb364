"""The planner at scale on a real Hugging Face mixture-of-experts model (issue 50).

Qwen3-30B-A3B as transformers builds it (`examples/scale.py`: `qwen3_30b_a3b`, all 48 layers,
128 experts of 768, top 8, on the meta device in bf16, no download) at 8K tokens, on `h100x8`
(64 H100 of 80 GB) with 128 sequences: two sequences per rank without a pipeline, as the
user's 1,024 on `h100x64` (512 GPUs). One sequence's activations through the 48 blocks are
~110 GB (a block saves ~2.3 GB at 8K tokens, its attention cores ~0.2 GB of it), so no layout
fits without recomputing the MoE blocks, and selective recomputation (the attention cores) is
not enough either: the search must recompute whole MoE blocks and find a layout that fits.
The composed search measures one block per in-node layout, so its cost does not grow with the
layers or the ranks (the user's 512 GPUs: `benchmarks/planner_at_scale.py --only qwen3:exercise`).
"""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

from autopar import Cluster, PlanError, SearchSpace
from autopar.compiler.trace import reusing_traces
from autopar.cost.cluster import GB
from autopar.planner.search import search
from examples import scale
from examples.hf_models import tiny_causal_lm, token_batch
from tests.test_composed_cost import NODE, planned_and_composed

pytest.importorskip("transformers")

# the exercise's space (`examples/planner_exercise.py`) less context and tensor parallelism (their
# in-node layouts would only be measured to lose): data, expert and pipeline parallelism, ZeRO,
# one-sequence micro-batches, recomputation
SPACE = SearchSpace(axes=("dp", "ep", "pp"), zero_stages=(0, 1, 3), microbatch_multiples=(1, 2),
                    one_sequence_microbatches=True)


@pytest.fixture(scope="module")
def qwen3():
    """The model and its batch; its exports shared by the module's searches (the first pays them)."""
    with reusing_traces():
        yield scale.qwen3_30b_a3b(batch=128)


def test_a_real_moe_model_that_needs_its_blocks_recomputed_finds_a_layout_that_fits(qwen3):
    model, batch = qwen3
    cluster = Cluster.preset("h100x8")
    result = search(model, cluster, example_inputs=batch, space=SPACE, method="blocks")
    best = result.best
    assert best.fits and best.estimate.peak_bytes <= cluster.memory_gb * GB
    assert best.candidate.recompute == "full"
    assert best.candidate.degree("ep") > 1  # 30B of experts: replicating them costs memory and gradient traffic
    priced = [o for o in result.outcomes if o.estimate is not None]
    assert not any(o.fits for o in priced if o.candidate.recompute is None)


def test_a_real_moe_model_that_fits_nowhere_says_what_binds_and_by_how_much(qwen3):
    """On ranks of 4 GB nothing fits, recomputation included: the error names the closest
    candidate's peak, memory as the binding constraint, by how much it is over, at which moment
    and what it holds then."""
    model, batch = qwen3
    small = replace(Cluster.preset("h100x8"), memory_gb=4.0)
    space = replace(SPACE, axes=("dp",), zero_stages=(3,))
    with pytest.raises(PlanError) as refused:
        search(model, small, example_inputs=batch, space=space, method="blocks")
    text = str(refused.value)
    found = re.search(r"fits nowhere on h100x8: the smallest peak .* is ([0-9.]+) GB per rank \((.*)\), and a rank "
                      r"has 4 GB\n  binding: memory per rank, over by ([0-9.]+) GB at (backward starts|optimizer step) "
                      r"\(it already recomputes \(full\)\); held: (.*) GB\n", text)
    assert found, text
    peak, over = float(found.group(1)), float(found.group(3))
    assert over == pytest.approx(peak - 4.0, rel=1e-3)
    assert "recompute full" in found.group(2) and "activations" in found.group(5)


def test_blocks_that_differ_are_refused_rather_than_priced_as_the_first():
    """DeepSeek-V3's first blocks are dense and the others mixture-of-experts: pricing one block
    for all would price every block as a dense one (what the search did before it checked)."""
    model = tiny_causal_lm("deepseek_v3")  # its small config: block 0 dense, block 1 MoE
    with pytest.raises(PlanError, match=r"not all alike: 1 of 2 \(first: model\.model\.layers\.1"):
        search(model, Cluster.preset("h100x8"), example_inputs=token_batch(batch=64, seq=16), method="blocks")


def test_folded_expert_layouts_are_searched_and_priced_as_their_plans():
    """With ep and tp, the search tries each expert's FFN split over tp (expert-tensor parallelism)
    and the experts split over ep × tp (folded: `expert_parallel(fold=("tp",))`), each priced from
    its own one-block plan. Every composed price agrees with the candidate's planned one within
    `test_composed_cost`'s bounds, and only the folded candidate exchanges its tokens over the
    flattened ep+tp group."""
    model, batch = tiny_causal_lm("qwen3_moe"), token_batch(batch=8, seq=16)
    space = SearchSpace(axes=("ep", "tp"), sequence_parallel=(False,))
    pairs = planned_and_composed(model, NODE, batch, space)  # a node of 4
    assert {"ep2 × tp2", "ep2 × tp2 × experts on ep·tp"} <= {label for label, *_ in pairs}
    for label, candidate, full, part in pairs:
        assert abs(part.held_bytes / full.held_bytes - 1) <= 0.01, (label, part.memory, full.memory)
        assert abs(part.peak_bytes / full.peak_bytes - 1) <= 0.08, (label, part.moments, full.moments)
        assert abs(part.seconds / full.seconds - 1) <= 0.17, (label, part.parts, full.parts)
        assert abs(part.wire_bytes / full.wire_bytes - 1) <= 0.25, (label, part.wire_bytes, full.wire_bytes)
        if "ep2" in label:
            folded = candidate.fold_experts
            for estimate in (full, part):
                assert ("ep+tp all_to_all" in estimate.comm_by_kind) == folded, (label, estimate.comm_by_kind)
                assert ("ep all_to_all" in estimate.comm_by_kind) == (not folded), (label, estimate.comm_by_kind)
