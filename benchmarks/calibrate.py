"""Measure this machine as an autopar `Cluster`: α and β of gloo all-reduce, matmul throughput.

`autopar.calibrate(world_size=N)` on N local ranks (one thread each); prints every sample with
the fitted α-β model's time and its error, then the `Cluster` it describes (the figures
`autopar.cost.cluster.PRESETS["cpu2x4"]` records for this 2-core machine).

Run: python benchmarks/calibrate.py [--world 2,4]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", default="2,4", help="comma-separated rank counts (default 2,4)")
    for world in [int(w) for w in parser.parse_args().world.split(",")]:
        result = autopar.calibrate(world_size=world)
        c = result.cluster
        print(f"== {world} ranks")
        print(result.table())
        print(f"fit: α {c.intra_latency_us:.1f} µs per ring step (a lone message: {c.p2p_latency_us:.1f} µs), "
              f"β {c.intra_gbps:.3f} GB/s, worst error "
              f"{result.worst_relative_residual:.0%}; matmul {c.peak_tflops * 1e3:.1f} GFLOP/s per rank "
              f"(all ranks at once), memory {c.memory_gb:.2f} GB per rank")
        print(f"memory bandwidth {c.memory_gbps:.2f} GB/s per rank (per op size, KiB touched, GB/s: "
              f"{[(b // 1024, round(g, 1)) for b, g in c.memory_curve]}), {c.op_overhead_us:.1f} µs per operator call, "
              f"overlap {c.overlap:.2f} (4 MiB all-reduce {result.overlap_seconds[0] * 1e3:.1f} ms, matmuls "
              f"{result.overlap_seconds[1] * 1e3:.1f} ms, both {result.overlap_seconds[2] * 1e3:.1f} ms)\n")


if __name__ == "__main__":
    main()
