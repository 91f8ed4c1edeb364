"""autopar's ZeRO against PyTorch's own sharded data parallelism, on the example GPT.

Each row runs on four local CPU processes (gloo, one thread each, `autopar.runtime.launch`):

| row   | autopar                                   | PyTorch                                                      |
|-------|-------------------------------------------|--------------------------------------------------------------|
| zero3 | `zero(stage=3)` on dp=4                   | FSDP2: `fully_shard` on each `model.layers[i]`, then the     |
|       |                                           | root, 1-D DeviceMesh of 4, reshard_after_forward=True        |
| zero2 | `zero(stage=2)` on dp=4                   | DDP (PyTorch has no ZeRO-2 of replicated parameters)         |
| zero2_fsdp | the same                             | FSDP2 as zero3's with reshard_after_forward=False (SHARD_GRAD_OP: |
|       |                                           | one all-gather and one reduce-scatter per step, as ZeRO-2)   |
| zero1 | `zero(stage=1)` on dp=4                   | DDP + `ZeroRedundancyOptimizer(AdamW)` (PyTorch's ZeRO-1)    |

Both sides' collectives go through the same gloo process group.

Both programs start from the same weights (`torch.manual_seed(0)` before each is built) and
train on the same global batch: autopar's module takes `module.local_batch(*global_batch)`
and returns the global mean loss; PyTorch's rank r gets the r-th contiguous chunk of dim 0 and
returns its local mean loss (FSDP2's reduce-scatter and DDP's all-reduce average gradients
over the ranks, so the gradients are the same). A training step is zero_grad, forward,
backward and an AdamW step (lr 1e-3); steps alternate between the two programs (`measure`).

- Step time: as benchmarks/compare_step_time.py: barrier, time the step on every rank, keep
  the slowest rank; median over the timed steps. `ratio` is autopar over PyTorch.
- Bytes: logical bytes per step per rank handed to the process groups, counted on the first
  step by compare_step_time's `CollectiveBytes` (all-reduce input, all-gather output,
  reduce-scatter input, all-to-all input, broadcast input; classic c10d and functional ops).
  autopar's count is cross-checked with `CommCounter` and shown next to its plan's ledger.
- Peak memory: PyTorch's own `torch.distributed._tools.mem_tracker.MemTracker` (a
  TorchDispatchMode that works on CPU: it keeps a weakref per untyped storage an op returns,
  patches `UntypedStorage.resize_`, and records the peak of live bytes). It only knows storages
  it has seen, so before a tracked step `track_program` hands it every tensor reachable from
  the program (`live_tensors`: a walk of `gc.get_referents` from the model and the optimizer
  that does not enter Python modules or classes, plus each leaf's `.grad`; fake and meta
  tensors are skipped). That covers parameters, gradients, optimizer state and whatever the
  runtime keeps on the side (FSDP2's unsharded parameter storages, resized to 0 between uses;
  autopar's replicated copies and gradient buffers). The first step is tracked too (lazy
  initialisation, optimizer state creation), and the peak is read on the second step: the
  live bytes at its start (`at rest`) and the most live bytes at any op of it (`peak`), split
  by MemTracker's categories at that moment (its own attribution: tensors made inside
  `optimizer.step`, e.g. a post-step parameter all-gather, count as `Optstate`; tensors found
  by the walk that are not parameters or optimizer state are `Other`). `module.plan` is the
  part of autopar's live bytes reachable from its plan.
  Live bytes are tensor storages only: gloo's internal buffers and the allocator's slack are
  not seen, the same for both programs. The table shows the largest rank's peak; `ratio` is
  autopar's over PyTorch's.
- Loss: the first-step loss of both (PyTorch's local losses averaged over ranks) and the
  largest relative gap over all steps.

`--compile`: both sides through torch.compile with inductor (autopar `compile=True`; FSDP2's,
DDP's model compiled whole). The counted and the memory steps come after the timed ones and run
eagerly (dynamo compiles nothing under a dispatch mode): under `--compile` the memory columns are
the eager programs'.

Run: python benchmarks/compare_fsdp.py [--quick] [--compile] [--rows zero3,zero1] [--steps N] [--warmup N]
(`--help` lists the model flags, the same as compare_step_time.py's).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples`, `benchmarks` are not installed

import autopar  # noqa: E402
from autopar.measure.comm_counter import CommCounter  # noqa: E402
from benchmarks.compare_step_time import (KINDS, QUICK_DEFAULTS, WORLD_SIZE, CollectiveBytes,  # noqa: E402
                                          alternate_steps, as_float, batch_slice, build_model, compiled,
                                          graphs_compiled, ledger_bytes, median_step_ms, mib)
from benchmarks.row_runs import run_rows  # noqa: E402
from examples.gpt import GPTConfig, example_batch  # noqa: E402

TOTAL = "Total"  # MemTracker's key for the sum over categories
# MemTracker's post-accumulate-grad hook passes `param.grad` even when it is None; nothing is tracked then
warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass of tensor, but got")


@dataclass(frozen=True)
class Settings:
    model: GPTConfig
    batch: int
    warmup: int
    steps: int
    lr: float = 1e-3
    compile: bool = False  # both sides through torch.compile (inductor)


@dataclass
class Program:
    """One side of a row on this rank: what it trains, with what, on which inputs."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inputs: list[torch.Tensor]
    tracker: MemTracker = field(default_factory=MemTracker)

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(*self.inputs)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def adamw(params, settings: Settings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=settings.lr)


