"""Installed-package smoke test, part 2: the planner's composed search on a 405B-shaped model for
8,192 GPUs (far more than 16 ranks: the search composes one block's ledgers), run from a user's
directory with autopar installed as a package. The model is the user's own GPT (a copy of
examples/gpt.py) at Llama 3.1 405B's width, depth, heads, vocabulary and parameters per block
(transformers is not installed here; `examples/scale.py` builds the real one). Exits non-zero if
no layout is chosen."""
import time

import torch

import autopar
from examples.gpt import GPT, GPTConfig

# d 16384, 126 blocks, 128 heads, vocabulary 128,256; an MLP of 64,512 gives the block the
# parameters of Llama's grouped-query attention with a SwiGLU of 53,248
config = GPTConfig(vocab_size=128256, seq_len=8192, n_layer=126, n_head=128, d_model=16384, d_ff=64512)
with torch.device("meta"):
    model = GPT(config).to(torch.bfloat16)
ids = torch.empty(2048, 8192, dtype=torch.long, device="meta")
cluster = autopar.Cluster.preset("h100x1024")
start = time.perf_counter()
result = autopar.search(model, cluster, example_inputs=(ids, ids), method="blocks")
best = result.best
print(f"405B shape on {cluster.label} ({cluster.world_size} GPUs): searched {len(result.outcomes)} candidates in "
      f"{time.perf_counter() - start:.1f} s; chosen {best.candidate.label}, {best.estimate.seconds:.2f} s a step, "
      f"peak {best.estimate.peak_bytes / 1e9:.1f} GB")
assert best.fits, "the chosen layout does not fit"
assert autopar.__file__.find("site-packages") >= 0, f"autopar imported from {autopar.__file__}, not the installed package"
