"""Tensor-parallel layouts found in the traced graph: the patterns Megatron parallelises.

Megatron's pattern is a projection whose output reaches a second projection, back into the
residual stream, only through per-feature or per-head ops (activations, gating products, head
reshapes, attention, rotary embedding); the first is sharded column-wise (output features), the
second row-wise (input features), and the block between them runs on shards with no
communication. It is visible in the graph whatever the modules are called:
1. `autopar/compiler/strategies/graph_structure.py` finds the projections (`mm`/`addmm` against a 2-D
   parameter), classifies every node (constant, parameter-only, projection output, derived from
   projection outputs, residual stream) and joins derived nodes with the projections around
   them into components (`components`).
2. `_regions`: a component with columns (projections whose outputs it consumes) and rows
   (projections whose data operand it produces) whose values never leak into the stream is a
   block (attention when it holds attention, else MLP); one with columns only that reaches
   `_log_softmax` is the vocabulary head. A column whose output features are split into k equal
   parts (a fused q|k|v or gate|up) is block-sharded (`_StridedShard`, k blocks).
3. `_without_conflicts`: a weight two regions want placed differently keeps the first.
4. `_checked`: `autopar/compiler/strategies/check_layout.py` runs DTensor's propagation and autopar's op rules
   on the candidates (`check_candidates`): one stands only if nothing it shards needs communication
   before its rows, whose outputs must be Partial; parameters inside a block take the placement
   their consumer asks for. An attention that fails with smaller key/value projections is tried
   again with them replicated (tensor axis larger than the key/value heads: each rank slices
   the repeated heads it needs); a dimension the axis still does not divide (heads % tp) is
   the PlanError that names it.
5. `_embedding_regions`: embeddings looked up with user token ids are vocabulary-parallel (a
   weight tied to a head that is not sharded stays replicated with it).
`find_layout` returns a `FoundLayout`: a placement and the pattern that decided it (or why it
stayed replicated) per parameter (`_choices`), and the module boundaries of blocks, embeddings
and heads (`_boundaries`), which `tensor_parallel()` turns into a `Strategy`
(`autopar/compiler/strategies/tensor_parallel.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.compiler.context import PlaceholderInfo, shared_store
from autopar.compiler.strategies.check_layout import Candidate, check_candidates
from autopar.compiler.strategies.graph_structure import (
    PASS_THROUGH,
    VIEWS,
    Projection,
    classify,
    common_module,
    components,
    find_projections,
    fused_blocks,
    param_of,
)
from autopar.core.errors import PlanError
from autopar.core.ir import module_stack

aten = torch.ops.aten
_ATTENTION = {aten.scaled_dot_product_attention.default, aten._softmax.default, aten._safe_softmax.default}


@dataclass(frozen=True)
class ParamChoice:
    fqn: str
    placement: Placement
    why: str


@dataclass(frozen=True)
class FoundLayout:
    """What `find_layout` decided: per parameter a placement and why; module boundaries by role
    ("block": replicated in, reduced out; "embedding": reduced out; "head": replicated in)."""

    params: tuple[ParamChoice, ...]
    modules: tuple[tuple[str, str], ...]
    notes: tuple[str, ...] = ()


@dataclass
class _Region:
    kind: str  # "attention", "mlp", "head", "embedding"
    columns: list[Projection]
    rows: list[Projection]
    nodes: set[torch.fx.Node]
    block: str
    summary: str
    fused: dict[str, int] = field(default_factory=dict)
    replicated: list[Projection] = field(default_factory=list)
    embedding: str | None = None  # the weight of an "embedding" region
    rejected: str | None = None  # why it is not sharded

    def reject(self, reason: str) -> None:
        self.rejected = reason

    @property
    def where(self) -> str:
        return f"{self.kind} pattern in {self.block or '<root>'} ({self.summary})"


def _describe(kind: str, columns: list[Projection], rows: list[Projection], nodes: set[torch.fx.Node]) -> str:
    ops = sorted({str(n.target).replace("aten.", "").split(".")[0] for n in nodes if n.op == "call_function"
                  and n.target not in VIEWS and n.target not in PASS_THROUGH and "view" not in str(n.target)
                  and str(n.target).startswith("aten.")})
    middle = "scaled_dot_product_attention" if "scaled_dot_product_attention" in ops else ", ".join(ops[:5])
    names = " + ".join(p.name for p in columns)
    return f"{names} -> {middle} -> {' + '.join(p.name for p in rows)}" if rows else f"{names} -> {middle}"


def _regions(components: list[dict]) -> list[_Region]:
    """Blocks and heads of the components; structurally impossible blocks come rejected."""
    regions = []
    for group in components:
        columns, rows, nodes = group["columns"], group["rows"], group["nodes"]
        kind = "attention" if any(n.target in _ATTENTION for n in nodes) else "mlp"
        members = [p.node for p in columns + rows] + list(nodes)
        if not rows:
            if group["escapes"] and any(n.target is aten._log_softmax.default for n in nodes):
                regions.append(_Region("head", columns, rows, nodes, common_module([p.node for p in columns]),
                                       _describe("head", columns, rows, nodes)))
            continue
        region = _Region(kind, columns, rows, nodes, common_module(members), _describe(kind, columns, rows, nodes),
                         fused={p.weight: k for p in columns if (k := fused_blocks(p)) > 1})
        if group["escapes"]:
            member, user = group["escapes"][0]
            region.reject(f"{member.name} also reaches {user.name} ({user.target}) in the residual stream")
        elif {p.node for p in columns} & {p.node for p in rows}:
            region.reject(f"{next(p for p in columns if p in rows).weight} both takes and gives sharded features")
        regions.append(region)
    return regions


def _upstream_params(nodes: set[torch.fx.Node], kinds: dict) -> set[torch.fx.Node]:
    """`param`-kind ancestors of `nodes` (weight transposes, casts, `1 + w`), placeholders included."""
    found: set[torch.fx.Node] = set()
    stack = [i for n in nodes for i in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if kinds.get(node) == "param" and node not in found:
            found.add(node)
            stack.extend(node.all_input_nodes)
    return found


def _downstream(nodes: set[torch.fx.Node]) -> set[torch.fx.Node]:
    found, stack = set(), list(nodes)
    while stack:
        for user in stack.pop().users:
            if user not in found and user.op == "call_function":
                found.add(user)
                stack.append(user)
    return found


def _seeds(region: _Region) -> dict[str, Placement]:
    seeds: dict[str, Placement] = {region.embedding: Shard(0)} if region.embedding else {}
    for p in region.columns:
        if p in region.replicated:
            continue
        blocks = region.fused.get(p.weight, 1)
        seeds[p.weight] = _StridedShard(p.out_dim, split_factor=blocks) if blocks > 1 else Shard(p.out_dim)
        if p.bias is not None:
            seeds[p.bias] = _StridedShard(0, split_factor=blocks) if blocks > 1 else Shard(0)
    for p in region.rows:
        seeds[p.weight] = Shard(1 - p.out_dim)
    return seeds


def _candidate(region: _Region, kinds: dict) -> Candidate:
    nodes = set(region.nodes) | {p.node for p in region.columns + region.rows}
    if region.kind == "head":
        nodes |= _downstream(nodes)
    nodes |= _upstream_params(nodes, kinds)
    return Candidate(seeds=_seeds(region), nodes=nodes,
                     columns=[p.node for p in region.columns if p not in region.replicated],
                     rows=[p.node for p in region.rows])


def _token_embeddings(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo]) -> list[tuple[torch.fx.Node, str]]:
    """(node, weight FQN) of `aten.embedding`s of a parameter looked up by user inputs (token ids)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.embedding.default:
            continue
        weight, ids = node.args[0], node.args[1]
        while weight.op == "call_function" and weight.target in PASS_THROUGH:
            weight = weight.args[0]
        while ids.op == "call_function" and (ids.target in VIEWS or ids.target in PASS_THROUGH):
            ids = ids.args[0]
        info = placeholders.get(ids.name) if ids.op == "placeholder" else None
        if param_of(weight, placeholders) is not None and info is not None and info.kind == "input":
            found.append((node, placeholders[weight.name].target))
    return found


