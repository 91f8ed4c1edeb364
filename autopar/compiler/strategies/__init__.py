"""Strategies as data: which parameters, inputs and module boundaries get which placement.

A `Strategy` is a frozen record bound to one mesh axis: parameter rules (FQN glob ->
placement), input rules (user input index -> placement) and module layouts (module-path glob
-> placement of what enters and what leaves the module, like torchtitan's PrepareModuleInput /
PrepareModuleOutput but applied to graph edges). Strategies for different axes compose;
`resolve_strategies` binds deferred ones to the traced graph (`tensor_parallel()` without a
layout finds it there), merges them into a `ResolvedStrategy` the planner queries, and refuses
an axis the mesh does not have. `check_axes` refuses, before tracing, a mesh axis of size > 1 that
no strategy claims (every rank on it would compute the same thing; `replicated(axis)` says that is
meant) and two strategies whose roles conflict on one axis (`strategy_role`). Constructors live
beside: `data_parallel.py` (+ `replicated`),
`tensor_parallel.py` (+ sequence parallel), `zero.py` (ZeRO-1/2/3, FSDP, HSDP: a data-parallel
axis that also shards the training state), `pipeline.py` (pipeline stages, schedule and
micro-batches on an axis), `recompute.py` (regions run again in backward; on no axis), `mixed_precision.py`
(compute and reduce dtypes, and `float8`: linears computed in FP8; on no axis), `autopar/compiler/context.py` (sequence shards, attention lowered to ring / all-gather /
all-to-all), `expert.py` (experts split over an axis, tokens exchanged by all-to-all); `find_layout.py` + `check_layout.py` find Megatron's patterns in the
graph, `layouts.py` declares them by module names (an override).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement

from autopar.compiler.strategies.mixed_precision import Float8Declaration
from autopar.compiler.strategies.mixed_precision import MixedPrecisionDeclaration
from autopar.compiler.strategies.recompute import RecomputeDeclaration
from autopar.compiler.strategies.schedule import ScheduleDeclaration
from autopar.compiler.strategies.token_shard import TokenShard
from autopar.core.errors import PlanError
from autopar.core.mesh import JOIN, Mesh

if TYPE_CHECKING:
    import torch.fx

    from autopar.compiler.context import PlaceholderInfo
    from autopar.compiler.strategies.context import ContextDeclaration
    from autopar.compiler.strategies.expert import ExpertDeclaration
    from autopar.compiler.strategies.pipeline import PipelineDeclaration
    from autopar.compiler.strategies.recompute import RecomputeDeclaration
    from autopar.compiler.strategies.schedule import ScheduleDeclaration
    from autopar.compiler.strategies.zero import ShardedState


@dataclass(frozen=True)
class ParamRule:
    """Parameters whose FQN matches `pattern` get `placement` on the strategy's axis; `why` (e.g.
    the graph pattern that decided it) appears in the parameter's origin."""

    pattern: str
    placement: Placement
    why: str = ""


@dataclass(frozen=True)
class InputRule:
    """User input number `index` (flattened order) gets `placement` on the strategy's axis."""

    index: int | None
    placement: Placement


@dataclass(frozen=True)
class ModuleLayout:
    """Tensors entering / leaving modules matching `pattern` are redistributed to these placements."""

    pattern: str
    inputs: Placement | None = None
    outputs: "Placement | TokenShard | None" = None


@dataclass(frozen=True)
class Strategy:
    """One axis' worth of declarations. `name` appears in reports and errors."""

    name: str
    axis: str
    params: tuple[ParamRule, ...] = ()
    inputs: tuple[InputRule, ...] = ()
    modules: tuple[ModuleLayout, ...] = ()
    sharded_state: "ShardedState | None" = None  # ZeRO / FSDP on this axis (autopar/compiler/strategies/zero.py)
    pipeline: "PipelineDeclaration | None" = None  # pipeline stages on this axis (autopar/compiler/strategies/pipeline.py)
    context: "ContextDeclaration | None" = None  # sequence shards and their attention (autopar/compiler/strategies/context.py)
    experts: "ExpertDeclaration | None" = None  # experts split over this axis, tokens exchanged (autopar/compiler/strategies/expert.py)
    regather_in_backward: bool = False  # all-gathers on this axis keep their input for backward, not output
    notes: tuple[str, ...] = ()  # what the strategy left out and why (e.g. a pattern it could not shard)


