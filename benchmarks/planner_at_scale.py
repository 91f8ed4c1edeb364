"""How long the planner at scale takes to search published models as Hugging Face builds them
(issue 50: a 70B model on 512 GPUs in ≤ 12 s, the 405B on 8,192 GPUs in ≤ 30 s, a 30B-A3B
mixture of experts on 512 GPUs in ≤ 30 s, each a first search in a fresh process), and what it chose.

`python benchmarks/planner_at_scale.py` searches, in this process, one after the other, the
transformers models of `examples/scale.py` on the meta device in bf16: Llama 3 8B on `h100x8`
(64 GPUs), Llama 3 70B on `h100x64` (512 GPUs), Llama 3.1 405B on `h100x1024` (8,192 GPUs) and
Qwen3-30B-A3B (`Qwen3MoeForCausalLM`, 128 experts, top 8) on `h100x64`, at their published
batches, each under the default `SearchSpace` (every axis, SP on and off, ZeRO 0–3, both
schedules) and under the space the exercise uses (`examples/planner_exercise.py`: SP with TP,
interleaving, up to 8 micro-batches per pipeline rank, CP from 8K tokens per rank). It prints
the wall time of each search, the candidates priced and the winner. A first search in a process
also pays PyTorch's first-call costs (not the imports: they come before the clock starts);
`--only 70b:exercise` searches that case alone (`8b`/`70b`/`405b`/`qwen3`, `default`/`exercise`):
one such process per case gives the first searches the targets are about. `--repeat 2` searches
each case twice in the process (the first search and a later one).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` is not an installed package
from autopar.cost.cluster import Cluster
from autopar.planner.search import search
from autopar.planner.search_space import SearchSpace
from examples import scale
from examples.planner_exercise import SPACE as EXERCISE

CASES = [("8b", "Llama 3 8B", scale.llama3_8b, "h100x8"),
         ("70b", "Llama 3 70B", scale.llama3_70b, "h100x64"),
         ("405b", "Llama 3.1 405B", scale.llama3_405b, "h100x1024"),
         ("qwen3", "Qwen3-30B-A3B", scale.qwen3_30b_a3b, "h100x64")]
SPACES = [("default", SearchSpace()), ("exercise", EXERCISE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="one case, e.g. 8b:exercise")
    parser.add_argument("--repeat", type=int, default=1, help="searches of each case in this process")
    options = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for key, name, build, preset in CASES:
        if options.only and not options.only.startswith(key + ":"):
            continue
        model, batch = build()
        cluster = Cluster.preset(preset)
        for space_name, space in SPACES:
            if options.only and options.only != f"{key}:{space_name}":
                continue
            for _ in range(options.repeat):
                rows.append(_searched(name, model, batch, cluster, space_name, space))
    print(tabulate(rows, headers=["model", "cluster (GPUs)", "space", "search s", "candidates", "chosen",
                                  "step s", "peak GB"], disable_numparse=True))


def _searched(name: str, model: torch.nn.Module, batch: tuple, cluster: Cluster, space_name: str,
              space: SearchSpace) -> list:
    start = time.perf_counter()
    result = search(model, cluster, example_inputs=batch, space=space, method="blocks")
    seconds = time.perf_counter() - start
    row = [name, f"{cluster.label} ({cluster.world_size})", space_name, f"{seconds:.2f}", len(result.outcomes),
           result.best.candidate.label, f"{result.best.estimate.seconds:.2f}",
           f"{result.best.estimate.peak_bytes / 1e9:.1f}"]
    print(tabulate([row], disable_numparse=True), flush=True)
    return row


if __name__ == "__main__":
    main()
