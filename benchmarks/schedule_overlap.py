"""What the scheduling pass gains: autopar with it (the default) against `autopar.schedule(overlap=False)`,
and with async TP on top (`autopar.schedule(chunks=2)`: each TP/SP linear and its forward collective
in two pieces of rows, `autopar/compiler/passes/chunk_collectives.py`).

Each row is one mesh and strategy on the example GPT (the model flags of
`benchmarks/compare_step_time.py`), on local CPU processes (gloo, one thread each). Every rank
parallelizes the same model three times — the pass on, off, and on with chunks=2 — and alternates
their training steps (zero_grad, forward, backward, AdamW), a barrier before each; the slowest
rank's median over the timed steps is kept. The losses of the programs are printed side by side: the
pass reorders and splits work, it does not change the arithmetic (the weight-gradient GEMMs read the
same operands; a piece's matmul computes the same rows), so they agree to the last printed digit or
within fp32 rounding of a GEMM's layout. `in flight` counts the steps the pass left with nodes
between their halves in rank 0's graph (the report's "Collectives in flight" table); chunked, each
piece's collective is one.

| row        | ranks | mesh      | strategies                        | what the pass puts in flight                     |
|------------|-------|-----------|-----------------------------------|--------------------------------------------------|
| tp2        | 2     | tp=2      | tensor_parallel                   | each f's backward all-reduce over dW GEMMs       |
| tp2_sp     | 2     | tp=2      | sequence_parallel                 | each SP all-gather's backward reduce-scatter, ditto |
| dp2_tp2    | 4     | dp=2,tp=2 | data_parallel + tensor_parallel   | as tp2                                           |
| tp4_sp     | 4     | tp=4      | sequence_parallel                 | as tp2_sp                                        |

Run: python benchmarks/schedule_overlap.py [--rows tp2,tp2_sp] [--steps N (default 20)] [--warmup N] [model flags]
(the mixture-of-experts rows are `benchmarks/moe_expert_parallel.py`'s "no overlap" row).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples`, `benchmarks` are not installed

import autopar  # noqa: E402
from autopar.compiler.passes.schedule_collectives import overlaps  # noqa: E402
from autopar.runtime.launch import launch  # noqa: E402
from benchmarks.compare_step_time import (Settings, alternate_steps, build_model, make_step,  # noqa: E402
                                          median_step_ms, parse_settings)
from examples.gpt import example_batch  # noqa: E402

ROWS: dict[str, tuple[int, str, Any]] = {
    "tp2": (2, "tp=2", lambda: [autopar.tensor_parallel()]),
    "tp2_sp": (2, "tp=2", lambda: [autopar.sequence_parallel()]),
    "dp2_tp2": (4, "dp=2,tp=2", lambda: [autopar.data_parallel(), autopar.tensor_parallel()]),
    "tp4_sp": (4, "tp=4", lambda: [autopar.sequence_parallel()]),
}
SIDES = (("on", ()), ("off", (autopar.schedule(overlap=False),)), ("chunks", (autopar.schedule(chunks=2),)))


def run_row(rank: int, world: int, row: str, settings: Settings) -> dict[str, Any]:
    _, mesh, strategies = ROWS[row]
    batch = example_batch(settings.model, batch=settings.batch)
    steps, in_flight = {}, {}
    for side, extra in SIDES:
        module = autopar.parallelize(build_model(settings), mesh, strategies=[*strategies(), *extra],
                                     example_inputs=batch)
        steps[side] = make_step(module, module.local_batch(*batch), lr=settings.lr)
        in_flight[side] = sum(1 for over in overlaps(module.plan.rank_graph(rank).graph) if over.between)
    results = {side: {"losses": [], "times": [], "in_flight": in_flight[side]} for side in steps}
    alternate_steps(steps, results, first=0, warmup=settings.warmup, timed=settings.steps)
    return results


def main() -> None:
    argv = sys.argv[1:]
    rows = ["tp2", "tp2_sp", "dp2_tp2", "tp4_sp"]
    if "--rows" in argv:
        index = argv.index("--rows")
        rows = [r for r in argv[index + 1].split(",") if r]
        del argv[index:index + 2]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if "--steps" not in argv:
        argv += ["--steps", "20"]
    settings, _, timeout_s = parse_settings(argv)  # the model flags and steps of compare_step_time
    table = []
    for row in rows:
        world = ROWS[row][0]
        ranks = launch(run_row, world, row, settings, timeout_s=timeout_s)
        on, off, chunks = (median_step_ms([r[side] for r in ranks]) for side, _ in SIDES)
        losses = [ranks[0][side]["losses"][settings.warmup + settings.steps - 1] for side, _ in SIDES]
        table.append([row, world, ROWS[row][1], ranks[0]["on"]["in_flight"], f"{on:.1f}", f"{off:.1f}",
                      f"{on / off:.3f}", ranks[0]["chunks"]["in_flight"], f"{chunks:.1f}", f"{chunks / on:.3f}",
                      *(f"{loss:.6f}" for loss in losses)])
        print(f"{row}: done", flush=True)
    model = settings.model
    print(f"\nexample GPT: {model.n_layer} layers, d_model {model.d_model}, {model.n_head} heads, seq {model.seq_len}, "
          f"global batch {settings.batch}; median of {settings.steps} steps after {settings.warmup} warm-up, "
          f"slowest rank; steps of both sides alternating\n")
    print(tabulate(table, headers=["row", "ranks", "mesh", "in flight", "pass on ms", "pass off ms", "on / off",
                                   "in flight chunked", "chunks=2 ms", "chunks / on", "last loss on", "last loss off",
                                   "last loss chunks"], tablefmt="simple", disable_numparse=True))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
