"""Bytes copied per training step: what layout copies (`clone`, `copy_`) cost a rank, counted
from outside by a dispatch mode, on the example GPT under each row's strategies (4 gloo ranks).

Every ATen `clone` and `copy_` a step dispatches is counted with its output bytes (a
`.contiguous()` of a strided tensor and a `reshape` that cannot view are clones), split by
whether it ran inside one of autopar's redistribution steps (`autopar.runtime.collectives`,
found from the Python stack) or elsewhere (the model's own ops, autograd, the optimizer).
Rows: tp4+SP (SP's default: the tokens sharded on the batch, dim 0 of [b, s, h], where the
local batch splits over tp — `strategies/token_shard.py`), the same pinned to the sequence
(`_on_sequence`: dim 1, what it was before, and what it still is where the batch does not split),
tp4, dp2×tp2+SP (and pinned), zero3. Timing is not measured here (`compare_step_time.py` does).

Run: python benchmarks/copies.py [--rows tp4_sp,tp4_sp_on_sequence]
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
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402

ROWS = {
    "tp4_sp": ("tp=4", lambda: [autopar.sequence_parallel()]),
    "tp4_sp_on_sequence": ("tp=4", lambda: [autopar.sequence_parallel(sequence_dim=1)]),
    "tp4": ("tp=4", lambda: [autopar.tensor_parallel()]),
    "dp2_tp2_sp": ("dp=2,tp=2", lambda: [autopar.data_parallel(), autopar.sequence_parallel()]),
    "dp2_tp2_sp_on_sequence": ("dp=2,tp=2", lambda: [autopar.data_parallel(),
                                                     autopar.sequence_parallel(sequence_dim=1)]),
    "zero3": ("dp=4", lambda: [autopar.zero(stage=3)]),
}
_COPIES = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default}


class CopiedBytes(TorchDispatchMode):
    """Output bytes of every clone / copy_, by whether autopar's collectives issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = {"collectives": 0, "elsewhere": 0}
        self.calls = {"collectives": 0, "elsewhere": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _COPIES:
            where = ("collectives" if any(frame.filename.endswith("autopar/runtime/collectives.py")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args()
    config = GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=8, d_model=256, d_ff=1024)
    table = []
    for row in args.rows.split(","):
        rank0 = launch(run_row, 4, row, config, timeout_s=600)[0]
        table.append([row, rank0["calls"]["collectives"], f"{rank0['bytes']['collectives'] / 2**20:.2f}",
                      rank0["calls"]["elsewhere"], f"{rank0['bytes']['elsewhere'] / 2**20:.2f}"])
    print(f"example GPT {config}, global batch 8, rank 0, one training step")
    print(tabulate(table, headers=["row", "copies in collectives", "MiB", "copies elsewhere", "MiB"]))


if __name__ == "__main__":
    main()
