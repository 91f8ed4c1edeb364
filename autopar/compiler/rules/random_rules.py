"""Random ops: every rank draws the single-device model's values, or the plan is refused.

One device draws each random tensor whole from its generator; every rank starts from the same
seed, so an op a rank runs whole (its inputs replicated, or no tensor inputs: `rand`, `randn`,
`randint`, `randperm`) draws one device's values by itself. An op on a shard must draw the
whole tensor and keep its piece (`autopar/core/ops/dropout.py`); anything else is refused,
because a rank drawing only its shard's values would differ from one device from the first
step on, and leave its generator elsewhere for every later draw.

- `draws`: whether a node draws at run time (a `nondeterministic_seeded` op; dropout only with
  p > 0 in training, attention only with dropout_p > 0).
- `dropout_rule`, `fresh_draw_rule`: autopar's rules for `native_dropout` and for the ops DTensor
  has no rule for whose values depend on the input's shape only (`uniform`, `bernoulli(x, p)`,
  `exponential`): the input's placements kept, its piece of the whole draw kept.
- `one_device_draws`: after DTensor decided a random op (a Partial dropout input it reduce-
  scatters, `rand_like` / `randn_like` / `normal` of a shard, `bernoulli` of sharded
  probabilities), the kernel that draws one device's values for those placements, or
  `refuse_draw`'s PlanError (naming the op, its module and source line, and the fix); a draw on
  a mixture-of-experts block's routed rows (tokens sorted by expert) on shards is refused too.
- `cuts`: a placement's cuts, as the kernels read them; `what_to_zero`: the setting a refusal's fix
  names. Attention dropout on shards is `attention_rules.py`'s, under a pipeline every draw is
  refused by `autopar/compiler/passes/split_pipeline.py` (each stage has its own generator).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement

from autopar.compiler.rules.registry import RuleContext, RuleResult, register, spec_like
from autopar.core.errors import PlanError
from autopar.core.ir import ARG_SPECS, SPEC, describe, hint, shard_dim
from autopar.core.ops import dropout, moe

aten = torch.ops.aten

# ops whose values depend on their input's shape, dtype and layout only (`dropout.drawn_like`)
DRAWN_LIKE = {aten.uniform.default: "uniform.default", aten.bernoulli.p: "bernoulli.p",
              aten.exponential.default: "exponential.default",
              aten.normal_functional.default: "normal_functional.default", aten.rand_like.default: "rand_like.default",
              aten.randn_like.default: "randn_like.default", aten.randint_like.default: "randint_like.default",
              aten.randint_like.low_dtype: "randint_like.low_dtype"}
_DTENSOR_LACKS = (aten.uniform.default, aten.bernoulli.p, aten.exponential.default)


def what_to_zero(node: torch.fx.Node) -> str:
    """The setting that turns `node`'s draw off, in the words of a Hugging Face config."""
    name = node.target.name() if isinstance(node.target, torch._ops.OpOverload) else str(node.target)
    if "attention" in name:
        return "the attention dropout to 0 (e.g. config.attention_dropout = 0.0, GPT-2's attn_pdrop = 0.0)"
    if "dropout" in name:
        return "this dropout's probability to 0 (e.g. config.hidden_dropout = 0.0, GPT-2's resid_pdrop = 0.0)"
    return "this noise to 0 (e.g. config.router_jitter_noise = 0.0 for a router's uniform_ jitter)"


def argument(node: torch.fx.Node, name: str, default: Any = None) -> Any:
    """The value `node` passes for its op's argument `name` (the schema's default when left out)."""
    schema = getattr(node.target, "_schema", None)
    for index, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == name:
            if index < len(node.args) and not arg.kwarg_only:
                return node.args[index]
            return node.kwargs.get(name, arg.default_value if arg.has_default_value() else default)
    return default


def draws(node: torch.fx.Node) -> bool:
    """Whether running `node` draws from the generator."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if "dropout" in target.name() and "attention" not in target.name():
        return bool(argument(node, "p")) and argument(node, "train", True) is not False
    if any(arg.name == "dropout_p" for arg in target._schema.arguments):
        return bool(argument(node, "dropout_p"))
    return True


def refuse_draw(node: torch.fx.Node, placements: str, why: str) -> PlanError:
    """The PlanError of a random op whose rank graph would not draw one device's values."""
    return PlanError.at(node, f"{node.target} draws random values on a shard ({placements}) and {why}: each rank "
                              f"would draw values of its own, not the single-device model's, and leave its "
                              f"generator elsewhere for every later draw",
                        fix=f"set {what_to_zero(node)} for training with autopar, or draw the tensor outside the "
                            f"model and pass it as an input, or use a strategy that keeps this op's inputs replicated")


def cuts(placements: tuple[Placement, ...], ctx: RuleContext) -> tuple[str, dict[str, tuple[str, str]]]:
    """"axis:dim:size:layout:blocks" per sharding axis, ';'-joined, outermost first, and the
    kernel's `index_<axis>` keyword arguments (the rank's coordinate on each)."""
    entries, indices = [], {}
    for axis, parts, placement in zip(ctx.mesh_names, ctx.mesh_shape, placements):
        if shard_dim(placement) is None:
            continue
        entries.append(f"{axis}:{placement.dim}:{parts}:{ctx.layout(axis)}:{getattr(placement, 'split_factor', 1)}")
        indices[f"index_{axis}"] = ("index", axis)
    return ";".join(entries), indices