def pytorch_fsdp2(settings: Settings, global_batch: tuple, rank: int, *, reshard: bool = True) -> Program:
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    model = build_model(settings)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    model = compiled(model, settings)
    return Program(model, adamw(model.parameters(), settings), batch_slice(global_batch, index=rank, parts=WORLD_SIZE))


def pytorch_fsdp2_grad_op(settings: Settings, global_batch: tuple, rank: int) -> Program:
    """FSDP2 keeping each unit gathered from forward to backward (FSDP's SHARD_GRAD_OP, which its
    documentation likens to ZeRO-2): one all-gather and one reduce-scatter of the parameters per
    step, as autopar's ZeRO-2 moves; its parameters sharded between steps, where ZeRO-2 keeps them."""
    return pytorch_fsdp2(settings, global_batch, rank, reshard=False)


def pytorch_ddp(settings: Settings, global_batch: tuple, rank: int) -> Program:
    model = compiled(DistributedDataParallel(build_model(settings)), settings)
    return Program(model, adamw(model.parameters(), settings), batch_slice(global_batch, index=rank, parts=WORLD_SIZE))


def pytorch_ddp_zero1(settings: Settings, global_batch: tuple, rank: int) -> Program:
    model = compiled(DistributedDataParallel(build_model(settings)), settings)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=settings.lr)
    return Program(model, optimizer, batch_slice(global_batch, index=rank, parts=WORLD_SIZE))


@dataclass(frozen=True)
class Row:
    stage: int
    pytorch: Callable[[Settings, tuple, int], Program]
    pytorch_description: str


ROWS = {
    "zero3": Row(3, pytorch_fsdp2, "FSDP2 fully_shard(layers[i]) then fully_shard(root), mesh (4,), "
                                   "reshard_after_forward=True"),
    "zero2": Row(2, pytorch_ddp, "DDP (no PyTorch ZeRO-2 with replicated parameters; FSDP2 shards them)"),
    "zero2_fsdp": Row(2, pytorch_fsdp2_grad_op, "FSDP2 as zero3's, reshard_after_forward=False (FSDP's SHARD_GRAD_OP: "
                                                "the same all-gather and reduce-scatter per step as ZeRO-2)"),
    "zero1": Row(1, pytorch_ddp_zero1, "DDP + ZeroRedundancyOptimizer(optimizer_class=AdamW)"),
}