def _kv_fallback(region: _Region) -> bool:
    """Replicate an attention's narrower columns (key/value heads fewer than the axis); False if none."""
    widths = {p: p.node.meta["val"].shape[-1] for p in region.columns}
    narrow = [p for p in region.columns if widths[p] < max(widths.values())]
    if region.kind != "attention" or region.replicated or not narrow:
        return False
    region.replicated = narrow
    return True


def _checked(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo], kinds: dict, axis: str, size: int,
             regions: list[_Region]) -> tuple[list[_Region], dict[str, tuple[Placement, str, _Region]]]:
    """Regions that pass `check_candidates` (the others are rejected with the reason), and what
    parameters inside them want."""
    wants: dict[str, tuple[Placement, str, _Region]] = {}
    for _ in range(4):
        candidates = [_candidate(r, kinds) for r in regions]
        for candidate, region in zip(candidates, regions):
            candidate.seeds.update({fqn: w[0] for fqn, w in wants.items() if w[2] is region})
        results = check_candidates(gm, placeholders, axis=axis, size=size, candidates=candidates)
        changed, kept = False, []
        for region, result in zip(regions, results):
            if result.failure is not None and _kv_fallback(region):
                changed = True
            elif result.uneven is not None:
                raise result.uneven  # e.g. heads % tp != 0: the axis does not fit the model
            elif result.failure is not None:
                region.reject(result.failure)
                changed = True
                continue
            for fqn, (placement, consumer) in result.wants.items():
                if wants.get(fqn, (None,))[0] != placement:
                    wants[fqn] = (placement, consumer, region)
                    changed = True
            kept.append(region)
        regions = kept
        if not changed:
            return regions, wants
    raise PlanError("the tensor-parallel layout finder did not settle after 4 rounds; declare a layout: "
                    "tensor_parallel(layout=TransformerLayout(...))")


