"""Measure the machine at hand as a `Cluster` (`autopar/cluster.py`): α, β and compute throughput.

`calibrate(world_size=4)` starts `world_size` local processes (`autopar.runtime.launch`: gloo on
CPU, NCCL where there are GPUs, one thread each) that together:
- time `torch.distributed.all_reduce` over all of them at logical sizes `SIZES` (after a warm-up,
  the median of `repeats` calls; each call's time is the slowest rank's, read after a barrier);
- time a square fp32 matrix product on every rank at once (the ranks share the machine's cores
  as training's ranks do), giving the per-rank throughput.

The α-β fit: an all-reduce of S bytes over n ranks takes t = 2(n-1)·α + (2(n-1)/n)·S / β (the
registry's steps and wire bytes, `autopar.comm_kinds`). Least squares of t on the wire bytes,
weighted by 1/t² (relative error, so the small sizes that fix α count as much as the large ones
that fix β), gives the intercept 2(n-1)·α and the slope 1/β. One node: the fitted link is both
`intra` and `inter`. `Calibration` keeps every sample, the fitted time at each size and the
largest relative residual, so that a user can see how well two numbers describe the machine.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch

from autopar.cluster import GB, Cluster
from autopar.comm_kinds import KINDS, wire_bytes

SIZES = tuple(4 ** k * 1024 for k in range(8))  # 1 KiB ... 16 MiB
MATMUL_N = 512


@dataclass(frozen=True)
class Calibration:
    cluster: Cluster
    world_size: int
    samples: tuple[tuple[int, float], ...]  # (all-reduce logical bytes, median seconds)
    fitted: tuple[float, ...]  # the model's seconds at each sample's size
    matmul_seconds: float

    @property
    def worst_relative_residual(self) -> float:
        return max(abs(f - t) / t for (_, t), f in zip(self.samples, self.fitted))

    def table(self) -> str:
        from tabulate import tabulate

        rows = [(f"{size:,}", f"{t * 1e3:.3f}", f"{f * 1e3:.3f}", f"{(f - t) / t:+.0%}")
                for (size, t), f in zip(self.samples, self.fitted)]
        return tabulate(rows, headers=["all_reduce bytes", "measured ms", "α-β model ms", "error"],
                        disable_numparse=True)


def _timed_all_reduce(nbytes: int, repeats: int) -> float:
    import torch.distributed as dist

    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    for _ in range(2):
        dist.all_reduce(tensor)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
        times.append(float(elapsed))
    return statistics.median(times)


def _timed_matmul(n: int, repeats: int) -> float:
    import torch.distributed as dist

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    dist.barrier()  # every rank computes at once: the cores are shared as in training
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _calibration_rank(rank: int, world_size: int, sizes: tuple[int, ...], repeats: int) -> dict:
    samples = [(size, _timed_all_reduce(size, repeats)) for size in sizes]
    return {"samples": samples, "matmul": _timed_matmul(MATMUL_N, repeats)}


def fit_alpha_beta(samples: list[tuple[int, float]], world_size: int) -> tuple[float, float]:
    """(α seconds per ring step, β bytes per second) of all-reduce samples (module docstring)."""
    steps = KINDS["all_reduce"].latency_steps(world_size)
    xs = [float(wire_bytes("all_reduce", world_size, size)) for size, _ in samples]
    ys = [t for _, t in samples]
    weights = [1.0 / (t * t) for t in ys]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys)) / total
    slope = (sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys))
             / sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs)))
    intercept = mean_y - slope * mean_x
    if slope <= 0:
        raise RuntimeError(f"all-reduce time does not grow with its size ({samples}); the machine is too noisy "
                           f"to calibrate now")
    return max(intercept, 0.0) / steps, 1.0 / slope


def _memory_gb_per_rank(world_size: int) -> float:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / world_size / GB


def calibrate(*, world_size: int = 4, sizes: tuple[int, ...] = SIZES, repeats: int = 9,
              timeout_s: float = 300.0) -> Calibration:
    """Measure this machine with `world_size` local ranks (module docstring)."""
    from autopar.runtime.launch import launch

    if world_size < 2:
        raise ValueError("calibrating a link needs at least 2 ranks")
    results = launch(_calibration_rank, world_size, tuple(sizes), repeats, timeout_s=timeout_s)
    samples = results[0]["samples"]  # every rank holds the same (slowest-rank) times
    alpha, beta = fit_alpha_beta(samples, world_size)
    matmul = max(r["matmul"] for r in results)
    cluster = Cluster(nodes=1, gpus_per_node=world_size, memory_gb=round(_memory_gb_per_rank(world_size), 3),
                      intra_gbps=beta / GB, inter_gbps=beta / GB, peak_tflops=2 * MATMUL_N ** 3 / matmul / 1e12,
                      intra_latency_us=alpha * 1e6, inter_latency_us=alpha * 1e6,
                      name=f"this machine, {world_size} ranks (measured)")
    fitted = tuple(cluster.collective_seconds("all_reduce", world_size, size, "intra") for size, _ in samples)
    return Calibration(cluster, world_size, tuple(samples), fitted, matmul)
