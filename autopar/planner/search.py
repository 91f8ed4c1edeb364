"""The planner: autopar chooses the degrees and strategies itself, from its own ledgers, and says why.

`search(model, cluster, example_inputs=...)` enumerates the candidates of `autopar/planner/search_space.py` for
the cluster's world, plans each one (`autopar.plan`: a candidate the compiler refuses — heads
that do not split, a batch that does not divide — is out, with the compiler's own message),
prices the plan (`step_cost.estimate`: step time and peak memory per rank from the ledgers),
and ranks them: those that fit the cluster's memory by predicted step time, then those that do
not by peak memory. A candidate that does not fit is planned again with sequence parallelism's
re-gather in backward where it has SP (`SearchSpace.regather`), then with recomputation
(`SearchSpace.recompute`, each policy in order until one fits) before it is given up, since
memory is what recomputation buys — after every candidate has been priced without it, fastest
first, and only while its time without recomputation is below the best that fits: recomputation
only adds time (the forward again, its collectives again), so past that bound it cannot win
(`SearchResult.pruned` names each candidate passed over, with both times). A composed search
also passes over a selective-recomputation variant that cannot fit even if it freed every byte
its attention cores saved (`BlockPricer.cannot_fit`, read off the layout measured without
recomputation), and goes on to the next policy. Together they skip measuring most in-node layouts with
recomputation (the 8B shape on 64 GPUs: 5 layouts measured instead of 12 in the exercise's
space, 33 instead of 84 in the default one, besides 8 refused before any pass runs;
`tests/test_composed_cost.py` checks the winner against pricing everything). A composed search
measures the first pass's layouts at once, on two processes where that is safe
(`BlockPricer.prefetch`, `autopar/planner/layout_workers.py`).

`SearchResult.best` is the winner (its plan kept; the others' dropped as they are priced, so a
search holds one plan at a time besides the best), `why_lost(outcome)` what a candidate lost to
the winner by; `table(top=)` the ranking with each candidate's memory, bytes, predicted time and
its parts, and why it lost, `explain()` the winner's binding constraint and the runner-up's
margin — both rendered from the result as data (`autopar/planner/search_report.py`), as a search
file (`autopar/planner/search_file.py`) renders them without searching again. Nothing fits:
`PlanError` naming the smallest peak any candidate needs and what binds it (`_what_binds`: memory
per rank, over by how much, at which moment, the largest categories held then, and whether it
already recomputes); nothing plans: `PlanError` with each refusal.

`autopar.plan(model, cluster=..., example_inputs=...)` with no mesh and no strategies is a
search that returns the winner's plan (`Plan.search` holds the result); the CLI's
`autopar plan TARGET --cluster NAME --auto` prints the answer and the table.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch

from autopar.compiler.plan import plan
from autopar.compiler.trace import reusing_traces
from autopar.core.errors import PlanError
from autopar.core.schedules import SPLIT_BACKWARD
from autopar.cost.cluster import GB, Cluster
from autopar.cost.step_cost import estimate
from autopar.planner.layout_pricer import BlockPricer, first_line, input_dim
from autopar.planner.routing_skew import check_skew
from autopar.planner.search_report import answer, ranking_table, search_data
from autopar.planner.search_space import (Candidate, Enumeration, ModelFacts, Outcome, Pruned, SearchSpace, candidates,
                                          memory_variants)


@dataclass
class SearchResult:
    cluster: Cluster
    outcomes: list[Outcome]  # ranked: fitting by predicted time, then not fitting by peak, then refused
    pruned: list[Pruned]
    seconds: float
    facts: ModelFacts | None = None  # what the search knew of the model (batch, sequence), for its report
    space: SearchSpace | None = None
    method: str = ""  # "plans" or "blocks": how the candidates were priced

    @property
    def best(self) -> Outcome:
        return self.outcomes[0]

    def why_lost(self, outcome: Outcome) -> str:
        if outcome is self.best:
            return "chosen"
        if outcome.refused is not None:
            return f"refused: {outcome.refused}"
        if not outcome.fits:
            return outcome.estimate.binding
        mine, best = outcome.estimate, self.best.estimate
        gaps = {part: mine.parts[part] - best.parts.get(part, 0.0) for part in mine.parts}
        part, gap = max(gaps.items(), key=lambda item: item[1])
        slower = mine.seconds / best.seconds - 1 if best.seconds else 0.0
        return f"{slower:+.0%} step: {part} {gap * 1e3:+.2f} ms"

    def table(self, *, top: int | None = None) -> str:
        """The ranking (`autopar/planner/search_report.py`: `ranking_table`)."""
        return ranking_table(search_data(self), top=top)

    def explain(self) -> str:
        """The winner, its binding constraint and why (`autopar/planner/search_report.py`: `answer`)."""
        return answer(search_data(self))


def _price(model: torch.nn.Module, cluster: Cluster, candidate: Candidate, args: Sequence[Any],
           kwargs: dict | None) -> Outcome:
    start = time.perf_counter()
    try:
        planned = plan(model, cluster.mesh(candidate.mesh_spec), strategies=candidate.strategies(cluster.backend),
                       example_inputs=args, example_kwargs=kwargs)
    except PlanError as error:
        return Outcome(candidate, refused=first_line(error), seconds=time.perf_counter() - start)
    if cluster.fuses_attention:  # attention as the cluster runs it
        planned.fuse_attention()
    return Outcome(candidate, estimate(planned, cluster), plan=planned, seconds=time.perf_counter() - start)


METHODS = ("auto", "plans", "blocks")
PLANS_UP_TO = 16  # method="auto" plans every candidate up to this many ranks, composes blocks beyond


def search(model: torch.nn.Module, cluster: Cluster, *, example_inputs: Sequence[Any],
           example_kwargs: dict | None = None, space: SearchSpace | None = None,
           progress: Callable[[Outcome], None] | None = None, method: str = "auto") -> SearchResult:
    """Price every candidate for `cluster` (module docstring); the winner first. `method`:
    "plans" plans each candidate; "blocks" composes each from one block's ledgers per in-node
    layout (`autopar/planner/composed_cost.py`; no candidate is planned, `best.plan` is None); "auto" plans up to
    `PLANS_UP_TO` ranks and composes beyond."""
    if method not in METHODS:
        raise PlanError(f"unknown search method {method!r}; one of {', '.join(METHODS)}")
    start = time.perf_counter()
    space = space or SearchSpace()
    facts = replace(ModelFacts.of(model), sequence=input_dim(example_inputs, example_kwargs, 1),
                    batch=input_dim(example_inputs, example_kwargs, 0))
    enumeration: Enumeration = candidates(cluster.world_size, cluster, space, facts)
    if not enumeration.candidates:
        raise PlanError(f"no layout of {cluster.world_size} ranks passes the rules: "
                        + "; ".join(sorted({p.reason for p in enumeration.pruned})))
    composed = method == "blocks" or (method == "auto" and cluster.world_size > PLANS_UP_TO)
    check_skew(space.routing_skew, 0, 0)
    if space.routing_skew != 1.0 and not composed:
        raise PlanError(f"SearchSpace(routing_skew={space.routing_skew:g}) is priced by the composed search, which "
                        f"grows the busiest rank's routed activations (autopar/planner/routing_skew.py); a plan's "
                        f"ledgers are uniform routing's: search(..., method='blocks')")
    if composed:
        price = BlockPricer(model, cluster, example_inputs, example_kwargs, routing_skew=space.routing_skew,
                            split_backward=any(s in SPLIT_BACKWARD for s in space.schedules))
    else:
        def price(candidate: Candidate) -> Outcome:
            return _price(model, cluster, candidate, example_inputs, example_kwargs)
    outcomes: list[Outcome] = []
    pruned = list(enumeration.pruned)
    best: Outcome | None = None
    with reusing_traces(), _collecting_cycles_after(composed):
        if composed:  # every layout the first pass needs, on both cores where that is safe
            price.prefetch(enumeration.candidates, ladder=lambda twin: memory_variants(twin, space))
        for candidate in enumeration.candidates:
            best = _recorded(price(candidate), outcomes, best, progress)
        # the re-gather in backward and recomputation (`memory_variants`), for the candidates that
        # do not fit, fastest first: they only add time (an all-gather again; the forward again, its
        # collectives again), so a candidate whose time without them is already no better than the
        # best that fits cannot win with them and is not priced (its in-node layout with them is then
        # never measured: most of a composed search's cost)
        unfit = sorted((o for o in outcomes if o.estimate is not None and not o.fits), key=lambda o: o.estimate.seconds)
        for twin in unfit:
            for variant in memory_variants(twin.candidate, space):
                if best is not None and twin.estimate.seconds >= best.estimate.seconds:
                    pruned.append(Pruned(variant, f"as it is it does not fit and already takes "
                                                  f"{twin.estimate.seconds * 1e3:,.2f} ms, no less than the best that "
                                                  f"fits ({best.candidate.label}, {best.estimate.seconds * 1e3:,.2f} ms)"))
                    continue
                cannot = price.cannot_fit(variant) if composed else None
                if cannot is not None:  # the next variant saves more
                    pruned.append(cannot)
                    continue
                outcome = price(variant)
                best = _recorded(outcome, outcomes, best, progress)
                if outcome.fits:
                    break
    _fail_if_nothing_fits(outcomes, cluster, pruned)
    ranked = sorted(outcomes, key=_rank_key)
    return SearchResult(cluster, ranked, pruned, time.perf_counter() - start, facts=facts, space=space,
                        method="blocks" if composed else "plans")


@contextlib.contextmanager
def _collecting_cycles_after(deferred: bool) -> Iterator[None]:
    """Python's cyclic garbage collector held off while a composed search runs (`deferred`), as it
    was before once the search ends. The search makes millions of short-lived objects (fake
    tensors, graph copies, action lists) and each collection walks the whole heap — torch's and
    sympy's modules included: on the 8B exercise (`benchmarks/planner_at_scale.py`) collections
    took 1.0–1.5 s of a 6 s first search. Its cyclic garbage is bounded — each in-node layout's
    small plan, dropped once measured, ~12 MB on that search — and goes at the next collection
    after it. A search that plans every candidate keeps the collector: its garbage is every plan."""
    paused = deferred and gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _recorded(outcome: Outcome, outcomes: list[Outcome], best: "Outcome | None",
              progress: Callable[[Outcome], None] | None) -> "Outcome | None":
    """Record a priced candidate; returns the best so far (the only outcome that keeps its plan)."""
    outcomes.append(outcome)
    if outcome.fits and (best is None or outcome.estimate.seconds < best.estimate.seconds):
        if best is not None:
            best.plan = None
        best = outcome
    else:
        outcome.plan = None
    if progress is not None:
        progress(outcome)
    return best


def winner_plan(result: SearchResult, model: torch.nn.Module, *, example_inputs: Sequence[Any],
                example_kwargs: dict | None = None) -> Any:
    """The winner's plan: kept by a search that planned it, planned now after a composed search."""
    best = result.best
    if best.plan is None:

        best.plan = plan(model, result.cluster.mesh(best.candidate.mesh_spec),
                         strategies=best.candidate.strategies(result.cluster.backend),
                         example_inputs=example_inputs, example_kwargs=example_kwargs)
    best.plan.search = result
    return best.plan


