"""The planner at scale answers the lecture's exercise and is compared with published runs.

`python examples/planner_exercise.py seed` — the seed's exercise: on 64 nodes of 8 H100 (80 GB),
which layout for a 70B dense model, a 405B dense model, a 200B-total / 21B-active MoE and the
same MoE at a 1M-token context (`examples/scale.py` for the shapes and batches)?
`python examples/planner_exercise.py published` — Llama 3 405B on 8192 GPUs (TP8 × PP16 × DP64
at 8K; TP8 × CP16 × PP16 × DP4 at 128K) and DeepSeek-V3 on 2048 GPUs (PP16 × EP64, ZeRO-1):
the planner's choice, and the published layout priced by the same model.
Each prints, per case, the search's time, its top candidates (memory, bytes, predicted step,
why each lost) and the winner's binding constraint. Every figure comes from two small plans per
in-node layout composed with the ledger formulas (`autopar/planner/composed_cost.py`) on the preset
cluster's numbers (`autopar/cost/cluster.py`: H100 SXM, NVLink 450 GB/s, InfiniBand 45 GB/s per GPU).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from autopar.cost.cluster import Cluster
from autopar.core.errors import PlanError
from autopar.planner.layout_pricer import price_composed
from autopar.planner.search import search
from autopar.planner.search_space import Candidate, SearchSpace
from examples import scale

# SP always with TP (same bytes, less memory); up to 8 micro-batches per pipeline rank, or one
# sequence per micro-batch (the only way autopar accumulates gradients is a pipeline's
# micro-batches); CP only while a rank keeps
# 8K tokens of a sequence (Llama 3's 128K over CP16)
SPACE = SearchSpace(sequence_parallel=(True,), virtual_stages=(1, 2), microbatch_multiples=(1, 2, 4, 8),
                    context_tokens=8192, one_sequence_microbatches=True)
SEED_CLUSTER = Cluster.preset("h100x64")
SEED = [("70B dense, 8K tokens, 1024 sequences", scale.llama3_70b, SPACE),
        ("405B dense, 8K tokens, 2048 sequences", scale.llama3_405b, SPACE),
        ("200B-total / 21B-active MoE, 8K tokens, 1024 sequences", scale.moe_200b, SPACE),
        ("the same MoE at 1M tokens, 16 sequences", scale.moe_200b_1m, SPACE)]


def _h100(gpus: int) -> Cluster:
    return replace(Cluster.preset("h100x1024"), nodes=gpus // 8, name=f"h100x{gpus // 8}")


def _published() -> list[tuple[str, object, Cluster, SearchSpace, list[Candidate]]]:
    def llama(pp: int, dp: int, cp: int, micro: int) -> list[Candidate]:
        degrees = tuple((a, n) for a, n in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", 8)) if n > 1)
        return [Candidate(degrees, zero=1, sequence_parallel=True, schedule=s, microbatches=micro, virtual=v,
                          recompute=r) for s, v in (("1f1b", 1), ("interleaved_1f1b", 2)) for r in (None, "full")]

    # 15360 sequences over dp × ep = 128 replicas: 120 each, one per micro-batch
    deepseek = [Candidate((("pp", 16), ("dp", 2), ("ep", 64)), zero=1, schedule="1f1b", microbatches=120, recompute=r)
                for r in (None, "selective")]
    return [("Llama 3 405B, 8K tokens, 8192 GPUs (published: TP8 PP16 DP64)", scale.llama3_405b, _h100(8192), SPACE,
             llama(16, 64, 1, 32)),
            ("Llama 3 405B, 128K tokens, 8192 GPUs (published: TP8 CP16 PP16, DP fills)", scale.llama3_405b_128k,
             _h100(8192), SPACE, llama(16, 4, 16, 32)),
            ("DeepSeek-V3 shape, 4K tokens, 2048 GPUs (published: PP16 EP64 ZeRO-1)", scale.deepseek_v3, _h100(2048),
             SPACE, deepseek)]


def _case(title: str, build, cluster: Cluster, space: SearchSpace, published: list[Candidate], top: int) -> None:
    model, batch = build()
    params = sum(p.numel() for p in model.parameters())
    print(f"\n## {title}\n{params / 1e9:.0f}B parameters on {cluster.label} ({cluster.world_size} GPUs)")
    start = time.perf_counter()
    try:
        result = search(model, cluster, example_inputs=batch, space=space, method="blocks")
    except PlanError as error:  # the planner's answer: no candidate fits (or none plans)
        print(f"searched in {time.perf_counter() - start:.1f} s: {str(error).splitlines()[0]}")
        best = None
    else:
        rules = sum(1 for p in result.pruned if p.candidate.recompute is None)
        print(f"searched {len(result.outcomes)} candidates ({rules} pruned by the rules) in "
              f"{time.perf_counter() - start:.1f} s\n")
        print(result.table(top=top))
        print()
        print(result.explain())
        best = result.best.estimate
    for candidate in published:
        outcome = price_composed(model, cluster, candidate, example_inputs=batch)
        if outcome.estimate is None:
            print(f"published {candidate.label}: refused: {outcome.refused}")
            continue
        e = outcome.estimate
        against = f" ({e.seconds / best.seconds - 1:+.0%} against the choice)" if best is not None else ""
        print(f"published {candidate.label}: {e.seconds * 1e3:,.0f} ms{against}, peak {e.peak_bytes / 1e9:.1f} GB"
              f"{'' if e.fits else ' (does not fit)'}; parts "
              + ", ".join(f"{k} {v * 1e3:,.0f}" for k, v in e.parts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=("seed", "published"))
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.which == "seed":
        for title, build, space in SEED:
            _case(title, build, SEED_CLUSTER, space, [], args.top)
    else:
        for title, build, cluster, space, published in _published():
            _case(title, build, cluster, space, published, args.top)


if __name__ == "__main__":
    main()
