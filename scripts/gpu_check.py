"""GPU check (issue 46), part (a): the example GPT, the example MoE and a small Hugging Face Llama
trained at world 1 under each strategy at degree 1, eager and compiled, against the plain model on
the same device (parts (b) to (d): `scripts/gpu_figures.py`).

Run by `scripts/gpu_check.sh` under `torchrun --standalone --nproc-per-node=1`, which makes the
process group NCCL on the rank's GPU (`autopar.runtime.launch.init_from_env`). `--cpu` runs the
same cases over gloo on the CPU (a check of this script where there is no GPU). A case passes
when every step's loss and the final parameters equal the plain model's (fp32, relative error at
most 1e-5, TF32 off); it prints one line per case and exits 1 if any case fails.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar.runtime.launch import init_from_env  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402
from examples.hf_models import tiny_llama, token_batch  # noqa: E402
from examples.moe import MoEConfig, MoEGPT  # noqa: E402

TOLERANCE = 1e-5
EAGER_ONLY = {"ep"}  # compile=True refuses a mixture-of-experts block (its routed counts change every step)
STEPS = 3
GPT_CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
MOE_CONFIG = MoEConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, n_experts=4, top_k=2, d_expert=32)


def cases() -> dict[str, tuple]:
    """name -> (config, mesh, strategies), every strategy at degree 1; config "llama": Hugging
    Face's LlamaForCausalLM at small sizes (`examples/hf_models.tiny_llama`)."""
    return {
        "dp": (GPT_CONFIG, "dp=1", [autopar.data_parallel()]),
        "zero1": (GPT_CONFIG, "dp=1", [autopar.zero(stage=1)]),
        "fsdp": (GPT_CONFIG, "dp=1", [autopar.fsdp()]),
        "tp": (GPT_CONFIG, "tp=1", [autopar.tensor_parallel()]),
        "tp_sp": (GPT_CONFIG, "tp=1", [autopar.sequence_parallel()]),
        "cp_ring": (GPT_CONFIG, "cp=1", [autopar.context_parallel()]),
        "cp_alltoall": (GPT_CONFIG, "cp=1", [autopar.context_parallel(method="alltoall")]),
        "pp": (GPT_CONFIG, "pp=1", [autopar.pipeline_parallel(microbatches=2)]),
        "ep": (MOE_CONFIG, "ep=1", [autopar.expert_parallel()]),
        "llama_fsdp": ("llama", "dp=1", [autopar.fsdp()]),
        "llama_tp_sp": ("llama", "tp=1", [autopar.sequence_parallel()]),
        "llama_cp_ring": ("llama", "cp=1", [autopar.context_parallel()]),
    }


def _model(config: GPTConfig | str) -> torch.nn.Module:
    torch.manual_seed(0)
    if config == "llama":
        return tiny_llama()
    return MoEGPT(config) if isinstance(config, MoEConfig) else GPT(config)


def _batches(config: GPTConfig | str) -> list:
    if config == "llama":
        return [token_batch(batch=4, seq=16, seed=step) for step in range(STEPS)]
    return [example_batch(config, batch=4, seed=step) for step in range(STEPS)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _train_plain(model: torch.nn.Module, batches: list, device: torch.device) -> list[float]:
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens, targets in batches:
        loss = model(tokens.to(device), targets.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_case(name: str, config: GPTConfig, mesh: str, strategies: list, compiled: bool,
             device: torch.device) -> str:
    """One case; returns the failure ("" when it passed)."""
    batches = _batches(config)
    reference = _model(config)
    model = copy.deepcopy(reference)
    module = autopar.parallelize(model, mesh, strategies=strategies, example_inputs=batches[0], compile=compiled)
    placed = {p.device for p in module.parameters()}
    if placed != {device}:
        return f"parameters on {placed}, not on {device}"
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for tokens, targets in batches:
        loss = module.train_step(*module.local_batch(tokens.to(device), targets.to(device)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    expected = _train_plain(reference, batches, device)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    if worst > TOLERANCE:
        return f"losses {losses} != plain model's {expected}"
    full, plain = module.full_state_dict(), reference.state_dict()
    bad = [key for key in plain if _relative(full[key], plain[key]) > TOLERANCE]
    return f"parameters differ from the plain model's: {bad[:5]}" if bad else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (a check of this script)")
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = init_from_env(backend="gloo" if args.cpu else None)
    print(f"rank device {device}, backend {dist.get_backend()}", flush=True)
    failures = 0
    for name, (config, mesh, strategies) in cases().items():
        if args.only and name not in args.only:
            continue
        for compiled in (False, True) if name not in EAGER_ONLY else (False,):
            label = f"{name} {'compiled' if compiled else 'eager'}"
            try:
                problem = run_case(name, config, mesh, strategies, compiled, device)
            except Exception:  # a case that raises is reported and the others still run
                problem = traceback.format_exc()
            failures += bool(problem)
            print(f"{'FAIL' if problem else 'ok  '} {label}{': ' + problem if problem else ''}", flush=True)
    dist.destroy_process_group()
    print(f"{failures} case(s) failed" if failures else "every case equals the plain model", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
