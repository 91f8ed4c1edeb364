"""Installed-package smoke test, part 2: the planner's composed search on a 405B-shaped model for
8,192 GPUs (far more than 16 ranks: the search composes one block's ledgers), run from a user's
directory with autopar installed as a package. Exits non-zero if no layout is chosen."""
import time

import autopar
from examples import scale

model, batch = scale.llama3_405b()
cluster = autopar.Cluster.preset("h100x1024")
start = time.perf_counter()
result = autopar.search(model, cluster, example_inputs=batch, method="blocks")
best = result.best
print(f"405B shape on {cluster.label} ({cluster.world_size} GPUs): searched {len(result.outcomes)} candidates in "
      f"{time.perf_counter() - start:.1f} s; chosen {best.candidate.label}, {best.estimate.seconds:.2f} s a step, "
      f"peak {best.estimate.peak_bytes / 1e9:.1f} GB")
assert best.fits, "the chosen layout does not fit"
assert autopar.__file__.find("site-packages") >= 0, f"autopar imported from {autopar.__file__}, not the installed package"
