"""autopar's sharding rules for attention: `scaled_dot_product_attention`, which DTensor has no
rule for on the CPU kernel.

Batch- or head-sharded attention keeps that sharding (`sdpa_rule`; with dropout_p > 0 it applies
the rank's piece of one device's mask, `_attention_dropout`); attention on sequence shards
over a context-parallel axis is lowered to ring / all-gather / all-to-all attention
(`context_attention_rule`, `autopar/core/ops/context_attention.py`), its mask recognised at plan time as
causal or absent (`mask_kind.static_mask_kind`) or else passed whole along the sequence (a
document, padding or sliding-window mask read from the data), and its collectives declared for the ledger
(`_context_collectives`). Registered in `autopar.compiler.rules.registry`; importing `autopar.compiler.rules` loads this module.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement

from autopar.compiler.rules.mask_kind import static_mask_kind
from autopar.compiler.rules.random_rules import cuts, draws, refuse_draw
from autopar.compiler.rules.registry import InternalCollective, RuleContext, RuleResult, register, spec_like
from autopar.core.errors import PlanError
from autopar.core.ir import describe, hint, local_numel, simplified
from autopar.core.ops import context_attention, dropout

aten = torch.ops.aten


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult:
    """q sharded on batch (0) or heads (1) keeps that sharding when k and v are sharded alike or
    replicated (then sliced locally: key/value heads a rank holds whole, e.g. replicated because
    the tensor axis exceeds the key/value heads, after repeat_kv); q, k and v sharded on the
    sequence (2) over a context-parallel axis keep it and the op is lowered to
    `runtime.context_attention` (`context_attention_rule`); anything else replicates."""
    q, k, v = specs[:3]
    lowered = context_attention_rule(node, specs, ctx)
    if lowered is not None:
        return lowered
    mask = specs[3] if len(specs) > 3 else None
    chosen = []
    for axis_index in range(len(ctx.mesh_names)):
        placement = q.placements[axis_index]
        same = all(s.placements[axis_index] in (placement, Replicate()) for s in (k, v))
        keep = type(placement) is Shard and placement.dim in (0, 1) and same
        chosen.append(placement if keep else Replicate())
    chosen_t = tuple(chosen)
    required: list[DTensorSpec | None] = [spec_like(s, chosen_t) for s in (q, k, v)]
    if mask is not None:
        required.append(spec_like(mask, _mask_placements(node, chosen_t)))
    required += [None] * (len(specs) - len(required))
    output = spec_like(q, chosen_t, node.meta["val"])
    if not draws(node) or all(isinstance(p, Replicate) for p in chosen_t):
        return RuleResult(output=output, required=required)
    return RuleResult(output=output, required=required, **_attention_dropout(node, chosen_t, ctx))


def _mask_placements(node: torch.fx.Node, chosen: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The attention mask's placements for attention computed on `chosen`: the batch and head
    shards where the mask has those dims (it broadcasts from the right), whole elsewhere (a
    sequence shard of the query leaves the mask whole: the context kernels cut it per block)."""
    mask_val = node.args[3].meta["val"]
    offset = node.args[0].meta["val"].dim() - mask_val.dim()

    def on_mask(p: Placement) -> Placement:
        if isinstance(p, Shard) and p.dim in (0, 1) and p.dim >= offset and hint(mask_val.shape[p.dim - offset]) > 1:
            return Shard(p.dim - offset)
        return Replicate()
    return tuple(on_mask(p) for p in chosen)


def _attention_dropout(node: torch.fx.Node, chosen: tuple[Placement, ...], ctx: RuleContext) -> dict[str, Any]:
    """Attention dropout on batch / head shards: the local kernel applying the rank's piece of the
    mask one device's CPU kernel draws (`autopar/core/ops/dropout.attention_dropout`). Another
    device's kernel draws its mask in its own way (CUDA's Philox offsets): refused."""
    device = node.args[0].meta["val"].device.type
    if device not in ("cpu", "meta"):
        raise refuse_draw(node, describe(chosen), f"the {device} attention kernel's dropout mask "
                                                               f"cannot be drawn whole and cut")
    cut, indices = cuts(chosen, ctx)
    return {"local_kernel": dropout.attention_dropout, "kernel_kwargs": {"cuts": ("value", cut), **indices}}


def context_attention_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext
                           ) -> RuleResult | None:
    """Attention whose query arrives sequence-sharded (Shard(2) of [batch, heads, seq, head_dim]) on a
    context-parallel axis: q, k and v stay sequence-sharded there, batch and head shards on the other
    axes are kept as `sdpa_rule` keeps them, and the node runs `context_attention` with the axis'
    method. What each method moves is recorded for the ledger (`_context_collectives`)."""
    q = specs[0]
    found = [(axis, d) for axis, d in ctx.context_axes if q.placements[ctx.mesh_names.index(axis)] == Shard(2)]
    if not found:
        return None
    axis, declaration = found[0]
    axis_index = ctx.mesh_names.index(axis)
    _refuse_unlocalisable(node, axis, declaration, ctx.mesh_shape[axis_index])
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    chosen = []
    for i in range(len(ctx.mesh_names)):
        placement = q.placements[i]
        keep = i == axis_index or (type(placement) is Shard and placement.dim in (0, 1)
                                   and all(s.placements[i] in (placement, Replicate()) for s in specs[1:3]))
        chosen.append(placement if keep else Replicate())
    chosen_t = tuple(chosen)
    required: list[DTensorSpec | None] = [spec_like(s, chosen_t) for s in specs[:3]]
    # a mask computed from positions is read as "causal" or "none" and not passed; one read from the
    # data (documents, padding, a window) is passed whole along the sequence (context_attention.py)
    kind = "absent" if mask is None else static_mask_kind(mask) or "tensor"
    if kind == "tensor":
        required.append(spec_like(specs[3], _mask_placements(node, chosen_t)))
    required += [None] * (len(specs) - len(required))
    return RuleResult(
        output=spec_like(q, chosen_t, node.meta["val"]), required=required,
        local_kernel=context_attention.context_attention,
        kernel_kwargs={"group": ("group", axis), "size": ("size", axis), "index": ("index", axis),
                       "method": ("value", declaration.method), "layout": ("value", declaration.layout),
                       "mask": ("value", kind)},
        internal=_context_collectives(node, chosen_t, axis, declaration.method, ctx),
        unread_args=(3,) if kind in ("causal", "none") else ())


