"""Sharding rules for mixture-of-experts ops: the grouped matmul and the routing kernels
`autopar/compiler/passes/lower_moe.py` puts in the graph (`autopar/core/ops/moe.py`).

Tokens of an experts block are routed one by one, so a rank may route whatever tokens it holds:
the rows of the permuted tokens are `Shard(0)` wherever the tokens are sharded by rows (data,
ZeRO, expert or sequence shards; which rows a rank holds does not matter to row-wise ops), and
the offsets (rows per expert) are the rank's own counts, kept `Replicate` in shape and never
redistributed. Per mesh axis:

| op                 | inputs                                   | output                          |
|--------------------|------------------------------------------|---------------------------------|
| grouped matmul     | rows S(0), weights R                     | rows S(0)                       |
|                    | rows S(0), weights S(0), offsets S(0)    | rows S(0) (dispatched: local experts) |
|                    | rows R, weights S(2) (columns)           | S(1)                            |
|                    | rows S(1), weights S(1) (reduction dim)  | Partial                         |
|                    | rows Partial, weights R                  | Partial                         |
|                    | rows S(0), weights sharded otherwise     | rows S(0), weights gathered     |
|                    | anything else                            | both replicated first           |
| moe_permute        | tokens and top-k ids sharded alike by rows (S(0) on every axis of a folded exchange) | rows S(0), offsets R, order S(0), ids S(0) |
| moe_unpermute      | rows S(0) / R / Partial, router weights  | the router weights' row placement; Partial stays Partial |
| moe_dispatch       | rows S(0) on the expert axis (every axis of `ep+tp`) | rows S(0), offsets S(0) (local experts), counts R |
| moe_combine        | rows S(0) on the expert axis (every axis of `ep+tp`) | rows S(0)                       |
| moe_rejoin         | tokens as `moe_unpermute` returns them   | as they entered `moe_permute` where it cut them (a gather) |

The exchange records its all-to-alls for the comm ledger under uniform routing (every rank
sends and receives as many rows as it routes); a run's exact bytes follow from the row counts
it records (`runtime.moe.ROUTING`, `runtime.moe.routing_bytes`).
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.compiler.rules.registry import InternalCollective, RuleContext, RuleResult, register, spec_like
from autopar.core.ir import ARG_SPECS, SPEC, local_numel, shard_dim, simplified
from autopar.core.mesh import JOIN
from autopar.core.ops import moe

# grouped matmul ops by name: rows [N, K] sorted by expert, weights [E, K, M], cumulative offsets [E]
GROUPED_MATMULS = {"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"}


def is_grouped_mm(target: Any) -> bool:
    return str(target) in GROUPED_MATMULS


def _rows(placement: Placement) -> bool:
    return shard_dim(placement) == 0


def _grouped_mm_choice(x: Placement, w: Placement, offs: Placement | None) -> tuple[Placement, Placement, Placement]:
    """(x required, w required, output) on one axis."""
    if _rows(x) and isinstance(w, Replicate):
        return x, w, Shard(0)
    if _rows(x) and w == Shard(0) and offs == Shard(0):
        return x, w, Shard(0)
    if isinstance(x, Replicate) and shard_dim(w) == 2:  # a fused gate|up: _StridedShard(2) -> blocks of columns
        return x, w, Shard(1) if type(w) is Shard else _StridedShard(1, split_factor=w.split_factor)
    if x == Shard(1) and w == Shard(1):
        return x, w, Partial()
    if isinstance(x, Partial) and isinstance(w, Replicate):
        return x, w, Partial()
    if _rows(x):  # never gather permuted rows: their offsets count the rank's own rows only
        return x, Replicate(), Shard(0)
    return Replicate(), Replicate(), Replicate()


@register(torch.ops.aten._grouped_mm.default)
@register("transformers.grouped_mm_fallback.default")
def grouped_mm_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult:
    """rows [N, K] x experts' weights [E, K, M] -> [N, M], rows grouped by expert (module docstring)."""
    x, w = specs[:2]
    offs = specs[2] if len(specs) > 2 else None
    chosen = [_grouped_mm_choice(px, pw, offs.placements[i] if offs is not None else None)
              for i, (px, pw) in enumerate(zip(x.placements, w.placements))]
    required = [spec_like(x, tuple(c[0] for c in chosen)), spec_like(w, tuple(c[1] for c in chosen))]
    return RuleResult(output=spec_like(x, tuple(c[2] for c in chosen), node.meta["val"]),
                      required=required + [None] * (len(specs) - 2))


