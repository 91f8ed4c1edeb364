"""Measure the machine at hand as a `Cluster` (`autopar/cost/cluster.py`): α, β and compute throughput.

`autopar.calibrate(world_size=4)` (`autopar/api.py`) starts `world_size` local processes (gloo on
CPU, one thread each), each running `calibration_rank`, which together:
- time `torch.distributed.all_reduce` over all of them at logical sizes `SIZES` (after a warm-up,
  the median of `repeats` calls; each call's time is the slowest rank's, read after a barrier);
- time a square fp32 matrix product on every rank at once (the ranks share the machine's cores
  as training's ranks do; `_per_call`: samples of many calls, longer than the scheduler's
  slice, as for the copies and the small op below), giving the per-rank throughput; and one of
  bf16 operands (`Cluster.matmul_tflops`' "bfloat16" row: a CPU without bf16 matrix units
  multiplies bf16 over a hundred times slower than fp32, which a mixed-precision plan pays);
- time copies of 64 KiB to 32 MiB on every rank at once, each size in a loop of `LOOP_BYTES`
  (memory bandwidth: read + write bytes over the time beyond a 4-byte copy's, which is the
  call's fixed cost), one `Cluster.memory_curve` row per size: a CPU's caches serve the small
  ones several times faster; the 32 MiB copy is also `memory_gbps`; and a one-element add under
  autograd (the fixed cost of one operator call);
- the same for every smaller group size n dividing the world: the world cut into groups of n
  consecutive ranks that all-reduce at once, one α-β fit per size (`Cluster.group_links`: ranks
  sharing fewer cores wait longer for a peer the more of them there are);
- time a 4-byte message between ranks 0 and 1, back and forth, while the others wait at a
  barrier: half a round trip is the α of a lone point-to-point message (`Cluster.p2p_latency_us`,
  a pipeline's hand-over), which on ranks sharing cores is far below a collective's step;
- time all-gather, reduce-scatter, all-to-all and broadcast of 4 MiB over the world: each
  kind's time over what the all-reduce's α and β predict for it is its `kind_factor` (1 on
  NCCL, whose bus bandwidth serves every kind; gloo implements some kinds less directly);
- time an asynchronous all-reduce of 4 MiB alone, matrix products alone, and the two together:
  the share of the shorter one that disappears when they run at once is the `overlap` of
  asynchronous communication with compute (near 1 where links have their own engines; on a
  CPU gloo's thread takes the cores compute needs).

The α-β fit: an all-reduce of S bytes over n ranks takes t = 2(n-1)·α + (2(n-1)/n)·S / β (the
registry's steps and wire bytes, `autopar.core.comm_kinds`). Least squares of t on the wire bytes,
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
from typing import Callable

import torch
import torch.distributed as dist
from tabulate import tabulate

from autopar.core.comm_kinds import KINDS, wire_bytes
from autopar.cost.cluster import GB, Cluster

SIZES = tuple(4 ** k * 1024 for k in range(8))  # 1 KiB ... 16 MiB
MATMUL_N = 512
MATMUL_CALLS = 16  # per sample (`_per_call`)
BF16_MATMUL_N = 128  # smaller: where bf16 has no matrix units one 512-square product takes a second
COPY_BYTES = 32 * 2 ** 20
CURVE_BYTES = tuple(4 ** k * 64 * 1024 for k in range(4)) + (COPY_BYTES,)  # 64 KiB ... 4 MiB, 32 MiB
LOOP_BYTES = 128 * 2 ** 20  # copied per sample: longer than the scheduler's slice, where ranks share cores
OVERLAP_BYTES = 4 * 2 ** 20
KIND_BYTES = 4 * 2 ** 20


@dataclass(frozen=True)
class Calibration:
    cluster: Cluster
    world_size: int
    samples: tuple[tuple[int, float], ...]  # (all-reduce logical bytes, median seconds)
    fitted: tuple[float, ...]  # the model's seconds at each sample's size
    matmul_seconds: float
    overlap_seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)  # all-reduce, matmuls, both at once

    @property
    def worst_relative_residual(self) -> float:
        return max(abs(f - t) / t for (_, t), f in zip(self.samples, self.fitted))

    def table(self) -> str:
        rows = [(f"{size:,}", f"{t * 1e3:.3f}", f"{f * 1e3:.3f}", f"{(f - t) / t:+.0%}")
                for (size, t), f in zip(self.samples, self.fitted)]
        return tabulate(rows, headers=["all_reduce bytes", "measured ms", "α-β model ms", "error"],
                        disable_numparse=True)


def _timed_all_reduce(nbytes: int, repeats: int, group: object = None) -> float:
    """Median over `repeats` of the slowest rank's time of one all-reduce in `group` (every group
    of the world's partition at once; None: the world)."""
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    return _median_slowest(lambda: dist.all_reduce(tensor, group=group), repeats, warmup=2)


