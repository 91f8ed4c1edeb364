"""The composed search's pricing: candidates priced from per-layout block ledgers, each layout
measured once.

`BlockPricer(model, cluster, example_inputs)` is the `price` of `planner.search(method="blocks")`:
a candidate's in-node `Layout` (tp, cp, ep, sp, recompute) is measured the first time a
candidate needs it (`block_ledgers.measure_layout`: one small plan and its fake run, sharing the
search's traces) and every candidate sharing it is composed from those ledgers
(`composed_cost.composed_estimate`, ~1 ms). A layout the compiler refuses (or PyTorch fails on)
refuses every candidate that needs it, with the message. `price_composed` prices one given
candidate the same way (a published configuration the search's rules would not enumerate).
`prefetch(candidates, ladder=)` measures every layout of the search's first pass at once and
composes its candidates, split between this process and a forked copy
(`autopar/planner/layout_workers.py`; each process composes the candidates of the layouts it measured,
the copy's estimates come back with its ledgers), and while the copy works the recomputation
variants the second pass will ask for: the second pass simulated on this process's own
estimates (unfit candidates fastest first, each policy until one fits, while faster than the
best that fits so far). `cannot_fit(variant)` says, without measuring it, when a selective
variant cannot fit: the layout without recomputation with every byte its attention cores saved
freed (`Part.core_activation_bytes`) still peaks above a rank's memory. A pool of workers
measuring a few layouts each was tried before and gained 1.24× on 8 layouts; one fork after the
export, with the heap warm, gains 1.5× on 27.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from autopar.compiler.context import sharing_sharding_decisions
from autopar.compiler.trace import reusing_traces
from autopar.core.errors import PlanError
from autopar.core.schedules import SPLIT_BACKWARD
from autopar.cost.cluster import GB, Cluster
from autopar.planner.block_ledgers import BlockLedgers, Layout, check_blocks_alike, measure_layout, traced_blocks
from autopar.planner.composed_cost import composed_estimate
from autopar.planner.layout_workers import measured
from autopar.planner.routing_skew import skewed
from autopar.planner.search_space import Candidate, Outcome, Pruned


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
                  sequence_parallel=candidate.sequence_parallel, recompute=candidate.recompute,
                  regather=candidate.regather, fold_experts=candidate.fold_experts, float8=candidate.float8)


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class BlockPricer:
    def __init__(self, model: torch.nn.Module, cluster: Cluster, example_inputs: Sequence[Any],
                 example_kwargs: dict | None = None, *, routing_skew: float = 1.0, split_backward: bool = False) -> None:
        check_blocks_alike(model)
        self.model, self.cluster, self.args, self.kwargs = model, cluster, example_inputs, example_kwargs
        self.routing_skew = routing_skew  # the busiest expert's load over the mean (`routing_skew.py`)
        self.split_backward = split_backward  # split-backward schedules searched: their B-to-W holds measured
        self.batch = global_batch(example_inputs, example_kwargs)
        self.layouts: dict[Layout, "BlockLedgers | str"] = {}
        self.decisions: dict = {}  # DTensor's sharding decisions, shared by every layout's plans
        self.estimates: dict = {}  # candidate -> its composed estimate
        self.floors: dict = {}  # selective variant -> why it cannot fit, or None (`cannot_fit`)

    def measure(self, layout: Layout) -> "BlockLedgers | str":
        try:
            with sharing_sharding_decisions(self.decisions):
                return measure_layout(self.model, layout, example_inputs=self.args, example_kwargs=self.kwargs,
                                      holds=self.split_backward, fused_attention=self.cluster.fuses_attention)
        except PlanError as error:
            return first_line(error)
        except RuntimeError as error:  # PyTorch failing on the layout's shapes (a view past 2^31 elements
            # on the meta device): that layout is out, the search goes on
            return f"{type(error).__name__} while planning {layout.mesh_spec}: {first_line(error)}"

    def ledgers(self, layout: Layout) -> "BlockLedgers | str":
        if layout not in self.layouts:
            self.layouts[layout] = self.measure(layout)
        return self.layouts[layout]

    def prefetch(self, candidates: Iterable[Candidate], *,
                 ladder: "Callable[[Candidate], list[Candidate]] | None" = None) -> None:
        """Measure every layout these candidates need that is not measured yet, and compose the
        candidates of each, on two processes where that is safe (`layout_workers.measured`: the
        copy sends back its layouts' ledgers and its candidates' estimates, composed on its core);
        while the second works, the first measures its layouts' variants that `ladder` gives
        (`search_space.memory_variants`: what the search asks for next where a layout does not fit)."""
        chosen = [c for c in candidates if self._splits(c) is None]
        wanted = [layout_of(c) for c in chosen]
        of_layout: dict[Layout, list[Candidate]] = {}
        for candidate, layout in zip(chosen, wanted):
            of_layout.setdefault(layout, []).append(candidate)

        def measure_and_compose(layout: Layout) -> tuple:
            """(the layout's ledgers or why it is refused, its candidates' estimates)."""
            ledgers = self.measure(layout)
            if isinstance(ledgers, str):
                return ledgers, {}
            return ledgers, {c: self._estimate(c, ledgers) for c in of_layout.get(layout, ())}

        def variants(measured_here: dict) -> Iterator[Layout]:
            """The recomputation variants the search's second pass will ask for, as far as the
            layouts measured here tell, in its order: the candidates that do not fit, fastest first,
            each with each policy until one fits (none that `cannot_fit`), while it is faster than
            the best that fits so far. Read lazily: each variant's estimate, once it is measured
            (`measured_here` gains it), may lower that bound."""
            priced = [(c, self.estimates[c]) for c in chosen if c in self.estimates]
            bound = min((e.seconds for _, e in priced if e.fits), default=float("inf"))
            for seconds, twin in sorted(((e.seconds, c) for c, e in priced if not e.fits), key=lambda x: x[0]):
                for variant in ladder(twin):
                    if seconds >= bound:
                        break
                    if self.cannot_fit(variant, measured_here.get(layout_of(twin), (None,))[0]) is not None:
                        continue
                    if layout_of(variant) not in measured_here:
                        yield layout_of(variant)
                    ledgers = measured_here.get(layout_of(variant), (None,))[0]
                    if not isinstance(ledgers, BlockLedgers):  # refused: the next policy is priced
                        continue
                    estimate = self._estimate(variant, ledgers)
                    if estimate.fits:
                        bound = min(bound, estimate.seconds)
                        break

        def export() -> None:  # once, before the fork: both processes plan copies of this trace
            try:
                traced_blocks(self.model, wanted[0], example_inputs=self.args, example_kwargs=self.kwargs)
            except (PlanError, RuntimeError):  # each layout's measurement meets it and says so
                pass

        results = measured(measure_and_compose, [layout for layout in wanted if layout not in self.layouts],
                           variants=variants if ladder else None, warm=export if wanted else None)
        for layout, (ledgers, estimates) in results.items():
            self.layouts[layout] = ledgers
            for candidate, estimate in estimates.items():
                if candidate not in self.estimates:  # the copy's: they name a copy of the cluster
                    self.estimates[candidate] = replace(estimate, cluster=self.cluster)

    def cannot_fit(self, variant: Candidate, twin: "BlockLedgers | str | None" = None) -> "Pruned | None":
        """Why a selective-recomputation variant cannot fit, known without measuring it (None where
        it might): its layout without recomputation, measured, with every byte its attention
        cores saved freed, the blocks' and any outside them (`Part.core_activation_bytes`, the
        most recomputing the cores can free: the cores' inputs stay saved and their run again only
        adds a transient) still peaks above a rank's memory."""
        if variant.recompute != "selective":
            return None
        twin = twin or self.layouts.get(replace(layout_of(variant), recompute=None))
        if not isinstance(twin, BlockLedgers) or not (twin.block.core_activation_bytes
                                                      or twin.rest.core_activation_bytes):
            return None
        if variant not in self.floors:  # asked while prefetching and again by the second pass
            self.floors[variant] = self._floor(variant, twin)
        return self.floors[variant]

    def _floor(self, variant: Candidate, twin: BlockLedgers) -> "Pruned | None":
        """`cannot_fit` for a measured twin: the twin composed with its cores' bytes freed."""
        freed = [replace(part, activation_bytes=part.activation_bytes - part.core_activation_bytes)
                 for part in (twin.block, twin.rest)]
        floor = composed_estimate(skewed(replace(twin, block=freed[0], rest=freed[1]), self.routing_skew), variant,
                                  self.cluster, global_batch=self.batch)
        if floor.fits:
            return None
        return Pruned(variant, f"selective recomputation frees at most its attention cores' saved activations "
                               f"({twin.block.core_activation_bytes / GB:.3g} GB per block and sequence); with all of "
                               f"them freed it still peaks at {floor.peak_bytes / GB:.4g} GB per rank, more than "
                               f"{self.cluster.memory_gb:g} GB", peak_at_least=floor.peak_bytes)

    def _estimate(self, candidate: Candidate, ledgers: BlockLedgers) -> Any:
        if candidate not in self.estimates:
            self.estimates[candidate] = composed_estimate(skewed(ledgers, self.routing_skew), candidate, self.cluster,
                                                          global_batch=self.batch)
        return self.estimates[candidate]

    def _splits(self, candidate: Candidate) -> str | None:
        split = candidate.degree("dp") * candidate.degree("ep") * (candidate.microbatches or 1)
        if self.batch % split:
            return f"the batch of {self.batch} does not split into dp × ep × micro-batches = {split}"
        return None

    def __call__(self, candidate: Candidate) -> Any:
        start = time.perf_counter()
        refused = self._splits(candidate)
        ledgers = self.ledgers(layout_of(candidate)) if refused is None else refused
        if isinstance(ledgers, str):
            return Outcome(candidate, refused=ledgers, seconds=time.perf_counter() - start)
        return Outcome(candidate, self._estimate(candidate, ledgers), seconds=time.perf_counter() - start)


def price_composed(model: torch.nn.Module, cluster: Cluster, candidate: Candidate, *, example_inputs: Sequence[Any],
                   example_kwargs: dict | None = None, routing_skew: float = 1.0) -> Any:
    """One candidate priced as the composed search prices it, whether or not the search's rules
    would enumerate it (a published configuration that puts expert parallelism across nodes)."""
    with reusing_traces():
        return BlockPricer(model, cluster, example_inputs, example_kwargs, routing_skew=routing_skew,
                           split_backward=candidate.schedule in SPLIT_BACKWARD)(candidate)