def _matches(pattern: str, path: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern)


class _FirstMatch:
    """The first of `rules` (in order) whose glob `pattern` matches a path, remembered per path.
    A found layout declares one rule per parameter and per block, so a deep model has thousands:
    patterns without glob characters are looked up in a dict, the others tried in order."""

    def __init__(self, rules: "tuple[ParamRule, ...] | list[ModuleLayout]") -> None:
        self.rules = list(rules)
        self.exact: dict[str, int] = {}
        self.globs: list[int] = []
        for index, rule in enumerate(self.rules):
            if any(c in rule.pattern for c in "*?["):
                self.globs.append(index)
            else:
                self.exact.setdefault(rule.pattern, index)
        self.found: dict[str, object] = {}

    def __call__(self, path: str):
        if path not in self.found:
            by_glob = next((i for i in self.globs if _matches(self.rules[i].pattern, path)), None)
            indices = [i for i in (self.exact.get(path), by_glob) if i is not None]
            self.found[path] = self.rules[min(indices)] if indices else None
        return self.found[path]


@dataclass(frozen=True)
class ResolvedStrategy:
    """The composed strategies on one mesh; every query returns one placement per mesh axis."""

    mesh: Mesh
    strategies: tuple[Strategy, ...]
    recompute: "RecomputeDeclaration | None" = None  # regions run again in backward (autopar/compiler/strategies/recompute.py)
    schedule: "ScheduleDeclaration | None" = None  # collectives overlapped or not (autopar/compiler/strategies/schedule.py)
    # compute and reduce dtypes over fp32 masters (autopar/compiler/strategies/mixed_precision.py)
    mixed_precision: "MixedPrecisionDeclaration | None" = None
    # linears computed in FP8 (autopar/compiler/strategies/mixed_precision.py)
    float8: "Float8Declaration | None" = None
    # the process group's backend the plan is for (`plan(backend=)`); None: the initialised group's, if any
    backend: str | None = None
    _lookups: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _first(self, strategy: Strategy, kind: str, path: str):
        """The first parameter rule ("params") or module layout with inputs ("inputs") or outputs
        ("outputs") of `strategy` matching `path` (`_FirstMatch`, built once per strategy and kind)."""
        key = (next(i for i, s in enumerate(self.strategies) if s is strategy), kind)
        if key not in self._lookups:
            rules = strategy.params if kind == "params" else [
                layout for layout in strategy.modules if getattr(layout, kind) is not None]
            self._lookups[key] = _FirstMatch(rules)
        return self._lookups[key](path)

    def _for_axis(self, axis: str) -> list[Strategy]:
        """Strategies on `axis`; none on an axis of size 1, where every placement is Replicate."""
        if self.mesh.size(axis) == 1:
            return []
        return [s for s in self.strategies if s.axis == axis]

    def sharded_state(self) -> "tuple[str, ShardedState] | None":
        """(axis, declaration) of the one ZeRO/FSDP strategy, if any (not on a size-1 axis)."""
        found = [(s.axis, s.sharded_state) for axis in self.mesh.names for s in self._for_axis(axis)
                 if s.sharded_state is not None]
        return found[0] if found else None

    def pipeline(self) -> "tuple[str, PipelineDeclaration] | None":
        """(axis, declaration) of the pipeline strategy, if any (not on a size-1 axis)."""
        found = [(s.axis, s.pipeline) for axis in self.mesh.names for s in self._for_axis(axis)
                 if s.pipeline is not None]
        return found[0] if found else None

    def context_axes(self) -> "tuple[tuple[str, ContextDeclaration], ...]":
        """(axis, declaration) of every context-parallel axis (not of size 1)."""
        return tuple((axis, s.context) for axis in self.mesh.names for s in self._for_axis(axis)
                     if s.context is not None)

    def expert_declaration(self, axis: str) -> "ExpertDeclaration":
        return next(s.experts for s in self._for_axis(axis) if s.experts is not None)

    def expert_axes(self) -> tuple[str, ...]:
        """Every expert-parallel axis (not of size 1)."""
        return tuple(axis for axis in self.mesh.names for s in self._for_axis(axis) if s.experts is not None)

    def expert_group(self, axis: str) -> str:
        """The group key the experts of expert-parallel `axis` are exchanged over: the axis and the
        axes folded into it (`autopar/compiler/strategies/expert.py`)."""
        fold = self.expert_declaration(axis).fold
        return JOIN.join(a for a in self.mesh.names if a == axis or (a in fold and self.mesh.size(a) > 1))

    def sequence_layout(self, axis: str) -> str:
        """How a dimension sharded on `axis` is cut (`autopar.core.sequence_chunks`)."""
        return next((d.layout for a, d in self.context_axes() if a == axis), "contiguous")

    def regathers(self, axis: str) -> bool:
        """Whether all-gathers on `axis` save their shard and gather again in backward (Megatron SP)."""
        return any(s.regather_in_backward for s in self._for_axis(axis))

    def param_placements(self, fqn: str) -> tuple[Placement, ...]:
        return tuple(placement for placement, _ in self._param_choices(fqn))

    def param_origin(self, fqn: str) -> str:
        """Why each axis got its placement: the strategy rule that matched, or none (replicated)."""
        return "; ".join(f"{axis}: {why}" for axis, (_, why) in zip(self.mesh.names, self._param_choices(fqn)))

    def _param_choices(self, fqn: str) -> list[tuple[Placement, str]]:
        choices = []
        for axis in self.mesh.names:
            chosen: tuple[Placement, str] = (Replicate(), "replicated (no parameter rule on this axis)")
            for strategy in self._for_axis(axis):
                rule = self._first(strategy, "params", fqn)
                if rule is not None:
                    why = f": {rule.why}" if rule.why else ""
                    chosen = (rule.placement, f"{rule.placement} from {strategy.name} rule {rule.pattern!r}{why}")
                    break
            choices.append(chosen)
        return choices

    def input_placements(self, index: int) -> tuple[Placement, ...]:
        placements = []
        for axis in self.mesh.names:
            chosen: Placement = Replicate()
            for strategy in self._for_axis(axis):
                rule = next((r for r in strategy.inputs if r.index in (None, index)), None)
                if rule is not None:
                    chosen = rule.placement
                    break
            placements.append(chosen)
        return tuple(placements)

    def edge_placements(self, producer_stack: list[str], consumer_stack: list[str],
                        placements: tuple[Placement, ...], reasons: list[str] | None = None, *,
                        shape: "tuple[int, ...] | None" = None) -> tuple[Placement, ...]:
        """Placements a tensor (of global `shape`) must have on an edge that leaves and/or enters
        modules (why: into `reasons`). A declared `TokenShard` is resolved last, against the other
        axes' placements (`autopar/compiler/strategies/token_shard.py`)."""
        left = [m for m in producer_stack if m not in consumer_stack]
        entered = [m for m in consumer_stack if m not in producer_stack]
        result = list(placements)
        for index, axis in enumerate(self.mesh.names):
            for strategy in self._for_axis(axis):
                for module in reversed(left):
                    layout = self._first(strategy, "outputs", module)
                    if layout is not None:
                        result[index] = layout.outputs
                        if reasons is not None:
                            reasons.append(f"{axis}: {layout.outputs} leaving {module} ({strategy.name} layout {layout.pattern!r})")
                for module in entered:
                    layout = self._first(strategy, "inputs", module)
                    if layout is not None:
                        result[index] = layout.inputs
                        if reasons is not None:
                            reasons.append(f"{axis}: {layout.inputs} entering {module} ({strategy.name} layout {layout.pattern!r})")
        declared = tuple(result)
        if not any(isinstance(p, TokenShard) for p in declared):  # most edges: nothing to resolve
            return declared
        sizes = tuple(self.mesh.size(axis) for axis in self.mesh.names)
        for index, placement in enumerate(declared):
            if isinstance(placement, TokenShard):
                result[index] = placement.resolve(shape=shape, placements=declared, axis_index=index, sizes=sizes)
                if reasons is not None:
                    reasons.append(f"{self.mesh.names[index]}: tokens sharded on dim {result[index].dim}")
        return tuple(result)


