"""The main job: train the example GPT with dp=2 x tp=2 (+ sequence parallel) on 4 CPU processes
and show, step by step, that the loss equals the single-device run.

    python examples/train_gpt.py                      # starts 4 gloo processes itself
    torchrun --nproc-per-node=4 examples/train_gpt.py # or under torchrun
    python examples/train_gpt.py --mesh tp=4 --no-sp --steps 3
    python examples/train_gpt.py --zero 3              # FSDP on dp (ZeRO-3) with SP on tp
    python examples/train_gpt.py --mesh pp=2,dp=2 --schedule 1f1b --microbatches 4 --timeline step.svg

Rank 0 prints the plan (parameter placements, passes, communication ledger), then a table of
losses: autopar, single device, relative error. Exits non-zero if any step differs by more than
1e-5 (fp32).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.runtime.launch import init_from_env, launch  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64, d_ff=256)
PIPELINE_CONFIG = GPTConfig(vocab_size=256, seq_len=32, n_layer=8, n_head=4, d_model=64, d_ff=256)
TOLERANCE = 1e-5


def config_for(mesh_text: str) -> GPTConfig:
    return PIPELINE_CONFIG if "pp" in autopar.Mesh.parse(mesh_text).names else CONFIG


def strategies(mesh: autopar.Mesh, sequence_parallel: bool, zero_stage: int = 0, pipeline: dict | None = None) -> list:
    data = autopar.zero(stage=zero_stage) if zero_stage else autopar.data_parallel()
    chosen = [data] if "dp" in mesh.names else []
    if "tp" in mesh.names:
        chosen.append(autopar.sequence_parallel() if sequence_parallel else autopar.tensor_parallel())
    if "pp" in mesh.names:
        chosen.append(autopar.pipeline_parallel(**(pipeline or {})))
    return chosen


def batches(steps: int, config: GPTConfig = CONFIG) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [example_batch(config, batch=8, seed=step) for step in range(steps)]


def train_single_device(steps: int, config: GPTConfig = CONFIG) -> list[float]:
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches(steps, config):
        optimizer.zero_grad()
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_rank(rank: int, world_size: int, mesh_text: str, sequence_parallel: bool, steps: int,
               zero_stage: int = 0, pipeline: dict | None = None, timeline: str | None = None) -> list[float]:
    mesh = autopar.Mesh.parse(mesh_text)
    config = config_for(mesh_text)
    torch.manual_seed(0)
    model = GPT(config)
    data = batches(steps, config)
    module = autopar.parallelize(model, mesh, strategies=strategies(mesh, sequence_parallel, zero_stage, pipeline),
                                 example_inputs=data[0])
    if rank == 0:
        print(module.plan.report(activations=False), flush=True)
    print_plan_timing(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    device = next(module.parameters()).device  # the rank's (an accelerator under torchrun on GPUs)
    losses = []
    for batch in data:
        optimizer.zero_grad()
        losses.append(module.train_step(*(t.to(device) for t in module.local_batch(*batch))).item())
        optimizer.step()
    if timeline and module.pipeline is not None:
        write_timeline(module, timeline)
    return losses


def print_plan_timing(module: autopar.ParallelModule) -> None:
    """Rank 0 planned, the others received its plan (autopar/artifacts/plan_once.py): each rank's own work
    against rank 0's planning (benchmarks/plan_once.py measures it at length)."""
    timings: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(timings, module.plan_timing)
    if torch.distributed.get_rank() != 0:
        return
    planning = timings[0]
    rows = [[rank, t.source, f"{t.seconds * 1000:.0f}", f"{t.cpu_seconds * 1000:.0f}", f"{t.waited * 1000:.0f}",
             f"{t.seconds / planning.seconds:.1%}"] for rank, t in enumerate(timings)]
    print("\nplan once\n" + tabulate(rows, headers=["rank", "plan from", "own work ms", "own CPU ms", "waited ms",
                                                    "wall / rank 0"]) + "\n", flush=True)


def write_timeline(module: autopar.ParallelModule, path: str) -> None:
    """The last step's measured timeline beside the bubble ledger's prediction (rank 0 writes it)."""
    from autopar.compiler.ledger.bubble import build_bubble_ledger, measured_timeline, waited_seconds
    from autopar.tools.views.timeline import render_timeline

    timelines = module.pipeline.gather_timeline()
    if module.rank == 0:
        with open(path, "w") as handle:
            handle.write(render_timeline(predicted=build_bubble_ledger(module.plan, cores=os.cpu_count()).timeline,
                                         measured=measured_timeline(timelines), waited=waited_seconds(timelines),
                                         title=module.plan.pipeline.schedule))
        print(f"timeline of the last step written to {path}", flush=True)


def report(distributed: list[float], single: list[float]) -> bool:
    rows = [[step, f"{a:.7f}", f"{b:.7f}", f"{abs(a - b) / abs(b):.2e}"] for step, (a, b) in
            enumerate(zip(distributed, single))]
    print("\n" + tabulate(rows, headers=["step", "autopar loss", "single-device loss", "rel. error"]))
    ok = all(abs(a - b) <= TOLERANCE * abs(b) for a, b in zip(distributed, single))
    print("\nloss equals the single-device run at every step" if ok else "\nMISMATCH with the single-device run")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="dp=2,tp=2")
    parser.add_argument("--no-sp", action="store_true", help="plain tensor parallelism, no sequence parallelism")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                        help="ZeRO stage on the dp axis (0: plain data parallelism)")
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule on a pp axis")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches per step")
    parser.add_argument("--virtual-stages", type=int, default=1, help="pipeline stages per rank (interleaved)")
    parser.add_argument("--timeline", help="pipeline: write the last step's timeline (SVG) here")
    args = parser.parse_args()
    sequence_parallel = not args.no_sp
    pipeline = {"schedule": args.schedule, "microbatches": args.microbatches, "virtual_stages": args.virtual_stages}
    config = config_for(args.mesh)
    if "RANK" in os.environ:  # under torchrun
        init_from_env()
        losses = train_rank(torch.distributed.get_rank(), torch.distributed.get_world_size(), args.mesh,
                            sequence_parallel, args.steps, args.zero, pipeline, args.timeline)
        ok = report(losses, train_single_device(args.steps, config)) if torch.distributed.get_rank() == 0 else True
        torch.distributed.destroy_process_group()
        return 0 if ok else 1
    world = autopar.Mesh.parse(args.mesh).world_size
    print(f"starting {world} CPU processes (gloo) for mesh {args.mesh}", flush=True)
    results = launch(train_rank, world, args.mesh, sequence_parallel, args.steps, args.zero, pipeline, args.timeline,
                     timeout_s=300)
    return 0 if report(results[0], train_single_device(args.steps, config)) else 1


if __name__ == "__main__":
    sys.exit(main())
