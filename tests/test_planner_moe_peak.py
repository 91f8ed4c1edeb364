"""The planner's peak memory on a real Hugging Face mixture-of-experts model, against a run (issue 50).

This file owns one question: when the planner chooses a layout for a real transformers MoE
(Qwen3-MoE as `AutoModelForCausalLM.from_config` builds it, every default left as shipped, only
sizes made small: `examples/hf_models.py`'s `tiny_causal_lm`), does the layout it chose run on
gloo ranks, and is the peak it predicted for it (`SearchResult.best.estimate.peak_bytes`: the
step's largest moment, `autopar/compiler/ledger/peak.py`) the peak that run reaches? The peak is
measured from outside, as `tests/test_planner.py` measures its candidates': every live tensor
storage of the process (`autopar.measure.storages.LiveStorages`), the steps after the first, the
lowest of three. The same search at scale, without a run, is `tests/test_planner_moe.py`'s.

The run on rank 1 once read 35% over the prediction: a plan chosen by the planner crossed to the
other ranks with its ranking, whose winner's plan held rank 0's weights, so rank 1 kept a whole
second copy of the model (0.96 MB) as long as its plan lived (`autopar/artifacts/plan_codec.py`,
`_without_weights`; `tests/test_plan_once.py` checks the encoding itself).
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar import Cluster, SearchSpace
from autopar.measure.storages import LiveStorages
from autopar.runtime.launch import launch
from examples.hf_models import tiny_causal_lm, token_batch
from autopar.measure.step_peaks import step_peaks
from tests.numerics import LR

# eight experts of 64 (the zoo's small Qwen3-MoE has four of 32): the experts are 82% of the
# parameters (197K of 239K), so that replicating them (with their gradients and Adam's two moments) is what
# decides whether a layout fits
SIZES = {"num_experts": 8, "moe_intermediate_size": 64}
SPACE = SearchSpace(axes=("dp", "ep"))  # two ranks: dp2 with each ZeRO stage, or ep2; recomputation where none fits


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return tiny_causal_lm("qwen3_moe", **SIZES)


def _two_ranks_of_3_mb() -> Cluster:
    """`tests/test_planner.py`'s two ranks, on gloo (ZeRO's exchanges as the run makes them), of 3 MB."""
    return Cluster(nodes=1, gpus_per_node=2, memory_gb=0.003, intra_gbps=1.0, inter_gbps=1.0, peak_tflops=0.05,
                   intra_latency_us=100, inter_latency_us=100, memory_gbps=10, op_overhead_us=5, name="two",
                   backend="gloo")


def _chosen_and_measured(rank: int, world: int, batch: tuple) -> dict:
    """`parallelize(cluster=)` on this rank (rank 0 searches, both run the winner), then four steps
    (zero_grad, train_step, AdamW) under `LiveStorages`: the most live bytes of each, the batch
    taken out (`autopar/measure/step_peaks.py`); rank 0 also returns its search's verdict on every candidate."""
    torch.set_num_threads(1)
    storages = LiveStorages()
    storages.track(list(batch))
    with storages:
        module = autopar.parallelize(_model(), cluster=_two_ranks_of_3_mb(), space=SPACE, example_inputs=batch)
        optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
        steps = step_peaks(module, optimizer, batch, storages)
    result = {"mesh": str(module.plan.mesh), "steps": steps}
    search = getattr(module.plan, "search", None)
    if search is not None:  # rank 0: the one that searched
        result["outcomes"] = {o.candidate.label: (o.fits, o.estimate.peak_bytes, dict(o.estimate.moments))
                              for o in search.outcomes if o.estimate is not None}
        result["chosen"] = search.best.candidate.label
    return result


@pytest.mark.timeout(180)
def test_the_layout_chosen_for_a_hugging_face_moe_runs_at_its_predicted_peak_within_5_percent(transformers):
    """Two ranks of 3 MB, 8 sequences of 16 tokens. Plain data parallelism would be the fastest
    (8.7 ms predicted) but each rank then holds every expert, its gradient and two Adam moments
    (4.9 MB at the peak); ZeRO-1/2/3 shard those but pay for their exchanges in time and in
    transient buffers (ZeRO-3 still 3.8 MB, where backward hands the first unit's gradients over);
    recomputation frees activations, not the replicated experts (dp2 with either policy: 4.9 MB).
    Expert parallelism holds half of the experts and of their state on each rank and batch-shards
    the rest like dp: 2.85 MB, the only layout that fits, so the planner chooses ep=2. It runs, and
    the peak it predicted (when backward starts) is within 5% of the measured one, on each rank and
    for the job (the larger rank's, as `tests/test_planner.py` compares).

    What parts them is the routing. The ledger's expert activations assume uniform routing (each
    rank's experts receive the 256 rows its tokens route, 2 layers x 64 tokens x top 2); the run's
    router sends what it chose, and trains (AdamW, lr 1e-2), so the counts move from step to step:
    in steps 2-4 rank 1's experts received 289, 303 and 369 rows and peaked 1.6%, 2.3% and 5.4%
    over the prediction, rank 0's 223, 209 and 143 and peaked 1.1%, 1.9% and 3.7% under it (the
    first step, with balanced counts on both ranks, has no Adam moments yet). That is ~1.3 KB a row
    over or under the uniform count: the row received, its gate-up output (twice its width), the
    activation and the product, 5 x 64 floats. Two such steps later the counts are near uniform
    again (252 and 241 rows on rank 1: within 0.6%). The lowest of three steps is compared, as
    `tests/test_planner.py` does: here rank 1's +1.6% and rank 0's -3.7% (prediction 3.9% over)."""
    batch = token_batch(batch=8, seq=16)
    results = launch(_chosen_and_measured, 2, batch, timeout_s=150)
    searched = results[0]
    assert searched["chosen"] == "ep2" and {r["mesh"] for r in results} == {"ep=2"}, searched
    fitting = [label for label, (fits, _, _) in searched["outcomes"].items() if fits]
    assert fitting == ["ep2"] and searched["outcomes"]["dp2"][0] is False, searched["outcomes"]
    _, predicted, moments = searched["outcomes"]["ep2"]
    measured = [min(r["steps"][1:]) for r in results]
    for peak in measured + [max(measured)]:
        assert abs(predicted / peak - 1) <= 0.05, (predicted, moments, [r["steps"] for r in results])
