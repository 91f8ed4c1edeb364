"""Step time and communication of autopar against PyTorch's own parallel APIs, on the example GPT.

Each row runs on four local CPU processes (gloo, one thread each, `autopar.runtime.launch`):

| row     | autopar                                 | PyTorch                                                 |
|---------|-----------------------------------------|---------------------------------------------------------|
| dp4     | data_parallel on dp=4                   | DistributedDataParallel on the rank's batch slice       |
| tp4     | tensor_parallel on tp=4                 | parallelize_module: Colwise q/k/v/up, Rowwise o/down,   |
|         |                                         | vocab-parallel embed_tokens, Colwise lm_head with       |
|         |                                         | loss_parallel                                           |
| tp4_sp  | sequence_parallel on tp=4               | tp4's plan + SequenceParallel norms, PrepareModuleInput |
|         |                                         | on attn/mlp (torchtitan's Llama plan)                   |
| dp2_tp2 | data_parallel + tensor_parallel on      | tp4's plan on mesh["tp"] + DDP on mesh["dp"]            |
|         | dp=2,tp=2                               |                                                         |

A training step is zero_grad, forward, backward and an AdamW step. Both programs start from the
same weights (`torch.manual_seed(0)` on every rank before parallelizing) and train on the same
global batch; their steps alternate, so machine drift hits both alike (`measure`).

- Step time: barrier, time the step on every rank, keep the slowest rank; median over the timed
  steps. `ratio` is autopar's median over PyTorch's.
- Bytes: logical bytes per step per rank handed to the process groups (all-reduce input,
  all-gather output, reduce-scatter input, all-to-all input, broadcast input), counted on the
  first, untimed step by `CollectiveBytes`, a dispatch mode defined here that sees classic c10d
  ops (DDP) and functional collectives (DTensor, autopar). autopar's step is also counted by
  `autopar.measure.comm_counter.CommCounter` and shown next to its plan's ledger (`ledger_bytes`).
- Loss: the first-step loss of both programs (PyTorch's local losses averaged over ranks, which
  is the global-batch mean when the batch is split evenly), and the largest relative gap over all steps.

`--compile`: both sides through torch.compile with inductor (autopar `compile=True`; PyTorch's
DDP- or DTensor-wrapped model compiled whole; under dp×tp each block of the TP model compiled, then
the model wrapped by DDP, as torchtitan does); the step counted by `CollectiveBytes` comes after the timed steps (`measure_compiled`).

Run: python benchmarks/compare_step_time.py [--quick] [--compile] [--rows dp4,tp4] [--steps N] [--warmup N]
(`--help` lists the model flags). `--no-loss-parallel` gives PyTorch an lm_head that all-gathers
the logits instead of PyTorch's loss_parallel.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` is not an installed package

import autopar  # noqa: E402
from autopar.measure.comm_counter import CommCounter  # noqa: E402
from benchmarks.row_runs import run_rows  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402

WORLD_SIZE = 4
MIB = 2**20
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

# Collective op name -> (kind, index of the argument whose size is the logical size, index of a
# group-size argument that multiplies it or None). Classic c10d ops are what DDP issues; the
# functional ones are what DTensor and autopar issue.
COLLECTIVE_OPS: dict[str, tuple[str, int, int | None]] = {
    "c10d::allreduce_": ("all_reduce", 0, None),
    "c10d::allreduce_coalesced_": ("all_reduce", 0, None),
    "c10d::allgather_": ("all_gather", 0, None),
    "c10d::_allgather_base_": ("all_gather", 0, None),
    "c10d::allgather_coalesced_": ("all_gather", 0, None),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0, None),
    "c10d::reduce_scatter_": ("reduce_scatter", 1, None),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1, None),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, None),
    "c10d::alltoall_": ("all_to_all", 1, None),
    "c10d::alltoall_base_": ("all_to_all", 1, None),
    "c10d::broadcast_": ("broadcast", 0, None),
    "_c10d_functional::all_reduce": ("all_reduce", 0, None),
    "_c10d_functional::all_reduce_": ("all_reduce", 0, None),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", 0, None),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", 0, None),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0, 1),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", 0, 1),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", 0, 1),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0, None),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", 0, None),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, None),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0, None),
    "_c10d_functional::broadcast": ("broadcast", 0, None),
    "_c10d_functional::broadcast_": ("broadcast", 0, None),
}

NOT_COMMUNICATION = ("wait", "barrier", "_wrap_tensor_autograd")


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """Counts calls and logical bytes of every collective dispatched while active, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.unknown: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run first: the collectives it issues then come back here
        name = func._schema.name
        if name in COLLECTIVE_OPS:
            kind, measured, group_size = COLLECTIVE_OPS[name]
            self.calls[kind] += 1
            self.bytes[kind] += tensor_bytes(args[measured]) * (args[group_size] if group_size is not None else 1)
        elif func.namespace.startswith(("c10d", "_c10d")) and not any(word in name for word in NOT_COMMUNICATION):
            self.unknown.add(name)
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class Settings:
    model: GPTConfig
    batch: int
    warmup: int
    steps: int
    loss_parallel: bool
    lr: float = 1e-3
    compile: bool = False  # both sides through torch.compile (inductor)