def _refuse_unlocalisable(node: torch.fx.Node, axis: str, declaration: Any, size: int) -> None:
    """Plan-time errors for attention context parallelism cannot lower (the issue's bad inputs)."""
    q_val, k_val = node.args[0].meta["val"], node.args[1].meta["val"]
    where = f"attention on sequence shards over {axis!r} (context_parallel, method={declaration.method!r})"
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    if mask is not None and len(node.args) <= 3:  # aten's graphs pass it by position; kept out of the rule's specs
        raise PlanError.at(node, f"{where}: its attention mask ({mask.name}) is passed by keyword, which the "
                                 f"context-parallel rule cannot place", fix="pass attn_mask by position")
    if dropout:
        raise PlanError.at(node, f"{where} does not support attention dropout (dropout_p={dropout})",
                           fix="set the attention dropout to 0 (e.g. config.attention_dropout = 0.0)")
    seq = q_val.shape[2]
    parts = 2 * size if declaration.load_balance else size
    if isinstance(seq, int) and seq % parts:
        why = "2·cp chunks with load_balance=True" if declaration.load_balance else "cp chunks"
        raise PlanError.at(node, f"{where}: sequence length {seq} does not divide into {parts} equal {why}",
                           fix=f"use a sequence length divisible by {parts}"
                               + (", or load_balance=False (then divisible by the axis size)"
                                  if declaration.load_balance else ""))
    if declaration.method == "alltoall":
        for name, value in (("query", q_val), ("key/value", k_val)):
            if isinstance(value.shape[1], int) and value.shape[1] % size:
                raise PlanError.at(node, f"{where}: {value.shape[1]} {name} heads do not divide over {size} ranks "
                                         f"(all-to-all scatters heads)",
                                   fix=f"use method='ring' or 'allgather', or an axis size dividing {value.shape[1]}")


def _context_collectives(node: torch.fx.Node, placements: tuple[Placement, ...], axis: str, method: str,
                         ctx: RuleContext) -> list[InternalCollective]:
    """What context_attention moves per use, one record per tensor moved, in logical bytes of the
    rank's shards. Gradients of K/V travel (ring) or are reduce-scattered (allgather) as fp32."""
    size = ctx.mesh_shape[ctx.mesh_names.index(axis)]
    q_val, k_val, v_val = (a.meta["val"] for a in node.args[:3])

    def local(value: torch.Tensor, dtype: torch.dtype | None = None) -> sympy.Expr:
        numel = local_numel(tuple(value.shape), placements, ctx.mesh_shape)
        return simplified(numel * (dtype or value.dtype).itemsize)

    k, v = local(k_val), local(v_val)
    dk, dv = local(k_val, torch.float32), local(v_val, torch.float32)
    dtype = k_val.dtype
    if method == "ring":  # one send and one receive per tensor and step (module docstring of the kernel)
        moved = [("forward", k, size - 1, dtype, "ring: K blocks to the next rank"),
                 ("forward", v, size - 1, dtype, "ring: V blocks to the next rank"),
                 ("backward", k, size - 1, dtype, "ring: K blocks again"),
                 ("backward", v, size - 1, dtype, "ring: V blocks again"),
                 ("backward", dk, size, torch.float32, "ring: dK accumulators (fp32), the last one home"),
                 ("backward", dv, size, torch.float32, "ring: dV accumulators (fp32), the last one home")]
        return [InternalCollective(kind, axis, phase, nbytes, moved_dtype, why, calls=calls)
                for phase, nbytes, calls, moved_dtype, why in moved if calls for kind in ("send", "recv")]
    if method == "allgather":  # S of a gather is the gathered size, of a reduce-scatter its input
        return [InternalCollective("all_gather", axis, phase, simplified(size * t), dtype, f"{name} all-gathered{again}")
                for phase, again in (("forward", ""), ("backward", " again (only the shards are saved)"))
                for name, t in (("K", k), ("V", v))] + [
                InternalCollective("reduce_scatter", axis, "backward", simplified(size * t), torch.float32,
                                   f"{name} reduce-scattered (fp32)") for name, t in (("dK", dk), ("dV", dv))]
    out = local(node.meta["val"])
    return [InternalCollective("all_to_all", axis, phase, nbytes, dtype, f"Ulysses: {name} ({phase})")
            for phase in ("forward", "backward")
            for name, nbytes in (("query", local(q_val)), ("key", k), ("value", v), ("output", out))]
