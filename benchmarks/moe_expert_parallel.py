"""autopar's expert parallelism against data parallelism and a torchtitan-style PyTorch EP, on the example MoE.

The model is `examples/moe.py`'s MoEGPT (routed SwiGLU experts as grouped matmuls, load-balancing
and z auxiliary losses in the loss). For each world size N (default 2 and 4; local CPU processes,
gloo, one thread each, `autopar.runtime.launch`) every rank builds four programs:

| row        | program                                                                                |
|------------|----------------------------------------------------------------------------------------|
| autopar EP | `expert_parallel()` on ep=N: experts split by expert (rank r owns experts r·E/N ..     |
|            | (r+1)·E/N-1), tokens carried to them by all-to-all, everything else data parallel      |
|            | (the scheduling pass on: the auxiliary losses' statistics reductions land late)        |
| autopar EP, no overlap | the same with `autopar.schedule(overlap=False)`: every collective waits where  |
|            | it is issued (what the scheduling pass gains, measured side by side)                   |
| autopar DP | `data_parallel()` on dp=N: every rank holds every expert, gradients all-reduced        |
| PyTorch EP | hand-written with PyTorch primitives the way torchtitan's all-to-all token dispatcher  |
|            | does it (`ExpertParallelExperts`): each rank keeps its experts' slices of             |
|            | `layers[i].moe.experts.gate_up/down`; a forward sorts the rows by expert, counts them  |
|            | (`bincount`), exchanges the counts (`torch.distributed.all_to_all_single`), exchanges  |
|            | the rows (`_functional_collectives.all_to_all_single_autograd`, as torchtitan), regroups|
|            | them by local expert, runs the grouped matmuls over the local experts                  |
|            | (`examples.moe.grouped_mm`), regroups back, all-to-alls back, weights and unpermutes.   |
|            | The non-expert parameters are under DDP (expert parameters ignored through             |
|            | `_set_params_and_buffers_to_ignore_for_model`); the expert gradients are divided by N  |
|            | (torchtitan's gradient divide factor), so both are gradients of the global mean loss.  |

All four start from the same weights (`torch.manual_seed(0)` before each is built) and train on
the same global batch with AdamW (lr 1e-3): autopar's modules take `module.local_batch(*batch)`
and return the global loss; PyTorch's rank r takes the r-th contiguous chunk of dim 0 (the same
tokens autopar's ep rank r holds) and returns its local loss. Its auxiliary losses are therefore
per-rank statistics (each rank's fraction of rows per expert and mean router probability), as in
torchtitan: its loss and gradients differ slightly from one device's (with both auxiliary
coefficients set to 0 its gradients matched one device's to ~3e-7 relative when this was
written), and the table shows the gap rather than claiming equality. autopar's rows compute the auxiliary losses over the global batch;
the script checks that the EP row's first-step loss equals the single-device loss of the same
global batch (relative 1e-5, computed in the launching process) and exits non-zero if it does not.

Measurement, as benchmarks/compare_fsdp.py (whose helpers this file imports):
- Step time: zero_grad, forward, backward, AdamW step; the four programs' steps alternate, a
  barrier before each, every rank timed, the slowest rank kept; median over the timed steps.
  Ratios are over PyTorch EP. With N=4 on a 2-core machine the ranks share cores: compare rows
  within one N, not across N.
- Peak memory: PyTorch's MemTracker, told about every tensor reachable from the program before a
  tracked step (`track_program`); read on the second step; the largest rank's peak. DDP's flat
  gradient bucket (the size of the non-expert gradients) is held in C++, out of the walk's
  reach, but it is allocated by an op during a tracked step, so it is counted; autopar's peak
  includes what `module.plan` holds (a note gives it when it is 1% of the peak or more).
- Communication: logical bytes per rank handed to the process groups on the first step, counted
  from outside by `autopar.measure.comm_counter.CommCounter` (all-to-all: each call's input, the
  row exchanges and the counts exchanges, forward and backward; all-reduce: input); the largest
  rank's. The all-to-all bytes depend on the routing of that step.

Run: python benchmarks/moe_expert_parallel.py [--quick] [--world 2,4] [--steps N] [--warmup N]
(`--help` lists the model flags).
"""
from __future__ import annotations

