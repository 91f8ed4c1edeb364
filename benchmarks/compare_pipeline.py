"""autopar's pipeline parallelism against `torch.distributed.pipelining`, on the example GPT.

Each row is one schedule on a pipeline of `--pp` local CPU processes (gloo, one thread each,
`autopar.runtime.launch`); both sides cut the model the same way, run the same number of
micro-batches and train on the same global batch:

| row              | autopar `pipeline_parallel(...)`      | PyTorch (`torch.distributed.pipelining`)        |
|------------------|---------------------------------------|-------------------------------------------------|
| gpipe            | schedule="gpipe"                      | ScheduleGPipe                                   |
| 1f1b             | schedule="1f1b"                       | Schedule1F1B                                    |
| interleaved_1f1b | schedule="interleaved_1f1b", v=2      | ScheduleInterleaved1F1B, two stages per rank    |
| zb_h1            | schedule="zb_h1"                      | ScheduleInterleavedZeroBubble, one stage a rank |
| dualpipev        | schedule="dualpipev" (2 stages a rank)| ScheduleDualPipeV, stages s and 2p-1-s on rank s |
| dualpipev_apart  | the same, overlap=False               | ScheduleDualPipeV                               |

DualPipeV's paired forward and backward run side by side in autopar (`runtime/overlap.py`, two
threads of the rank); PyTorch's runtime runs an OVERLAP_F_B action's two halves one after the
other unless a custom function is registered for it. `dualpipev_apart` runs autopar's pairs one
after the other too.

ZB-H1 has no class of its own in PyTorch: `ScheduleInterleavedZeroBubble` is the paper's ZB1P
(zero bubble over several stages per rank) and accepts a one-stage list, which is ZB-H1. The
`same order` column says whether PyTorch's stages executed exactly autopar's action list on every
rank and step (`record_actions`; PyTorch's input-gradient backward counted as autopar's B, and
under a split-backward schedule its full backward as autopar's B then W).

The cut: autopar balances the stages (`stages=None`: blocks by forward FLOPs, the first stage
also carrying the embeddings, the last the final norm, lm_head and loss) and the PyTorch stages
are built by hand from the same model with that cut (`module.plan.pipeline.starts`, `GPTStage`);
stage s runs on pp rank s mod p on both sides (DualPipeV: in a V, stages c and 2p-1-c on rank c). PyTorch's last stage returns logits and the
schedule's `loss_fn` (cross-entropy over the micro-batch's tokens, a mean) makes the loss;
`scale_grads=True` divides the accumulated gradients by m. autopar seeds each micro-batch's
backward with 1/m. Every micro-batch has the same number of tokens, so both train the
global-batch mean loss. Both start from the same weights (compare_step_time's `build_model`).

A training step is zero_grad, the schedule over all micro-batches (autopar:
`module.train_step(*module.local_batch(*batch))`, which also broadcasts the loss from the last
stage, one scalar; PyTorch: `schedule.step(...)`, `return_outputs=False`) and an AdamW step.
`measure` runs the programs: step 0, step 1 under MemTracker, then the two programs' steps
alternate (compare_step_time's `alternate_steps`).

- Step time: barrier, time the step on every rank, keep the slowest rank; median over the timed
  steps. `ratio` is autopar's over PyTorch's.
- Peak memory: PyTorch's `MemTracker`, as compare_fsdp.py measures it (every tensor reachable
  from the program handed to it first, the peak of live storage bytes during step 1), per pp
  rank, with its per-module statistics off (`PipelineMemTracker`: its module tracker cannot
  follow forwards that come after backwards in one step, and its hooks break PyTorch's stage
  set-up). PyTorch's program is reached from its stage modules and its schedule (which keeps
  the receive buffers), autopar's from the module (a note says so where what `module.plan`
  holds is more than 1% of the peak, as compare_fsdp.py does).
- Loss: the first step's loss of both (autopar: the mean over micro-batches, on every rank;
  PyTorch: the mean of the last stage's micro-batch losses) and the largest relative gap over
  all steps.

Run: python benchmarks/compare_pipeline.py [--quick] [--rows 1f1b,zb_h1] [--pp 2|4|2,4] [--steps N]
(`--help` lists the model flags). At pp=2 each rank has a core of this 2-core machine to itself;
at pp=4 four ranks share two cores, which both programs suffer alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples`, `benchmarks` are not installed

import autopar  # noqa: E402
from autopar.core import schedules  # noqa: E402
from benchmarks.compare_fsdp import Program, adamw, memory_step, ratio, track_program  # noqa: E402
from benchmarks.compare_step_time import alternate_steps, as_float, build_model, median_step_ms, mib  # noqa: E402
from benchmarks.row_runs import run_rows  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402


@dataclass(frozen=True)
class Settings:
    model: GPTConfig
    batch: int
    microbatches: int
    pp: int
    warmup: int
    steps: int
    lr: float = 1e-3


@dataclass(frozen=True)
class Row:
    schedule: str
    virtual: int
    pytorch_schedule: type
    pytorch_description: str
    overlap: bool | None = None  # autopar's `pipeline_parallel(overlap=)` (None: the schedule's default)


ROWS = {
    "gpipe": Row("gpipe", 1, ScheduleGPipe, "ScheduleGPipe"),
    "1f1b": Row("1f1b", 1, Schedule1F1B, "Schedule1F1B"),
    "interleaved_1f1b": Row("interleaved_1f1b", 2, ScheduleInterleaved1F1B,
                            "ScheduleInterleaved1F1B, stages s and s+p on rank s"),
    "zb_h1": Row("zb_h1", 1, ScheduleInterleavedZeroBubble,
                 "ScheduleInterleavedZeroBubble (ZB1P) with one stage per rank, i.e. ZB-H1"),
    "dualpipev": Row("dualpipev", 2, ScheduleDualPipeV, "ScheduleDualPipeV, stages c and 2p-1-c on rank c"),
    # autopar's paired forwards and backwards one after the other, as PyTorch's runtime runs them
    "dualpipev_apart": Row("dualpipev", 2, ScheduleDualPipeV,
                           "ScheduleDualPipeV; autopar with overlap=False (its pairs one after the other)", False),
}


class GPTStage(nn.Module):
    """Blocks [first, last) of the example GPT; the first stage also embeds the tokens, the last
    also applies the final norm and lm_head (and returns logits: the schedule makes the loss)."""

    def __init__(self, model: GPT, first: int, last: int) -> None:
        super().__init__()
        self.embed_tokens = model.embed_tokens if first == 0 else None
        self.embed_positions = model.embed_positions if first == 0 else None
        self.layers = nn.ModuleList(model.layers[first:last])
        self.norm = model.norm if last == len(model.layers) else None
        self.lm_head = model.lm_head if last == len(model.layers) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x) + self.embed_positions(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The example GPT's loss from its logits: mean next-token cross-entropy of the micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _NoModuleHooks(ModTracker):
    """A module tracker that installs no hooks: `parents` stays {"Global"}, `is_bw` still works."""

    def __enter__(self) -> "_NoModuleHooks":
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class PipelineMemTracker(MemTracker):
    """MemTracker without its per-module statistics (the peak of live bytes is kept).

    Its module tracker takes a module's next forward after a backward for the next iteration
    and refuses a second forward of a root module then, while a pipeline step runs forwards
    after backwards (1F1B); and the gradient hooks it puts on module inputs break PyTorch's
    stage set-up, which calls autograd.grad on leaf inputs. Without it the tracker still sees
    every storage an op makes and keeps the peak of live bytes; a tensor made in backward is
    filed as `Temp` (gradients included), in forward as `Activation`, in `optimizer.step` as
    `Optstate`: the totals are what compare_fsdp's tracker measures, the categories coarser."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _NoModuleHooks()