# roles a strategy plays on its axis; two strategies on one axis conflict unless both are "tensor"
# (tensor_parallel() with sequence_parallel() on tp) or a role is unknown (a user's own Strategy)
ROLES = {"data": "shards the batch (data parallel)", "tensor": "splits the layers (tensor parallel)",
         "pipeline": "holds pipeline stages", "context": "shards the sequence (context parallel)",
         "replicated": "is declared replicated"}


def strategy_role(strategy: Any) -> str | None:
    """What `strategy` (a `Strategy` or a deferred one) does with its axis: a key of `ROLES`, or None
    for a strategy autopar does not know (expert parallelism is checked in `resolve_strategies`)."""
    name = getattr(strategy, "name", "")
    declared = [(getattr(strategy, "pipeline", None), "pipeline"), (getattr(strategy, "context", None), "context"),
                (getattr(strategy, "sharded_state", None), "data")]
    found = next((role for value, role in declared if value is not None), None)
    if found is not None:
        return found
    if getattr(strategy, "experts", None) is not None or name == "expert_parallel":
        return None
    if name == "data_parallel":
        return "data"
    if name == "replicated":
        return "replicated"
    return "tensor" if name.startswith("tensor_parallel") else None


def _flatten(strategies: "Sequence[Any]") -> list[Any]:
    """The strategies, hsdp()'s pair unpacked, without the declarations that belong to no axis."""
    flat = [s for item in strategies for s in (item if isinstance(item, (tuple, list)) else (item,))]
    return [s for s in flat if not isinstance(s, _NO_AXIS)]


