"""autopar's own sharding rules, for ops DTensor has no rule for or shards in a way we cannot use.

DTensor's registry (`DTensor._op_dispatcher.sharding_propagator`) answers for most aten ops; the
propagation pass asks it first unless a rule here is registered for the op. A rule sees the
node and the placements its tensor arguments arrive with, and returns a `RuleResult`: output
spec(s), the spec each tensor argument must have, optionally a local kernel to run instead of the
aten op (`autopar.runtime.local_ops`) and the collectives that kernel issues, for the ledger.
A rule may return None to hand the op back to DTensor.

Rules: scaled_dot_product_attention (batch- or head-sharded; DTensor has no rule for the CPU
kernel; sequence-sharded on a context-parallel axis: lowered to ring / all-gather / all-to-all
attention, `runtime/context_attention.py`), embedding (vocabulary-parallel), _log_softmax and nll_loss_forward (vocabulary- and
batch-sharded cross-entropy that never gathers the logits), sum over all dimensions written as
`sum.dim_IntList(x, [])` (DTensor keeps the input's Shard on the 0-d output), split_with_sizes of a block-sharded
(`_StridedShard`) fused projection into its blocks (HF GPT-2's q|k|v) and slices of whole blocks
(Phi-3's), copy (`aten.copy`: the result is the source, placed as the source is). Register one with `@register(op)`;
registering an op twice is an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.errors import PlanError
from autopar.ir import hint, local_numel, shard_dim, simplified, sym_size, tensor_meta
from autopar.runtime import context_attention, dropout, local_ops

aten = torch.ops.aten


@dataclass(frozen=True)
class InternalCollective:
    """A collective a local kernel issues: kind, axis, phase, logical bytes per call (sympy) and calls per use."""

    kind: str
    axis: str
    phase: str
    logical_bytes: sympy.Expr
    dtype: torch.dtype
    why: str
    calls: int = 1


@dataclass
class RuleResult:
    """`required[i]`: spec positional argument i must arrive with (None: not a tensor / as is).
    `unread_args`: positions the emitter passes as None, so what computed them can be dropped
    (a mask the planner read as causal). `kernel_kwargs`: keyword arguments the emitter binds per rank, name -> (kind, axis) with kind
    "index" (the rank's coordinate on axis), "size" (the axis size), "group" (its process-group
    name), "groups" (names for the comma-separated axes) or "none" (None)."""

    output: Any
    required: list[DTensorSpec | None]
    local_kernel: Callable[..., Any] | None = None
    kernel_kwargs: dict[str, tuple[str, str]] = field(default_factory=dict)
    internal: list[InternalCollective] = field(default_factory=list)
    unread_args: tuple[int, ...] = ()  # positional arguments the local kernel ignores: passed as None


@dataclass(frozen=True)
class RuleContext:
    mesh_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    context_axes: tuple = ()  # (axis, strategies.context.ContextDeclaration) per context-parallel axis

    def layout(self, axis: str) -> str:
        """How a dimension sharded on `axis` is cut (`runtime/sequence_chunks.py`)."""
        return next((d.layout for a, d in self.context_axes if a == axis), "contiguous")


_RULES: dict[Any, Callable[..., RuleResult | None]] = {}


def register(op: Any) -> Callable[[Callable[..., RuleResult | None]], Callable[..., RuleResult | None]]:
    def decorate(rule: Callable[..., RuleResult | None]) -> Callable[..., RuleResult | None]:
        if op in _RULES:
            raise ValueError(f"a sharding rule for {op} is already registered ({_RULES[op].__name__})")
        _RULES[op] = rule
        return rule

    return decorate


def lookup(op: Any) -> Callable[..., RuleResult | None] | None:
    """The rule for `op`; ops of libraries registered when imported (transformers' custom ops) are
    registered by their name."""
    return _RULES.get(op) or _RULES.get(str(op))


def _spec_like(spec: DTensorSpec, placements: tuple[Placement, ...], value: torch.Tensor | None = None) -> DTensorSpec:
    meta = spec.tensor_meta if value is None else tensor_meta(value)
    return DTensorSpec(spec.mesh, placements, meta)


def _numel(value: torch.Tensor) -> sympy.Expr:
    total = sympy.Integer(1)
    for size in value.shape:
        total *= sym_size(size)
    return total


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
    required: list[DTensorSpec | None] = [_spec_like(s, chosen_t) for s in (q, k, v)]
    if mask is not None:
        mask_val = node.args[3].meta["val"]
        mask_placements = tuple(p if isinstance(p, Shard) and hint(mask_val.shape[p.dim]) > 1 else Replicate()
                                for p in chosen_t)
        required.append(_spec_like(mask, mask_placements))
    required += [None] * (len(specs) - len(required))
    return RuleResult(output=_spec_like(q, chosen_t, node.meta["val"]), required=required)


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
    required: list[DTensorSpec | None] = [_spec_like(s, chosen_t) for s in specs[:3]]
    required += [None] * (len(specs) - len(required))  # a static mask is read as "causal" or "none"
    return RuleResult(
        output=_spec_like(q, chosen_t, node.meta["val"]), required=required,
        local_kernel=context_attention.context_attention,
        kernel_kwargs={"group": ("group", axis), "size": ("size", axis), "index": ("index", axis),
                       "method": ("value", declaration.method), "layout": ("value", declaration.layout),
                       "mask": ("value", static_mask_kind(mask) if mask is not None else "absent")},
        internal=_context_collectives(node, chosen_t, axis, declaration.method, ctx),
        unread_args=(3,) if len(node.args) > 3 and node.args[3] is not None else ())


def _refuse_unlocalisable(node: torch.fx.Node, axis: str, declaration: Any, size: int) -> None:
    """Plan-time errors for attention context parallelism cannot lower (the issue's bad inputs)."""
    q_val, k_val = node.args[0].meta["val"], node.args[1].meta["val"]
    where = f"attention on sequence shards over {axis!r} (context_parallel, method={declaration.method!r})"
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    if mask is not None and static_mask_kind(mask) is None:
        raise PlanError.at(node, f"{where}: its attention mask ({mask.name}) is not the causal mask or no mask "
                                 f"computed from positions alone (a padding, sliding-window or document mask, or "
                                 f"one read from an input), and cannot be localised to the rank's chunks",
                           fix="build the model so attention is causal or unmasked (is_causal=True, no attn_mask; "
                               "for Hugging Face models pass no attention_mask), or leave context_parallel out")
    if dropout:
        raise PlanError.at(node, f"{where} does not support attention dropout (dropout_p={dropout})",
                           fix="set the attention dropout to 0 (e.g. config.attention_dropout = 0.0)")
    device = q_val.device.type
    if declaration.method != "alltoall" and device not in ("meta", *context_attention.BLOCK_KERNELS):
        raise PlanError.at(node, f"{where}: no attention block kernel that returns the log-sum-exp is registered "
                                 f"for device {device!r} (registered: {', '.join(context_attention.BLOCK_KERNELS)})",
                           fix="use method='alltoall' (whole-sequence SDPA per head group), or register a kernel in "
                               "autopar.runtime.context_attention.BLOCK_KERNELS")
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


def static_mask_kind(mask: torch.fx.Node) -> str | None:
    """"causal" or "none" when `mask` is computed from constants alone (e.g. Hugging Face's mask
    built from `arange`s) and equals the causal lower triangle, or allows everything; None when it
    reads an input or parameter, fails to evaluate, or is anything else. Evaluated once per node at
    the example's sizes, on CPU."""
    if "autopar_mask_kind" in mask.meta:
        return mask.meta["autopar_mask_kind"]
    mask.meta["autopar_mask_kind"] = kind = _evaluate_mask_kind(mask)
    return kind


def _evaluate_mask_kind(mask: torch.fx.Node) -> str | None:
    ancestors, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node not in ancestors:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    if any(node.op != "call_function" for node in ancestors):
        return None
    values: dict[torch.fx.Node, Any] = {}

    def concrete(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return values[value]
        return torch.device("cpu") if isinstance(value, torch.device) else hint(value)

    try:
        for node in (n for n in mask.graph.nodes if n in ancestors):
            args, kwargs = torch.utils._pytree.tree_map(concrete, (node.args, dict(node.kwargs)))
            values[node] = node.target(*args, **kwargs)
    except Exception:  # an op that does not run on constants here: not a mask we can read
        return None
    value = values[mask]
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    if value.dtype == torch.bool:
        allowed = value
    else:
        allowed = value > torch.finfo(value.dtype).min / 2
        if bool((value[allowed] != 0).any()):
            return None  # an additive bias, not a mask
    rows, cols = value.shape[-2:]
    if bool(allowed.all()):
        return "none"
    causal = torch.ones(rows, cols, dtype=torch.bool).tril()
    return "causal" if bool((allowed == causal).all()) else None


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
        moved = [("forward", k, size - 1, "ring: K blocks to the next rank"),
                 ("forward", v, size - 1, "ring: V blocks to the next rank"),
                 ("backward", k, size - 1, "ring: K blocks again"), ("backward", v, size - 1, "ring: V blocks again"),
                 ("backward", dk, size, "ring: dK accumulators (fp32), the last one home"),
                 ("backward", dv, size, "ring: dV accumulators (fp32), the last one home")]
        return [InternalCollective(kind, axis, phase, nbytes, dtype, why, calls=calls)
                for phase, nbytes, calls, why in moved if calls for kind in ("send", "recv")]
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


@register(aten.native_dropout.default)
def dropout_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """Dropout on a sharded tensor keeps its placement and draws the single-device mask
    (`runtime/dropout.py`): the whole mask on every rank, the rank's piece applied. Replicated
    (every rank draws the same mask itself) and Partial inputs go to DTensor (which replicates)."""
    x = specs[0]
    if x is None or any(isinstance(p, Partial) for p in x.placements):
        return None
    cuts, kwargs = [], {}
    for axis, parts, placement in zip(ctx.mesh_names, ctx.mesh_shape, x.placements):
        if shard_dim(placement) is None:
            continue
        cuts.append(f"{axis}:{placement.dim}:{parts}:{ctx.layout(axis)}:{getattr(placement, 'split_factor', 1)}")
        kwargs[f"index_{axis}"] = ("index", axis)
    if not cuts:
        return None
    out_val, mask_val = node.meta["val"]
    return RuleResult(output=(_spec_like(x, x.placements, out_val), _spec_like(x, x.placements, mask_val)),
                      required=[x] + [None] * (len(specs) - 1), local_kernel=dropout.sharded_dropout,
                      kernel_kwargs={"cuts": ("value", ";".join(cuts)), **kwargs})


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
        output=_spec_like(weight, tuple(out), node.meta["val"]),
        required=[weight, _spec_like(ids, tuple(ids_placements))] + [None] * (len(specs) - 2),
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
    return RuleResult(output=_spec_like(x, x.placements, node.meta["val"]), required=[x, None, None],
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
        output=(_spec_like(log_probs, tuple(out), out_val), _spec_like(log_probs, tuple(total), total_val)),
        required=[_spec_like(log_probs, tuple(lp_required)), _spec_like(target, tuple(target_required))]
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
    outputs = [_spec_like(x, placements, v) for v in node.meta["val"]]
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
    return RuleResult(output=_spec_like(x, placements, node.meta["val"]), required=[x] + [None] * (len(specs) - 1),
                      local_kernel=local_ops.slice_blocks,
                      kernel_kwargs={"parts": ("size", ctx.mesh_names[strided[0]])})


@register(aten.copy.default)
def copy_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """`copy(self, src)` is `src`'s values in `self`'s shape (multi-head latent attention writes its
    rotary part into a fresh tensor this way). Equal shapes: the output is placed as `src` is and
    `self` (overwritten) only needs the same local shape (sliced if sharded, else as it is); a
    broadcast `src`: everything replicated. aten has no derivative for the functional copy, so
    it runs as `local_ops.copy_values` (gradient to `src`, none to `self`)."""
    destination, source = specs[:2]
    if destination is None or source is None:
        return None
    if any(type(p) not in (Shard, Replicate, Partial) for p in source.placements + destination.placements):
        return None
    if destination.tensor_meta.shape == source.tensor_meta.shape:
        placements = source.placements
        wanted = tuple(p if isinstance(p, Shard) else Replicate() for p in source.placements)
    else:
        placements = wanted = (Replicate(),) * len(ctx.mesh_names)
    return RuleResult(output=_spec_like(source, placements, node.meta["val"]),
                      required=[_spec_like(destination, wanted), _spec_like(source, placements)]
                      + [None] * (len(specs) - 2),
                      local_kernel=local_ops.copy_values)


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
    return RuleResult(output=_spec_like(x, placements, node.meta["val"]), required=[x] + [None] * (len(specs) - 1))


from autopar import expert_rules  # noqa: E402,F401  (registers the mixture-of-experts rules)
