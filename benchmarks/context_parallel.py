"""Context parallelism at long sequence: autopar's ring, all-gather and all-to-all attention against
one device and against PyTorch's `context_parallel`, and the load balance of causal ring attention.

The model is the example GPT (`examples/gpt.py`) at `--seq` tokens (default 2048), batch 1. Each
row is one launch of `--cp` local CPU processes (gloo, one thread each); the one-device row is one
process. A training step is zero_grad, forward, backward and an AdamW step.

Table 1, step time and memory, per (cp, method, causal):
- autopar: `parallelize(model, "cp=N", strategies=[context_parallel(method=...)])`, the global
  batch cut by `module.local_batch`; gradients all-reduced over cp by the runtime.
- PyTorch: `torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[ids, targets],
  buffer_seq_dims=[1, 1])` around forward and backward (its ring attention replaces SDPA), the
  gradients then all-reduced (mean) over the mesh by hand, as DDP would. Non-causal only: its causal
  path fails on CPU (`../shared/reference/TORCH-CPU-NOTES.md`). Timing only: the example computes
  its positions with `arange(ids.shape[1])`, which under PyTorch's buffer sharding gives each rank
  positions 0..s/N-1 (autopar localises the whole sequence's positions), so its loss differs.
- step ms: barrier, time the step on every rank, keep the slowest rank; median over `--steps`.
  `vs one` is the step time over one device's; `vs torch` over PyTorch's in the same launch.
- step peak MiB: the most bytes of tensor storages allocated during a step (activations, gradients,
  communication buffers, temporaries; not the parameters and optimizer state held from before,
  the same on both sides) alive at once on a rank, measured from outside
  (`autopar.measure.storages.LiveStorages`), the largest over ranks.

Table 2, load balance of causal ring attention: the time each rank spends in the attention
kernels (the CPU flash kernel's forward and backward, from `torch.profiler`, not the runtime)
during one step (the least of 5), with and without `load_balance`, and the largest over the mean.

Table 3, packed sequences: Hugging Face Llama (`examples/hf_models.packed_llama`, `--d-model`,
`--heads`, `--layers`) on one row of `--seq` tokens holding 6 documents of random, uneven lengths
(their first labels ignored, as `DataCollatorWithFlattening` gives; one row per rank, as long-
context training runs), cp ring with the causal zig-zag, against the same row with its documents
reordered by the document balancer (`autopar/core/document_balance.py`). Per rank: the attention
blocks it computes (query chunk x key chunk the document mask allows anything of: `attention_work`,
counted from the positions), the query-key pairs the mask allows it (`attention_pairs`), and the
milliseconds in the attention kernels during one step (least of 5, as Table 2); the largest over
the mean of each; and the step time (median over `--steps` of the slowest rank's forward and
backward). Seeds 0 and 1 of the documents' lengths.

Run: python benchmarks/context_parallel.py [--seq 2048] [--cp 2,4] [--steps 3] [--tables step,balance,packed] [--quick]
At cp=2 each rank has a core of this 2-core machine; at cp=4 four ranks share two cores.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples`, `benchmarks` are not installed

import autopar  # noqa: E402
from autopar.measure.storages import LiveStorages  # noqa: E402
from autopar.runtime.launch import launch  # noqa: E402
from autopar.core.document_balance import attention_pairs, attention_work, balance_documents, imbalance  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402
from examples.hf_models import packed_llama, packed_token_batch  # noqa: E402

MIB = 1 << 20
FLASH_KERNELS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


@dataclass(frozen=True)
class Settings:
    seq: int
    d_model: int
    heads: int
    layers: int
    steps: int
    warmup: int = 1
    lr: float = 1e-3

    def config(self, causal: bool) -> GPTConfig:
        return GPTConfig(vocab_size=256, seq_len=self.seq, n_layer=self.layers, n_head=self.heads,
                         d_model=self.d_model, d_ff=4 * self.d_model, causal=causal)


def _model(settings: Settings, causal: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(settings.config(causal))


def _timed(step: Callable[[], torch.Tensor], settings: Settings) -> dict[str, Any]:
    """Warm-up, then timed steps (a barrier before each where there is a group), and one step's peak."""
    grouped = dist.is_initialized()
    for _ in range(settings.warmup):
        step()
    storages = LiveStorages()
    with storages:
        step()
    times = []
    for _ in range(settings.steps):
        if grouped:
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"times": times, "peak": storages.peak_bytes}


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: list[torch.Tensor],
                sync: Callable[[], None] | None = None) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(*inputs)
        loss.backward()
        if sync is not None:
            sync()
        optimizer.step()
        return loss.detach()
    return step