# the declarations that belong to no mesh axis
_NO_AXIS = (RecomputeDeclaration, ScheduleDeclaration, MixedPrecisionDeclaration, Float8Declaration)


def check_axes(mesh: Mesh, strategies: "Sequence[Any]") -> None:
    """Refuse, before anything is traced: a declaration that is not a strategy, a strategy on an
    axis the mesh lacks, two strategies whose roles conflict on one axis, and a mesh axis of size > 1
    that no strategy claims (the batch would be replicated on it: every rank on the axis computing
    the same thing)."""
    flat = _flatten(strategies)
    for strategy in flat:
        if not isinstance(getattr(strategy, "axis", None), str) or not hasattr(strategy, "name"):
            raise PlanError(f"{strategy!r} is not a Strategy; build one with autopar.compiler.strategies "
                            f"(data_parallel(), tensor_parallel(...)) or Strategy(...)")
        mesh.require_axis(strategy.axis, wanted_by=f"strategy {strategy.name!r}")
    for axis in mesh.names:
        on_axis = [s for s in flat if s.axis == axis]
        if mesh.size(axis) > 1:
            _refuse_conflicts(axis, on_axis)
        if mesh.size(axis) > 1 and not on_axis:
            raise PlanError(_unused_axis_message(mesh, axis, flat))


def _refuse_conflicts(axis: str, on_axis: list[Any]) -> None:
    """Two strategies on `axis` conflict when their roles differ, or both shard the batch."""
    known = [(s, strategy_role(s)) for s in on_axis if strategy_role(s) is not None]
    for index, (first, first_role) in enumerate(known):
        for second, second_role in known[index + 1:]:
            if first_role == second_role == "tensor":
                continue
            if first_role == second_role:
                why = f"both {ROLES[first_role]}"
                sharded = next((s for s in (first, second) if getattr(s, "sharded_state", None) is not None), None)
                fix = (f"keep one of them ({sharded.name} alone is data parallel with its training state sharded)"
                       if sharded is not None else "keep one of them")
            else:
                why = f"{first.name} {ROLES[first_role]} and {second.name} {ROLES[second_role]}"
                fix = "give each its own mesh axis (axis= on one of them, and that axis in the mesh)"
            raise PlanError(f"strategies {first.name} and {second.name} both claim mesh axis {axis!r}: {why}, and "
                            f"one axis does one thing\n  fix: {fix}")


def _unused_axis_message(mesh: Mesh, axis: str, flat: list[Any]) -> str:
    others = [a for a in mesh.names if a != axis]
    smaller = ",".join(f"{a}={mesh.size(a)}" for a in others) or f"{axis}=1"
    claimed = ", ".join(f"{s.name} on {s.axis!r}" for s in flat) or "no strategies"
    return (f"mesh axis {axis!r} (size {mesh.size(axis)}) is used by no strategy ({claimed}): every rank along it "
            f"would get the same batch and compute the same thing, {mesh.size(axis)} times over\n"
            f"  fix: add a strategy on {axis!r} (e.g. {_suggestion(axis)}), use the mesh {smaller!r} without it, or "
            f"declare it replicated on purpose with autopar.replicated({axis!r})")


