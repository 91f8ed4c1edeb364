"""Plan once: rank 0's planning time against the time the other ranks spend obtaining its plan.

A 4-process gloo job (`autopar.runtime.launch`, one thread each) on the main job's model and
mesh (`examples/train_gpt.py`: the example GPT, dp=2 x tp=2, data_parallel + sequence_parallel).
Each rank calls `autopar.parallelize`; rank 0 traces and plans, the others receive the plan
(`autopar/artifacts/plan_once.py`). Per rank the table shows where its plan came from, its own work in wall
and CPU seconds (rank 0: tracing + passes + the plan-time check; others: reading, checking and
decoding the plan), the time it waited for rank 0, and that work as a share of rank 0's planning.
For comparison the same job then makes every rank plan by itself at once (what `parallelize` did
before plan-once: four processes planning on the machine's shared cores). Every rank's rank
graph is checked to be the code of the plan made in this process.

Run: python benchmarks/plan_once.py [--layers N] [--repeat N]
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tabulate import tabulate  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.launch import launch  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402

MESH = "dp=2,tp=2"


def strategies() -> list:
    return [autopar.data_parallel(), autopar.sequence_parallel()]


def config(layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=256, seq_len=32, n_layer=layers, n_head=4, d_model=64, d_ff=256)


def code_digest(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def rank_main(rank: int, world: int, layers: int, repeat: int) -> dict:
    """Each repeat: parallelize (plan once), then every rank planning itself, timed."""
    runs = []
    for _ in range(repeat):
        torch.manual_seed(0)
        model = GPT(config(layers))
        dist.barrier()  # every rank starts parallelize together; nothing else runs meanwhile
        module = autopar.parallelize(model, MESH, strategies=strategies(), example_inputs=example_batch(config(layers)))
        dist.barrier()
        start = time.perf_counter()
        autopar.plan(model, MESH, strategies=strategies(), example_inputs=example_batch(config(layers)))
        runs.append({"timing": module.plan_timing, "alone": time.perf_counter() - start,
                     "digest": code_digest(module.plan.rank_graph(rank).code)})
    return {"rank": rank, "runs": runs}


def expected_digests(layers: int) -> dict[int, str]:
    plan = autopar.plan(GPT(config(layers)), MESH, strategies=strategies(), example_inputs=example_batch(config(layers)))
    return {rank: code_digest(plan.rank_graph(rank).code) for rank in range(plan.mesh.world_size)}


def table(results: list[dict]) -> tuple[str, float]:
    """The rows of the last repeat, and the largest CPU share any receiving rank took."""
    rows, shares = [], []
    for repeat in range(len(results[0]["runs"])):
        planner = results[0]["runs"][repeat]["timing"]
        for result in results:
            run = result["runs"][repeat]
            timing = run["timing"]
            wall, cpu = timing.seconds / planner.seconds, timing.cpu_seconds / planner.cpu_seconds
            if timing.source != "planned":
                shares.append(max(wall, cpu))
            if repeat == len(results[0]["runs"]) - 1:
                rows.append([result["rank"], timing.source, f"{timing.seconds * 1000:.0f}",
                             f"{timing.cpu_seconds * 1000:.0f}", f"{timing.waited * 1000:.0f}",
                             f"{timing.payload_bytes / 1024:.0f}", f"{wall:.1%}", f"{cpu:.1%}",
                             f"{run['alone'] * 1000:.0f}"])
    headers = ["rank", "plan from", "own work ms", "own CPU ms", "waited ms", "plan KiB", "wall / rank 0",
               "CPU / rank 0", "each rank plans itself ms"]
    return tabulate(rows, headers=headers), max(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="parallelize calls per job (the first pays imports)")
    args = parser.parse_args()
    results = launch(rank_main, 4, args.layers, args.repeat, timeout_s=300)
    expected = expected_digests(args.layers)
    for result in results:
        for run in result["runs"]:
            if run["digest"] != expected[result["rank"]]:
                raise SystemExit(f"rank {result['rank']} runs a graph different from the plan made here")
    text, worst = table(results)
    print(f"example GPT ({args.layers} layers), {MESH}, data_parallel + sequence_parallel, 4 gloo processes; "
          f"last of {args.repeat} parallelize calls")
    print(text)
    print(f"largest share of rank 0's planning time a receiving rank spent (wall or CPU, any call): {worst:.1%}; "
          f"every rank's graph is the one planned here")


if __name__ == "__main__":
    main()
