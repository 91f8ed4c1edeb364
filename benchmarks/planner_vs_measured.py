"""The planner's predictions against runs: every candidate it prices is also run and timed.

For each world size: `autopar.calibrate(world_size=N)` measures this machine (α, β, a lone
message's α, matmul throughput, memory bandwidth per op size, per-call cost, overlap; printed in
the header), `autopar.planner.search.search` plans and prices
every candidate layout of the example GPT on that cluster, and then one launch of N gloo ranks
(one thread each) runs every priced candidate that fits (16 per launch): parallelize
(rank 0 plans, the others receive), four steps under `LiveStorages` (each step's peak of live
tensor bytes, the global and local batch taken out; the measured peak is the lowest of the last
three steps' peaks, the largest over the ranks, and the highest is printed beside it — see
`_build`; nothing is asked of autopar's runtime), then timed steps (zero_grad, forward, backward, AdamW step; barrier
before each, the slowest rank's time, median over the steps) in rounds: each round times every
candidate of the launch once, so that the machine's drift hits them alike.

Printed per world size: each candidate's predicted and measured step time and peak, the
planner's first choice against the fastest measured, and the Spearman rank correlation of
predicted against measured step time (the median's; beside it the same against each candidate's
fastest round, which other load on the machine can only slow, and the share of CPU time the
hypervisor gave other guests during the runs, from /proc/stat: how far to trust the times).

Run: python benchmarks/planner_vs_measured.py [--world 4,8] [--steps 5] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402
from autopar.measure.step_peaks import step_peaks  # noqa: E402
from autopar.measure.storages import LiveStorages  # noqa: E402
from autopar.planner.search import search  # noqa: E402
from autopar.runtime.launch import launch  # noqa: E402
from autopar.planner.search_space import SearchSpace  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402

# context_tokens=1: the example GPT's sequences are 16 tokens, and the benchmark runs cp candidates too
SPACES = {4: SearchSpace(context_tokens=1), 8: SearchSpace(zero_stages=(0, 1, 3), schedules=("1f1b",), context_tokens=1)}


PEAK_STEPS = 3  # steps after the first whose peaks are read


def _build(candidate, config: GPTConfig, batch: tuple) -> tuple:
    """Parallelize, then 1 + `PEAK_STEPS` steps under `LiveStorages`, each step's peak (batches
    taken out) read after the first: (lowest, highest) over those steps, each the largest over
    the ranks. A step's peak varies on one rank by what gloo's worker threads still hold: they drop
    a finished collective's tensors a moment after `wait()` returns, later the busier the cores
    (8 ranks on 2); the lowest is the program's own peak, the highest shows the lag."""
    storages = LiveStorages()
    storages.track(list(batch))
    with storages:
        torch.manual_seed(0)
        module = autopar.parallelize(GPT(config), candidate.mesh_spec, strategies=candidate.strategies(),
                                     example_inputs=batch)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        peaks = step_peaks(module, optimizer, batch, storages, steps=1 + PEAK_STEPS)
    local = module.local_batch(*batch)
    ours = torch.tensor([min(peaks[1:]), max(peaks[1:])], dtype=torch.int64)
    dist.all_reduce(ours, op=dist.ReduceOp.MAX)
    return module, optimizer, local, (int(ours[0]), int(ours[1]))


def _timed_step(module, optimizer, local) -> float:
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    module.train_step(*local)
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
    return float(elapsed)


def _run_all(rank: int, world: int, chosen: list, config: GPTConfig, batch: tuple, steps: int) -> list[dict]:
    """Every candidate built, then `steps` rounds each timing every candidate once (drift hits all alike)."""
    torch.set_num_threads(1)
    built = [_build(candidate, config, batch) for candidate in chosen]
    times: list[list[float]] = [[] for _ in chosen]
    for _ in range(steps):
        for index, (module, optimizer, local, _) in enumerate(built):
            times[index].append(_timed_step(module, optimizer, local))
    return [{"seconds": statistics.median(t), "fastest": min(t), "peak": b[3][0], "highest": b[3][1]}
            for t, b in zip(times, built)]