def _suggestion(axis: str) -> str:
    known = {"dp": "autopar.data_parallel()", "tp": "autopar.tensor_parallel()",
             "pp": "autopar.pipeline_parallel()", "cp": "autopar.context_parallel()", "ep": "autopar.expert_parallel()"}
    return known.get(axis, f"autopar.data_parallel(axis={axis!r})")


def resolve_strategies(mesh: Mesh, strategies: "list[Strategy] | tuple[Strategy, ...]",
                       graph_module: "torch.fx.GraphModule", placeholders: "dict[str, PlaceholderInfo]", *,
                       backend: str | None = None) -> ResolvedStrategy:
    """Bind deferred strategies (the tensor-parallel layout found in the traced graph) and check
    every strategy names an axis of `mesh`."""
    flat = []
    for strategy in strategies:  # hsdp() declares two axes at once: a tuple of strategies
        flat.extend(strategy if isinstance(strategy, (tuple, list)) else [strategy])
    recomputes = [s for s in flat if isinstance(s, RecomputeDeclaration)]
    if len(recomputes) > 1:
        raise PlanError(f"recompute is declared {len(recomputes)} times ({[r.describe() for r in recomputes]}); "
                        f"declare it once (module globs can list several modules)")
    schedules = [s for s in flat if isinstance(s, ScheduleDeclaration)]
    if len(schedules) > 1:
        raise PlanError(f"schedule is declared {len(schedules)} times; declare it once")
    precisions = [s for s in flat if isinstance(s, MixedPrecisionDeclaration)]
    if len(precisions) > 1:
        raise PlanError(f"mixed_precision is declared {len(precisions)} times; declare it once")
    float8s = [s for s in flat if isinstance(s, Float8Declaration)]
    if len(float8s) > 1:
        raise PlanError(f"float8 is declared {len(float8s)} times; declare it once (module globs can list several)")
    flat = [s for s in flat if not isinstance(s, _NO_AXIS)]
    for deferred in (s for s in flat if hasattr(s, "bind")):
        mesh.require_axis(deferred.axis, wanted_by=f"strategy {deferred.name!r}")
    strategies = [s.bind(mesh=mesh, graph_module=graph_module, placeholders=placeholders) if hasattr(s, "bind") else s
                  for s in flat]
    for folding in (s for s in flat if hasattr(s, "fold_onto")):  # expert_parallel(fold=...): after every bind
        strategies = folding.fold_onto(mesh=mesh, strategies=strategies, graph_module=graph_module,
                                       placeholders=placeholders)
    for strategy in strategies:
        if not isinstance(strategy, Strategy):
            raise PlanError(f"{strategy!r} is not a Strategy; build one with autopar.compiler.strategies "
                            f"(data_parallel(), tensor_parallel(...)) or Strategy(...)")
        mesh.require_axis(strategy.axis, wanted_by=f"strategy {strategy.name!r}")
    sharded = [s for s in strategies if s.sharded_state is not None]
    if len(sharded) > 1:
        raise PlanError(f"strategies {[s.name for s in sharded]} each shard the training state; declare one ZeRO/FSDP "
                        f"axis (hsdp() shards over one axis and replicates over another)")
    experts = [s.axis for s in strategies if s.experts is not None and mesh.size(s.axis) > 1]
    if len(experts) > 1:
        raise PlanError(f"expert_parallel is declared on axes {experts}; declare one expert-parallel axis")
    for axis in experts:
        sharing = [s.name for s in strategies if s.axis == axis and s.experts is None]
        if sharing:
            raise PlanError(f"expert_parallel on {axis!r} shares its axis with {sharing}: the expert-parallel axis is "
                            f"carved from the data axes (it shards the batch like data parallelism and splits the "
                            f"experts), so it cannot also carry {', '.join(sharing)}\n  fix: give experts their own "
                            f"axis, e.g. mesh 'dp=2,ep=2' with data_parallel() on dp and expert_parallel() on ep")
    pipelines = [s for s in strategies if s.pipeline is not None]
    if len(pipelines) > 1:
        raise PlanError(f"strategies {[s.name for s in pipelines]} each declare a pipeline; declare one pipeline axis")
    return ResolvedStrategy(mesh=mesh, strategies=tuple(strategies), recompute=recomputes[0] if recomputes else None,
                            schedule=schedules[0] if schedules else None,
                            mixed_precision=precisions[0] if precisions else None,
                            float8=float8s[0] if float8s else None, backend=backend)