def _embedding_regions(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo]) -> list[_Region]:
    regions = []
    for node, weight in _token_embeddings(gm, placeholders):
        module = common_module([node])
        regions.append(_Region("embedding", [], [], {node}, module, f"{node.args[1].name} -> embedding",
                               embedding=weight))
    return regions


def _without_conflicts(regions: list[_Region]) -> list[_Region]:
    """A parameter seeded two ways (a weight shared by projections of different roles): later regions go."""
    seeded: dict[str, Placement] = {}
    kept = []
    for region in (r for r in regions if r.rejected is None):
        seeds = _seeds(region)
        clash = next((fqn for fqn, p in seeds.items() if seeded.get(fqn, p) != p), None)
        if clash is not None:
            region.reject(f"{clash} is also {seeded[clash]} elsewhere")
            continue
        seeded.update(seeds)
        kept.append(region)
    return kept


def _tied_to_rejected(regions: list[_Region], rejected_weights: set[str]) -> list[_Region]:
    """An embedding whose weight is also a head that failed stays replicated with it (one tensor)."""
    kept = []
    for region in regions:
        if region.embedding in rejected_weights:
            region.reject(f"its weight {region.embedding} is tied to a head that is not sharded")
            continue
        kept.append(region)
    return kept


def find_layout(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo], *, axis: str,
                size: int) -> FoundLayout:
    """The tensor-parallel layout of a traced graph on an axis of `size` ranks (module docstring).
    Within `context.sharing_sharding_decisions()` (the planner at scale) found once per graph and
    size: every in-node layout of one tensor-parallel degree plans a copy of the same trace."""
    store = shared_store()
    if store is None:
        return _find_layout(gm, placeholders, axis=axis, size=size)
    key = ("tensor-parallel layout", _fingerprint(gm, placeholders), axis, size)
    if key not in store:
        try:
            store[key] = _find_layout(gm, placeholders, axis=axis, size=size)
        except PlanError as error:
            store[key] = error
    if isinstance(store[key], PlanError):
        raise store[key]
    return store[key]


def _fingerprint(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo]) -> tuple:
    """What `_find_layout` reads of a graph: each node's op, target, arguments, shape and module
    stack, and what each placeholder is."""
    rows = []
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        rows.append((node.op, str(node.target), str(node.args), str(node.kwargs), str(shape),
                     tuple(module_stack(node)), placeholders.get(node.name)))
    return tuple(rows)