def _layout(value: torch.Tensor) -> str:
    """The memory layout of one device's output, dims outermost first (`torch.empty_permuted`)."""
    strides = [hint(s) for s in value.stride()]
    return ",".join(str(d) for d in sorted(range(value.dim()), key=lambda d: -strides[d]))


def on_routed_rows(node: torch.fx.Node) -> bool:
    """Whether `node` reads a mixture-of-experts block's routed rows (tokens in expert order,
    between `moe_permute` and `moe_unpermute`): a rank's rows there are not a block of one device's."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.target in (moe.moe_permute, moe.moe_dispatch):
            return True
        if current.target not in (moe.moe_unpermute, moe.moe_combine):
            stack.extend(current.all_input_nodes)
    return False


def _kernel(node: torch.fx.Node, placements: tuple[Placement, ...], ctx: RuleContext
            ) -> tuple[Any, dict[str, tuple[str, str]]] | None:
    """The kernel drawing one device's values for an output placed `placements`, with its keyword
    arguments; None when `node.target` has none. Refused on routed rows (`on_routed_rows`)."""
    if on_routed_rows(node):
        raise refuse_draw(node, describe(placements), "it reads a mixture-of-experts block's routed rows (tokens "
                                                      "sorted by expert: a rank's rows are not a block of one "
                                                      "device's)")
    cut, indices = cuts(placements, ctx)
    kwargs = {"cuts": ("value", cut), **indices}
    if node.target is aten.native_dropout.default:
        return dropout.sharded_dropout, kwargs
    if node.target is aten.bernoulli.default:
        return dropout.bernoulli_of_shard, kwargs
    if node.target in DRAWN_LIKE:
        value = node.meta["val"]
        return dropout.drawn_like, {"draw": ("value", DRAWN_LIKE[node.target]), "order": ("value", _layout(value)),
                                    **kwargs}
    return None


@register(aten.native_dropout.default)
def dropout_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """Dropout on a sharded tensor keeps its placement and draws the single-device mask: the whole
    mask on every rank, the rank's piece applied. Replicated inputs (every rank draws the same mask
    itself) and Partial ones go to DTensor (`one_device_draws` then gives its choice the kernel)."""
    x = specs[0]
    if x is None or any(isinstance(p, Partial) for p in x.placements) or not cuts(x.placements, ctx)[0]:
        return None
    kernel, kwargs = _kernel(node, x.placements, ctx)
    out_val, mask_val = node.meta["val"]
    return RuleResult(output=(spec_like(x, x.placements, out_val), spec_like(x, x.placements, mask_val)),
                      required=[x] + [None] * (len(specs) - 1), local_kernel=kernel, kernel_kwargs=kwargs)


def fresh_draw_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult | None:
    """`uniform(x)`, `bernoulli(x, p)`, `exponential(x)`: values of `x`'s shape, `x`'s own unread.
    The output keeps `x`'s shards (drawn whole, the piece kept); a Partial `x` already has the
    whole shape, so the output is replicated there."""
    x = specs[0]
    if x is None or any(not isinstance(p, (Partial, Replicate)) and shard_dim(p) is None for p in x.placements):
        return None
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
    out = spec_like(x, placements, node.meta["val"])
    required = [x] + [None] * (len(specs) - 1)
    if not cuts(placements, ctx)[0]:
        return RuleResult(output=out, required=required)
    kernel, kwargs = _kernel(node, placements, ctx)
    return RuleResult(output=out, required=required, local_kernel=kernel, kernel_kwargs=kwargs)


for _op in _DTENSOR_LACKS:
    register(_op)(fresh_draw_rule)


def one_device_draws(node: torch.fx.Node, ctx: RuleContext) -> RuleResult | None:
    """For a random op DTensor placed (`SPEC`, `ARG_SPECS` set): None when it runs whole on every
    rank, the kernel drawing one device's values on its output's shards, or a PlanError."""
    if not draws(node):
        return None
    output = node.meta[SPEC]
    outputs = [s for s in (output if isinstance(output, (tuple, list)) else (output,)) if isinstance(s, DTensorSpec)]
    inputs = [s for s in node.meta.get(ARG_SPECS, []) if isinstance(s, DTensorSpec)]
    if all(isinstance(p, Replicate) for s in inputs + outputs for p in s.placements):
        return None
    placements = outputs[0].placements
    shown = describe(placements)
    if any(s.placements != placements for s in outputs + inputs[:1]):
        raise refuse_draw(node, shown, "its input and output are placed differently")
    if any(isinstance(p, Partial) for p in placements):
        raise refuse_draw(node, shown, "a partial sum cannot be drawn on")
    found = _kernel(node, placements, ctx)
    if found is None:
        raise refuse_draw(node, shown, "autopar cannot draw one device's values for it on a shard")
    kernel, kwargs = found
    return RuleResult(output=output, required=list(node.meta.get(ARG_SPECS, [])), local_kernel=kernel,
                      kernel_kwargs=kwargs)
