"""The pipeline bubble autopar measures against the one its bubble ledger predicts, per schedule.

One job of `--pp` local CPU processes (gloo, one thread each, `autopar.runtime.launch`; default
p=4, m=8) builds autopar's pipelined example GPT once per schedule (gpipe, 1f1b,
interleaved_1f1b with v=2, zb_h1) and trains them with their steps alternating (compare_step_time's
`alternate_steps`: barrier, step), so that a machine shared with other work slows every
schedule alike. The model has `--layers` identical blocks and the cut is declared (`stages=`):
each of the p·v stages gets the same number of blocks. The first stage also embeds the tokens
(a lookup) and the last applies the final norm, lm_head and loss, small against the blocks at
the default sizes: the report prints each stage's forward FLOPs from the bubble ledger
(`stage_flops`).

Measured: every rank keeps `module.pipeline.timeline` after each of its `--steps` measured steps
(after `--warmup`); they are gathered once at the end (what `gather_timeline()` gathers, without
a collective between the alternating steps). `ledger.bubble.measured_fractions` gives each rank's
idle fraction of each step; the tables show the median over the steps.

Predicted, per rank:
- `ledger Nc`: `build_bubble_ledger(plan, cores=os.cpu_count())`: stages priced by FLOPs, the
  ranks sharing the machine's N cores (processor sharing): what this machine should show;
- `ledger 1c`: `build_bubble_ledger(plan)`: one core per rank, the textbook figure (`formula`,
  the balanced-stage formula, beside it);
- `calibrated Nc`, a calibration: `autopar.core.schedules.simulate` of the same action lists with
  measured costs (`stage_costs`): before the job, the eager stage modules of the same cut
  (compare_pipeline's `GPTStage`) run one micro-batch each in this process on one thread, and
  the main thread's CPU time is kept (`time.thread_time`: what the action demands from a core,
  whatever else the machine runs): forward (with the loss on the last stage), full backward,
  and for a split backward B (`stage_backward_input`) and W (`stage_backward_weight`) as
  autopar's runtime splits them (the first stage receives nothing and runs its whole backward
  in B); plus the p2p latency measured at the start of the job (half a send/recv round trip of
  one micro-batch's activation between pp ranks 0 and 1) on every cross-rank dependency;
- `replay 1c`: the simulator with the run's own median compute time per action kind and stage
  (end - start - waited), one core per rank (those times already hold the waiting for a core):
  what the schedule's dependencies alone make of the action times the run had. A measured
  bubble above the replay is time the simulator does not model (latency, uneven action times).

`gap` is (measured - predicted) / predicted. The summary gives the mean idle fraction over the
ranks and whether measured interleaved_1f1b < 1f1b and zb_h1 < interleaved_1f1b.

Why a gap, in numbers: the header gives the load average before and after the job and the p2p
latency; per rank, the step span against the calibrated simulator's, where the idle time goes
(blocked in receives; between two actions, i.e. the executor's own work outside the actions;
before the first and after the last action), and the main thread's CPU time in `train_step`
against the CPU time its actions take alone (above 1: autopar's stage graphs and runtime cost
more CPU than the eager modules); per stage, the median wall time of F, B and W in the run
against their CPU time alone (the run's includes waiting for a core).

The SVG of one step per schedule (the step of median span: the ledger's prediction with
`cores=os.cpu_count()` beside the measured step, `autopar.tools.views.timeline.render_timeline`) goes
to `--svg-dir` (default benchmarks/out/, ignored by git).

Run: python benchmarks/pipeline_bubble.py [--quick] [--rows 1f1b,zb_h1] [--pp 4] [--steps N]
[--svg-dir DIR]. Four ranks on a 2-core machine share the cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples`, `benchmarks` are not installed

import autopar  # noqa: E402
from autopar.core import schedules# noqa: E402
from autopar.cost.calibration import round_trip  # noqa: E402
from autopar.compiler.ledger.bubble import (build_bubble_ledger, measured_fractions, measured_timeline,  # noqa: E402
                                   waited_seconds)
from autopar.runtime.launch import launch  # noqa: E402
from autopar.tools.views.timeline import render_timeline  # noqa: E402
from benchmarks.compare_pipeline import GPTStage, token_cross_entropy  # noqa: E402
from benchmarks.compare_step_time import alternate_steps, build_model  # noqa: E402
from benchmarks.row_runs import failure_reason  # noqa: E402
from examples.gpt import GPTConfig, example_batch  # noqa: E402

VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1}
SVG_DIR = Path(__file__).resolve().parent / "out"


@dataclass(frozen=True)
class Settings:
    model: GPTConfig
    batch: int
    microbatches: int
    pp: int
    warmup: int
    steps: int
    repeats: int  # calibration: runs of each stage alone, the median kept
    lr: float = 1e-3


def equal_bounds(layers: int, stages: int) -> list[int]:
    """The first block of every stage, then the block count: equal block counts per stage."""
    if layers % stages:
        raise ValueError(f"{layers} blocks do not split into {stages} equal stages: choose --layers as a multiple")
    return [s * layers // stages for s in range(stages + 1)]


# ---- the job: every schedule on the same p ranks, steps alternating

class ScheduleRun:
    """One schedule's module on this rank; `step` trains one step and keeps this rank's timeline
    and the main thread's CPU seconds of `train_step`."""

    def __init__(self, schedule: str, settings: Settings, global_batch: tuple) -> None:
        virtual = VIRTUAL[schedule]
        bounds = equal_bounds(settings.model.n_layer, settings.pp * virtual)
        strategy = autopar.pipeline_parallel(schedule=schedule, microbatches=settings.microbatches,
                                             virtual_stages=virtual, stages=[f"layers.{b}" for b in bounds[1:-1]])
        self.module = autopar.parallelize(build_model(settings), f"pp={settings.pp}", strategies=[strategy],
                                          example_inputs=global_batch)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=settings.lr)
        self.local = self.module.local_batch(*global_batch)
        self.timelines: list[list[Any]] = []
        self.cpu: list[float] = []

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        start = time.thread_time()
        loss = self.module.train_step(*self.local)
        self.cpu.append(time.thread_time() - start)
        self.optimizer.step()
        self.timelines.append(self.module.pipeline.timeline)
        return loss