@dataclass
class PipelineProgram(Program):
    """compare_fsdp's Program whose forward and backward are one schedule step (`run`, which
    returns the loss)."""

    run: Callable[[], torch.Tensor] | None = None
    tracker: MemTracker = field(default_factory=PipelineMemTracker)

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.run()
        self.optimizer.step()
        return loss


class StagesAndSchedule(nn.Module):
    """This rank's PyTorch stage modules and the schedule running them: what compare_fsdp's
    `live_tensors` walks from the program (the schedule keeps its stages' receive buffers)."""

    def __init__(self, stages: nn.ModuleList, schedule: Any) -> None:
        super().__init__()
        self.stages = stages
        self.schedule = schedule


def stage_bounds(plan: Any, layers: int) -> list[int]:
    """The first block of every stage, then the block count: stage s holds [bounds[s], bounds[s+1])."""
    starts = [int(re.search(r"\.(\d+)$", start).group(1)) for start in plan.pipeline.starts]
    return [0, *starts, layers]


def autopar_side(row: Row, settings: Settings, global_batch: tuple) -> tuple[PipelineProgram, list[int]]:
    """autopar's program on this rank, and the cut its plan chose."""
    strategy = autopar.pipeline_parallel(schedule=row.schedule, microbatches=settings.microbatches,
                                         virtual_stages=row.virtual, overlap=row.overlap)
    module = autopar.parallelize(build_model(settings), f"pp={settings.pp}", strategies=[strategy],
                                 example_inputs=global_batch)
    local = module.local_batch(*global_batch)
    program = PipelineProgram(module, adamw(module.parameters(), settings), [], run=lambda: module.train_step(*local))
    return program, stage_bounds(module.plan, settings.model.n_layer)


