"""Bytes copied per training step: what layout copies (`clone`, `copy_`, `cat`) cost a rank, counted
from outside by a dispatch mode, on the example GPT under each row's strategies (4 gloo ranks).

Every ATen `clone`, `copy_` and `cat` a step dispatches is counted with its output bytes (a
`.contiguous()` of a strided tensor and a `reshape` that cannot view are clones; a flat buffer
built from pieces is a cat), split by
whether it ran inside one of autopar's redistribution steps (`autopar.core.ops.collectives`,
found from the Python stack) or elsewhere (the model's own ops, autograd, the optimizer).
Rows: tp4+SP (SP's default: the tokens sharded on the batch, dim 0 of [b, s, h], where the
local batch splits over tp — `autopar/compiler/strategies/token_shard.py`), the same pinned to the sequence
(`_on_sequence`: dim 1, what it was before, and what it still is where the batch does not split),
tp4, dp2×tp2+SP (and pinned), zero3, and context parallelism's three attentions on cp=4 (the
all-gathered K/V used in the collective's rank-major buffer, block by block; Ulysses' all-to-alls
laid out with one copy a side at most).

`--time`: what the copies cost — each rank parallelizes the model twice, SP on its default
dimension and pinned to the sequence, and alternates their training steps (a barrier before
each; the slowest rank's median, as `compare_step_time.py` measures), rows tp4_sp and dp2_tp2_sp;
the last losses of both are printed (the same tokens, the same arithmetic per token).

Run: python benchmarks/copies.py [--rows tp4_sp,tp4_sp_on_sequence] [--time [--steps N]]
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` is not an installed package

import autopar  # noqa: E402
from autopar.runtime.launch import launch  # noqa: E402
from benchmarks.compare_step_time import alternate_steps, make_step, median_step_ms  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402

ROWS = {
    "tp4_sp": ("tp=4", lambda: [autopar.sequence_parallel()]),
    "tp4_sp_on_sequence": ("tp=4", lambda: [autopar.sequence_parallel(sequence_dim=1)]),
    "tp4": ("tp=4", lambda: [autopar.tensor_parallel()]),
    "dp2_tp2_sp": ("dp=2,tp=2", lambda: [autopar.data_parallel(), autopar.sequence_parallel()]),
    "dp2_tp2_sp_on_sequence": ("dp=2,tp=2", lambda: [autopar.data_parallel(),
                                                     autopar.sequence_parallel(sequence_dim=1)]),
    "zero3": ("dp=4", lambda: [autopar.zero(stage=3)]),
    "cp4_ring": ("cp=4", lambda: [autopar.context_parallel(method="ring")]),
    "cp4_allgather": ("cp=4", lambda: [autopar.context_parallel(method="allgather")]),
    "cp4_alltoall": ("cp=4", lambda: [autopar.context_parallel(method="alltoall")]),
}
_COPIES = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten.cat.default}


class CopiedBytes(TorchDispatchMode):
    """Output bytes of every clone / copy_ / cat, by whether autopar's collectives issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = {"collectives": 0, "elsewhere": 0}
        self.calls = {"collectives": 0, "elsewhere": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _COPIES:
            where = ("collectives" if any(frame.filename.endswith("autopar/core/ops/collectives.py")
                                          for frame in traceback.extract_stack(limit=12)) else "elsewhere")
            self.bytes[where] += out.numel() * out.element_size()
            self.calls[where] += 1
        return out


def run_row(rank: int, world: int, row: str, config: GPTConfig) -> dict[str, Any]:
    mesh, strategies = ROWS[row]
    batch = example_batch(config, batch=8)
    torch.manual_seed(0)
    module = autopar.parallelize(GPT(config), mesh, strategies=strategies(), example_inputs=batch)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    local = module.plan.local_inputs(list(batch), rank)
    for _ in range(2):  # the second step is counted (the first also builds the optimizer state)
        counter = CopiedBytes()
        with counter:
            optimizer.zero_grad(set_to_none=True)
            module(*local).backward()
            optimizer.step()
    return {"bytes": counter.bytes, "calls": counter.calls}


def time_row(rank: int, world: int, row: str, config: GPTConfig, steps: int) -> dict[str, Any]:
    """Alternating steps of SP's default token dimension and of SP pinned to the sequence."""
    mesh, _ = ROWS[row]
    batch = example_batch(config, batch=8)
    sides = {"default": ROWS[row][1], "on sequence": ROWS[f"{row}_on_sequence"][1]}
    step_functions = {}
    for side, strategies in sides.items():
        torch.manual_seed(0)
        module = autopar.parallelize(GPT(config), mesh, strategies=strategies(), example_inputs=batch)
        step_functions[side] = make_step(module, module.local_batch(*batch), lr=1e-3)
    results = {side: {"losses": [], "times": []} for side in sides}
    alternate_steps(step_functions, results, first=0, warmup=2, timed=steps)
    return results


def print_times(config: GPTConfig, steps: int) -> None:
    table = []
    for row in ("tp4_sp", "dp2_tp2_sp"):
        ranks = launch(time_row, 4, row, config, steps, timeout_s=900)
        default, pinned = (median_step_ms([r[side] for r in ranks]) for side in ("default", "on sequence"))
        table.append([row, f"{default:.1f}", f"{pinned:.1f}", f"{default / pinned:.3f}",
                      f"{ranks[0]['default']['losses'][-1]:.6f}", f"{ranks[0]['on sequence']['losses'][-1]:.6f}"])
    print(f"median of {steps} steps after 2 warm-up, slowest rank, steps alternating")
    print(tabulate(table, headers=["row", "default ms", "on sequence ms", "ratio", "last loss default",
                                   "last loss on sequence"], disable_numparse=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--time", action="store_true", help="time SP on its default dimension against the sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side (with --time)")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=8, d_model=256, d_ff=1024)
    if args.time:
        print_times(config, args.steps)
        return
    table = []
    for row in args.rows.split(","):
        rank0 = launch(run_row, 4, row, config, timeout_s=600)[0]
        table.append([row, rank0["calls"]["collectives"], f"{rank0['bytes']['collectives'] / 2**20:.2f}",
                      rank0["calls"]["elsewhere"], f"{rank0['bytes']['elsewhere'] / 2**20:.2f}"])
    print(f"example GPT {config}, global batch 8, rank 0, one training step")
    print(tabulate(table, headers=["row", "copies in collectives", "MiB", "copies elsewhere", "MiB"]))


if __name__ == "__main__":
    main()