def p2p_latency(settings: Settings, *, repeats: int = 20) -> float:
    """Median one-way seconds of a micro-batch's activation between pp ranks 0 and 1 (half a
    gloo send/recv round trip); the other ranks wait at the barrier after."""
    shape = (settings.batch // settings.microbatches, settings.model.seq_len, settings.model.d_model)
    rank, buffer, trips = dist.get_rank(), torch.zeros(shape), []
    for _ in range(repeats if rank < 2 else 0):
        start = time.perf_counter()
        round_trip(rank, buffer)
        trips.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(trips) / 2 if trips else 0.0


def run_job(rank: int, world_size: int, rows: list[str], settings: Settings) -> dict[str, Any] | None:
    """All schedules on this job's p ranks, their steps alternating (compare_step_time's
    `alternate_steps`: drift of the machine hits every schedule alike). Rank 0 returns, per
    schedule, every measured step's timelines of all ranks, the CPU seconds per rank and step,
    and the bubble ledgers; with the p2p latency and the load average before and after."""
    load_before, latency = os.getloadavg()[0], p2p_latency(settings)
    global_batch = example_batch(settings.model, batch=settings.batch)
    runs = {schedule: ScheduleRun(schedule, settings, global_batch) for schedule in rows}
    results = {schedule: {"losses": [], "times": []} for schedule in rows}
    alternate_steps({schedule: run.step for schedule, run in runs.items()}, results, first=0,
                    warmup=settings.warmup, timed=settings.steps)
    mine = {schedule: (run.timelines[settings.warmup:], run.cpu[settings.warmup:]) for schedule, run in runs.items()}
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    schedules_out = {}
    for schedule, run in runs.items():
        steps = [[everyone[r][schedule][0][k] for r in range(world_size)] for k in range(settings.steps)]
        cpu = [[everyone[r][schedule][1][k] for r in range(world_size)] for k in range(settings.steps)]
        schedules_out[schedule] = {"steps": steps, "cpu": cpu, "shared": build_bubble_ledger(run.module.plan,
                                                                                              cores=os.cpu_count()),
                                   "own": build_bubble_ledger(run.module.plan), "losses": results[schedule]["losses"]}
    return {"schedules": schedules_out, "latency": latency, "load": (load_before, os.getloadavg()[0])}


# ---- calibration: each stage alone

def cpu_seconds(call: Callable[[], Any]) -> tuple[float, Any]:
    """The main thread's CPU seconds of `call` (what an action demands from a core: time the OS
    gives to other processes of a loaded machine is not in it) and its result."""
    start = time.thread_time()
    result = call()
    return time.thread_time() - start, result


def time_stage(run: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor, params: list[torch.Tensor], *,
               first: bool, microbatches: int, repeats: int) -> dict[str, float]:
    """Median CPU seconds of one micro-batch's F, full backward (B_full), input-gradient backward
    (B) and weight-gradient backward (W) of one stage; the first stage's B is its full backward."""
    samples: dict[str, list[float]] = {"F": [], "B_full": [], "B": [], "W": []}
    for _ in range(repeats):
        seconds, out = cpu_seconds(lambda: run(inputs))
        samples["F"].append(seconds)
        grad = torch.full_like(out, 1.0 / microbatches) if out.dim() == 0 else torch.randn_like(out)
        samples["B_full"].append(cpu_seconds(lambda: torch.autograd.backward([out], [grad]))[0])
        out = run(inputs)
        if first:
            samples["B"].append(cpu_seconds(lambda: torch.autograd.backward([out], [grad]))[0])
            samples["W"].append(0.0)
        else:
            seconds, (_, groups) = cpu_seconds(lambda: stage_backward_input([out], [grad], [inputs], iter(params)))
            samples["B"].append(seconds)
            samples["W"].append(cpu_seconds(lambda: stage_backward_weight(iter(params), groups))[0])
        for param in params:
            param.grad = None
    return {kind: statistics.median(values) for kind, values in samples.items()}


def stage_costs(settings: Settings, stages: int) -> dict[int, dict[str, float]]:
    """Per stage of the equal cut into `stages`: CPU seconds of F, B_full, B and W on one
    micro-batch, each stage alone in this process on one thread (see the module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(settings)
        rows = settings.batch // settings.microbatches
        tokens, targets = (t[:rows] for t in example_batch(settings.model, batch=settings.batch))
        bounds = equal_bounds(settings.model.n_layer, stages)
        hidden, costs = tokens, {}
        for s in range(stages):
            stage = GPTStage(model, bounds[s], bounds[s + 1])
            last = s == stages - 1
            run = (lambda x, stage=stage: token_cross_entropy(stage(x), targets)) if last else stage
            inputs = hidden if s == 0 else hidden.detach().requires_grad_(True)
            costs[s] = time_stage(run, inputs, list(stage.parameters()), first=s == 0,
                                  microbatches=settings.microbatches, repeats=settings.repeats)
            if not last:
                with torch.no_grad():
                    hidden = stage(inputs)
        return costs
    finally:
        torch.set_num_threads(threads)


def alone_cost(schedule: str, costs: dict[int, dict[str, float]]) -> Callable[[schedules.Action], float]:
    split = schedule in schedules.SPLIT_BACKWARD
    return lambda a: costs[a.stage][a.kind if split or a.kind == "F" else "B_full"]


def simulate(schedule: str, settings: Settings, cost: Callable[[schedules.Action], float], *,
             cores: float | None, latency: float = 0.0) -> list[schedules.Timed]:
    """`autopar.core.schedules.simulate` of the schedule's action lists with these costs (seconds)."""
    virtual = VIRTUAL[schedule]
    orders = schedules.actions(schedule, degree=settings.pp, virtual=virtual, microbatches=settings.microbatches)
    return schedules.simulate(orders, cost, stages=settings.pp * virtual, split_backward=schedule in
                              schedules.SPLIT_BACKWARD, latency=latency, cores=cores)


# ---- what the measured timelines say

def span(timed: list) -> float:
    """First start to last end of a step (a list of ranks' action lists, or of `Timed`)."""
    actions = [a for rank in timed for a in rank] if timed and isinstance(timed[0], list) else timed
    return max(a.end for a in actions) - min(a.start for a in actions)


def idle_breakdown(timelines: list[list[Any]]) -> list[dict[str, float]]:
    """Per rank, seconds of the step: blocked in receives, between two of its actions, and
    before its first / after its last action (the step: first start to last end over ranks)."""
    begin = min(a.start for rank in timelines for a in rank)
    end = max(a.end for rank in timelines for a in rank)
    return [{"waited": sum(a.waited for a in actions),
             "between": sum(b.start - a.end for a, b in zip(actions, actions[1:])),
             "edges": actions[0].start - begin + end - actions[-1].end} for actions in timelines]


def run_costs(steps: list[list[list[Any]]]) -> dict[tuple[str, int], float]:
    """Median compute seconds (end - start - waited) per (kind, stage) over the measured actions."""
    samples: dict[tuple[str, int], list[float]] = {}
    for timelines in steps:
        for actions in timelines:
            for a in actions:
                samples.setdefault((a.kind, a.stage), []).append(a.end - a.start - a.waited)
    return {key: statistics.median(values) for key, values in samples.items()}


def median_step(steps: list[list[list[Any]]]) -> list[list[Any]]:
    spans = [span(timelines) for timelines in steps]
    return steps[spans.index(statistics.median_low(spans))]


# ---- one schedule's report

@dataclass
class ScheduleReport:
    name: str
    measured: list[float]  # idle fraction per rank, median over steps
    predicted: dict[str, list[float]]  # column -> idle fraction per rank
    formula: float
    stage_flops: dict[int, int]
    diagnostics: list[list[Any]]
    actions: list[list[Any]]
    first_loss: float


def report_schedule(name: str, result: dict[str, Any], *, settings: Settings, costs: dict[int, dict[str, float]],
                    latency: float) -> ScheduleReport:
    steps, shared, own = result["steps"], result["shared"], result["own"]
    per_step = [measured_fractions(timelines) for timelines in steps]
    measured = [statistics.median(fractions[r] for fractions in per_step) for r in range(settings.pp)]
    calibrated = simulate(name, settings, alone_cost(name, costs), cores=os.cpu_count(), latency=latency)
    replayed = simulate(name, settings, lambda a, c=run_costs(steps): c[(a.kind, a.stage)], cores=None)
    predicted = {"ledger": shared.fractions, "ledger 1c": own.fractions,
                 "calibrated": schedules.bubble_fractions(calibrated, settings.pp),
                 "replay": schedules.bubble_fractions(replayed, settings.pp)}
    return ScheduleReport(name, measured, predicted, own.formula, shared.stage_flops,
                          diagnostics(name, result, calibrated, costs, settings), action_rows(name, steps, costs),
                          result["losses"][0])


def diagnostics(name: str, result: dict[str, Any], calibrated: list[schedules.Timed],
                costs: dict[int, dict[str, float]], settings: Settings) -> list[list[Any]]:
    """Per rank (ms, medians over steps): the step span measured and calibrated, where the rank's
    idle time goes, and its main thread's CPU time in `train_step` against the CPU its actions
    take alone."""
    steps = result["steps"]
    breakdowns = [idle_breakdown(timelines) for timelines in steps]
    orders = schedules.actions(name, degree=settings.pp, virtual=VIRTUAL[name], microbatches=settings.microbatches)
    cost = alone_cost(name, costs)
    rows = []
    for r in range(settings.pp):
        waited, between, edges = (1000 * statistics.median(b[r][key] for b in breakdowns)
                                  for key in ("waited", "between", "edges"))
        cpu = 1000 * statistics.median(step[r] for step in result["cpu"])
        alone = 1000 * sum(cost(a) for a in orders[r])
        rows.append([name, r, f"{1000 * statistics.median(map(span, steps)):.0f}", f"{1000 * span(calibrated):.0f}",
                     f"{waited:.0f}", f"{between:.1f}", f"{edges:.0f}", f"{cpu:.0f}", f"{alone:.0f}",
                     f"{cpu / alone:.2f}"])
    return rows


def action_rows(name: str, steps: list, costs: dict[int, dict[str, float]]) -> list[list[Any]]:
    """Per stage: median measured compute ms of F, B, W in the run against the CPU ms alone."""
    measured, cost = run_costs(steps), alone_cost(name, costs)
    rows = []
    for stage in sorted(costs):
        cells: list[Any] = [name, stage]
        for kind in ("F", "B", "W"):
            if (kind, stage) in measured:
                cells += [f"{1000 * measured[(kind, stage)]:.1f}",
                          f"{1000 * cost(schedules.Action(kind, stage, 0)):.1f}"]
            else:
                cells += ["", ""]
        rows.append(cells)
    return rows


def write_svg(name: str, result: dict[str, Any], svg_dir: Path) -> Path:
    """The median-span step measured, beside the ledger's prediction with cores=os.cpu_count()."""
    timelines = median_step(result["steps"])
    picture = render_timeline(predicted=result["shared"].timeline, measured=measured_timeline(timelines),
                              waited=waited_seconds(timelines), title=name)
    svg_dir.mkdir(parents=True, exist_ok=True)
    path = svg_dir / f"pipeline_bubble_{name}.svg"
    path.write_text(picture)
    return path


# ---- the report

def pct(fraction: float) -> str:
    return f"{fraction:.1%}"


def gap(measured: float, predicted: float) -> str:
    return f"{(measured - predicted) / predicted:+.0%}" if predicted else "n/a"


COLUMNS = ("ledger", "ledger 1c", "calibrated", "replay")


def print_report(reports: list[ScheduleReport], job: dict[str, Any], settings: Settings) -> None:
    model, cores = settings.model, os.cpu_count()
    print(f"\nexample GPT: {model.n_layer} identical blocks, d_model {model.d_model}, {model.n_head} heads, d_ff "
          f"{model.d_ff}, seq {model.seq_len}, vocab {model.vocab_size}; global batch {settings.batch}, "
          f"m={settings.microbatches}; p={settings.pp} gloo ranks x 1 thread on {cores} cores, schedules' steps "
          f"alternating; median over {settings.steps} steps after {settings.warmup} warm-up\n"
          f"load average (1 min) {job['load'][0]:.1f} before the job, {job['load'][1]:.1f} after; p2p latency "
          f"(half a send/recv round trip of one micro-batch's activation) {1000 * job['latency']:.2f} ms\n")
    for report in reports:
        print(f"{report.name}: forward GFLOP per micro-batch by stage (bubble ledger stage_flops): "
              + ", ".join(f"{s}: {f / 1e9:.3f}" for s, f in sorted(report.stage_flops.items())))
    print("first-step loss (the same weights and batch for every schedule): "
          + ", ".join(f"{report.name} {report.first_loss:.6f}" for report in reports))
    print(f"\nIdle fraction of the step per pp rank. Predicted: bubble ledger (FLOPs) with cores={cores} and with one "
          f"core per rank; calibrated: simulated with each stage's CPU time alone (eager PyTorch modules), "
          f"cores={cores}, the p2p latency above; replay: simulated with the run's own median action times, one core "
          "per rank. gap = (measured - predicted) / predicted\n")
    rows = [[r.name, rank, pct(r.measured[rank]), *(cell for column in COLUMNS for cell in
             (pct(r.predicted[column][rank]), gap(r.measured[rank], r.predicted[column][rank]))), pct(r.formula)]
            for r in reports for rank in range(settings.pp)]
    headers = ["schedule", "pp rank", "measured", f"ledger {cores}c", "gap", "ledger 1c", "gap", f"calibrated {cores}c",
               "gap", "replay 1c", "gap", "formula"]
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))
    means = {r.name: statistics.fmean(r.measured) for r in reports}
    print("\nMean over ranks\n")
    print(tabulate([[r.name, pct(means[r.name]), *(pct(statistics.fmean(r.predicted[c])) for c in COLUMNS),
                     pct(r.formula)] for r in reports],
                   headers=["schedule", "measured", f"ledger {cores}c", "ledger 1c", f"calibrated {cores}c",
                            "replay 1c", "formula"], tablefmt="simple",
                   disable_numparse=True))
    print_orderings(means)
    print("\nWhere the time goes (ms, medians over steps): step span measured and calibrated; per rank idle time "
          "blocked in receives, between its actions (the executor's own work outside actions), before its first and "
          "after its last action; main-thread CPU time of train_step against the CPU time its actions take alone\n")
    print(tabulate([row for r in reports for row in r.diagnostics],
                   headers=["schedule", "pp rank", "span", "calibrated span", "in receives", "between actions",
                            "before/after", "CPU in run", "CPU alone", "ratio"], tablefmt="simple",
                   disable_numparse=True))
    print("\nCompute time per action (ms, median): wall time in the run (includes waiting for a core) and CPU time "
          "alone\n")
    print(tabulate([row for r in reports for row in r.actions],
                   headers=["schedule", "stage", "F run", "F alone", "B run", "B alone", "W run", "W alone"],
                   tablefmt="simple", disable_numparse=True))


