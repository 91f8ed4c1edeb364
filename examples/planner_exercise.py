"""The planner at scale answers the lecture's exercise and is compared with published runs.

`python examples/planner_exercise.py seed` — the seed's exercise: on 64 nodes of 8 H100 (80 GB),
which layout for a 70B dense model, a 405B dense model, a 200B-total / 21B-active MoE and the
same MoE at a 1M-token context (`examples/scale.py` for the shapes and batches)?
`python examples/planner_exercise.py published` — Llama 3 405B on 8192 GPUs (TP8 × PP16 × DP64
at 8K; TP8 × CP16 × PP16 × DP4 at 128K) and DeepSeek-V3 on 2048 GPUs (PP16 × EP64, ZeRO-1):
the planner's choice, and the published layout priced by the same model. `--float8 rowwise`:
the same with every candidate's linears in FP8 (`autopar.float8`); `--local-scales`: each rank
scaling its own rows (`float8(data_scales="local")`). `--pairs-side-by-side`: DualPipeV's pairs
priced side by side on the GPU clusters too (a what-if: autopar runs them so on CPU ranks only).
Each prints, per case, the search's time, its top candidates (memory, bytes, predicted step,
why each lost) and the winner's binding constraint. Every figure comes from two small plans per
in-node layout composed with the ledger formulas (`autopar/planner/composed_cost.py`) on the preset
cluster's numbers (`autopar/cost/cluster.py`: H100 SXM, NVLink 450 GB/s, InfiniBand 45 GB/s per GPU).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` is not an installed package
from autopar.compiler.strategies.mixed_precision import float8
from autopar.core import schedules
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
    # each published layout as it is, with sequence parallelism's re-gather in backward (Megatron's
    # default), and with full recomputation
    savings = ((None, False), (None, True), ("full", False))

    def dense(degrees: dict[str, int], micro: int, *, zero: int = 1, virtual: tuple[int, ...] = (1, 2)
              ) -> list[Candidate]:
        mesh = tuple((a, n) for a, n in degrees.items() if n > 1)
        if "pp" not in degrees:
            return [Candidate(mesh, zero=zero, sequence_parallel=True, recompute=r, regather=g) for r, g in savings]
        return [Candidate(mesh, zero=zero, sequence_parallel=True, schedule="1f1b" if v == 1 else "interleaved_1f1b",
                          microbatches=micro, virtual=v, recompute=r, regather=g) for v in virtual for r, g in savings]

    # the batches: Llama 3's report (16M tokens at 8K; 128 sequences at 128K), torchtitan's 70B
    # recipe (8 sequences per FSDP rank), Megatron-Bridge's 70B recipe (128 sequences, one per
    # micro-batch, virtual stages of 4 blocks), Megatron's MoE table (256 sequences of 4K for
    # Mixtral), DeepSeek-V3's report (15,360 sequences of 4K): micro-batches are counted per
    # pipeline replica, one sequence each
    # DeepSeek's DualPipe as autopar runs it, the V (`dualpipev`: its paired forwards and backwards
    # hide each other's all-to-alls), without ZeRO-1 (which autopar's DualPipeV refuses)
    deepseek = ([Candidate((("pp", 16), ("dp", 2), ("ep", 64)), zero=1, schedule="1f1b", microbatches=120, recompute=r)
                 for r in (None, "selective", "full")]
                + [Candidate((("pp", 16), ("dp", 2), ("ep", 64)), schedule="dualpipev", microbatches=120, virtual=2,
                             recompute=r) for r in (None, "full")])
    mixtral = [Candidate((("pp", 4), ("dp", 2), ("ep", 8), ("tp", 4)), zero=1, sequence_parallel=True,
                         schedule="1f1b" if v == 1 else "interleaved_1f1b", microbatches=16, virtual=v, recompute=r,
                         regather=g)
               for v in (1, 2) for r, g in savings]
    return [("Llama 3 405B, 8K tokens, 8192 GPUs (published: TP8 PP16 DP64)", scale.llama3_405b, _h100(8192), SPACE,
             dense({"pp": 16, "dp": 64, "tp": 8}, 32, virtual=(1, 2, 4))),
            ("Llama 3 405B, 128K tokens, 8192 GPUs (published: TP8 CP16 PP16, DP fills)", scale.llama3_405b_128k,
             _h100(8192), SPACE, dense({"pp": 16, "dp": 4, "cp": 16, "tp": 8}, 32)),
            ("Llama 3 70B, 8K tokens, 256 sequences, 256 GPUs (torchtitan: FSDP32 TP8)",
             lambda: scale.llama3("70b", batch=256, seq=8192), _h100(256), SPACE,
             dense({"dp": 32, "tp": 8}, 1, zero=3)),
            ("Llama 3 70B, 8K tokens, 128 sequences, 64 GPUs (Megatron-Bridge: TP4 PP4 CP2 DP2, VP5)",
             lambda: scale.llama3("70b", batch=128, seq=8192), _h100(64), SPACE,
             dense({"pp": 4, "dp": 2, "cp": 2, "tp": 4}, 64, virtual=(1, 5))),
            ("Mixtral 8x22B, 4K tokens, 256 sequences, 256 GPUs (published: TP4 PP4 EP8)", scale.mixtral_8x22b,
             _h100(256), SPACE, mixtral),
            ("DeepSeek-V3 with its 3 dense blocks as MoE blocks, 4K tokens, 15360 sequences, 2048 GPUs "
             "(published: PP16 EP64 ZeRO-1)", lambda: scale.deepseek_v3(dense_blocks=0), _h100(2048), SPACE, deepseek)]


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
    parser.add_argument("--only", default=None, help="the cases whose title contains this text, e.g. 'Mixtral'")
    parser.add_argument("--float8", default=None, choices=("rowwise", "tensorwise"),
                        help="every candidate's linears in FP8 with this recipe (autopar.float8); its FLOPs priced "
                             "at the cluster's FP8 rate (the FP8 columns of docs/planner.md)")
    parser.add_argument("--local-scales", action="store_true",
                        help="with --float8: each rank scales its own rows (float8(data_scales='local'), torchao's way)")
    parser.add_argument("--pairs-side-by-side", action="store_true",
                        help="a what-if: price DualPipeV's paired forwards and backwards side by side on the GPU "
                             "clusters too, which autopar's runtime does on CPU ranks only (docs/pipeline.md)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.pairs_side_by_side:
        schedules.SIDE_BY_SIDE_BACKENDS.add("nccl")
    if args.which == "seed":
        cases = [(title, build, SEED_CLUSTER, space, []) for title, build, space in SEED]
    else:
        cases = _published()
    if args.float8:
        declared = float8(args.float8, data_scales="local" if args.local_scales else "global")
        cases = [(title, build, cluster, replace(space, float8=declared),
                  [replace(c, float8=declared) for c in published]) for title, build, cluster, space, published in cases]
    for title, build, cluster, space, published in cases:
        if args.only is None or args.only in title:
            _case(title, build, cluster, space, published, args.top)


if __name__ == "__main__":
    main()