def _median_slowest(call: "object", repeats: int, *, warmup: int = 1) -> float:
    """`call` run `warmup` times, then `repeats` times each after a barrier: the median of the
    slowest rank's time."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(_slowest(time.perf_counter() - start))
    return statistics.median(times)


def _group_samples(rank: int, world_size: int, sizes: tuple[int, ...], repeats: int) -> dict[int, list]:
    """Per group size n < world dividing it: the world cut into groups of n consecutive ranks, all
    of them all-reducing at once (as a dp×tp mesh's tp groups do)."""
    samples = {}
    for n in (n for n in range(2, world_size) if world_size % n == 0):
        groups = [dist.new_group(list(range(start, start + n))) for start in range(0, world_size, n)]
        mine = groups[rank // n]
        samples[n] = [(size, _timed_all_reduce(size, repeats, mine)) for size in sizes]
    return samples


def _timed_handover(rank: int, repeats: int, round_trips: int = 10) -> float:
    """Half a round trip of a 4-byte message between ranks 0 and 1 while the other ranks wait at
    the next barrier (median over `repeats` samples of `round_trips` each, after one unrecorded)."""
    message = torch.zeros(1)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(round_trips if rank < 2 else 0):
            round_trip(rank, message)
        times.append((time.perf_counter() - start) / (2 * round_trips))
    return statistics.median(times[1:])


def round_trip(rank: int, message: torch.Tensor) -> None:
    """`message` from rank 0 to rank 1 and back (ranks 0 and 1 only)."""
    if rank == 0:
        dist.send(message, 1)
        dist.recv(message, 1)
    else:
        dist.recv(message, 0)
        dist.send(message, 0)


def _per_call(call: Callable[[], object], calls: int, repeats: int) -> float:
    """Seconds of one `call` with every rank calling at once: after a barrier, the median over
    `repeats` samples of `calls` calls each. A sample outlasts the scheduler's slice, so that
    where ranks share cores every sample sees them shared, as training does (one short call
    often ran on a core its peer had left, and read the speed of a rank alone)."""
    call()
    dist.barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _timed_matmul(n: int, repeats: int, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return _per_call(lambda: torch.mm(a, b), MATMUL_CALLS, repeats)


def _timed_copies(sizes: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Per size: seconds of one copy of that many bytes, every rank copying at once, beyond a
    4-byte copy's time (median over `repeats` samples of a `LOOP_BYTES` loop each)."""
    def per_copy(nbytes: int) -> float:
        source, target = torch.ones(max(nbytes // 4, 1)), torch.empty(max(nbytes // 4, 1))
        return _per_call(lambda: target.copy_(source), max(1, LOOP_BYTES // max(nbytes, 4096)), repeats)

    fixed = per_copy(4)
    return {size: max(per_copy(size) - fixed, 1e-9) for size in sizes}


def _timed_small_op(repeats: int, calls: int = 5000) -> float:
    x = torch.ones(1, requires_grad=True)
    return _per_call(lambda: x + 1.0, calls, repeats)


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _overlap_times(repeats: int) -> tuple[float, float, float]:
    """(all-reduce alone, matmuls alone, both at once), each the slowest rank's median."""
    tensor, a = torch.ones(OVERLAP_BYTES // 4), torch.randn(MATMUL_N, MATMUL_N)
    # as many products as take the all-reduce's time: the share is then read off two equal parts
    one = _slowest(_timed_matmul(MATMUL_N, repeats))
    count = max(1, round(_timed_all_reduce(OVERLAP_BYTES, repeats) / one))

    def matmuls() -> None:
        for _ in range(count):
            torch.mm(a, a)

    def alone() -> None:
        dist.all_reduce(tensor, async_op=True).wait()

    def both() -> None:
        work = dist.all_reduce(tensor, async_op=True)
        matmuls()
        work.wait()

    return _median_slowest(alone, repeats), _median_slowest(matmuls, repeats), _median_slowest(both, repeats)


def _timed_kinds(rank: int, world_size: int, repeats: int) -> dict[str, float]:
    """Median seconds (slowest rank) of each other collective kind over the world at KIND_BYTES logical."""
    whole, piece = torch.ones(KIND_BYTES // 4), torch.ones(KIND_BYTES // 4 // world_size)
    calls = {"all_gather": lambda: dist.all_gather_into_tensor(whole, piece),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(piece, whole),
             "all_to_all": lambda: dist.all_to_all_single(whole.clone(), whole),
             "broadcast": lambda: dist.broadcast(whole, src=0)}
    return {kind: _median_slowest(call, repeats) for kind, call in calls.items()}


def calibration_rank(rank: int, world_size: int, sizes: tuple[int, ...], repeats: int) -> dict:
    samples = [(size, _timed_all_reduce(size, repeats)) for size in sizes]
    return {"samples": samples, "groups": _group_samples(rank, world_size, sizes, repeats), "matmul": _timed_matmul(MATMUL_N, repeats),
            "matmul_bf16": _timed_matmul(BF16_MATMUL_N, repeats, torch.bfloat16),
            "copies": _timed_copies(CURVE_BYTES, repeats), "small_op": _timed_small_op(repeats),
            "overlap": _overlap_times(repeats), "kinds": _timed_kinds(rank, world_size, repeats),
            "handover": _timed_handover(rank, repeats)}


def overlap_share(communication: float, compute: float, both: float) -> float:
    """The share of the shorter of two activities hidden when they run at once, in [0, 1]."""
    hidden = communication + compute - both
    return min(1.0, max(0.0, hidden / min(communication, compute)))


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


def fit_calibration(results: list[dict], world_size: int) -> Calibration:
    """The cluster that `calibration_rank`'s measurements on `world_size` local ranks describe
    (module docstring), `results` by rank."""
    samples = results[0]["samples"]  # every rank holds the same (slowest-rank) times
    alpha, beta = fit_alpha_beta(samples, world_size)
    matmul = max(r["matmul"] for r in results)
    bf16_tflops = 2 * BF16_MATMUL_N ** 3 / max(r["matmul_bf16"] for r in results) / 1e12
    copies = {size: max(r["copies"][size] for r in results) for size in CURVE_BYTES}
    curve = tuple((2 * size, 2 * size / seconds / GB) for size, seconds in sorted(copies.items()))
    small_op = max(r["small_op"] for r in results)
    overlap = results[0]["overlap"]
    group_links = [(world_size, alpha * 1e6, beta / GB)]
    for n, group_samples in sorted(results[0]["groups"].items()):
        group_alpha, group_beta = fit_alpha_beta(group_samples, n)
        group_links.append((n, group_alpha * 1e6, group_beta / GB))
    base = Cluster(nodes=1, gpus_per_node=world_size, memory_gb=1, intra_gbps=beta / GB, inter_gbps=beta / GB,
                   peak_tflops=1, intra_latency_us=alpha * 1e6, inter_latency_us=alpha * 1e6)
    kind_factors = tuple(sorted((kind, seconds / base.collective_seconds(kind, world_size, KIND_BYTES, "intra"))
                                for kind, seconds in results[0]["kinds"].items()))
    processors = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cluster = Cluster(nodes=1, gpus_per_node=world_size, memory_gb=round(_memory_gb_per_rank(world_size), 3),
                      intra_gbps=beta / GB, inter_gbps=beta / GB, peak_tflops=2 * MATMUL_N ** 3 / matmul / 1e12,
                      intra_latency_us=alpha * 1e6, inter_latency_us=alpha * 1e6,
                      p2p_latency_us=results[0]["handover"] * 1e6,
                      memory_gbps=2 * COPY_BYTES / copies[COPY_BYTES] / GB, memory_curve=curve,
                      op_overhead_us=small_op * 1e6, matmul_tflops=(("bfloat16", bf16_tflops),),
                      overlap=overlap_share(*overlap), processors=processors if processors < world_size else None,
                      group_links=tuple(sorted(group_links)), kind_factors=kind_factors,
                      name=f"local host, {world_size} ranks (measured)", backend="gloo")
    fitted = tuple(cluster.collective_seconds("all_reduce", world_size, size, "intra") for size, _ in samples)
    return Calibration(cluster, world_size, tuple(samples), fitted, matmul, overlap)
