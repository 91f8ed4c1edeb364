"""Installed-package smoke test, part 3: a 2-rank job under torchrun, as a user writes one: their
own process group, `autopar.parallelize`, an optimizer over the module's parameters, three steps;
every rank checks its losses against the same model trained on one device (fp32, rel <= 1e-5).

    torchrun --standalone --nproc-per-node=2 train_job.py
"""
import copy

import torch
import torch.distributed as dist

import autopar
from examples.gpt import GPT, GPTConfig, example_batch

dist.init_process_group("gloo")
torch.manual_seed(0)
config = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=2, d_model=32, d_ff=64)
model = GPT(config)
reference = copy.deepcopy(model)
batches = [example_batch(config, batch=4, seed=step) for step in range(3)]
module = autopar.parallelize(model, "dp=2", strategies=[autopar.data_parallel()], example_inputs=batches[0])
optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
for step, batch in enumerate(batches):
    loss = module(*module.local_batch(*batch))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    expected = reference(*batch)
    expected.backward()
    reference_optimizer.step()
    reference_optimizer.zero_grad()
    error = abs(loss.item() - expected.item()) / abs(expected.item())
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.6f}, one device {expected.item():.6f}, rel {error:.1e}")
    assert error <= 1e-5, f"rank {dist.get_rank()} step {step}: loss {loss.item()} against {expected.item()}"
assert "site-packages" in autopar.__file__, f"autopar imported from {autopar.__file__}, not the installed package"
dist.destroy_process_group()