StepFn = Callable[[], torch.Tensor]


def make_step(model: torch.nn.Module, inputs: list[torch.Tensor], *, lr: float,
              loss_context: Callable[[], Any] = contextlib.nullcontext) -> StepFn:
    """One training step (zero_grad, forward, backward, AdamW) that returns the detached loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with loss_context():
            loss = model(*inputs)
            loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def batch_slice(global_batch: tuple[torch.Tensor, ...], *, index: int, parts: int) -> list[torch.Tensor]:
    return [torch.chunk(tensor, parts, dim=0)[index].contiguous() for tensor in global_batch]


def build_model(settings: Settings) -> GPT:
    torch.manual_seed(0)
    return GPT(settings.model)


def tensor_parallel_plan(*, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
    """PyTorch's TP (optionally + SP) plan for the example GPT, after torchtitan's Llama plan."""
    seq = Shard(1) if sequence_parallel else Replicate()
    if loss_parallel:
        lm_head = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    else:
        lm_head = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    plan: dict[str, Any] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attn.q_proj": ColwiseParallel(),
        "layers.*.attn.k_proj": ColwiseParallel(),
        "layers.*.attn.v_proj": ColwiseParallel(),
        "layers.*.attn.o_proj": RowwiseParallel(output_layouts=seq),
        "layers.*.mlp.up_proj": ColwiseParallel(),
        "layers.*.mlp.down_proj": RowwiseParallel(output_layouts=seq),
        "lm_head": lm_head,
    }
    if sequence_parallel:
        # The positional embedding is added to sequence shards: slice its (replicated) output the same way.
        plan["embed_positions"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        for norm in ("layers.*.attn_norm", "layers.*.mlp_norm", "norm"):
            plan[norm] = SequenceParallel()
        for block in ("layers.*.attn", "layers.*.mlp"):
            plan[block] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def compiled(model: torch.nn.Module, settings: Settings) -> torch.nn.Module:
    """PyTorch's side under `--compile`: the whole (wrapped) model through torch.compile, as PyTorch's
    docs do it (DDP: dynamo's DDPOptimizer splits the graph at the buckets; DTensor: traced as is);
    dp×tp compiles per block instead (`pytorch_tp`)."""
    return torch.compile(model) if settings.compile else model


def pytorch_ddp(settings: Settings, global_batch: tuple, rank: int) -> StepFn:
    model = compiled(DistributedDataParallel(build_model(settings)), settings)
    local = batch_slice(global_batch, index=rank, parts=WORLD_SIZE)
    return make_step(model, local, lr=settings.lr)


def pytorch_tp(settings: Settings, global_batch: tuple, rank: int, *, sequence_parallel: bool = False,
               dp: int = 1) -> StepFn:
    """parallelize_module on the tp (sub)mesh; with dp > 1, DDP over the dp submesh on a batch slice."""
    tp = WORLD_SIZE // dp
    mesh: DeviceMesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(settings)
    plan = tensor_parallel_plan(sequence_parallel=sequence_parallel, loss_parallel=settings.loss_parallel)
    parallelize_module(model, mesh["tp"], plan)
    if dp > 1 and settings.compile:
        # torchtitan's order: each block compiled, then data parallelism applied (so DDP's hooks see
        # each block's gradients as its backward ends); compiling DDP over the DTensor model whole
        # fails in its second step ("backward through the graph a second time", 2026-12-05)
        for index, block in enumerate(model.layers):
            model.layers[index] = torch.compile(block)
    else:
        model = compiled(model, settings)
    inputs = list(global_batch)
    if dp > 1:
        model = DistributedDataParallel(model, device_mesh=mesh["dp"])
        inputs = batch_slice(global_batch, index=mesh.get_local_rank("dp"), parts=dp)
    context = loss_parallel if settings.loss_parallel else contextlib.nullcontext
    return make_step(model, inputs, lr=settings.lr, loss_context=context)


@dataclass(frozen=True)
class Row:
    mesh: str
    strategies: Callable[[], list]
    pytorch: Callable[[Settings, tuple, int], StepFn]
    pytorch_description: str


ROWS = {
    "dp4": Row("dp=4", lambda: [autopar.data_parallel()], pytorch_ddp,
               "DDP, batch slice per rank (both sides' gradient all-reduces through gloo)"),
    "tp4": Row("tp=4", lambda: [autopar.tensor_parallel()], pytorch_tp,
               "parallelize_module: Colwise q/k/v/up, Rowwise o/down, vocab-parallel embed_tokens and lm_head"),
    "tp4_sp": Row("tp=4", lambda: [autopar.sequence_parallel()], functools.partial(pytorch_tp, sequence_parallel=True),
                  "tp4's plan + SequenceParallel norms, PrepareModuleInput on attn/mlp, embed_positions sliced"),
    "dp2_tp2": Row("dp=2,tp=2", lambda: [autopar.data_parallel(), autopar.tensor_parallel()],
                   functools.partial(pytorch_tp, dp=2), "tp4's plan on mesh['tp'] + DDP(device_mesh=mesh['dp'])"),
}


def autopar_side(row: Row, settings: Settings, global_batch: tuple) -> tuple[StepFn, int]:
    """autopar's step for this rank and the plan's static ledger total (bytes per step per rank)."""
    module = autopar.parallelize(build_model(settings), row.mesh, strategies=row.strategies(),
                                 example_inputs=global_batch, compile=settings.compile)
    return make_step(module, module.local_batch(*global_batch), lr=settings.lr), ledger_bytes(module)


def ledger_bytes(module: torch.nn.Module) -> int:
    """The plan's static ledger: bytes per step per rank through the process groups (what the
    counters see)."""
    return sum(nbytes for _, nbytes in module.plan.comm.by_key().values())


def as_float(loss: torch.Tensor) -> float:
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def counted_step(step: StepFn, *, with_comm_counter: bool) -> dict[str, Any]:
    """Run one step under `CollectiveBytes` (and autopar's `CommCounter`); return loss and counts."""
    counter = CollectiveBytes()
    autopar_counter = CommCounter() if with_comm_counter else contextlib.nullcontext()
    with counter, autopar_counter:
        loss = step()
    result = {"losses": [as_float(loss)], "times": [], "calls": dict(counter.calls), "bytes": dict(counter.bytes),
              "unknown": sorted(counter.unknown)}
    if with_comm_counter:
        result["comm_counter_bytes"] = sum(call.logical_bytes for call in autopar_counter.calls)
    return result


def measure(steps: dict[str, StepFn], settings: Settings, notes: list[str]) -> dict[str, dict[str, Any]]:
    """Alternate the contenders' steps: the first one counted, then warm-up, then timed steps.
    A PyTorch program whose first step raises (the same way on every rank) is dropped with a note."""
    if settings.compile:
        return measure_compiled(steps, settings, notes)
    results = {"autopar": counted_step(steps["autopar"], with_comm_counter=True)}
    if "pytorch" in steps:
        try:
            results["pytorch"] = counted_step(steps["pytorch"], with_comm_counter=False)
        except Exception as error:
            notes.append(f"PyTorch step failed: {type(error).__name__}: {str(error).splitlines()[0]}")
            steps = {"autopar": steps["autopar"]}
    alternate_steps(steps, results, first=1, warmup=settings.warmup, timed=settings.steps)
    return results


def measure_compiled(steps: dict[str, StepFn], settings: Settings, notes: list[str]) -> dict[str, dict[str, Any]]:
    """`measure` for compiled programs: the counted step comes last. Dynamo does not compile a frame
    while a (non-infra) dispatch mode is active, and once it has skipped a frame it runs that frame
    eagerly from then on: a first step under `CollectiveBytes` would leave both programs uncompiled."""
    first = {}
    for name, step in list(steps.items()):
        try:
            # compiles; a program that fails in its second compiled step (PyTorch's DDP over DTensor) is left out
            first[name] = [as_float(step()), as_float(step())]
        except Exception as error:
            if name != "pytorch":
                raise
            notes.append(f"PyTorch step failed: {type(error).__name__}: {str(error).splitlines()[0]}")
            del steps[name]
    results = {name: {"losses": losses, "times": []} for name, losses in first.items()}
    alternate_steps(steps, results, first=2, warmup=settings.warmup, timed=settings.steps)
    for name, step in steps.items():
        with warnings.catch_warnings():  # autopar's warning that this step runs eagerly: it is meant to
            warnings.filterwarnings("ignore", message=r"parallelize\(compile=True\)")
            counted = counted_step(step, with_comm_counter=name == "autopar")
        results[name].update({key: value for key, value in counted.items() if key not in ("losses", "times")})
    return results


def alternate_steps(steps: dict[str, Callable[[], torch.Tensor]], results: dict[str, dict[str, Any]], *,
                    first: int, warmup: int, timed: int) -> None:
    """Steps `first` .. warmup+timed-1 of each contender, alternating, a barrier before each: the
    loss of every step, the wall time of each step past the warm-up (the report keeps the slowest rank)."""
    for index in range(first, warmup + timed):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            loss = step()
            elapsed = time.perf_counter() - start
            results[name]["losses"].append(as_float(loss))
            if index >= warmup:
                results[name]["times"].append(elapsed)


def run_row(rank: int, world_size: int, row_name: str, settings: Settings) -> dict[str, Any]:
    """One rank of one row: build both programs, measure them, return per-rank results and notes."""
    row = ROWS[row_name]
    global_batch = example_batch(settings.model, batch=settings.batch)
    autopar_step, ledger_total = autopar_side(row, settings, global_batch)
    steps, notes = {"autopar": autopar_step}, []
    try:
        steps["pytorch"] = row.pytorch(settings, global_batch, rank)
    except Exception as error:  # the same on every rank: this side is left out of the row, not the run
        notes.append(f"PyTorch side failed to build: {type(error).__name__}: {error}")
    graphs: dict[str, int] = {}
    results = measure({name: graphs_compiled(step, graphs, name) for name, step in steps.items()}, settings, notes)
    results["autopar"]["ledger_bytes"] = ledger_total
    if settings.compile:
        notes.append("graphs dynamo compiled on rank 0: " + ", ".join(f"{name} {n}" for name, n in graphs.items()))
    return {"sides": results, "notes": notes}


def graphs_compiled(step: StepFn, tally: dict[str, int], name: str) -> StepFn:
    """`step`, adding the graphs dynamo compiles while it runs to `tally[name]`."""
    from torch._dynamo.utils import counters

    def counted() -> torch.Tensor:
        before = counters["stats"]["unique_graphs"]
        try:
            return step()
        finally:
            tally[name] = tally.get(name, 0) + counters["stats"]["unique_graphs"] - before

    return counted


def median_step_ms(per_rank: list[dict[str, Any]]) -> float:
    slowest = [max(times) for times in zip(*(side["times"] for side in per_rank))]
    return 1000 * statistics.median(slowest)


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.2f}"


