"""The composed search's pricing: candidates priced from per-layout block ledgers, each layout
measured once.

`BlockPricer(model, cluster, example_inputs)` is the `price` of `planner.search(method="blocks")`:
a candidate's in-node `Layout` (tp, cp, ep, sp, recompute) is measured the first time a
candidate needs it (`block_ledgers.measure_layout`: one small plan and its fake run, sharing the
search's traces) and every candidate sharing it is composed from those ledgers
(`composed_cost.composed_estimate`, ~1 ms). A layout the compiler refuses (or PyTorch fails on)
refuses every candidate that needs it, with the message. `price_composed` prices one given
candidate the same way (a published configuration the search's rules would not enumerate).
`prefetch(candidates, recompute=)` measures every layout of the search's first pass at once,
split between this process and a forked copy (`autopar/layout_workers.py`), and while the copy
works the recomputation variants the second pass will likely ask for (composing this process's
share to find them; those estimates are kept). A pool of workers measuring a few layouts each was
tried before and gained 1.24× on 8 layouts; one fork after the export, with the heap warm,
gains 1.5× on 27.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Iterable, Sequence

import torch

from autopar.block_ledgers import BlockLedgers, Layout, measure_layout, traced_blocks
from autopar.cluster import Cluster
from autopar.composed_cost import composed_estimate
from autopar.context import sharing_sharding_decisions
from autopar.errors import PlanError
from autopar.layout_workers import measured
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
        self.estimates: dict = {}  # candidate -> its composed estimate

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

    def prefetch(self, candidates: Iterable[Candidate], *, recompute: Sequence[str] = ()) -> None:
        """Measure every layout these candidates need that is not measured yet, on two processes
        where that is safe (`layout_workers.measured`); while the second works, the first measures
        its layouts' variants with each `recompute` policy (what the search asks for next where a
        layout does not fit)."""
        chosen = [c for c in candidates if self._splits(c) is None]
        wanted = [layout_of(c) for c in chosen]

        def variants(measured_here: dict) -> list[Layout]:
            """The recomputation variants the search's second pass will likely ask for: of the
            layouts measured here, those with candidates that do not fit yet are faster than
            every one that fits, fastest first (their estimates kept for the first pass)."""
            priced = [(c, self._estimate(c, measured_here[layout_of(c)])) for c in chosen
                      if not isinstance(measured_here.get(layout_of(c), ""), str)]
            bound = min((e.seconds for _, e in priced if e.fits), default=float("inf"))
            unfit = sorted(((e.seconds, c) for c, e in priced if not e.fits and e.seconds < bound), key=lambda x: x[0])
            return [replace(layout_of(c), recompute=policy) for _, c in unfit for policy in recompute
                    if c.recompute is None]

        def export() -> None:  # once, before the fork: both processes plan copies of this trace
            try:
                traced_blocks(self.model, wanted[0], example_inputs=self.args, example_kwargs=self.kwargs)
            except (PlanError, RuntimeError):  # each layout's measurement meets it and says so
                pass

        self.layouts.update(measured(self.measure, [layout for layout in wanted if layout not in self.layouts],
                                     variants=variants if recompute else None, warm=export if wanted else None))

    def _estimate(self, candidate: Candidate, ledgers: BlockLedgers) -> Any:
        if candidate not in self.estimates:
            self.estimates[candidate] = composed_estimate(ledgers, candidate, self.cluster, global_batch=self.batch)
        return self.estimates[candidate]

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
        return Outcome(candidate, self._estimate(candidate, ledgers), seconds=time.perf_counter() - start)


def price_composed(model: torch.nn.Module, cluster: Cluster, candidate: Candidate, *, example_inputs: Sequence[Any],
                   example_kwargs: dict | None = None) -> Any:
    """One candidate priced as the composed search prices it, whether or not the search's rules
    would enumerate it (a published configuration that puts expert parallelism across nodes)."""
    with reusing_traces():
        return BlockPricer(model, cluster, example_inputs, example_kwargs)(candidate)
