"""Checking tensor-parallel candidates with the planner's own propagation, before any plan exists.

`autopar/compiler/strategies/find_layout.py` finds candidate blocks (columns, rows, the nodes between them),
vocabulary heads and embeddings by the graph's structure; whether an op between two projections
really is per-feature or per-head is decided here by the rules that will later place it:
`check_candidates` copies the graph (`Graph.graph_copy`: the original's metadata stays as it
was), seeds the candidates' parameters on a one-axis mesh of the tensor axis' size (everything
else replicated), and runs `passes.propagate_placements.propagate_node` (DTensor's sharding
propagator and `autopar.compiler.rules.op_rules`) on each candidate's nodes. A candidate fails when
- an op has no rule for, or cannot evenly split, what the candidate shards (the PlanError's
  first line is kept as the reason; an uneven split keeps the whole error, `CheckResult.uneven`);
- a value it shards or holds partial must be redistributed (communication inside the block);
- a placement comes out that the collectives cannot move (e.g. DTensor's `_MaskPartial`);
- a column's output is not sharded, or a row's output not Partial.
A replicated value that an op wants sharded is sliced locally (no communication); when it is a
parameter, the wanted placement is returned (`CheckResult.wants`) so that it can be stored
sharded instead (a column's bias, a per-head weight).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils import _pytree as pytree

from autopar.compiler.context import CompileContext, PlaceholderInfo
from autopar.compiler.passes.propagate_placements import propagate_node
from autopar.compiler.strategies import ResolvedStrategy
from autopar.core.errors import PlanError
from autopar.core.ir import ARG_SPECS, SPEC, describe, tensor_meta
from autopar.core.mesh import Mesh

_MOVABLE = (Shard, _StridedShard, Replicate, Partial)


@dataclass
class Candidate:
    """Parameters to seed (FQN -> placement on the axis), nodes to place, and which projection
    outputs must come out sharded (columns) or Partial (rows)."""

    seeds: dict[str, Placement]
    nodes: set[torch.fx.Node]
    columns: list[torch.fx.Node] = field(default_factory=list)
    rows: list[torch.fx.Node] = field(default_factory=list)


@dataclass
class CheckResult:
    failure: str | None = None
    uneven: PlanError | None = None  # the failure was a dimension the axis does not divide (heads % tp)
    wants: dict[str, tuple[Placement, str]] = field(default_factory=dict)  # FQN -> (placement, consumer)


def _spec(mesh: Mesh, ctx: CompileContext, value: object, placement: Placement) -> object:
    if isinstance(value, torch.Tensor):
        return DTensorSpec(ctx.device_mesh, (placement,), tensor_meta(value))
    if isinstance(value, (tuple, list)):
        return tuple(_spec(mesh, ctx, v, Replicate()) for v in value)
    return None


def _arguments_failure(node: torch.fx.Node, placeholders: dict[str, PlaceholderInfo],
                       result: CheckResult) -> str | None:
    """Why `node`'s placement needs communication on an argument, if it does."""
    wanted = node.meta.get(ARG_SPECS) or []
    for leaf, want in zip(pytree.tree_leaves((node.args, dict(node.kwargs))), wanted):
        have = leaf.meta.get(SPEC) if isinstance(leaf, torch.fx.Node) else None
        if not isinstance(want, DTensorSpec) or not isinstance(have, DTensorSpec) or have.placements == want.placements:
            continue
        source, target = have.placements[0], want.placements[0]
        if isinstance(source, Replicate) and type(target) in (Shard, Partial):
            info = placeholders.get(leaf.name) if leaf.op == "placeholder" else None
            if info is not None and info.kind == "parameter" and type(target) is Shard:
                result.wants[info.target] = (target, str(node.target))
            continue
        return (f"{node.name} ({node.target}) needs {leaf.name} as {describe(want.placements)} but it is "
                f"{describe(have.placements)}: communication inside the pattern")
    return None


def _outputs_failure(node: torch.fx.Node) -> str | None:
    spec = node.meta.get(SPEC)
    for one in spec if isinstance(spec, (tuple, list)) else (spec,):
        if isinstance(one, DTensorSpec) and not isinstance(one.placements[0], _MOVABLE):
            return f"{node.name} ({node.target}) comes out {one.placements[0]}, which no collective moves"
    return None


def check_candidates(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo], *, axis: str, size: int,
                     candidates: list[Candidate]) -> list[CheckResult]:
    """One `CheckResult` per candidate (see the module docstring); all are placed in one pass."""
    mesh = Mesh({axis: size})
    ctx = CompileContext(mesh=mesh, device_mesh=mesh.device_mesh(plan_rank=0), strategy=ResolvedStrategy(mesh, ()),
                         placeholders=placeholders)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    graph = torch.fx.Graph()
    graph.graph_copy(gm.graph, copies)
    owner = {copies[node]: index for index, candidate in enumerate(candidates) for node in candidate.nodes}
    seeds = {fqn: placement for candidate in candidates for fqn, placement in candidate.seeds.items()}
    results = [CheckResult() for _ in candidates]
    for node in graph.nodes:
        value = node.meta.get("val")
        index = owner.get(node)
        if node.op == "placeholder":
            info = placeholders[node.name]
            placement = seeds.get(info.target, Replicate()) if info.kind == "parameter" else Replicate()
            node.meta[SPEC] = _spec(mesh, ctx, value, placement)
        elif node.op != "call_function" or index is None or results[index].failure is not None:
            node.meta[SPEC] = _spec(mesh, ctx, value, Replicate())
        else:
            try:
                propagate_node(node, ctx)
                failure = _arguments_failure(node, placeholders, results[index]) or _outputs_failure(node)
            except PlanError as error:
                failure = f"{node.name}: {str(error).splitlines()[0]}"
                if "split evenly" in str(error):
                    results[index].uneven = error
            if failure is not None:
                results[index].failure = failure
                node.meta[SPEC] = _spec(mesh, ctx, value, Replicate())
    for candidate, result in zip(candidates, results):
        if result.failure is None:
            result.failure = _ports_failure(candidate, copies)
    return results


def _ports_failure(candidate: Candidate, copies: dict[torch.fx.Node, torch.fx.Node]) -> str | None:
    for node in candidate.columns:
        placement = copies[node].meta[SPEC].placements[0]
        if not isinstance(placement, (Shard, _StridedShard)):
            return f"the column projection {node.name} comes out {placement}, not sharded"
    for node in candidate.rows:
        placement = copies[node].meta[SPEC].placements[0]
        if not isinstance(placement, Partial):
            return f"the row projection {node.name} comes out {placement}, not partial"
    return None