def one_device(rank: int, world: int, settings: Settings, causal: bool) -> dict[str, Any]:
    model = _model(settings, causal)
    batch = example_batch(settings.config(causal), batch=1)
    return _timed(_train_step(model, torch.optim.AdamW(model.parameters(), lr=settings.lr), list(batch)), settings)


def autopar_row(rank: int, world: int, settings: Settings, causal: bool, method: str) -> dict[str, Any]:
    batch = example_batch(settings.config(causal), batch=1)
    module = autopar.parallelize(_model(settings, causal), f"cp={world}",
                                 strategies=[autopar.context_parallel(method=method)], example_inputs=batch)
    optimizer = torch.optim.AdamW(module.parameters(), lr=settings.lr)
    return _timed(_train_step(module, optimizer, module.local_batch(*batch)), settings)


def pytorch_row(rank: int, world: int, settings: Settings) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = _model(settings, causal=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    ids, targets = (t.clone() for t in example_batch(settings.config(False), batch=1))

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        with context_parallel(mesh, buffers=[ids, targets], buffer_seq_dims=[1, 1]):
            loss = model(ids, targets)
            loss.backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat / world, grads)):
            grad.copy_(synced)
        optimizer.step()
        return loss.detach()
    return _timed(step, settings)


def attention_time(rank: int, world: int, settings: Settings, balanced: bool, repeats: int = 5) -> float:
    """Milliseconds this rank spends in the flash kernels during one causal ring step: the least
    over `repeats` steps (a step whose rank was preempted by another process only reads longer)."""
    batch = example_batch(settings.config(True), batch=1)
    module = autopar.parallelize(_model(settings, True), f"cp={world}",
                                 strategies=[autopar.context_parallel(load_balance=balanced)], example_inputs=batch)
    return _kernel_ms(module, module.local_batch(*batch), repeats)


def _kernel_ms(module: Any, local: tuple, repeats: int) -> float:
    """Milliseconds this rank spends in the flash kernels during one forward and backward, the
    least of `repeats` (after a warm-up)."""
    module(*local).backward()
    spent = []
    for _ in range(repeats):
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            module(*local).backward()
        spent.append(sum(e.self_cpu_time_total for e in profiler.key_averages() if e.key in FLASH_KERNELS) / 1000)
    return min(spent)


def _packed_batch(settings: Settings, world: int, balanced: bool, seed: int) -> tuple[torch.Tensor, ...]:
    batch = packed_token_batch(batch=1, seq=settings.seq, documents=6, seed=seed, separated=True)
    if not balanced:
        return batch
    index = balance_documents(batch[1], size=world)
    return tuple(t.gather(1, index) for t in batch)


def packed_attention(rank: int, world: int, settings: Settings, balanced: bool, seed: int,
                     repeats: int = 5) -> dict[str, Any]:
    """This rank's attention blocks and pairs, milliseconds in the attention kernels (least of
    `repeats` profiled steps) and forward-and-backward times on a packed row, zig-zag or balanced."""
    batch = _packed_batch(settings, world, balanced, seed)
    torch.manual_seed(0)
    model = packed_llama(layers=settings.layers, hidden=settings.d_model, heads=settings.heads,
                         positions=settings.seq)
    module = autopar.parallelize(model, f"cp={world}", strategies=[autopar.context_parallel()], example_inputs=batch)
    local = module.local_batch(*batch)
    kernel_ms = _kernel_ms(module, local, repeats)
    times = []
    for _ in range(settings.steps):
        dist.barrier()
        start = time.perf_counter()
        module(*local).backward()
        times.append(time.perf_counter() - start)
    return {"blocks": attention_work(batch[1], size=world)[rank], "pairs": attention_pairs(batch[1], size=world)[rank],
            "kernel_ms": kernel_ms, "times": times}


def packed_table(settings: Settings, sizes: list[int]) -> list[list[Any]]:
    rows = []
    for cp in sizes:
        for seed in (0, 1):
            for balanced in (False, True):
                per_rank = launch(packed_attention, cp, settings, balanced, seed, timeout_s=900)
                blocks, pairs = [r["blocks"] for r in per_rank], [r["pairs"] for r in per_rank]
                kernel = [r["kernel_ms"] for r in per_rank]
                rows.append([cp, seed, "documents balanced" if balanced else "causal zig-zag",
                             " / ".join(map(str, blocks)), f"{imbalance(blocks):.2f}",
                             " / ".join(f"{p / 1e3:.0f}K" for p in pairs), f"{imbalance(pairs):.2f}",
                             " / ".join(f"{t:.0f}" for t in kernel), f"{imbalance(kernel):.2f}",
                             f"{_median_ms(per_rank):.0f}"])
    return rows