def summarize_row(row_name: str, ranks: list[dict[str, Any]]) -> tuple[list[Any], list[list[Any]], list[str]]:
    """The row of the main table, rows of the per-kind table, and notes, from every rank's results."""
    notes = [f"{row_name}: {note}" for note in ranks[0]["notes"]]
    autopar = [rank["sides"]["autopar"] for rank in ranks]
    pytorch = [rank["sides"]["pytorch"] for rank in ranks] if "pytorch" in ranks[0]["sides"] else None
    autopar_ms = median_step_ms(autopar)
    measured = max(sum(side["bytes"].values()) for side in autopar)
    counted = max(side["comm_counter_bytes"] for side in autopar)
    if counted != measured:
        notes.append(f"{row_name}: CommCounter counts {counted} B but CollectiveBytes {measured} B for autopar")
    for name, sides in (("autopar", autopar), ("PyTorch", pytorch or [])):
        if any(side["unknown"] for side in sides):
            notes.append(f"{row_name}: {name} issued collectives not counted: {sides[0]['unknown']}")
    first_autopar = autopar[0]["losses"][0]
    kinds = [kind_row(row_name, "autopar", autopar)]
    if pytorch is None:
        return ([row_name, f"{autopar_ms:.0f}", "n/a", "n/a", mib(measured), mib(autopar[0]["ledger_bytes"]), "n/a",
                 f"{first_autopar:.6f}", "n/a", "n/a"], kinds, notes)
    pytorch_ms = median_step_ms(pytorch)
    losses = [statistics.fmean(step) for step in zip(*(side["losses"] for side in pytorch))]
    gaps = [abs(a - p) / abs(p) for a, p in zip(autopar[0]["losses"], losses)]
    kinds.append(kind_row(row_name, "PyTorch", pytorch))
    return ([row_name, f"{autopar_ms:.0f}", f"{pytorch_ms:.0f}", f"{autopar_ms / pytorch_ms:.2f}", mib(measured),
             mib(autopar[0]["ledger_bytes"]), mib(max(sum(side["bytes"].values()) for side in pytorch)),
             f"{first_autopar:.6f}", f"{losses[0]:.6f}", f"{gaps[0]:.1e} / {max(gaps):.1e}"], kinds, notes)