def autopar_side(row: Row, settings: Settings, global_batch: tuple) -> tuple[Program, int]:
    """autopar's program for this rank and the plan's static ledger total (bytes per step per rank)."""
    module = autopar.parallelize(build_model(settings), f"dp={WORLD_SIZE}",
                                 strategies=[autopar.zero(stage=row.stage)],
                                 example_inputs=global_batch, compile=settings.compile)
    program = Program(module, adamw(module.parameters(), settings), module.local_batch(*global_batch))
    return program, ledger_bytes(module)


def live_tensors(*roots: Any) -> list[torch.Tensor]:
    """Every real tensor reachable from `roots` through Python references (not through modules,
    classes or module globals), and the `.grad` of each leaf found."""
    module_dicts = {id(vars(module)) for module in list(sys.modules.values()) if module is not None}
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not isinstance(obj, FakeTensor) and obj.device.type != "meta":
                found.append(obj)
                if obj.is_leaf and obj.grad is not None:
                    stack.append(obj.grad)
            continue
        if isinstance(obj, (types.ModuleType, type)) or id(obj) in module_dicts:
            continue
        stack.extend(gc.get_referents(obj))
    return found


def track_program(program: Program) -> None:
    """Tell the program's tracker about everything alive now; parameters and optimizer state
    last, so that they are filed under their own categories rather than `Other`."""
    program.tracker.track_external(*live_tensors(program.model, program.optimizer))
    program.tracker.track_external(program.model, program.optimizer)
    program.tracker.reset_mod_stats()  # MemTracker refuses a second forward of a root it has seen


def total_bytes(snapshot: dict[torch.device, dict[str, int]]) -> int:
    return sum(device[TOTAL] for device in snapshot.values())


def memory_step(program: Program) -> tuple[torch.Tensor, dict[str, Any]]:
    """One step under the program's MemTracker: its loss, live bytes at start and peak by category."""
    track_program(program)
    at_rest = total_bytes(program.tracker.get_tracker_snapshot("current"))
    with program.tracker:
        loss = program.step()
    peak = program.tracker.get_tracker_snapshot("peak")
    categories: dict[str, int] = defaultdict(int)
    for device in peak.values():
        for category, nbytes in device.items():
            categories[str(getattr(category, "value", category))] += nbytes
    return loss, {"at_rest": at_rest, "peak": total_bytes(peak), "categories": dict(categories),
                  "plan_state": storage_bytes(live_tensors(getattr(program.model, "plan", None)))}


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


def first_step(program: Program, *, is_autopar: bool) -> dict[str, Any]:
    """The first step: collectives counted (and CommCounter for autopar), memory tracked (not read)."""
    counter = CollectiveBytes()
    autopar_counter = CommCounter() if is_autopar else contextlib.nullcontext()
    track_program(program)
    with counter, autopar_counter, program.tracker:
        loss = program.step()
    result = {"losses": [as_float(loss)], "times": [], "calls": dict(counter.calls), "bytes": dict(counter.bytes),
              "unknown": sorted(counter.unknown)}
    if is_autopar:
        result["comm_counter_bytes"] = sum(call.logical_bytes for call in autopar_counter.calls)
    return result


def measure(programs: dict[str, Program], settings: Settings) -> dict[str, dict[str, Any]]:
    """Alternate the two programs: step 0 counted, step 1 memory, further warm-up, timed steps.
    Compiled (`--compile`): warm-up and timed steps first, then the counted and the memory steps
    (see compare_step_time.measure_compiled: dynamo runs a frame it skipped under a dispatch mode
    eagerly from then on), which therefore measure the programs run eagerly."""
    steps = {name: program.step for name, program in programs.items()}
    timed = {name: {"losses": [], "times": []} for name in programs}
    if settings.compile:
        alternate_steps(steps, timed, first=0, warmup=settings.warmup, timed=settings.steps)
    with warnings.catch_warnings():  # autopar's warning that a compiled program now runs eagerly: meant here
        warnings.filterwarnings("ignore", message=r"parallelize\(compile=True\)")
        results = {name: first_step(program, is_autopar=name == "autopar") for name, program in programs.items()}
    for name, program in programs.items():
        dist.barrier()
        loss, results[name]["memory"] = memory_step(program)
        results[name]["losses"].append(as_float(loss))
    if settings.compile:
        for name, side in results.items():
            side["losses"], side["times"] = timed[name]["losses"] + side["losses"], timed[name]["times"]
    else:
        alternate_steps(steps, results, first=2, warmup=settings.warmup, timed=settings.steps)
    return results


