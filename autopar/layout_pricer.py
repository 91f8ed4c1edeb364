"""The composed search's pricing: candidates priced from per-layout block ledgers, each layout
measured once.

`BlockPricer(model, cluster, example_inputs)` is the `price` of `planner.search(method="blocks")`:
a candidate's in-node `Layout` (tp, cp, ep, sp, recompute) is measured the first time a
candidate needs it (`block_ledgers.measure_layout`: two small plans, sharing the search's
traces) and every candidate sharing it is composed from those ledgers
(`composed_cost.composed_estimate`, ~1 ms). A layout the compiler refuses (or PyTorch fails on)
refuses every candidate that needs it, with the message. `price_composed` prices one given
candidate the same way (a published configuration the search's rules would not enumerate).
Measuring layouts in forked worker processes was tried: 8 layouts of the 8B shape took 6.2 s on
two workers against 7.7 s in one process (the workers' copy-on-write faults on the inherited
heap eat most of the second core), not worth a process pool.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from autopar.block_ledgers import BlockLedgers, Layout, measure_layout
from autopar.cluster import Cluster
from autopar.composed_cost import composed_estimate
from autopar.context import sharing_sharding_decisions
from autopar.errors import PlanError
from autopar.search_space import Candidate
from autopar.trace import reusing_traces


def input_dim(example_inputs: Sequence[Any], example_kwargs: dict | None, dim: int) -> int | None:
    """The size of dimension `dim` of the first tensor input that has it (0: the batch, 1: the
    sequence of token inputs); None without one."""
    for value in list(example_inputs) + list((example_kwargs or {}).values()):
        if isinstance(value, torch.Tensor) and value.dim() > dim:
            return int(value.shape[dim])
    return None


def global_batch(example_inputs: Sequence[Any], example_kwargs: dict | None = None) -> int:
    """The batch: the first dimension of the first tensor input."""
    batch = input_dim(example_inputs, example_kwargs, 0)
    if batch is None:
        raise PlanError("the planner needs a tensor input whose first dimension is the batch")
    return batch


def layout_of(candidate: Candidate) -> Layout:
    return Layout(tp=candidate.degree("tp"), cp=candidate.degree("cp"), ep=candidate.degree("ep"),
                  sequence_parallel=candidate.sequence_parallel, recompute=candidate.recompute)


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class BlockPricer:
    def __init__(self, model: torch.nn.Module, cluster: Cluster, example_inputs: Sequence[Any],
                 example_kwargs: dict | None = None) -> None:
        self.model, self.cluster, self.args, self.kwargs = model, cluster, example_inputs, example_kwargs
        self.batch = global_batch(example_inputs, example_kwargs)
        self.layouts: dict[Layout, "BlockLedgers | str"] = {}
        self.decisions: dict = {}  # DTensor's sharding decisions, shared by every layout's plans

    def measure(self, layout: Layout) -> "BlockLedgers | str":
        try:
            with sharing_sharding_decisions(self.decisions):
                return measure_layout(self.model, layout, example_inputs=self.args, example_kwargs=self.kwargs)
        except PlanError as error:
            return first_line(error)
        except RuntimeError as error:  # PyTorch failing on the layout's shapes (a view past 2^31 elements
            # on the meta device): that layout is out, the search goes on
            return f"{type(error).__name__} while planning {layout.mesh_spec}: {first_line(error)}"

    def ledgers(self, layout: Layout) -> "BlockLedgers | str":
        if layout not in self.layouts:
            self.layouts[layout] = self.measure(layout)
        return self.layouts[layout]

    def _splits(self, candidate: Candidate) -> str | None:
        split = candidate.degree("dp") * candidate.degree("ep") * (candidate.microbatches or 1)
        if self.batch % split:
            return f"the batch of {self.batch} does not split into dp × ep × micro-batches = {split}"
        return None

    def __call__(self, candidate: Candidate) -> Any:
        from autopar.planner import Outcome

        start = time.perf_counter()
        refused = self._splits(candidate)
        ledgers = self.ledgers(layout_of(candidate)) if refused is None else refused
        if isinstance(ledgers, str):
            return Outcome(candidate, refused=ledgers, seconds=time.perf_counter() - start)
        return Outcome(candidate, composed_estimate(ledgers, candidate, self.cluster, global_batch=self.batch),
                       seconds=time.perf_counter() - start)


def price_composed(model: torch.nn.Module, cluster: Cluster, candidate: Candidate, *, example_inputs: Sequence[Any],
                   example_kwargs: dict | None = None) -> Any:
    """One candidate priced as the composed search prices it, whether or not the search's rules
    would enumerate it (a published configuration that puts expert parallelism across nodes)."""
    with reusing_traces():
        return BlockPricer(model, cluster, example_inputs, example_kwargs)(candidate)