def kind_row(row_name: str, side_name: str, sides: list[dict[str, Any]]) -> list[Any]:
    """Rank 0's calls and MiB per collective kind."""
    side = sides[0]
    cells = [f"{side['calls'][kind]} / {mib(side['bytes'][kind])}" if kind in side["calls"] else "" for kind in KINDS]
    return [row_name, side_name, *cells]


def print_report(summaries: list[tuple[list[Any], list[list[Any]], list[str]]], row_names: list[str],
                 settings: Settings) -> None:
    model = settings.model
    print(f"\nexample GPT: {model.n_layer} layers, d_model {model.d_model}, {model.n_head} heads, d_ff {model.d_ff}, "
          f"seq {model.seq_len}, vocab {model.vocab_size}; global batch {settings.batch}; {WORLD_SIZE} gloo ranks x "
          f"1 thread; median of {settings.steps} steps after {settings.warmup} warm-up\n")
    headers = ["row", "autopar ms", "PyTorch ms", "ratio", "autopar MiB", "ledger MiB", "PyTorch MiB",
               "loss autopar", "loss PyTorch", "loss gap 1st/max"]
    print(tabulate([summary[0] for summary in summaries], headers=headers, tablefmt="simple",
                   disable_numparse=True))
    print("\nCollectives per step on rank 0 (calls / MiB)\n")
    print(tabulate([kind for summary in summaries for kind in summary[1]], headers=["row", "side", *KINDS],
                   tablefmt="simple", disable_numparse=True))
    lm_head = "gathers the logits (--no-loss-parallel)" if not settings.loss_parallel else "under loss_parallel"
    print(f"\nPyTorch programs; TP lm_head {lm_head}:")
    print("\n".join(f"- {name}: {ROWS[name].pytorch_description}" for name in row_names))
    notes = [note for summary in summaries for note in summary[2]]
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {note}" for note in notes))