def _rank_key(outcome: Outcome) -> tuple:
    if outcome.estimate is None:
        return (2, 0.0)
    if not outcome.fits:
        return (1, outcome.estimate.peak_bytes)
    return (0, outcome.estimate.seconds)


def _fail_if_nothing_fits(outcomes: list[Outcome], cluster: Cluster, pruned: Sequence[Pruned] = ()) -> None:
    priced = [o for o in outcomes if o.estimate is not None]
    if not priced:
        reasons = "\n".join(f"  {o.candidate.label}: {o.refused}" for o in outcomes)
        raise PlanError(f"the compiler refused every candidate layout of {cluster.world_size} ranks:\n{reasons}")
    if not any(o.fits for o in priced):
        smallest = min(priced, key=lambda o: o.estimate.peak_bytes)
        least = smallest.estimate.peak_bytes
        # a variant passed over unmeasured (`BlockPricer.cannot_fit`) may need less: its floor is named
        below = [p for p in pruned if p.peak_at_least is not None and p.peak_at_least < least]
        lowest = min(below, key=lambda p: p.peak_at_least) if below else None
        what = ("any candidate needs is" if lowest is None else "a priced candidate needs is")
        floor = ("" if lowest is None else f"; {lowest.candidate.label}, passed over unmeasured, needs at least "
                                           f"{lowest.peak_at_least / GB:.4g} GB")
        raise PlanError(f"the model fits nowhere on {cluster.label}: the smallest peak {what} "
                        f"{least / GB:.4g} GB per rank ({smallest.candidate.label}{floor}), and a "
                        f"rank has {cluster.memory_gb:g} GB\n  {_what_binds(smallest, cluster)}\n"
                        f"  fix: more ranks or more memory per rank, a smaller batch, or bf16 parameters")


def _what_binds(smallest: Outcome, cluster: Cluster) -> str:
    """The binding constraint of the candidate that comes closest: memory, over by how much, at
    which moment, the largest categories held then, and whether it already recomputes."""
    estimate = smallest.estimate
    over = (estimate.peak_bytes - cluster.memory_bytes) / GB
    moment = max(estimate.moments, key=estimate.moments.get) if estimate.moments else "the peak"
    held = sorted(((n, b) for n, b in estimate.memory.items() if b > 0), key=lambda item: -item[1])[:3]
    parts = ", ".join(f"{name} {nbytes / GB:.4g} GB" for name, nbytes in held)
    recomputed = (f"it already recomputes ({smallest.candidate.recompute})" if smallest.candidate.recompute
                  else "without recomputation")
    return (f"binding: memory per rank, over by {over:.4g} GB at {moment} ({recomputed}); held: {parts}")
