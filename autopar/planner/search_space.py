"""What the planner searches: every way to lay a world of ranks out as dp/tp/pp/cp/ep and the options of each.

A `Candidate` is data — mesh degrees and options — and turns into the strategies a user would
declare (`Candidate.strategies()`); `SearchSpace` says which axes and options to try, and
`candidates(world, cluster, space, facts)` enumerates them: every ordered factorisation of the
world into the space's axes (degree-1 axes left out of the mesh), then per axis present:

- dp: the ZeRO stage (0 is plain data parallelism; under a pipeline only 0 and 1 — a stage
  whose units were sharded would regather them every micro-batch);
- tp: sequence parallelism on or off;
- pp: each schedule, each micro-batch count (multiples of the degree; with
  `one_sequence_microbatches` also one sequence per micro-batch), and with
  `virtual_stages` > 1 the interleaved 1F1B schedule with that many stages per rank;
  `dualpipev` in `schedules` (not by default) runs two stages per rank in a V, with at least
  2p micro-batches and without ZeRO (the compiler refuses a split backward under ZeRO);
- cp: the ring lowering (load-balanced), while each rank keeps `context_tokens` of a sequence;
- ep: the experts split over the axis (only for a model with experts, `ModelFacts.experts`); with
  tp too, each expert's FFN split over tp (expert-tensor parallelism) or, `fold_experts`, the
  experts split over ep × tp with no expert-tensor split (`expert_parallel(fold=("tp",))`).

The lecture's hard rules prune before anything is planned, each pruned candidate keeping its
reason: tensor and expert parallelism stay inside a node (their collectives sit on the critical
path of every layer; `SearchSpace.cross_node_tp=True` lifts it); a pipeline needs at least as
many repeated blocks as stages (virtual ones included); context parallelism needs attention and
a long sequence (at least `context_tokens` per rank: it is for long contexts). The mesh order is the
usual one, outermost first: pp, dp, cp, ep, tp — tensor parallelism's ranks consecutive, so
they share a node.
Recomputation is not enumerated: the planner adds it to a candidate that does not fit
(`autopar/planner/search.py`), as the lecture's rule says (recompute only for memory).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch

from autopar.compiler.strategies.context import context_parallel
from autopar.compiler.strategies.data_parallel import data_parallel
from autopar.compiler.strategies.expert import expert_parallel
from autopar.compiler.strategies.mixed_precision import Float8Declaration
from autopar.compiler.strategies.pipeline import pipeline_parallel
from autopar.compiler.strategies.recompute import recompute
from autopar.compiler.strategies.tensor_parallel import sequence_parallel, tensor_parallel
from autopar.compiler.strategies.zero import zero
from autopar.core.comm_kinds import gradient_exchange_kind, parameter_gather_kind
from autopar.core.schedules import SPLIT_BACKWARD, V_SHAPED
from autopar.cost.cluster import Cluster
from autopar.cost.step_cost import StepEstimate

AXIS_ORDER = ("pp", "dp", "cp", "ep", "tp")


@dataclass(frozen=True)
class Candidate:
    degrees: tuple[tuple[str, int], ...]  # axes of size > 1, in AXIS_ORDER; () for one rank
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str | None = None
    microbatches: int | None = None
    recompute: str | None = None
    virtual: int = 1  # pipeline stages per pp rank (interleaved_1f1b when > 1)
    # with sequence parallelism: each SP linear keeps its input's sequence shard for backward and
    # gathers it again there (Megatron's), instead of keeping the gathered input
    regather: bool = False
    fold_experts: bool = False  # the experts split over ep × tp, not each expert over tp (`expert_parallel(fold=)`)
    float8: "Float8Declaration | None" = None  # the linears in FP8 (`autopar.float8(...)`), None: as traced

    def degree(self, axis: str) -> int:
        return dict(self.degrees).get(axis, 1)

    @property
    def mesh_spec(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.degrees) or "dp=1"

    @property
    def label(self) -> str:
        parts = []
        for axis, size in self.degrees:
            text = f"{axis}{size}"
            if axis == "dp" and self.zero:
                text += f" zero{self.zero}"
            if axis == "tp" and self.sequence_parallel:
                text += "+sp" + (" regather" if self.regather else "")
            if axis == "pp":
                text += f" {self.schedule} m{self.microbatches}" + (f" v{self.virtual}" if self.virtual > 1 else "")
            parts.append(text)
        if self.fold_experts:
            parts.append("experts on ep·tp")
        if self.recompute:
            parts.append(f"recompute {self.recompute}")
        if self.float8:
            parts.append(self.float8.label)
        return " × ".join(parts) or "one rank"

    def strategies(self, backend: str | None = None) -> list[Any]:
        """The candidate's declarations; `backend`: the cluster's (how ZeRO exchanges gradients
        and re-gathers parameters; None: as the process planning it would)."""
        chosen: list[Any] = []
        for axis, _ in self.degrees or (("dp", 1),):
            if axis == "dp":
                chosen.append(zero(stage=self.zero, reduce=gradient_exchange_kind("auto", backend),
                                   gather=parameter_gather_kind("auto", backend)) if self.zero else data_parallel())
            elif axis == "tp":
                chosen.append(sequence_parallel(regather_in_backward=self.regather) if self.sequence_parallel
                              else tensor_parallel())
            elif axis == "pp":
                chosen.append(pipeline_parallel(schedule=self.schedule, microbatches=self.microbatches,
                                                virtual_stages=self.virtual))
            elif axis == "cp":
                chosen.append(context_parallel())
            elif axis == "ep":
                chosen.append(expert_parallel(fold=("tp",) if self.fold_experts else ()))
        if self.recompute:
            chosen.append(recompute(self.recompute))
        if self.float8:
            chosen.append(self.float8)
        return chosen


@dataclass(frozen=True)
class SearchSpace:
    axes: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    sequence_parallel: tuple[bool, ...] = (False, True)
    schedules: tuple[str, ...] = ("1f1b", "gpipe")
    microbatch_multiples: tuple[int, ...] = (1, 2)  # micro-batches = multiple × pp degree
    virtual_stages: tuple[int, ...] = (1,)  # > 1: interleaved_1f1b with that many stages per pp rank
    one_sequence_microbatches: bool = False  # also m = the replica's sequences (1F1B/GPipe; needs ModelFacts.batch)
    # tried, in order, on a candidate that does not fit, until one fits: the cheaper first (selective
    # recomputes the attention core, full the whole block: never faster in the cost model, and it
    # saves more memory), so the first that fits is the fastest that fits
    recompute: tuple[str, ...] = ("selective", "full")
    # tried first, on a candidate with sequence parallelism that does not fit: the re-gather in
    # backward (`Candidate.regather`) saves the gathered inputs of every SP linear for one more
    # all-gather each in backward, usually less than recomputing anything
    regather: bool = True
    cross_node_tp: bool = False
    context_tokens: int = 1024  # cp only while each rank keeps at least this many tokens of a sequence
    fold_experts: tuple[bool, ...] = (False, True)  # with ep and tp: experts split over tp, or over ep × tp
    # the busiest expert's routed rows over the mean (1.0: uniform routing): the busiest expert-parallel
    # rank's activations made from received rows are priced at that load (`routing_skew.py`)
    routing_skew: float = 1.0
    # every candidate's linears in FP8 as declared (`autopar.float8(...)`); None: as traced
    float8: "Float8Declaration | None" = None


@dataclass(frozen=True)
class ModelFacts:
    """What the search needs to know of a model before planning it."""
    blocks: int  # the longest run of repeated blocks (a pipeline's stages split them)
    experts: bool
    attention: bool
    sequence: int | None = None  # tokens per sequence (the inputs' second dimension), where known
    batch: int | None = None  # sequences per step (the inputs' first dimension), where known

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelFacts":
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        blocks = max((len(m) for m in lists), default=1)
        names = " ".join(type(m).__name__.lower() for m in model.modules())
        experts = any(hasattr(m, "experts") or "expert" in type(m).__name__.lower() for m in model.modules())
        attention = "attention" in names or "attn" in names
        return cls(blocks=blocks, experts=experts, attention=attention)


@dataclass(frozen=True)
class Pruned:
    candidate: Candidate
    reason: str
    peak_at_least: int | None = None  # bytes per rank it needs at least, where known (`BlockPricer.cannot_fit`)


def memory_variants(twin: Candidate, space: SearchSpace) -> list[Candidate]:
    """What the search tries, in order, on a candidate that does not fit, until one fits: the
    re-gather in backward where it has sequence parallelism (`SearchSpace.regather`), then each
    recomputation policy (`SearchSpace.recompute`); a variant already is one of these: none."""
    if twin.recompute is not None or twin.regather:
        return []
    regathering = [replace(twin, regather=True)] if space.regather and twin.sequence_parallel else []
    return regathering + [replace(twin, recompute=policy) for policy in space.recompute]


@dataclass
class Enumeration:
    candidates: list[Candidate] = field(default_factory=list)
    pruned: list[Pruned] = field(default_factory=list)


def factorisations(world: int, axes: tuple[str, ...]) -> Iterator[tuple[tuple[str, int], ...]]:
    """Every assignment of degrees (each dividing the rest) to `axes` whose product is `world`."""
    if not axes:
        if world == 1:
            yield ()
        return
    first, rest = axes[0], axes[1:]
    for size in (d for d in range(1, world + 1) if world % d == 0):
        for tail in factorisations(world // size, rest):
            yield ((first, size),) + tail if size > 1 else tail


def _options(degrees: tuple[tuple[str, int], ...], space: SearchSpace, facts: ModelFacts) -> Iterator[Candidate]:
    sizes = dict(degrees)
    zeros = space.zero_stages if "dp" in sizes else (0,)
    if "pp" in sizes:
        zeros = tuple(z for z in zeros if z <= 1)
    sps = space.sequence_parallel if "tp" in sizes else (False,)
    pipelines = [(None, None, 1)]
    if "pp" in sizes:
        pipelines = [(s, m * sizes["pp"], 2 if s in V_SHAPED else 1) for s in space.schedules
                     for m in space.microbatch_multiples if s not in V_SHAPED or m >= 2]
        pipelines += [("interleaved_1f1b", m * sizes["pp"], v) for v in space.virtual_stages if v > 1
                      for m in space.microbatch_multiples]
        replicas = sizes.get("dp", 1) * sizes.get("ep", 1)
        finest = facts.batch // replicas if facts.batch and facts.batch % replicas == 0 else 0
        if space.one_sequence_microbatches and finest >= sizes["pp"] and finest not in {m for _, m, _ in pipelines}:
            pipelines += [(s, finest, 2 if s in V_SHAPED else 1) for s in space.schedules
                          if s not in V_SHAPED or finest >= 2 * sizes["pp"]]
    folds = space.fold_experts if "ep" in sizes and "tp" in sizes else (False,)
    for z in zeros:
        for sp in sps:
            for schedule, micro, virtual in pipelines:
                if z and schedule in SPLIT_BACKWARD:  # refused by the compiler: a split backward under ZeRO
                    continue
                for fold in folds:
                    yield Candidate(degrees, zero=z, sequence_parallel=sp, schedule=schedule, microbatches=micro,
                                    virtual=virtual, fold_experts=fold, float8=space.float8)


def candidates(world: int, cluster: Cluster, space: SearchSpace, facts: ModelFacts) -> Enumeration:
    """The candidates to plan, and those the hard rules prune with their reasons (module docstring)."""
    axes = tuple(a for a in AXIS_ORDER if a in space.axes)
    result = Enumeration()
    for degrees in factorisations(world, axes):
        sizes = dict(degrees)
        reason = _pruned(sizes, cluster, space, facts)
        for candidate in _options(degrees, space, facts):
            why = reason or (f"pp={sizes['pp']} × {candidate.virtual} virtual stages is more stages than the model's "
                             f"{facts.blocks} repeated blocks" if candidate.virtual * sizes.get("pp", 1) > facts.blocks
                             else None)
            (result.pruned.append(Pruned(candidate, why)) if why else result.candidates.append(candidate))
    return result


def _pruned(sizes: dict[str, int], cluster: Cluster, space: SearchSpace, facts: ModelFacts) -> str | None:
    node = cluster.gpus_per_node
    if not space.cross_node_tp:
        if sizes.get("tp", 1) > node:
            return f"tp={sizes['tp']} crosses nodes of {node} (tensor parallelism stays inside a node)"
        if sizes.get("ep", 1) * sizes.get("tp", 1) > node:
            return f"ep×tp={sizes.get('ep', 1) * sizes.get('tp', 1)} crosses nodes of {node} (expert parallelism stays inside a node)"
    if sizes.get("pp", 1) > facts.blocks:
        return f"pp={sizes['pp']} has more stages than the model's {facts.blocks} repeated blocks"
    if "ep" in sizes and not facts.experts:
        return "ep: the model has no experts"
    if "cp" in sizes and not facts.attention:
        return "cp: the model has no attention"
    if "cp" in sizes and facts.sequence is not None and facts.sequence < sizes["cp"] * space.context_tokens:
        return (f"cp={sizes['cp']} leaves {facts.sequence // sizes['cp']} tokens of a sequence per rank, under "
                f"{space.context_tokens} (context parallelism is for long sequences)")
    return None


def world_degrees(candidate: Candidate) -> int:
    return math.prod(size for _, size in candidate.degrees)


@dataclass
class Outcome:
    candidate: Candidate
    estimate: StepEstimate | None = None
    refused: str | None = None  # the compiler's refusal (first line)
    plan: Any = field(default=None, repr=False)
    seconds: float = 0.0  # wall time spent planning and pricing it

    @property
    def fits(self) -> bool:
        return self.estimate is not None and self.estimate.fits