def pytorch_side(row: Row, settings: Settings, global_batch: tuple, rank: int, bounds: list[int],
                 executed: list[str]) -> PipelineProgram:
    """PipelineStages over the same cut (stage s on rank s mod p) under the row's PyTorch schedule,
    the actions they run appended to `executed`. The loss comes back on the rank of the last
    stage; the others return NaN."""
    model = build_model(settings)
    count = settings.pp * row.virtual
    indices = (list(schedules.v_stages(settings.pp, rank)) if row.schedule in schedules.V_SHAPED
               else [rank + chunk * settings.pp for chunk in range(row.virtual)])
    modules = nn.ModuleList(GPTStage(model, bounds[s], bounds[s + 1]) for s in indices)
    stages = [PipelineStage(module, s, count, torch.device("cpu")) for module, s in zip(modules, indices)]
    record_actions(stages, executed, split=row.schedule in schedules.SPLIT_BACKWARD)
    multi = issubclass(row.pytorch_schedule, PipelineScheduleMulti)
    schedule = row.pytorch_schedule(stages if multi else stages[0], n_microbatches=settings.microbatches,
                                    loss_fn=token_cross_entropy, scale_grads=True)
    inputs, targets = global_batch
    first, last = 0 in indices, count - 1 in indices

    def run() -> torch.Tensor:
        losses: list[torch.Tensor] = []
        schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                      losses=losses if last else None, return_outputs=False)
        return torch.stack(losses).detach().mean() if last else torch.tensor(float("nan"))

    return PipelineProgram(StagesAndSchedule(modules, schedule), adamw(modules.parameters(), settings), [], run=run)


def measure(programs: dict[str, PipelineProgram], settings: Settings) -> dict[str, dict[str, Any]]:
    """Step 0 of each under its tracker (lazy state, optimizer state), step 1 measuring memory
    (compare_fsdp's `memory_step`), then alternating warm-up and timed steps. (compare_fsdp's own
    `measure` also counts autopar's collectives with `CommCounter`, which raises on the pipeline's
    loss broadcast, a classic c10d broadcast.)"""
    results: dict[str, dict[str, Any]] = {}
    for name, program in programs.items():
        dist.barrier()
        track_program(program)
        with program.tracker:
            results[name] = {"losses": [as_float(program.step())], "times": []}
    for name, program in programs.items():
        dist.barrier()
        loss, results[name]["memory"] = memory_step(program)
        results[name]["losses"].append(as_float(loss))
    alternate_steps({name: program.step for name, program in programs.items()}, results, first=2,
                    warmup=settings.warmup, timed=settings.steps)
    return results