def _find_layout(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo], *, axis: str,
                 size: int) -> FoundLayout:
    ports = find_projections(gm, placeholders)
    kinds = classify(gm, placeholders, ports)
    found = _regions(components(gm, kinds, ports)) + _embedding_regions(gm, placeholders)
    accepted, wants = _checked(gm, placeholders, kinds, axis, size, _without_conflicts(found))
    heads_weights = {p.weight for r in found if r.kind == "head" for p in r.columns}
    rejected = heads_weights - {p.weight for r in accepted if r.kind == "head" for p in r.columns}
    if rejected & {r.embedding for r in accepted if r.embedding}:
        accepted, wants = _checked(gm, placeholders, kinds, axis, size, _tied_to_rejected(accepted, rejected))
    notes = [f"{r.where} not sharded: {r.rejected}" for r in found if r.rejected is not None]
    if not any(r.kind in ("attention", "mlp") for r in accepted):
        detail = "\n  ".join(notes) or "no projection feeds another through per-feature ops"
        raise PlanError(f"no tensor-parallel pattern found in the traced graph:\n  {detail}\n"
                        f"  fix: declare the layout: tensor_parallel(layout=TransformerLayout(name=..., column=(...), "
                        f"row=(...), embedding=(...), lm_head=(...), blocks=(...))), or leave tensor_parallel out")
    return FoundLayout(params=tuple(_choices(accepted, wants, found)), modules=tuple(_boundaries(accepted)),
                       notes=tuple(notes))


def _choices(accepted: list[_Region], wants: dict, found: list[_Region]) -> list[ParamChoice]:
    choices: dict[str, ParamChoice] = {}
    for region in accepted:
        where = f"{region.kind} pattern in {region.block or '<root>'}: {region.summary}"
        for fqn, placement in _seeds(region).items():
            role = ("vocabulary-parallel " + region.kind if region.kind in ("head", "embedding")
                    else "column" if any(fqn in (p.weight, p.bias) for p in region.columns) else "row")
            choices[fqn] = ParamChoice(fqn, placement, f"{role} of {where}")
        for p in region.rows:
            if p.bias is not None:
                choices[p.bias] = ParamChoice(p.bias, Replicate(), f"row bias of {where} (added once, after the reduction)")
        for p in region.replicated:
            for fqn in filter(None, (p.weight, p.bias)):
                choices[fqn] = ParamChoice(fqn, Replicate(), f"key/value projection of {where}: fewer heads than "
                                                             f"the axis, replicated; each rank slices the heads it needs")
        for fqn, (placement, consumer, owner) in wants.items():
            if owner is region and fqn not in choices:
                choices[fqn] = ParamChoice(fqn, placement, f"inside {where}: {consumer} takes it sharded")
    for region in found:
        if region.rejected is not None:
            for fqn in filter(None, [region.embedding] + [f for p in region.columns + region.rows for f in (p.weight, p.bias)]):
                choices.setdefault(fqn, ParamChoice(fqn, Replicate(), f"{region.where} not sharded: {region.rejected}"))
    return list(choices.values())


def _boundaries(accepted: list[_Region]) -> list[tuple[str, str]]:
    """(module, role) per accepted region: the innermost module holding the region. A block module
    that also holds an embedding or a head (the root) gets none; one inside another block's
    module (OPT's attention inside the layer that holds its MLP) gives way to it, so that what
    runs between two blocks of one module stays replicated."""
    ends = [n for r in accepted if r.kind in ("head", "embedding") for n in r.nodes | {p.node for p in r.columns}]
    blocks = {r.block for r in accepted if r.kind in ("attention", "mlp") and r.block
              and not any(r.block in module_stack(n) for n in ends)}
    outermost = {b for b in blocks if not any(b.startswith(other + ".") for other in blocks)}
    boundaries = []
    for region in accepted:
        if region.kind in ("attention", "mlp"):
            block = next((b for b in outermost if region.block == b or region.block.startswith(b + ".")), None)
            entry = (block, "block") if block is not None else None
        else:
            entry = (region.block, region.kind) if region.block else None
        if entry is not None and entry not in boundaries:
            boundaries.append(entry)
    return boundaries