def print_orderings(means: dict[str, float]) -> None:
    """Whether the measured bubbles order as the schedules promise."""
    lines = []
    for lower, higher in (("interleaved_1f1b", "1f1b"), ("zb_h1", "interleaved_1f1b")):
        if lower in means and higher in means:
            verdict = "yes" if means[lower] < means[higher] else "NO"
            lines.append(f"measured {lower} < {higher}: {verdict} ({pct(means[lower])} vs {pct(means[higher])})")
    if lines:
        print("\n" + "\n".join(lines))


QUICK_DEFAULTS = {"layers": 8, "d_model": 32, "heads": 4, "d_ff": 128, "seq_len": 16, "vocab": 64, "steps": 3,
                  "repeats": 3}


def parse_settings(argv: list[str] | None = None) -> tuple[Settings, list[str], Path, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"defaults for a smoke run: {QUICK_DEFAULTS}")
    parser.add_argument("--rows", default=",".join(VIRTUAL), help=f"comma-separated subset of {','.join(VIRTUAL)}")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    parser.add_argument("--layers", type=int, default=16, help="identical blocks (a multiple of 2 x pp)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps")
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--repeats", type=int, default=5, help="calibration runs of each stage alone")
    parser.add_argument("--svg-dir", type=Path, default=SVG_DIR)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck schedule is abandoned")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK_DEFAULTS)  # flags given explicitly still win
    args = parser.parse_args(argv)
    rows = [name for name in args.rows.split(",") if name]
    unknown = [name for name in rows if name not in VIRTUAL]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(VIRTUAL)}")
    model = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                      d_model=args.d_model, d_ff=args.d_ff)
    settings = Settings(model=model, batch=args.batch, microbatches=args.microbatches, pp=args.pp,
                        warmup=args.warmup, steps=args.steps, repeats=args.repeats)
    return settings, rows, args.svg_dir, args.timeout


def main() -> None:
    settings, rows, svg_dir, timeout_s = parse_settings()
    costs = {v: stage_costs(settings, settings.pp * v) for v in sorted({VIRTUAL[row] for row in rows})}
    try:
        job = launch(run_job, settings.pp, rows, settings, timeout_s=timeout_s)[0]
    except RuntimeError as error:
        sys.exit(f"the job failed: {failure_reason(str(error))}")
    reports = [report_schedule(name, result, settings=settings, costs=costs[VIRTUAL[name]], latency=job["latency"])
               for name, result in job["schedules"].items()]
    print_report(reports, job, settings)
    paths = [write_svg(name, result, svg_dir) for name, result in job["schedules"].items()]
    print(f"\nTimelines (ledger's prediction with cores={os.cpu_count()} beside the measured median step): "
          + ", ".join(str(path) for path in paths))


if __name__ == "__main__":
    main()
