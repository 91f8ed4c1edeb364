"""autopar's own sharding rules, for ops DTensor has no rule for or shards in a way we cannot use.

DTensor's registry (`DTensor._op_dispatcher.sharding_propagator`) answers for most aten ops; the
propagation pass asks it first unless a rule here is registered for the op. A rule sees the
node and the placements its tensor arguments arrive with, and returns a `RuleResult`: output
spec(s), the spec each tensor argument must have, optionally a local kernel to run instead of the
aten op (`autopar.core.ops.local_ops`) and the collectives that kernel issues, for the ledger.
A rule may return None to hand the op back to DTensor.

Rules here (random ops' are `random_rules.py`'s): embedding (vocabulary-parallel), _log_softmax and nll_loss_forward (vocabulary- and
batch-sharded cross-entropy that never gathers the logits), sum over all dimensions written as
`sum.dim_IntList(x, [])` (DTensor keeps the input's Shard on the 0-d output), split_with_sizes of a block-sharded
(`_StridedShard`) fused projection into its blocks (HF GPT-2's q|k|v) and slices of whole blocks
(Phi-3's), copy (`aten.copy`: the result is the source, placed as the source is). Register one with `@register(op)`;
registering an op twice is an error (`registry.py`). Attention's rules are `attention_rules.py`'s, the
mixture-of-experts ones `expert_rules.py`'s.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.compiler.rules.registry import InternalCollective, RuleContext, RuleResult, register, spec_like
from autopar.core.errors import PlanError
from autopar.core.ir import hint, shard_dim, sym_size
from autopar.core.ops import local_ops

aten = torch.ops.aten


def _numel(value: torch.Tensor) -> sympy.Expr:
    total = sympy.Integer(1)
    for size in value.shape:
        total *= sym_size(size)
    return total


@register(aten.embedding.default)
def embedding_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """Vocabulary-sharded weight (Shard(0)) with replicated ids gives a Partial output; every
    `aten.embedding` argument is passed on (padding_idx: the kernel maps it to its local row)."""
    weight, ids = specs[:2]
    vocab_axes = [i for i, p in enumerate(weight.placements) if p == Shard(0)]
    if not vocab_axes:
        return None
    if len(vocab_axes) > 1 or any(not isinstance(p, (Replicate, Shard)) or p == Shard(1) for p in weight.placements):
        return None
    axis_index = vocab_axes[0]
    if any(bool(a) for a in node.args[3:5]):
        raise PlanError.at(node, "a vocabulary-parallel embedding cannot scale gradients by frequency or give sparse "
                                 "gradients (counts and rows would be those of one vocabulary shard)",
                           fix="keep this embedding's weight replicated on the tensor axis (declare a "
                               "TransformerLayout without it), or construct the embedding with "
                               "scale_grad_by_freq=False, sparse=False")
    ids_placements = list(ids.placements)
    ids_placements[axis_index] = Replicate()
    out = []
    for i, p in enumerate(ids_placements):
        out.append(Partial() if i == axis_index else p)
    return RuleResult(
        output=spec_like(weight, tuple(out), node.meta["val"]),
        required=[weight, spec_like(ids, tuple(ids_placements))] + [None] * (len(specs) - 2),
        local_kernel=local_ops.vocab_parallel_embedding,
        kernel_kwargs={"index": ("index", ctx.mesh_names[axis_index])},
    )


@register(aten._log_softmax.default)
def log_softmax_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """Sharded on the softmax dimension: run `sharded_log_softmax` (three all-reduces of one value per row)."""
    x = specs[0]
    value = node.args[0].meta["val"]
    dim = node.args[1] % value.dim()
    sharded = [i for i, p in enumerate(x.placements) if p == Shard(dim)]
    if not sharded:
        return None
    if len(sharded) > 1 or any(isinstance(p, Partial) for p in x.placements):
        return None
    axis_index = sharded[0]
    axis = ctx.mesh_names[axis_index]
    rows = _numel(value) / sym_size(value.shape[dim])
    for i, p in enumerate(x.placements):
        if shard_dim(p) is not None and i != axis_index:  # Shard or _StridedShard (rows of [batch, seq] cut on seq)
            rows = rows / ctx.mesh_shape[i]
    nbytes = rows * value.dtype.itemsize
    internal = [InternalCollective("all_reduce", axis, "forward", nbytes, value.dtype, "vocab-parallel softmax: row max"),
                InternalCollective("all_reduce", axis, "forward", nbytes, value.dtype, "vocab-parallel softmax: row sum(exp)"),
                InternalCollective("all_reduce", axis, "backward", nbytes, value.dtype, "vocab-parallel softmax: row sum(grad)")]
    return RuleResult(output=spec_like(x, x.placements, node.meta["val"]), required=[x, None, None],
                      local_kernel=local_ops.sharded_log_softmax, kernel_kwargs={"group": ("group", axis)},
                      internal=internal)


@register(aten.nll_loss_forward.default)
def nll_loss_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """[N, C] log-probs sharded on classes (dim 1) and/or batch (dim 0, with the target).

    Class shards give a Partial loss (each rank owns some targets' log-probs); batch shards are
    reduced inside the kernel, loss sum and target count in one all-reduce, so the mean over
    non-ignored targets is exact and the loss comes out replicated on those axes."""
    log_probs, target = specs[:2]
    value = node.args[0].meta["val"]
    if value.dim() != 2 or (len(node.args) > 2 and node.args[2] is not None):
        return None
    reduction = node.args[3] if len(node.args) > 3 else 1
    class_axis = None
    batch_axes = []
    lp_required, target_required, out, total = [], [], [], []
    for i, p in enumerate(log_probs.placements):
        t = target.placements[i]
        if p == Shard(1):
            if class_axis is not None:
                return None
            class_axis = i
            lp_required.append(p); target_required.append(Replicate())
            out.append(Partial()); total.append(Replicate())
        elif isinstance(p, _StridedShard) and p.dim == 0 and (t == p or isinstance(t, Replicate)):
            # rows of a flattened [batch, seq] sharded on seq (context parallel): which rows a rank
            # holds does not matter to a sum over rows
            batch_axes.append(i)
            lp_required.append(p); target_required.append(p)
            out.append(p if reduction == 0 else Replicate()); total.append(Replicate())
        elif p == Shard(0) or (isinstance(p, Replicate) and t == Shard(0)):
            batch_axes.append(i)
            lp_required.append(Shard(0)); target_required.append(Shard(0))
            # summed over the batch shards inside the kernel, together with the target count
            out.append(Shard(0) if reduction == 0 else Replicate()); total.append(Replicate())
        elif isinstance(p, Replicate) and isinstance(t, Replicate):
            lp_required.append(p); target_required.append(t); out.append(p); total.append(p)
        else:
            return None
    if class_axis is None and not batch_axes:
        return None
    out_val, total_val = node.meta["val"]
    fused = 1 if reduction == 0 else 2  # (loss sum, target count) in one all-reduce per batch axis
    internal = [InternalCollective("all_reduce", ctx.mesh_names[i], "forward",
                                   sympy.Integer(fused * total_val.dtype.itemsize), total_val.dtype,
                                   "loss over batch shards: (sum, count of targets)") for i in batch_axes]
    kwargs: dict[str, tuple[str, str]] = {"batch_groups": ("groups", ",".join(ctx.mesh_names[i] for i in batch_axes))}
    if class_axis is not None:
        kwargs["class_index"] = ("index", ctx.mesh_names[class_axis])
    else:
        kwargs["class_index"] = ("none", "")
    return RuleResult(
        output=(spec_like(log_probs, tuple(out), out_val), spec_like(log_probs, tuple(total), total_val)),
        required=[spec_like(log_probs, tuple(lp_required)), spec_like(target, tuple(target_required))]
        + [None] * (len(specs) - 2),
        local_kernel=local_ops.sharded_nll_loss, kernel_kwargs=kwargs, internal=internal)


@register(aten.split_with_sizes.default)
def split_blocks_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """A block-sharded dimension (each rank holds its part of every block) split into its equal
    blocks gives each block Shard(dim): the local split takes sizes / axis size."""
    x = specs[0]
    value = node.args[0].meta["val"]
    sizes, dim = node.args[1], node.args[2] % value.dim() if len(node.args) > 2 else 0
    strided = [i for i, p in enumerate(x.placements) if isinstance(p, _StridedShard) and p.dim == dim]
    if len(strided) != 1 or len(set(sizes)) != 1 or x.placements[strided[0]].split_factor != len(sizes):
        return None
    axis_index = strided[0]
    placements = tuple(Shard(dim) if i == axis_index else p for i, p in enumerate(x.placements))
    outputs = [spec_like(x, placements, v) for v in node.meta["val"]]
    return RuleResult(output=outputs, required=[x, None, None][:len(node.args)],
                      local_kernel=local_ops.split_equal_blocks,
                      kernel_kwargs={"parts": ("size", ctx.mesh_names[axis_index])})


@register(aten.slice.Tensor)
def slice_blocks_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """A slice of whole blocks of a block-sharded dimension (a fused q|k|v taken apart by slicing,
    as Phi-3 does) is block-sharded the same way: one block gives Shard(dim), several a
    `_StridedShard` over them; locally the bounds divide by the axis size. Other slices: DTensor."""
    x = specs[0]
    value = node.args[0].meta["val"]
    dim = (node.args[1] if len(node.args) > 1 else 0) % value.dim()
    strided = [i for i, p in enumerate(x.placements) if isinstance(p, _StridedShard) and p.dim == dim]
    if len(strided) != 1 or any(shard_dim(p) == dim for i, p in enumerate(x.placements) if i != strided[0]):
        return None
    size = hint(value.shape[dim])
    start, end, step = (list(node.args[2:5]) + [None, None, 1][len(node.args[2:5]):])
    if not all(isinstance(a, (int, type(None))) for a in (start, end, step)):
        return None
    start, end = min(max(start or 0, 0), size), min(end if end is not None else size, size)
    blocks = x.placements[strided[0]].split_factor
    width = size // blocks
    if step != 1 or start % width or end % width or end <= start:
        return None
    count = (end - start) // width
    placement = Shard(dim) if count == 1 else _StridedShard(dim, split_factor=count)
    placements = tuple(placement if i == strided[0] else p for i, p in enumerate(x.placements))
    return RuleResult(output=spec_like(x, placements, node.meta["val"]), required=[x] + [None] * (len(specs) - 1),
                      local_kernel=local_ops.slice_blocks,
                      kernel_kwargs={"parts": ("size", ctx.mesh_names[strided[0]])})


@register(aten.copy.default)
def copy_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """`copy(self, src)` is `src`'s values in `self`'s shape (multi-head latent attention writes its
    rotary part into a fresh tensor this way). Equal shapes: the output is placed as `src` is and
    `self` (overwritten) only needs the same local shape (sliced if sharded, else as it is). A
    broadcast `src` (the rotary key of one head written into every head's) keeps each shard of a
    dimension it does not broadcast (a batch shard: data and expert parallelism) on the same
    dimension of the output, and is replicated over the other axes. aten has no derivative for
    the functional copy, so it runs as `local_ops.copy_values` (gradient to `src`, summed over
    the broadcast, none to `self`)."""
    destination, source = specs[:2]
    if destination is None or source is None:
        return None
    if any(type(p) not in (Shard, Replicate, Partial) for p in source.placements + destination.placements):
        return None
    if destination.tensor_meta.shape == source.tensor_meta.shape:
        placements = source.placements
        wanted = tuple(p if isinstance(p, Shard) else Replicate() for p in source.placements)
        from_source = placements
    else:
        placements, from_source = _broadcast_shards(source, destination.tensor_meta.shape)
        wanted = placements
    return RuleResult(output=spec_like(destination, placements, node.meta["val"]),
                      required=[spec_like(destination, wanted), spec_like(source, from_source)]
                      + [None] * (len(specs) - 2),
                      local_kernel=local_ops.copy_values)


def _broadcast_shards(source: DTensorSpec, shape: torch.Size) -> tuple[tuple, tuple]:
    """(the output's placements, the source's required ones) for `source` broadcast to `shape`:
    a shard of a dimension the broadcast keeps stays (on the output's dimension, aligned from the
    right); every other placement becomes Replicate."""
    offset = len(shape) - len(source.tensor_meta.shape)
    out, required = [], []
    for p in source.placements:
        if isinstance(p, Shard) and offset >= 0 and source.tensor_meta.shape[p.dim] == shape[p.dim + offset]:
            out.append(Shard(p.dim + offset))
            required.append(p)
        else:
            out.append(Replicate())
            required.append(Replicate())
    return tuple(out), tuple(required)


@register(aten.slice_scatter.default)
def slice_scatter_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """`slice_scatter(base, src, dim, start, end)` (an in-place write into a slice, as multi-head
    latent attention assembles its queries and keys) keeps a shard of any other dimension that
    `base` or `src` holds (slicing the other to match): locally the write is the same slice of the
    rank's rows. A shard of `dim` itself, or a partial value, is replicated (DTensor's answer)."""
    base, src = specs[:2]
    if base is None or src is None:
        return None
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % node.args[0].meta["val"].dim()
    placements = []
    for on_base, on_src in zip(base.placements, src.placements):
        kept = [p for p in (on_base, on_src) if isinstance(p, Shard) and p.dim != dim]
        agree = all(p in kept or isinstance(p, Replicate) for p in (on_base, on_src))
        placements.append(kept[0] if kept and agree and len(set(kept)) == 1 else Replicate())
    placements = tuple(placements)
    if all(isinstance(p, Replicate) for p in placements):
        return None
    return RuleResult(output=spec_like(base, placements, node.meta["val"]),
                      required=[spec_like(base, placements), spec_like(src, placements)] + [None] * (len(specs) - 2))


@register(aten.sum.dim_IntList)
def sum_all_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """`sum(x, dim=[])` reduces every dimension: sharded or partial axes give a Partial scalar."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims not in ([], None, ()):
        return None
    x = specs[0]
    placements = tuple(Replicate() if isinstance(p, Replicate) else Partial() for p in x.placements)
    if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in x.placements):
        return None
    return RuleResult(output=spec_like(x, placements, node.meta["val"]), required=[x] + [None] * (len(specs) - 1))