def _cpu_ticks() -> tuple[int, int]:
    """(all, stolen) CPU ticks of this machine so far (/proc/stat): time the hypervisor gave other
    guests while ours waited — load the benchmark cannot see otherwise."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0, 0
    return sum(fields[:8]), (fields[7] if len(fields) > 7 else 0)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", default="4,8")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smaller model, 3 steps")
    args = parser.parse_args()
    config = GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_head=4, d_model=128, d_ff=512)
    steps = args.steps
    if args.quick:
        config, steps = GPTConfig(vocab_size=128, seq_len=32, n_layer=4, n_head=4, d_model=64, d_ff=256), 3
    batch = example_batch(config, batch=8)
    for world in (int(w) for w in args.world.split(",")):
        calibration = autopar.calibrate(world_size=world)
        cluster = calibration.cluster
        result = search(GPT(config), cluster, example_inputs=batch, space=SPACES.get(world, SearchSpace()))
        priced = [o for o in result.outcomes if o.fits]
        print(f"{world} ranks: searched {len(result.outcomes)} candidates in {result.seconds:.1f} s; running "
              f"{len(priced)}", flush=True)
        measured = []
        ticks = _cpu_ticks()
        for start in range(0, len(priced), 16):  # a launch per 16 candidates: a failure loses less
            chunk = [o.candidate for o in priced[start:start + 16]]
            measured += launch(_run_all, world, chunk, config, batch, steps, timeout_s=1800)[0]
        total, stolen = (after - before for after, before in zip(_cpu_ticks(), ticks))
        rows = []
        for index, (outcome, run) in enumerate(zip(priced, measured)):
            e = outcome.estimate
            rows.append([index + 1, outcome.candidate.label, f"{e.seconds * 1e3:.1f}", f"{run['seconds'] * 1e3:.1f}",
                         f"{e.seconds / run['seconds']:.2f}", f"{e.peak_bytes / 2**20:.2f}",
                         f"{run['peak'] / 2**20:.2f}", f"{e.peak_bytes / run['peak'] - 1:+.1%}",
                         f"{run['highest'] / 2**20:.2f} ({e.peak_bytes / run['highest'] - 1:+.1%})"])
        predicted = [o.estimate.seconds for o in priced]
        times = [r["seconds"] for r in measured]
        fastest = min(range(len(times)), key=times.__getitem__)
        c = cluster
        print(f"== {world} ranks; cluster: α {c.intra_latency_us:.0f} µs (a lone message {c.p2p_latency_us:.0f} µs), "
              f"β {c.intra_gbps:.2f} GB/s, "
              f"{c.peak_tflops * 1e3:.1f} GFLOP/s, {c.memory_gbps:.1f} GB/s memory (per op size, KiB touched: "
              f"{[(b // 1024, round(g, 1)) for b, g in c.memory_curve]}), {c.op_overhead_us:.1f} µs per call, "
              f"overlap {c.overlap:.2f}, processors {c.processors}; per group size (n, α µs, β GB/s) "
              f"{[(n, round(a), round(b, 2)) for n, a, b in c.group_links]}; kind factors "
              f"{[(k, round(f, 2)) for k, f in c.kind_factors]}; search {result.seconds:.1f} s over {len(result.outcomes)} candidates "
              f"({len(result.pruned)} pruned)")
        print(f"model {config}, global batch {batch[0].shape[0]}")
        print(tabulate(rows, headers=["#", "candidate", "predicted ms", "measured ms", "pred/meas",
                                      "predicted peak MiB", "measured peak MiB", "peak error",
                                      "highest step's peak MiB (error)"], disable_numparse=True))
        print(f"planner's first choice: {priced[0].candidate.label}, measured {times[0] * 1e3:.1f} ms; fastest "
              f"measured: {priced[fastest].candidate.label}, {times[fastest] * 1e3:.1f} ms "
              f"(first choice {times[0] / times[fastest] - 1:+.1%})")
        print(f"Spearman rank correlation, predicted vs measured step time: {spearman(predicted, times):.3f} "
              f"(against each candidate's fastest round instead of its median: "
              f"{spearman(predicted, [r['fastest'] for r in measured]):.3f}); CPU time stolen by other guests "
              f"during the runs: {stolen / max(total, 1):.1%}\n")


if __name__ == "__main__":
    main()
