"""Planning time against layer count: the real Hugging Face Llama-3 models on the meta device,
dp=8 x tp=8 with FSDP + TP.

The models are transformers' `LlamaForCausalLM` built from the released configurations, written
in `examples/scale.py` (`LLAMA3`: Llama-3-8B, Llama-3-70B and Llama-3.1-405B; no download), in
bf16, on the meta device, with the loss (`examples/hf_models.CausalLMLoss`). One process plans
the whole model (`autopar.plan`, no process group) for a batch of 8K tokens (8 sequences of
1,024), twice: as the plain call plans it (sizes fixed: the "static" rows), and with a symbolic
batch and sequence (`dynamic_dims={"b": 0, "s": 1}`, as `tests/test_plan_at_scale.py` does: one
plan for every batch and sequence length; the "symbolic" rows), where torch's symbolic shape
arithmetic makes `torch.export` and the decompositions about three times slower. Each row runs in a fresh Python process (no warm caches from
an earlier row; its own peak memory) and reports the seconds of each phase, from
`Plan.phase_seconds`:

- export: `torch.export` of the model (of its first blocks when repeated blocks are reused)
- decompose: `run_decompositions` to core ATen
- replicate: the traced block copied for the other repeated blocks (`autopar/compiler/repeated_blocks.py`)
- layout: the tensor-parallel layout found in the graph (`resolve_strategies`)
- propagation: `drop_empty_concats` + `causal_masks` + `propagate_placements`
- insertion: `insert_collectives`, `insert_grad_reductions`, `split_pipeline`, `shard_parameters`,
  `schedule_collectives`
- ledger: gradient buckets and the communication ledger
- check: the plan-time run of rank 0's and rank 63's graphs on fake tensors
  (`autopar/compiler/check_rank_graphs.py`: the distinct blocks run, copied blocks compared with block 2)
- emission: rank 0's graph (`Plan.rank_graph(0)`: the graph this process would run)
- total: `autopar.plan` from call to return, plus emission (wall seconds)
- cpu: the CPU seconds of the same (the process's own: on a shared host, the steadier number)
- peak: the process's peak resident memory (torch and transformers imported: about 0.4 GiB)

Run: python benchmarks/planning_time.py [--shape 8b] [--layers 2,4,8,16,32] [--repeat 3] [--sizes static|symbolic]
     python benchmarks/planning_time.py --targets        # 8B (32 layers), 70B (80), 405B (126), both sizings
     python benchmarks/planning_time.py --targets --shapes 8b,70b
Each cell is the minimum over `--repeat` runs (the machine is shared; the minimum is the
least disturbed run).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` is not an installed package
from examples import scale  # noqa: E402

SHAPES = {shape: config["num_hidden_layers"] for shape, config in scale.LLAMA3.items()}  # layers of the released model
BATCH = (8, 1024)  # 8K tokens: 8 sequences (one per data-parallel rank) of 1,024
TARGETS = {"8b": 8.0, "70b": 12.0, "405b": 30.0}
PHASES = {
    "export": ("export",),
    "decompose": ("decompose",),
    "replicate": ("replicate_blocks",),
    "layout": ("resolve_strategies",),
    "propagation": ("drop_empty_concats", "causal_masks", "propagate_placements"),
    "insertion": ("insert_collectives", "insert_grad_reductions", "split_pipeline", "shard_parameters",
                  "schedule_collectives"),
    "ledger": ("comm_ledger",),
    "check": ("check_rank_graphs",),  # every rank graph run forward and backward on fake tensors
    "emission": ("emission",),
}
ROOT = Path(__file__).resolve().parents[1]


def llama_on_meta(shape: str, layers: int):
    """The released `shape` model (`examples/scale.py`) with `layers` blocks, in bf16 on the meta device, with its loss."""
    return scale.llama3(shape, layers=layers, batch=BATCH[0], seq=BATCH[1])[0]


SIZINGS = {"static": None, "symbolic": {"b": 0, "s": 1}}  # -> dynamic_dims


def plan_once(shape: str, layers: int, sizing: str) -> dict[str, float]:
    """Plan one shape in this process; the phase seconds, total (wall and CPU) and peak memory (GiB)."""
    import torch

    import autopar

    model = llama_on_meta(shape, layers)
    ids = torch.zeros(*BATCH, dtype=torch.long)
    start, cpu_start = time.perf_counter(), time.process_time()
    plan = autopar.plan(model, autopar.Mesh(dp=8, tp=8, ranks_per_node=8),
                        strategies=[autopar.fsdp(), autopar.tensor_parallel()], example_inputs=(ids, ids),
                        dynamic_dims=SIZINGS[sizing])
    emit_start = time.perf_counter()
    plan.rank_graph(0)
    end, cpu_end = time.perf_counter(), time.process_time()
    seconds = dict(plan.phase_seconds, emission=end - emit_start)
    row = {phase: sum(seconds.get(name, 0.0) for name in names) for phase, names in PHASES.items()}
    row["total"] = end - start
    row["cpu"] = cpu_end - cpu_start
    row["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row


def run_row(shape: str, layers: int, repeat: int, sizing: str) -> dict[str, float]:
    """The minimum of each column over `repeat` fresh processes."""
    best: dict[str, float] = {}
    for _ in range(repeat):
        output = subprocess.run([sys.executable, __file__, "--one", f"{shape}:{layers}:{sizing}"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
        row = json.loads(output.strip().splitlines()[-1])
        best = {key: min(value, best.get(key, value)) for key, value in row.items()}
    return best


def table(rows: list[tuple[str, int, str, dict[str, float]]]) -> str:
    columns = [*PHASES, "total", "cpu"]
    lines = ["| shape | layers | sizes | " + " | ".join(columns) + " | peak GiB |",
             "|---|---:|---|" + "---:|" * len(columns) + "---:|"]
    for shape, layers, sizing, row in rows:
        cells = " | ".join(f"{row[c]:.2f}" for c in columns)
        lines.append(f"| {shape} | {layers} | {sizing} | {cells} | {row['peak_gib']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", default="2,4,8,16,32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--targets", action="store_true", help="the released layer counts against the targets")
    parser.add_argument("--shapes", default=",".join(TARGETS), help="with --targets: which shapes")
    parser.add_argument("--sizes", default="static,symbolic", help="static, symbolic or both (comma-separated)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # shape:layers:sizing, in this process, JSON out
    args = parser.parse_args()
    if args.one:
        shape, layers, sizing = args.one.split(":")
        print(json.dumps(plan_once(shape, int(layers), sizing)))
        return
    sizings = args.sizes.split(",")
    if args.targets:
        rows = [(shape, SHAPES[shape], sizing, run_row(shape, SHAPES[shape], args.repeat, sizing))
                for shape in args.shapes.split(",") for sizing in sizings]
        print(table(rows))
        for shape, layers, sizing, row in rows:
            verdict = "met" if row["total"] <= TARGETS[shape] and row["peak_gib"] <= 2 else "NOT met"
            print(f"{shape} ({layers} layers, {sizing} sizes): {row['total']:.2f} s (target {TARGETS[shape]:.0f} s; "
                  f"CPU {row['cpu']:.2f} s), peak {row['peak_gib']:.2f} GiB (target 2): {verdict}")
        return
    print(table([(args.shape, n, sizing, run_row(args.shape, n, args.repeat, sizing))
                 for sizing in sizings for n in map(int, args.layers.split(","))]))


if __name__ == "__main__":
    main()
