"""Stress the jobs where a rank once aborted with a heap corruption (issue 45): a tiny Llama under
tensor + sequence parallelism (tp=2 + SP, tp=4 + SP, dp=2 x tp=2 + SP, with or without async TP's
chunks), 2 AdamW steps (`--steps`), each run a real multi-process gloo job
(`autopar.runtime.launch.launch`) through the numerics tests' harness
(`tests/numerics.distributed_rank`: the collective counter and the storage tracker active, as in
tests/test_hf_numerics.py and tests/test_zoo.py).

Every rank runs with `MALLOC_CHECK_=3` and faulthandler's stacks on a fatal signal; `--no-tcache`
also switches glibc's per-thread cache off (`GLIBC_TUNABLES=glibc.malloc.tcache_count=0`: a chunk
written past its end is then caught by the arenas' own checks at its next use). Keep the cache on
to see the gloo corruption below: it shows as "malloc(): unaligned tcache chunk detected", and
with the cache off the same runs came out clean (400 of them before 2026-12-06). Since glibc 2.34 `MALLOC_CHECK_`
acts only with `libc_malloc_debug.so` preloaded: `--malloc-debug` preloads it (its padding hides an
overflow of a byte or two that the arenas' checks catch without it: a one-byte overflow of a
24-byte block, glibc 2.36). The script executes itself again once with that environment, so that
the fork server the ranks start from has it too.

`--no-overlap` adds each variant's `autopar.schedule(overlap=False)` twin, to bisect: the
scheduling pass off, every graph collective waits where it is issued (the gradient buckets'
all-reduces still run asynchronously during backward, so one process group may still have two
collectives in flight). `--detail` sets `TORCH_DISTRIBUTED_DEBUG=DETAIL`: before each collective
gloo's wrapper checks its kind and shapes across the ranks, so a collective issued in a different
order on two ranks fails at once, named.

    python scripts/stress_heap.py --runs 200            # tp2_sp and dp2_tp2_sp
    python scripts/stress_heap.py --runs 20 --steps 60 --variants tp4_sp,dp2_tp2_sp_chunks --no-overlap
    python scripts/stress_heap.py --runs 40 --steps 30 --variants pp2_tp2_sp_chunks --model gpt --torch-gloo

The cause, found 2026-12-06 (docs/known-limits.md): PyTorch's gloo runs a process group's
collectives on two worker threads, and two collectives of one group running at once corrupt the
heap; autopar's launcher and `init_from_env` start gloo with one worker thread per group
(`autopar/runtime/serial_gloo.py`). `--torch-gloo` runs PyTorch's gloo instead, to see it: the
cores of the aborts show a gloo worker's cache of 32-byte chunks overwritten.

Prints one line per run and a summary per variant: runs, clean, aborts (SIGABRT), other signals,
timeouts, Python errors. Each failed run's message (every rank's stderr tail with faulthandler's
stacks) is written under --out. Exit status 1 if any run failed.
"""
from __future__ import annotations

import argparse
import collections
import ctypes.util
import functools
import os
import signal
import sys
import time
from pathlib import Path