def register_grouped_matmul(op: Any) -> None:
    """Declare a custom op a grouped matmul (rows [N, K] sorted by expert, weights [E, K, M],
    cumulative row offsets [E] -> [N, M]), like `aten._grouped_mm`: experts blocks using it are
    then found (`autopar/compiler/passes/lower_moe.py`) and it gets `grouped_mm_rule`. Registering it twice is harmless."""
    name = str(op)
    if name not in GROUPED_MATMULS:
        GROUPED_MATMULS.add(name)
        register(name)(grouped_mm_rule)


@register(moe.moe_permute)
def permute_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult:
    """Tokens keep their row shards. On an axis of the expert exchange's group where they are not
    sharded by rows (folded onto tensor parallelism without sequence parallelism: replicated), each
    rank routes its 1/n of them, Shard(0): a local slice; `moe_unpermute` returns them so sharded."""
    x, ids = specs[:2]
    exchanged = _exchanged_over(node, ctx)
    token, rows, counts = [], [], []
    for index, px in enumerate(x.placements):
        keep = px if _rows(px) else Shard(0) if index in exchanged else Replicate()
        token.append(keep)
        rows.append(Shard(0) if _rows(keep) else Replicate())
        counts.append(Replicate())
    vals = node.meta["val"]
    rows_t, counts_t = tuple(rows), tuple(counts)
    output = (spec_like(x, rows_t, vals[0]), spec_like(x, counts_t, vals[1]), spec_like(x, rows_t, vals[2]),
              spec_like(x, rows_t, vals[3]))
    return RuleResult(output=output, required=[spec_like(x, tuple(token)), spec_like(ids, tuple(token))])


@register(moe.moe_unpermute)
def unpermute_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult:
    """The tokens come back with the placement they were routed with (`moe_permute`'s input);
    rows still Partial (experts' row-parallel halves not yet summed) stay Partial."""
    y, order, weights = specs[:3]
    permute = node.args[1].args[0]
    tokens = permute.meta[ARG_SPECS][0].placements
    out, y_required, w_required = [], [], []
    for py, pt in zip(y.placements, tokens):
        if _rows(pt):
            out.append(pt); y_required.append(Shard(0)); w_required.append(pt)
        elif isinstance(py, Partial):
            out.append(py); y_required.append(py); w_required.append(Replicate())
        else:
            out.append(Replicate()); y_required.append(Replicate()); w_required.append(Replicate())
    return RuleResult(output=spec_like(y, tuple(out), node.meta["val"]),
                      required=[spec_like(y, tuple(y_required)), order, spec_like(weights, tuple(w_required))])


@register(moe.moe_rejoin)
def rejoin_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult:
    """The tokens back with the placement they entered `moe_permute` with on every axis where it
    sliced them for a folded exchange (`permute_rule`): an all-gather of the [T, d] tokens there.
    Tokens a folded axis holds as a sequence cut of flattened [batch, seq] rows (sequence
    parallelism: `_StridedShard(0)`) are gathered too: DTensor cannot always unflatten rows cut
    by two axes back into [batch, seq] (not when one sequence per rank is cut over 4 ranks), and
    the block's output is reshaped right after; the next op cuts them again where it wants them."""
    (tokens,) = specs[:1]
    permute = node.args[0].args[1].args[0]  # moe_rejoin(moe_unpermute(y, order := permute[2], ...))
    entered = permute.args[0].meta[SPEC].placements
    sliced = permute.meta[ARG_SPECS][0].placements
    exchanged = _exchanged_over(permute, ctx)
    placements = tuple(before if before != cut and not _rows(before) else
                       Replicate() if index in exchanged and isinstance(now, _StridedShard) else now
                       for index, (before, cut, now) in enumerate(zip(entered, sliced, tokens.placements)))
    return RuleResult(output=spec_like(tokens, placements, node.meta["val"]), required=[spec_like(tokens, placements)])


