"""GPU check, parts (b) to (d) of issue 46, on the rank's device at world 1 (run by `scripts/gpu_check.sh`).

- kernels: ring attention's blockwise computation (`autopar/core/ops/context_attention.py`, one
  rank holding two chunks of a balanced layout, so blocks are merged by log-sum-exp) with the
  device's block kernel (`attention_blocks.block_kernel`) against `scaled_dot_product_attention` on
  the whole sequence, output and dQ, dK, dV, in bf16 and fp32, causal and not.
- timing: one step of the example GPT (bf16) planned at dp=1 and compiled (`compile=True`) against
  `torch.compile` of the plain model, side by side in one run: ms per step, the ratio, and each
  one's model FLOP utilisation against the preset's peak.
- calibration: bf16 matmul TFLOP/s and copy bandwidth measured here, beside the preset's figures
  (`Cluster.preset(NAME)`, default h100x1).

`--cpu` runs the same code over gloo on the CPU at small sizes (a check of this script, not of a GPU).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar.core.ops.attention_blocks import block_kernel  # noqa: E402
from autopar.core.ops.context_attention import context_attention  # noqa: E402
from autopar.core.sequence_chunks import BALANCED  # noqa: E402
from autopar.cost.cluster import Cluster  # noqa: E402
from autopar.runtime.launch import init_from_env  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402

BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # bf16: 8 mantissa bits, two orders of summation


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def check_kernels(device: torch.device, small: bool) -> int:
    """Blockwise ring attention (one rank, two chunks) against SDPA; returns the number of failures."""
    shape = (2, 4, 64, 16) if small else (2, 8, 2048, 128)
    failures = 0
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (True, False):
            torch.manual_seed(0)
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            dout = torch.randn(shape, device=device, dtype=dtype)
            out = context_attention(q, k, v, is_causal=causal, group=dist.group.WORLD.group_name, size=1, index=0,
                                    method="ring", layout=BALANCED)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
            worst = max(_relative(a, b) for a, b in zip((out, *grads), (expected, *expected_grads)))
            kernel = block_kernel(q, k, v).forward.__name__.strip("_").replace("_forward", "")
            ok = worst <= BOUNDS[dtype]
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} ring blocks ({kernel} kernel) {str(dtype)[6:]} "
                  f"{'causal' if causal else 'full'}: worst rel err {worst:.2e} (bound {BOUNDS[dtype]:.0e})", flush=True)
    return failures


def _step_ms(step, device: torch.device, repeats: int) -> float:
    for _ in range(3):
        step()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def time_compiled(device: torch.device, small: bool, preset: Cluster) -> None:
    """The compiled world-1 rank graph against torch.compile of the plain model (ms per step, ratio, MFU)."""
    config = (GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64, d_ff=256) if small else
              GPTConfig(vocab_size=32768, seq_len=2048, n_layer=12, n_head=16, d_model=1024, d_ff=4096))
    batch = 2 if small else 8
    tokens, targets = (t.to(device) for t in example_batch(config, batch=batch, seed=0))
    torch.manual_seed(0)
    plain = GPT(config).to(device=device, dtype=torch.bfloat16)
    module = autopar.parallelize(copy.deepcopy(plain), "dp=1", strategies=[autopar.data_parallel()],
                                 example_inputs=(tokens, targets), compile=True)
    compiled_plain = torch.compile(plain)

    def plain_step():
        compiled_plain(tokens, targets).backward()

    def autopar_step():
        module.train_step(*module.local_batch(tokens, targets))

    repeats = 3 if small else 20
    theirs, ours = _step_ms(plain_step, device, repeats), _step_ms(autopar_step, device, repeats)
    parameters = sum(p.numel() for p in plain.parameters())
    flops = 6 * parameters * batch * config.seq_len  # forward and backward of every weight, per token
    peak = preset.peak_tflops * 1e12
    print(f"step: torch.compile(plain) {theirs:.2f} ms (MFU {flops / (theirs / 1e3) / peak:.1%}), "
          f"autopar dp=1 compiled {ours:.2f} ms (MFU {flops / (ours / 1e3) / peak:.1%}); "
          f"ratio {ours / theirs:.3f} (goal <= 1.05); MFU against {preset.name}'s {preset.peak_tflops:.0f} TFLOP/s",
          flush=True)


def calibrate(device: torch.device, small: bool, preset: Cluster) -> None:
    """bf16 matmul TFLOP/s and copy GB/s here, beside the preset's figures."""
    n = 512 if small else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = _step_ms(lambda: a @ b, device, 5 if small else 50)
    source = torch.empty(2 ** (24 if small else 30), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_ms = _step_ms(lambda: target.copy_(source), device, 5 if small else 50)
    tflops = 2 * n ** 3 / (matmul_ms / 1e3) / 1e12
    gbps = 2 * source.numel() / (copy_ms / 1e3) / 1e9  # read + write
    print(f"calibration on {device}: bf16 matmul {tflops:.1f} TFLOP/s (preset {preset.name}: "
          f"{preset.peak_tflops:.1f}), copy {gbps:.0f} GB/s read+write (preset: {preset.memory_gbps:.0f})", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU at small sizes (a check of this script)")
    parser.add_argument("--preset", default="h100x1", help="the cluster preset to compare with (default h100x1)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    device = init_from_env(backend="gloo" if args.cpu else None)
    preset = Cluster.preset(args.preset)
    failures = check_kernels(device, args.cpu)
    time_compiled(device, args.cpu, preset)
    calibrate(device, args.cpu, preset)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