HEAP_CHECKS = {"MALLOC_CHECK_": "3", "PYTHONFAULTHANDLER": "1",
               **({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"} if "--no-tcache" in sys.argv else {})}
ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = ("clean", "abort", "signal", "timeout", "error")
MALLOC_DEBUG = ctypes.util.find_library("c_malloc_debug") or "libc_malloc_debug.so.0"  # glibc >= 2.34

# glibc reads its tunables when a process starts: run again with them set (once), before torch is
# imported, so that this process, the fork server and every rank run under them
_WANTED = {**HEAP_CHECKS, **({"LD_PRELOAD": MALLOC_DEBUG} if "--malloc-debug" in sys.argv else {})}
if __name__ == "__main__" and not all(os.environ.get(k) == v for k, v in _WANTED.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_WANTED})
sys.path.insert(0, str(ROOT))  # tests/ and examples/ are not installed

import autopar  # noqa: E402
from autopar.runtime.launch import RankKilled, launch  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402
from examples.hf_models import tiny_llama, token_batch  # noqa: E402
from tests.numerics import distributed_rank  # noqa: E402


def _variants(names: list[str], no_overlap: bool) -> dict[str, tuple[str, list]]:
    base = {"tp2_sp": ("tp=2", [autopar.sequence_parallel()]),
            "tp4_sp": ("tp=4", [autopar.sequence_parallel()]),
            "dp2_tp2_sp": ("dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()]),
            "dp2_tp2_sp_chunks": ("dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel(),
                                                autopar.schedule(chunks=2)]),
            # the job that aborted most often (2026-12-06): 3 in 32 runs of 30 steps under PyTorch's gloo
            "pp2_tp2_sp_chunks": ("pp=2,tp=2", [autopar.pipeline_parallel(microbatches=2), autopar.sequence_parallel(),
                                                autopar.schedule(chunks=2)])}
    unknown = [n for n in names if n not in base]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(base)}")
    chosen = {name: base[name] for name in names}
    if no_overlap:
        for name in names:
            if name.endswith("_chunks"):  # chunks need the overlap (autopar.schedule refuses the pair)
                continue
            mesh, strategies = base[name]
            chosen[f"{name}:no_overlap"] = (mesh, [*strategies, autopar.schedule(overlap=False)])
    return chosen


def _classify(error: BaseException) -> str:
    if isinstance(error, RankKilled):
        cause = error.__cause__
        signal_name = getattr(cause, "signal_name", None) or ""
        return "abort" if signal_name == "SIGABRT" or "SIGABRT" in str(error) else "signal"
    text = str(error).lower()  # gloo's: "Timed out waiting ...", "Application timeout caused pair closure"
    if isinstance(error, TimeoutError) or "timed out" in text or "timeout caused" in text:
        return "timeout"
    return "error"


def _pipeline_step(module, local):
    return module.train_step(*local)


GPT4 = GPTConfig(vocab_size=128, seq_len=16, n_layer=4, n_head=4, d_model=32, d_ff=64)  # the pipeline tests' GPT


def run_once(mesh: str, strategies: list, *, steps: int, timeout_s: float, deadline_s: float,
             backend: str | None, model: str) -> None:
    if model == "gpt":
        build, batches = functools.partial(GPT, GPT4), [example_batch(GPT4, batch=8, seed=s) for s in range(steps)]
    else:
        build, batches = tiny_llama, [token_batch(batch=8, seq=16, vocab=128, seed=s) for s in range(steps)]
    world = autopar.Mesh.parse(mesh).world_size
    rank = functools.partial(distributed_rank, memory=False)
    if "pp" in autopar.Mesh.parse(mesh).names:
        rank = functools.partial(rank, step=_pipeline_step)
    launch(rank, world, build, batches, mesh, strategies, timeout_s=timeout_s, deadline_s=deadline_s,
           backend=backend)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per variant (default 200)")
    parser.add_argument("--variants", default="tp2_sp,dp2_tp2_sp",
                        help="comma-separated: tp2_sp, tp4_sp, dp2_tp2_sp, dp2_tp2_sp_chunks (the two jobs that "
                             "aborted on 2026-12-05 were tp4_sp and dp2_tp2_sp_chunks)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="also run each variant with autopar.schedule(overlap=False)")
    parser.add_argument("--only-no-overlap", action="store_true", help="run the overlap-off twins only")
    parser.add_argument("--detail", action="store_true", help="TORCH_DISTRIBUTED_DEBUG=DETAIL in every rank")
    parser.add_argument("--malloc-debug", action="store_true",
                        help=f"preload {MALLOC_DEBUG} (MALLOC_CHECK_ acts only with it since glibc 2.34)")
    parser.add_argument("--model", choices=("llama", "gpt"), default="llama",
                        help="the tiny Hugging Face Llama, or the example GPT of the pipeline tests")
    parser.add_argument("--no-tcache", action="store_true", help="glibc's per-thread cache off (module docstring)")
    parser.add_argument("--torch-gloo", action="store_true",
                        help="PyTorch's gloo (two worker threads a group), not autopar's serial gloo "
                             "(autopar/runtime/serial_gloo.py): what aborted")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="each collective's limit, seconds")
    parser.add_argument("--deadline", type=float, default=180.0, help="each run's limit, seconds")
    parser.add_argument("--out", default="/tmp/stress_heap", help="where failed runs' messages go")
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    variants = _variants(args.variants.split(","), args.no_overlap or args.only_no_overlap)
    if args.only_no_overlap:
        variants = {name: v for name, v in variants.items() if name.endswith(":no_overlap")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {name: collections.Counter() for name in variants}
    started = time.monotonic()
    stopped = False

    def stop(*_):
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    for run in range(args.runs):
        for name, (mesh, strategies) in variants.items():
            if stopped:
                break
            t0 = time.monotonic()
            try:
                run_once(mesh, strategies, steps=args.steps, timeout_s=args.timeout, deadline_s=args.deadline,
                         backend="gloo" if args.torch_gloo else None, model=args.model)
                outcome = "clean"
            except Exception as error:  # noqa: BLE001 - every failure is counted and kept
                outcome = _classify(error)
                path = out / f"{name.replace(':', '_')}-run{run}-{outcome}.txt"
                path.write_text(f"{type(error).__name__}: {error}\n")
                print(f"    kept: {path}", flush=True)
            counts[name][outcome] += 1
            print(f"run {run + 1}/{args.runs} {name}: {outcome} ({time.monotonic() - t0:.1f} s)", flush=True)
    print(f"\nsummary after {time.monotonic() - started:.0f} s (tcache {'off' if args.no_tcache else 'on'}, "
          f"{'PyTorch' if args.torch_gloo else 'serial'} gloo, MALLOC_CHECK_=3"
          f"{' with ' + os.environ['LD_PRELOAD'] if os.environ.get('LD_PRELOAD') else ' (inert without --malloc-debug)'}"
          f", faulthandler{', TORCH_DISTRIBUTED_DEBUG=DETAIL' if args.detail else ''}):")
    print(f"{'variant':28} {'runs':>5} " + " ".join(f"{o:>8}" for o in OUTCOMES))
    for name, counter in counts.items():
        print(f"{name:28} {sum(counter.values()):5d} " + " ".join(f"{counter[o]:8d}" for o in OUTCOMES))
    return 0 if all(counter["clean"] == sum(counter.values()) for counter in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