import argparse
import statistics
import warnings
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples`, `benchmarks` are not installed

import autopar  # noqa: E402
from autopar.measure.comm_counter import CommCounter  # noqa: E402
from autopar.runtime.launch import launch  # noqa: E402
from benchmarks.compare_fsdp import MEMORY_CATEGORIES, Program, memory_step, ratio, track_program  # noqa: E402
from benchmarks.compare_step_time import alternate_steps, as_float, batch_slice, median_step_ms, mib  # noqa: E402
from benchmarks.row_runs import failure_reason  # noqa: E402
from examples.gpt import example_batch  # noqa: E402
from examples.moe import Experts, MoEConfig, MoEGPT, grouped_mm  # noqa: E402

AUTOPAR_EP, AUTOPAR_EP_IN_ORDER, AUTOPAR_DP, PYTORCH_EP = ("autopar EP", "autopar EP, no overlap", "autopar DP",
                                                        "PyTorch EP")
ROWS = (AUTOPAR_EP, AUTOPAR_EP_IN_ORDER, AUTOPAR_DP, PYTORCH_EP)
LOSS_TOLERANCE = 1e-5
KIB = 2**10
# MemTracker's ModTracker loses its place in the module tree when a module runs twice per step
# (autopar's graphs, DDP's wrapper); it only affects per-module statistics, not the peak read here
warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")


@dataclass(frozen=True)
class Settings:
    model: MoEConfig
    batch: int
    warmup: int
    steps: int
    worlds: tuple[int, ...]
    lr: float = 1e-3


def build_model(settings: Settings) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(settings.model)


def adamw(params, settings: Settings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=settings.lr)


def expert_major_index(received: torch.Tensor) -> torch.Tensor:
    """Rows that arrived ordered (source rank, local expert), `received` [N, E/N] of them, as the
    gather index that orders them (local expert, source rank) (torchtitan's `_permute`)."""
    flat = received.reshape(-1)
    source_major_starts = (torch.cumsum(flat, 0) - flat).view_as(received).t().reshape(-1)
    counts = received.t().reshape(-1)
    expert_major_starts = torch.cumsum(counts, 0) - counts
    shift = torch.repeat_interleave(source_major_starts - expert_major_starts, counts)
    return torch.arange(int(counts.sum())) + shift


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel())
    return inverse


class ExpertParallelExperts(nn.Module):
    """This rank's experts of an `Experts` block and torchtitan's all-to-all token dispatcher around them."""

    def __init__(self, experts: Experts, *, rank: int, world: int) -> None:
        super().__init__()
        self.n_experts, self.world = experts.n_experts, world
        self.local_experts = experts.n_experts // world
        mine = slice(rank * self.local_experts, (rank + 1) * self.local_experts)
        self.gate_up = nn.Parameter(experts.gate_up.detach()[mine].clone())
        self.down = nn.Parameter(experts.down.detach()[mine].clone())
        self.rows_received = 0  # rows this rank's experts got in the last forward

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
        rows = x[perm // top_k]
        rows_per_expert = torch.bincount(expert_ids, minlength=self.n_experts)
        grouped, received, send, receive = self.dispatch(rows, rows_per_expert)
        out = self.local_swiglu(grouped, torch.cumsum(received.sum(0), 0, dtype=torch.int32))
        source_major = out[inverse_permutation(expert_major_index(received))]
        returned = all_to_all_single_autograd(source_major, send, receive, dist.group.WORLD)
        weighted = returned * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        return weighted[inverse_permutation(perm)].view(tokens, top_k, -1).sum(dim=1)

    def dispatch(self, rows: torch.Tensor, rows_per_expert: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """Counts all-to-all, rows all-to-all, regroup by local expert: (rows grouped by local
        expert, rows received [source rank, local expert], rows sent per rank, received per rank)."""
        received = torch.empty_like(rows_per_expert)
        dist.all_to_all_single(received, rows_per_expert)
        received = received.view(self.world, self.local_experts)
        send = rows_per_expert.view(self.world, self.local_experts).sum(1).tolist()
        receive = received.sum(1).tolist()
        self.rows_received = sum(receive)
        arrived = all_to_all_single_autograd(rows, receive, send, dist.group.WORLD)
        return arrived[expert_major_index(received)], received, send, receive

    def local_swiglu(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        gate, up = grouped_mm(rows, self.gate_up, offsets).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.down, offsets)


def pytorch_expert_parallel(settings: Settings, global_batch: tuple, rank: int, world: int) -> Program:
    """MoEGPT with each experts block replaced by this rank's `ExpertParallelExperts`, under DDP
    for everything else; expert gradients divided by N (module docstring)."""
    model = build_model(settings)
    for layer in model.layers:
        layer.moe.experts = ExpertParallelExperts(layer.moe.experts, rank=rank, world=world)
        for param in layer.moe.experts.parameters():
            param.register_hook(lambda grad: grad / world)
    expert_names = [name for name, _ in model.named_parameters() if ".moe.experts." in name]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    ddp = DistributedDataParallel(model)
    return Program(ddp, adamw(ddp.parameters(), settings), batch_slice(global_batch, index=rank, parts=world))


def autopar_program(settings: Settings, global_batch: tuple, mesh: str, *strategies: Any) -> Program:
    module = autopar.parallelize(build_model(settings), mesh, strategies=list(strategies), example_inputs=global_batch)
    return Program(module, adamw(module.parameters(), settings), module.local_batch(*global_batch))


def counted_first_step(program: Program) -> dict[str, Any]:
    """The first step under CommCounter and the program's MemTracker: loss, calls and bytes by kind,
    and the number of all-reduces under 1 KiB."""
    counter = CommCounter()
    track_program(program)
    with counter, program.tracker:
        loss = program.step()
    calls: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    for call in counter.calls:
        calls[call.kind] += 1
        nbytes[call.kind] += call.logical_bytes
    small_all_reduces = sum(1 for call in counter.calls if call.kind == "all_reduce" and call.logical_bytes < KIB)
    return {"losses": [as_float(loss)], "times": [], "calls": dict(calls), "bytes": dict(nbytes),
            "small_all_reduces": small_all_reduces}


def run_world(rank: int, world: int, settings: Settings) -> dict[str, Any]:
    """One rank: build the four programs, alternate their steps (step 0 counted, step 1 memory)."""
    global_batch = example_batch(settings.model, batch=settings.batch)
    programs = {AUTOPAR_EP: autopar_program(settings, global_batch, f"ep={world}", autopar.expert_parallel()),
                AUTOPAR_EP_IN_ORDER: autopar_program(settings, global_batch, f"ep={world}", autopar.expert_parallel(),
                                                     autopar.schedule(overlap=False)),
                AUTOPAR_DP: autopar_program(settings, global_batch, f"dp={world}", autopar.data_parallel()),
                PYTORCH_EP: pytorch_expert_parallel(settings, global_batch, rank, world)}
    results = {}
    for name, program in programs.items():
        dist.barrier()
        results[name] = counted_first_step(program)
    layers = programs[PYTORCH_EP].model.module.layers
    results["rows_received"] = [layer.moe.experts.rows_received for layer in layers]
    for name, program in programs.items():
        dist.barrier()
        loss, results[name]["memory"] = memory_step(program)
        results[name]["losses"].append(as_float(loss))
    alternate_steps({name: program.step for name, program in programs.items()}, results, first=2,
                    warmup=settings.warmup, timed=settings.steps)
    return results


def single_device_loss(settings: Settings) -> float:
    model = build_model(settings)
    with torch.no_grad():
        return float(model(*example_batch(settings.model, batch=settings.batch)))


def kib(nbytes: float) -> str:
    return f"{nbytes / KIB:.1f}"


def row_figures(name: str, ranks: list[dict[str, Any]]) -> dict[str, float]:
    """One program over every rank: slowest-rank median ms, largest peak and bytes, mean first loss."""
    sides = [rank[name] for rank in ranks]
    return {"ms": median_step_ms(sides),
            "peak": max(side["memory"]["peak"] for side in sides),
            "all_to_all": max(side["bytes"].get("all_to_all", 0) for side in sides),
            "all_reduce": max(side["bytes"].get("all_reduce", 0) for side in sides),
            "loss": statistics.fmean(side["losses"][0] for side in sides),
            "plan_state": max(side["memory"]["plan_state"] for side in sides)}


def summarize_world(world: int, ranks: list[dict[str, Any]], reference_loss: float
                    ) -> tuple[list[list[str]], list[list[str]], list[str], bool]:
    """Main-table rows, memory-detail rows (rank 0), notes, and whether the EP loss check passed."""
    figures = {name: row_figures(name, ranks) for name in ROWS}
    base = figures[PYTORCH_EP]
    table, notes = [], []
    for name in ROWS:
        row = figures[name]
        gap = abs(row["loss"] - reference_loss) / abs(reference_loss)
        table.append([name, str(world), f"{row['ms']:.0f}", ratio(row["ms"], base["ms"]), mib(row["peak"]),
                      ratio(row["peak"], base["peak"]), kib(row["all_to_all"]), kib(row["all_reduce"]),
                      f"{row['loss']:.6f}", f"{gap:.1e}"])
        if row["plan_state"] >= 0.01 * row["peak"]:
            notes.append(f"N={world} {name}: peak includes {mib(row['plan_state'])} MiB held by module.plan; "
                         f"without it {ratio(row['peak'] - row['plan_state'], base['peak'])} of PyTorch EP's")
    ep_gap = abs(figures[AUTOPAR_EP]["loss"] - reference_loss) / abs(reference_loss)
    passed = ep_gap <= LOSS_TOLERANCE
    notes.append(f"N={world}: autopar EP first-step loss vs one device: rel {ep_gap:.1e} "
                 f"({'ok' if passed else 'FAILED'}, tolerance {LOSS_TOLERANCE:.0e}); PyTorch EP's gap "
                 f"{abs(base['loss'] - reference_loss) / abs(reference_loss):.1e} (per-rank aux losses)")
    received = [sum(rank["rows_received"]) for rank in ranks]
    notes.append(f"N={world}: rows each rank's experts received in the first forward (all layers): {received}, "
                 f"max/mean {max(received) / statistics.fmean(received):.2f}")
    small = max(rank[AUTOPAR_EP]["small_all_reduces"] for rank in ranks)
    notes.append(f"N={world} autopar EP: {small} of its {ranks[0][AUTOPAR_EP]['calls'].get('all_reduce', 0)} "
                 f"all-reduces are under 1 KiB (the global statistics of the auxiliary losses, the loss mean): "
                 f"sync points PyTorch EP, whose aux losses are per-rank, does not have")
    details = [memory_detail(name, world, ranks[0][name]) for name in ROWS]
    return table, details, notes, passed


def memory_detail(name: str, world: int, side: dict[str, Any]) -> list[str]:
    """Rank 0's live MiB at rest, peak by MemTracker category, and first-step calls by kind."""
    memory = side["memory"]
    categories = [mib(memory["categories"].get(category, 0)) for category in MEMORY_CATEGORIES]
    calls = ", ".join(f"{kind} {count}" for kind, count in sorted(side["calls"].items()))
    return [name, str(world), mib(memory["at_rest"]), mib(memory["peak"]), *categories, calls]


def print_report(summaries: list[tuple], settings: Settings) -> None:
    model = settings.model
    print(f"\nexample MoE: {model.n_layer} layers, d_model {model.d_model}, {model.n_head} heads, "
          f"{model.n_experts} experts (top-{model.top_k}, d_expert {model.d_expert}), seq {model.seq_len}, vocab "
          f"{model.vocab_size}; global batch {settings.batch}; gloo ranks x 1 thread; median of {settings.steps} "
          f"steps after {settings.warmup} warm-up; ratios over PyTorch EP\n")
    headers = ["row", "N", "step ms", "ratio", "peak MiB", "ratio", "all-to-all KiB", "all-reduce KiB",
               "loss (1st step)", "gap vs 1 device"]
    print(tabulate([row for summary in summaries for row in summary[0]], headers=headers, tablefmt="simple",
                   disable_numparse=True))
    print("\nRank 0: memory step (MiB; peak by MemTracker category at the peak), collective calls of the first step\n")
    print(tabulate([row for summary in summaries for row in summary[1]],
                   headers=["row", "N", "at rest", "peak", *MEMORY_CATEGORIES, "calls"], tablefmt="simple",
                   disable_numparse=True))
    notes = [note for summary in summaries for note in summary[2]]
    print("\nNotes:\n" + "\n".join(f"- {note}" for note in notes))


QUICK_DEFAULTS = {"layers": 2, "d_model": 32, "heads": 4, "experts": 4, "d_expert": 32, "seq_len": 16, "vocab": 128,
                  "batch": 8, "steps": 3, "warmup": 2}


def parse_settings(argv: list[str] | None = None) -> tuple[Settings, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"defaults for a smoke run: {QUICK_DEFAULTS}")
    parser.add_argument("--world", default="2,4", help="comma-separated world sizes (each divides experts, batch)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--d-expert", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps (>= 2; the first is counted, the second measures memory)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck world is abandoned")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK_DEFAULTS)  # flags given explicitly still win
    args = parser.parse_args(argv)
    worlds = tuple(int(size) for size in args.world.split(",") if size)
    for world in worlds:
        if args.experts % world or args.batch % world:
            parser.error(f"world {world} must divide --experts {args.experts} and --batch {args.batch}")
    model = MoEConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                      d_model=args.d_model, n_experts=args.experts, top_k=args.top_k, d_expert=args.d_expert)
    settings = Settings(model=model, batch=args.batch, warmup=max(args.warmup, 2), steps=args.steps, worlds=worlds)
    return settings, args.timeout


def main() -> None:
    settings, timeout_s = parse_settings()
    reference_loss = single_device_loss(settings)
    summaries, failures = [], []
    for world in settings.worlds:
        start = time.perf_counter()
        try:
            ranks = launch(run_world, world, settings, timeout_s=timeout_s)
        except RuntimeError as error:
            failures.append(f"N={world}: failed: {failure_reason(str(error))}")
            print(failures[-1], flush=True)
            continue
        summaries.append(summarize_world(world, ranks, reference_loss))
        if not summaries[-1][3]:
            failures.append(f"N={world}: autopar EP's first-step loss differs from one device's")
        print(f"N={world}: done in {time.perf_counter() - start:.0f} s", flush=True)
    print_report(summaries, settings)
    if failures:
        sys.exit("\n".join(failures))


if __name__ == "__main__":
    main()