def run_row(rank: int, world_size: int, row_name: str, settings: Settings) -> dict[str, Any]:
    row = ROWS[row_name]
    global_batch = example_batch(settings.model, batch=settings.batch)
    autopar_program, ledger_total = autopar_side(row, settings, global_batch)
    programs = {"autopar": autopar_program, "pytorch": row.pytorch(settings, global_batch, rank)}
    graphs: dict[str, int] = {}
    for name, program in programs.items():
        program.step = graphs_compiled(program.step, graphs, name)
    results = measure(programs, settings)
    results["autopar"]["ledger_bytes"] = ledger_total
    if settings.compile:
        results["autopar"]["graphs"] = graphs
    return results


def ratio(autopar: float, pytorch: float) -> str:
    return f"{autopar / pytorch:.2f}" if pytorch else "n/a"


def summarize_row(row_name: str, ranks: list[dict[str, Any]]) -> tuple[list[Any], list[list[Any]], list[str]]:
    """The main table's row, rows of the memory and collectives tables, and notes."""
    autopar = [rank["autopar"] for rank in ranks]
    pytorch = [rank["pytorch"] for rank in ranks]
    notes = []
    autopar_ms, pytorch_ms = median_step_ms(autopar), median_step_ms(pytorch)
    autopar_bytes = max(sum(side["bytes"].values()) for side in autopar)
    pytorch_bytes = max(sum(side["bytes"].values()) for side in pytorch)
    counted = max(side["comm_counter_bytes"] for side in autopar)
    if counted != autopar_bytes:
        notes.append(f"{row_name}: CommCounter counts {counted} B but CollectiveBytes {autopar_bytes} B for autopar")
    for name, sides in (("autopar", autopar), ("PyTorch", pytorch)):
        if any(side["unknown"] for side in sides):
            notes.append(f"{row_name}: {name} issued collectives not counted: {sides[0]['unknown']}")
    autopar_peak = max(side["memory"]["peak"] for side in autopar)
    pytorch_peak = max(side["memory"]["peak"] for side in pytorch)
    plan_state = max(side["memory"]["plan_state"] for side in autopar)
    if plan_state:
        notes.append(f"{row_name}: autopar's peak includes {mib(plan_state)} MiB of tensors held by module.plan "
                     f"(the traced model's state); without them autopar/PyTorch peak would be "
                     f"{ratio(autopar_peak - plan_state, pytorch_peak)}")
    if "graphs" in autopar[0]:
        notes.append(f"{row_name}: graphs dynamo compiled on rank 0: "
                     + ", ".join(f"{name} {n}" for name, n in autopar[0]["graphs"].items()))
    pytorch_losses = [statistics.fmean(step) for step in zip(*(side["losses"] for side in pytorch))]
    gaps = [abs(a - p) / abs(p) for a, p in zip(autopar[0]["losses"], pytorch_losses)]
    main = [row_name, f"{autopar_ms:.0f}", f"{pytorch_ms:.0f}", ratio(autopar_ms, pytorch_ms),
            mib(autopar_peak), mib(pytorch_peak), ratio(autopar_peak, pytorch_peak),
            mib(autopar_bytes), mib(autopar[0]["ledger_bytes"]), mib(pytorch_bytes), ratio(autopar_bytes, pytorch_bytes),
            f"{autopar[0]['losses'][0]:.6f}", f"{pytorch_losses[0]:.6f}", f"{gaps[0]:.1e} / {max(gaps):.1e}"]
    details = [detail_row(row_name, "autopar", autopar), detail_row(row_name, "PyTorch", pytorch)]
    return main, details, notes