def record_actions(stages: list[PipelineStage], log: list[str], *, split: bool = False) -> None:
    """Append every compute action the stages run to `log`, as autopar's `str(Action)` ('F2.5';
    PyTorch's input-gradient backward is autopar's B; with `split`, a schedule whose backwards
    autopar splits, its full backward is autopar's B then W). PyTorch's own `_get_pipeline_order`
    is not what its single-stage schedules execute (for 1F1B's last rank it lists micro-batches
    1..m), so the executed calls are what is compared."""
    for stage in stages:
        for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                             ("backward_weight_one_chunk", "W")):
            def recorded(chunk: int, *args: Any, _run=getattr(stage, method), _kind=kind, _stage=stage.stage_index,
                         **kwargs: Any) -> Any:
                log.append(f"{_kind}{_stage}.{chunk}")
                if split and _kind == "B" and kwargs.get("full_backward", True):
                    log.append(f"W{_stage}.{chunk}")
                return _run(chunk, *args, **kwargs)

            setattr(stage, method, recorded)


def run_row(rank: int, world_size: int, row_name: str, settings: Settings) -> dict[str, Any]:
    """One rank of one row: build both programs, measure them."""
    row = ROWS[row_name]
    global_batch = example_batch(settings.model, batch=settings.batch)
    autopar_program, bounds = autopar_side(row, settings, global_batch)
    executed: list[str] = []
    programs = {"autopar": autopar_program,
                "pytorch": pytorch_side(row, settings, global_batch, rank, bounds, executed)}
    results = measure(programs, settings)
    ours = [str(action) for action in autopar_program.model.pipeline.actions]
    steps = len(results["pytorch"]["losses"])
    same_order = executed == ours * steps
    return {**results, "bounds": bounds, "same_order": same_order}


def summarize_row(row_name: str, ranks: list[dict[str, Any]], *,
                  pp: int) -> tuple[list[Any], list[list[Any]], list[str]]:
    """The main table's row, the per-rank memory rows and notes."""
    autopar = [rank["autopar"] for rank in ranks]
    pytorch = [rank["pytorch"] for rank in ranks]
    autopar_ms, pytorch_ms = median_step_ms(autopar), median_step_ms(pytorch)
    autopar_peak = max(side["memory"]["peak"] for side in autopar)
    pytorch_peak = max(side["memory"]["peak"] for side in pytorch)
    # PyTorch: the losses of the last stage's rank (the last rank; under DualPipeV the first)
    autopar_losses = autopar[0]["losses"]
    pytorch_losses = next(side["losses"] for side in reversed(pytorch) if not math.isnan(side["losses"][0]))
    gaps = [abs(a - p) / abs(p) for a, p in zip(autopar_losses, pytorch_losses)]
    notes = []
    if any(len(set(side["losses"])) != len(side["losses"]) for side in autopar[:1]):
        notes.append(f"{row_name} pp={pp}: autopar's loss did not change between two steps")
    same = "yes" if all(rank["same_order"] for rank in ranks) else "no"
    main = [row_name, pp, cut(ranks[0]["bounds"]), same, f"{autopar_ms:.0f}", f"{pytorch_ms:.0f}",
            ratio(autopar_ms, pytorch_ms), mib(autopar_peak), mib(pytorch_peak), ratio(autopar_peak, pytorch_peak),
            f"{autopar_losses[0]:.6f}", f"{pytorch_losses[0]:.6f}", f"{gaps[0]:.1e} / {max(gaps):.1e}"]
    details = [[row_name, pp, index, mib(a["memory"]["at_rest"]), mib(a["memory"]["peak"]),
                mib(p["memory"]["at_rest"]), mib(p["memory"]["peak"]), ratio(a["memory"]["peak"], p["memory"]["peak"])]
               for index, (a, p) in enumerate(zip(autopar, pytorch))]
    plan_state = max(side["memory"]["plan_state"] for side in autopar)
    if plan_state > autopar_peak / 100:
        notes.append(f"{row_name} pp={pp}: autopar's peak includes {mib(plan_state)} MiB of tensors held by "
                     "module.plan")
    return main, details, notes