QUICK_DEFAULTS = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 128, "seq_len": 16, "vocab": 128, "warmup": 1,
                  "steps": 3}


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
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (>= 1; the first is counted)")
    parser.add_argument("--steps", type=int, default=30,
                        help="timed steps (their median; 10 left dp4's ratio spread over ~0.1 across runs, "
                             "30 over ~0.04, 2026-12-05)")
    parser.add_argument("--no-loss-parallel", action="store_true", help="PyTorch lm_head gathers the logits")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck row is abandoned")
    parser.add_argument("--compile", action="store_true",
                        help="both sides through torch.compile (inductor): autopar compile=True, PyTorch's model "
                             "compiled; collectives are counted after the timed steps")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK_DEFAULTS)  # flags given explicitly still win
    args = parser.parse_args(argv)
    rows = [name for name in args.rows.split(",") if name]
    unknown = [name for name in rows if name not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    model = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                      d_model=args.d_model, d_ff=args.d_ff)
    settings = Settings(model=model, batch=args.batch, warmup=max(args.warmup, 1),
                        steps=args.steps, loss_parallel=not args.no_loss_parallel, compile=args.compile)
    return settings, rows, args.timeout


def main() -> None:
    settings, rows, timeout_s = parse_settings()
    print_report(run_rows(rows, settings, timeout_s=timeout_s, run=run_row, summarize=summarize_row,
                          world_size=WORLD_SIZE), rows, settings)


if __name__ == "__main__":
    main()