def _median_ms(per_rank: list[dict[str, Any]]) -> float:
    return 1000 * statistics.median(max(times) for times in zip(*(r["times"] for r in per_rank)))


def _peak(per_rank: list[dict[str, Any]]) -> str:
    return f"{max(r['peak'] for r in per_rank) / MIB:.1f}"


def _try(fn: Callable[..., Any], world: int, *args: Any) -> tuple[Any, str]:
    try:
        return launch(fn, world, *args, timeout_s=900), ""
    except RuntimeError as error:
        return None, str(error).strip().splitlines()[-1][:200]


def step_table(settings: Settings, sizes: list[int]) -> tuple[list[list[Any]], list[str]]:
    rows, notes = [], []
    for causal in (True, False):
        single = launch(one_device, 1, settings, causal, timeout_s=900)
        single_ms = _median_ms(single)
        rows.append([1, "one device", causal, f"{single_ms:.0f}", "1.00", "", _peak(single)])
        for cp in sizes:
            torch_ms = None
            if not causal:
                measured, failure = _try(pytorch_row, cp, settings)
                if measured is None:
                    notes.append(f"PyTorch context_parallel cp={cp}: failed: {failure}")
                    rows.append([cp, "PyTorch context_parallel", causal, "n/a", "", "", "n/a"])
                else:
                    torch_ms = _median_ms(measured)
                    rows.append([cp, "PyTorch context_parallel", causal, f"{torch_ms:.0f}",
                                 f"{torch_ms / single_ms:.2f}", "1.00", _peak(measured)])
            for method in ("ring", "allgather", "alltoall"):
                measured = launch(autopar_row, cp, settings, causal, method, timeout_s=900)
                ms = _median_ms(measured)
                rows.append([cp, f"autopar {method}", causal, f"{ms:.0f}", f"{ms / single_ms:.2f}",
                             f"{ms / torch_ms:.2f}" if torch_ms else "", _peak(measured)])
            print(f"cp={cp} causal={causal}: done", flush=True)
    return rows, notes


def balance_table(settings: Settings, sizes: list[int]) -> list[list[Any]]:
    rows = []
    for cp in sizes:
        for balanced in (True, False):
            per_rank = launch(attention_time, cp, settings, balanced, timeout_s=900)
            mean = statistics.mean(per_rank)
            rows.append([cp, "chunks i, 2N-1-i" if balanced else "chunk i", *[f"{t:.0f}" for t in per_rank],
                         *[""] * (max(sizes) - cp), f"{max(per_rank) / mean:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cp", default="2,4", help="comma-separated context-parallel sizes")
    parser.add_argument("--tables", default="step,balance,packed", help="which tables: step, balance, packed")
    parser.add_argument("--quick", action="store_true", help="seq 256, cp 2, 2 steps: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.seq, args.cp, args.steps = 256, "2", 2
    settings = Settings(seq=args.seq, d_model=args.d_model, heads=args.heads, layers=args.layers, steps=args.steps)
    sizes = [int(s) for s in args.cp.split(",")]
    print(f"example GPT, seq {settings.seq}, d_model {settings.d_model}, {settings.heads} heads, "
          f"{settings.layers} layers, batch 1, fp32; median of {settings.steps} steps, slowest rank", flush=True)
    if "step" in args.tables:
        rows, notes = step_table(settings, sizes)
        print(tabulate(rows, headers=["cp", "program", "causal", "step ms", "vs one", "vs torch", "step peak MiB"]))
        for note in notes:
            print("note:", note)
        print()
    if "balance" in args.tables:
        print("Causal ring attention: milliseconds in the attention kernels per rank, one step (least of 5)")
        print(tabulate(balance_table(settings, sizes),
                       headers=["cp", "sequence held", *[f"rank {r}" for r in range(max(sizes))], "max/mean"]))
        print()
    if "packed" in args.tables:
        print(f"Packed sequences (HF Llama, one row of {settings.seq} tokens, 6 documents), cp ring: per rank")
        print(tabulate(packed_table(settings, sizes),
                       headers=["cp", "seed", "layout", "blocks", "max/mean", "pairs", "max/mean", "kernel ms",
                                "max/mean", "fwd+bwd ms"]))


if __name__ == "__main__":
    main()