def cut(bounds: list[int]) -> str:
    """Blocks per stage, e.g. '0-3|4-7' or '0|1|2|3'."""
    return "|".join(f"{first}-{last - 1}" if last - first > 1 else f"{first}"
                    for first, last in zip(bounds, bounds[1:]))


def print_report(summaries: list[tuple[list[Any], list[list[Any]], list[str]]], settings: Settings,
                 load: tuple[float, float]) -> None:
    model = settings.model
    print(f"\nexample GPT: {model.n_layer} layers, d_model {model.d_model}, {model.n_head} heads, d_ff {model.d_ff}, "
          f"seq {model.seq_len}, vocab {model.vocab_size}; global batch {settings.batch}, {settings.microbatches} "
          f"micro-batches; gloo ranks x 1 thread on {os.cpu_count()} cores; median of {settings.steps} steps after "
          f"{settings.warmup} warm-up; load average (1 min) {load[0]:.1f} before, {load[1]:.1f} after\n")
    headers = ["row", "pp", "blocks per stage", "same order", "autopar ms", "PyTorch ms", "ratio", "autopar peak MiB",
               "PyTorch peak MiB", "ratio", "loss autopar", "loss PyTorch", "loss gap 1st/max"]
    print(tabulate([summary[0] for summary in summaries], headers=headers, tablefmt="simple", disable_numparse=True))
    print("\nMemory per pp rank (MiB, MemTracker: live bytes at the start of step 1 and their peak during it)\n")
    print(tabulate([detail for summary in summaries for detail in summary[1]],
                   headers=["row", "pp", "pp rank", "autopar at rest", "autopar peak", "PyTorch at rest",
                            "PyTorch peak", "ratio"],
                   tablefmt="simple", disable_numparse=True))
    rows = dict.fromkeys(summary[0][0] for summary in summaries)
    print("\nPyTorch schedules (torch.distributed.pipelining, PipelineStage per stage, loss_fn on the last stage):")
    print("\n".join(f"- {name}: {ROWS[name].pytorch_description}" for name in rows))
    notes = [note for summary in summaries for note in summary[2]]
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {note}" for note in notes))


QUICK_DEFAULTS = {"layers": 8, "d_model": 32, "heads": 4, "d_ff": 128, "seq_len": 16, "vocab": 128, "steps": 3}


def parse_settings(argv: list[str] | None = None) -> tuple[Settings, list[str], list[int], float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"defaults for a smoke run: {QUICK_DEFAULTS}")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--pp", default="2", help="pipeline sizes, comma-separated (2, 4 or 2,4; 4 ranks share 2 "
                                                  "cores here)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps (>= 2; the first is counted, the second measures memory)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck row is abandoned")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK_DEFAULTS)  # flags given explicitly still win
    args = parser.parse_args(argv)
    rows = [name for name in args.rows.split(",") if name]
    unknown = [name for name in rows if name not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    sizes = [int(size) for size in args.pp.split(",") if size]
    if any(size < 2 for size in sizes):
        parser.error("--pp: a pipeline has at least 2 ranks")
    model = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                      d_model=args.d_model, d_ff=args.d_ff)
    settings = Settings(model=model, batch=args.batch, microbatches=args.microbatches, pp=sizes[0],
                        warmup=max(args.warmup, 2), steps=args.steps)
    return settings, rows, sizes, args.timeout


def main() -> None:
    settings, rows, sizes, timeout_s = parse_settings()
    load_before, summaries = os.getloadavg()[0], []
    for pp in sizes:
        summaries += run_rows(rows, dataclasses.replace(settings, pp=pp), timeout_s=timeout_s, run=run_row,
                              summarize=lambda name, ranks, pp=pp: summarize_row(name, ranks, pp=pp), columns=12,
                              world_size=pp)
    print_report(summaries, settings, (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
