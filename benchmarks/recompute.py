"""Activation recomputation: what it saves and what it costs, against no recomputation and
against PyTorch's own checkpointing.

The example GPT with explicit attention (softmax(q·kᵀ)·v written out, as Hugging Face's "eager"
attention) on four gloo processes (`autopar.runtime.launch`). Rows:

| row           | autopar                                        | PyTorch equivalent                          |
|---------------|------------------------------------------------|---------------------------------------------|
| dp4           | data_parallel, recompute none/selective/full   | DDP; full: `torch.utils.checkpoint` per block |
| dp2_tp2_sp    | data_parallel + sequence_parallel              | -                                           |
| zero3         | zero(stage=3) on dp=4                          | -                                           |

Per policy: median step time (zero_grad, forward, backward, AdamW; slowest rank; steps of the
policies alternate so drift hits all alike), the activations the forward leaves alive for
backward on rank 0 measured from outside (`autopar.measure.activations`, no saved-tensor
hooks), autopar's activation ledger beside it, and both as ratios over the row's no-recompute
policy. PyTorch's full recomputation wraps each block in non-reentrant `torch.utils.checkpoint`
under DDP (what `apply_activation_checkpointing` does).

Run: python benchmarks/recompute.py [--quick] [--rows dp4,zero3] [--steps N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` is not an installed package

import autopar  # noqa: E402
from autopar.compiler.ledger.activations import saved_activations  # noqa: E402
from autopar.measure.activations import measure_saved_activations  # noqa: E402
from autopar.runtime.launch import launch  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402

POLICIES = ("none", "selective", "full")
ROWS: dict[str, tuple[str, Callable[[], list]]] = {
    "dp4": ("dp=4", lambda: [autopar.data_parallel()]),
    "dp2_tp2_sp": ("dp=2,tp=2", lambda: [autopar.data_parallel(), autopar.sequence_parallel()]),
    "zero3": ("dp=4", lambda: [autopar.zero(stage=3)]),
}


@dataclass(frozen=True)
class Settings:
    model: GPTConfig
    batch: int
    steps: int
    warmup: int


class _Checkpointed(torch.nn.Module):
    """PyTorch's full recomputation of one block: non-reentrant `torch.utils.checkpoint`."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _step(module: Any, inputs: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        module(*inputs).backward()
        optimizer.step()
    return step


def _autopar(row: str, policy: str, settings: Settings, batch: tuple) -> tuple[Any, list, int]:
    mesh, strategies = ROWS[row]
    chosen = strategies() + ([autopar.recompute(policy)] if policy != "none" else [])
    torch.manual_seed(0)
    module = autopar.parallelize(GPT(settings.model), mesh, strategies=chosen, example_inputs=batch)
    ledger = saved_activations(module.plan, rank=dist.get_rank()).number()
    return module, module.plan.local_inputs(list(batch), dist.get_rank()), ledger


def _pytorch(policy: str, settings: Settings, batch: tuple) -> tuple[Any, list]:
    torch.manual_seed(0)
    model = GPT(settings.model)
    if policy == "full":
        model.layers = torch.nn.ModuleList(_Checkpointed(block) for block in model.layers)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = [torch.chunk(t, world, dim=0)[rank].contiguous() for t in batch]
    return DistributedDataParallel(model), local


def _saved_bytes(module: Any, inputs: list) -> int:
    with measure_saved_activations() as saved:
        loss = saved.call(module, *inputs)
    loss.backward()
    return saved.bytes


def run_row(rank: int, world: int, row: str, settings: Settings) -> dict[str, Any]:
    batch = example_batch(settings.model, batch=settings.batch)
    programs: dict[str, tuple[Callable[[], None], int, int | None]] = {}
    for policy in POLICIES:
        module, inputs, ledger = _autopar(row, policy, settings, batch)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        programs[f"autopar {policy}"] = (_step(module, inputs, optimizer), _saved_bytes(module, inputs), ledger)
        optimizer.zero_grad(set_to_none=True)
    if row == "dp4":
        for policy in ("none", "full"):
            module, inputs = _pytorch(policy, settings, batch)
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
            programs[f"PyTorch {policy}"] = (_step(module, inputs, optimizer), _saved_bytes(module, inputs), None)
            optimizer.zero_grad(set_to_none=True)
    times: dict[str, list[float]] = {name: [] for name in programs}
    for index in range(settings.warmup + settings.steps):
        for name, (step, _, _) in programs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            if index >= settings.warmup:
                times[name].append(elapsed)
    return {name: {"times": times[name], "saved": saved, "ledger": ledger}
            for name, (_, saved, ledger) in programs.items()}


def summarize(row: str, ranks: list[dict[str, Any]]) -> list[list[Any]]:
    lines = []
    for name in ranks[0]:
        slowest = [max(per) for per in zip(*(r[name]["times"] for r in ranks))]
        side = name.split()[0]
        median = statistics.median(slowest) * 1000
        base = [max(per) for per in zip(*(r[f"{side} none"]["times"] for r in ranks))]
        saved, ledger = ranks[0][name]["saved"], ranks[0][name]["ledger"]
        base_saved = ranks[0][f"{side} none"]["saved"]
        lines.append([row, name, f"{median:.0f}", f"{median / (statistics.median(base) * 1000):.2f}",
                      f"{saved / 2**20:.2f}", "-" if ledger is None else f"{ledger / 2**20:.2f}",
                      "-" if ledger is None else ("yes" if ledger == saved else f"no ({saved - ledger:+,} B)"),
                      f"{saved / base_saved:.2f}"])
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model and 3 timed steps")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    config = GPTConfig(vocab_size=512, seq_len=args.seq, n_layer=args.layers, n_head=8, d_model=args.d_model,
                       d_ff=4 * args.d_model, explicit_attention=True)
    settings = Settings(model=config, batch=8, steps=args.steps, warmup=2)
    if args.quick:
        settings = replace(settings, model=replace(config, seq_len=32, d_model=64, d_ff=256, n_layer=2), steps=3,
                           warmup=1)
    table = []
    for row in args.rows.split(","):
        table += summarize(row, launch(run_row, 4, row, settings, timeout_s=900))
    print(f"example GPT (explicit attention) {settings.model}, global batch {settings.batch}, 4 gloo ranks")
    print(tabulate(table, headers=["row", "program", "step ms", "× none", "saved MiB (measured)",
                                   "ledger MiB", "ledger == measured", "saved × none"]))
    if "zero3" in args.rows:
        print("zero3: measured - ledger is the root unit's gathered parameters (embeddings, final norm, lm_head),\n"
              "kept from forward to backward as FSDP2 keeps its root (not an activation; tests/test_zero_numerics\n"
              "names the same difference)")


if __name__ == "__main__":
    main()