def _exchange_axes(node: torch.fx.Node, ctx: RuleContext) -> tuple[set[int], str]:
    """(mesh-axis indices, group key) of an exchange: one axis, or several folded (`ep+tp`)."""
    key = node.kwargs["group"]
    return {ctx.mesh_names.index(axis) for axis in key.split(JOIN)}, key


def _exchanged_over(permute: torch.fx.Node, ctx: RuleContext) -> set[int]:
    """The mesh-axis indices the `moe_dispatch` reading a `moe_permute`'s rows (through its
    getitem) exchanges over; none without expert parallelism."""
    dispatch = next((user for item in permute.users for user in item.users if user.target is moe.moe_dispatch), None)
    return _exchange_axes(dispatch, ctx)[0] if dispatch is not None else set()


def _row_bytes(value: torch.Tensor, placements: tuple[Placement, ...], ctx: RuleContext) -> sympy.Expr:
    return simplified(local_numel(tuple(value.shape), placements, ctx.mesh_shape) * value.dtype.itemsize)


@register(moe.moe_dispatch)
def dispatch_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult:
    rows, offsets = specs[:2]
    indices, axis = _exchange_axes(node, ctx)
    placements = tuple(Shard(0) if i in indices else p for i, p in enumerate(rows.placements))
    local_experts = tuple(Shard(0) if i in indices else Replicate() for i in range(len(ctx.mesh_names)))
    vals = node.meta["val"]
    replicated = (Replicate(),) * len(ctx.mesh_names)
    experts = vals[1].shape[0]
    nbytes = _row_bytes(vals[0], placements, ctx)
    why = f"expert parallelism ({node.kwargs.get('block', '')})"
    internal = [InternalCollective("all_to_all", axis, "forward", sympy.Integer(experts * 8), torch.int64,
                                   f"{why}: rows per expert"),
                InternalCollective("all_to_all", axis, "forward", nbytes, vals[0].dtype,
                                   f"{why}: token rows to their experts (uniform routing)"),
                InternalCollective("all_to_all", axis, "backward", nbytes, vals[0].dtype,
                                   f"{why}: gradients of the rows back (uniform routing)")]
    return RuleResult(output=(spec_like(rows, placements, vals[0]), spec_like(rows, local_experts, vals[1]),
                              spec_like(rows, replicated, vals[2])),
                      required=[spec_like(rows, placements), spec_like(offsets, replicated)],
                      local_kernel=moe.moe_dispatch,
                      kernel_kwargs={"group": ("group", axis), "size": ("size", axis), "index": ("index", axis)},
                      internal=internal)


@register(moe.moe_combine)
def combine_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult:
    rows, received, offsets = specs[:3]
    indices, axis = _exchange_axes(node, ctx)
    placements = tuple(Shard(0) if i in indices else p for i, p in enumerate(rows.placements))
    value = node.meta["val"]
    nbytes = _row_bytes(value, placements, ctx)
    why = "expert parallelism"
    internal = [InternalCollective("all_to_all", axis, "forward", nbytes, value.dtype,
                                   f"{why}: expert outputs back to their tokens (uniform routing)"),
                InternalCollective("all_to_all", axis, "backward", nbytes, value.dtype,
                                   f"{why}: gradients of the outputs to the experts (uniform routing)")]
    return RuleResult(output=spec_like(rows, placements, value), required=[spec_like(rows, placements), received,
                                                                            offsets],
                      local_kernel=moe.moe_combine,
                      kernel_kwargs={"group": ("group", axis), "size": ("size", axis)}, internal=internal)
