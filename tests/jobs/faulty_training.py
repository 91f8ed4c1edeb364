"""A torchrun job for tests/test_faults.py: the example GPT under dp=2, where rank 1 fails at
step 1 the way FAULT says: "raise" (an exception), "kill" (SIGKILL to itself, mid-step, after its
forward) or "stall" (sleeps forever inside the step). Every rank writes a line per step to stdout.

    torchrun --nproc-per-node=2 tests/jobs/faulty_training.py raise|kill|stall TIMEOUT_S
"""
from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.launch import init_from_env  # noqa: E402
from examples.gpt import GPT, GPTConfig, example_batch  # noqa: E402


def main() -> None:
    fault, timeout_s = sys.argv[1], float(sys.argv[2])
    init_from_env(timeout_s=timeout_s)
    rank = torch.distributed.get_rank()
    config = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
    torch.manual_seed(0)
    batch = example_batch(config, batch=8)
    module = autopar.parallelize(GPT(config), "dp=2", strategies=[autopar.data_parallel()], example_inputs=batch)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for step in range(3):
        optimizer.zero_grad()
        loss = module(*module.local_batch(*batch))
        if rank == 1 and step == 1:
            print(f"rank 1: failing ({fault}) in step 1 after its forward", flush=True)
            if fault == "raise":
                raise RuntimeError("rank 1 broke in step 1")
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        loss.backward()  # the gradient all-reduce waits for every rank
        optimizer.step()
        print(f"rank {rank}: step {step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