MEMORY_CATEGORIES = ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Other")


def detail_row(row_name: str, side_name: str, sides: list[dict[str, Any]]) -> list[Any]:
    """Rank 0: live MiB at rest, peak by MemTracker category, then calls / MiB per collective kind."""
    side = sides[0]
    memory = side["memory"]
    categories = [mib(memory["categories"].get(name, 0)) for name in MEMORY_CATEGORIES]
    kinds = [f"{side['calls'][kind]} / {mib(side['bytes'][kind])}" if kind in side["calls"] else "" for kind in KINDS]
    plan_state = mib(memory["plan_state"]) if side_name == "autopar" else ""
    return [row_name, side_name, mib(memory["at_rest"]), mib(memory["peak"]), *categories, plan_state, *kinds]


def print_report(summaries: list[tuple[list[Any], list[list[Any]], list[str]]], row_names: list[str],
                 settings: Settings) -> None:
    model = settings.model
    print(f"\nexample GPT: {model.n_layer} layers, d_model {model.d_model}, {model.n_head} heads, d_ff {model.d_ff}, "
          f"seq {model.seq_len}, vocab {model.vocab_size}; global batch {settings.batch}; {WORLD_SIZE} gloo ranks x "
          f"1 thread; median of {settings.steps} steps after {settings.warmup} warm-up\n")
    headers = ["row", "autopar ms", "PyTorch ms", "ratio", "autopar peak MiB", "PyTorch peak MiB", "ratio",
               "autopar comm MiB", "ledger MiB", "PyTorch comm MiB", "ratio", "loss autopar", "loss PyTorch",
               "loss gap 1st/max"]
    print(tabulate([summary[0] for summary in summaries], headers=headers, tablefmt="simple", disable_numparse=True))
    print("\nRank 0, memory step (MiB; peak by MemTracker category at the peak) and collectives of the first step "
          "(calls / MiB)\n")
    print(tabulate([detail for summary in summaries for detail in summary[1]],
                   headers=["row", "side", "at rest", "peak", *MEMORY_CATEGORIES, "module.plan", *KINDS],
                   tablefmt="simple",
                   disable_numparse=True))
    print("\nPyTorch programs:")
    print("\n".join(f"- {name}: {ROWS[name].pytorch_description}" for name in row_names))
    notes = [note for summary in summaries for note in summary[2]]
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {note}" for note in notes))


def parse_settings(argv: list[str] | None = None) -> tuple[Settings, list[str], float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"defaults for a smoke run: {QUICK_DEFAULTS}")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps (>= 2; the first is counted, the second measures memory)")
    parser.add_argument("--steps", type=int, default=30,
                        help="timed steps (their median; in compare_step_time.py, with 10 dp4's ratio read "
                             "0.80-0.92 across four runs here, with 30 0.82-0.86 across three, 2026-12-05)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck row is abandoned")
    parser.add_argument("--compile", action="store_true",
                        help="both sides through torch.compile (inductor); the counted and the memory steps "
                             "come last and run eagerly (dynamo compiles nothing under a dispatch mode)")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**{**QUICK_DEFAULTS, "warmup": 2})  # flags given explicitly still win
    args = parser.parse_args(argv)
    rows = [name for name in args.rows.split(",") if name]
    unknown = [name for name in rows if name not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    model = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                      d_model=args.d_model, d_ff=args.d_ff)
    settings = Settings(model=model, batch=args.batch, warmup=max(args.warmup, 2),
                        steps=args.steps, compile=args.compile)
    return settings, rows, args.timeout


def main() -> None:
    settings, rows, timeout_s = parse_settings()
    print_report(run_rows(rows, settings, timeout_s=timeout_s, run=run_row, summarize=summarize_row, columns=13,
                          world_size=WORLD_SIZE),
                 rows, settings)


if __name__ == "__main__":
    main()
