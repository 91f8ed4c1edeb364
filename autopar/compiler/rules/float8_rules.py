"""The sharding rule of FP8 linear products (`autopar/core/ops/float8_matmul.py`), put in the graph by
`autopar/compiler/passes/float8_linears.py`.

`float8_matmul(x [..., K], weight [N, K])` takes the layouts a matrix product takes, per mesh axis:

| x                       | weight | output         | the axis cuts |
|-------------------------|--------|----------------|---------------|
| S(d), d a row dimension | R      | S(d)           | rows (M)      |
| S(-1)                   | S(1)   | Partial(sum)   | inner (K)     |
| R                       | S(0)   | S(-1)          | cols (N)      |
| R                       | strided S(0) | strided S(-1) | cols (N): a fused projection's blocks, each cut |
| anything else           | R      | R (both gathered first) | nothing |

A Partial input is reduced first: an 8-bit cast is not linear, so partial sums cannot be cast apart.
Under `float8(data_scales="local")` (the node's `local_rows`) the axes cutting the rows are not
listed: each rank scales the rows it holds. The kernel all-reduces (max) each scale's largest
magnitude over the axes cutting the dimensions it spans (`float8_matmul.reductions`), so every rank
casts with one device's scales; `_scale_collectives` declares those all-reduces for the comm ledger,
in the magnitude's dtype."""
from __future__ import annotations

import sympy
import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.compiler.rules.registry import InternalCollective, RuleContext, RuleResult, register, spec_like
from autopar.core.ir import shard_dim, simplified, sym_size
from autopar.core.ops.float8_matmul import RECIPES, float8_matmul, reductions


@register(float8_matmul)
def float8_matmul_rule(node: torch.fx.Node, specs: list[DTensorSpec | None], ctx: RuleContext) -> RuleResult:
    x, weight = specs[0], specs[1]
    last = node.args[0].meta["val"].dim() - 1
    x_out: list[Placement] = []
    w_out: list[Placement] = []
    out: list[Placement] = []
    cut: dict[str, list[str]] = {"rows": [], "inner": [], "cols": []}
    row_parts = 1  # how many pieces the rows are cut in (the ledger's local sizes), reduced over or not
    for i, axis in enumerate(ctx.mesh_names):
        px, pw = x.placements[i], weight.placements[i]
        dim = shard_dim(px)
        if dim is not None and dim < last:
            kind, placements = "rows", (px, Replicate(), px)
            row_parts *= ctx.mesh_shape[i]
        elif dim == last or shard_dim(pw) == 1:
            kind, placements = "inner", (Shard(last), Shard(1), Partial())
        elif isinstance(pw, _StridedShard) and pw.dim == 0:  # a fused projection's blocks, each cut
            kind, placements = "cols", (Replicate(), pw, _StridedShard(last, split_factor=pw.split_factor))
        elif shard_dim(pw) == 0:
            kind, placements = "cols", (Replicate(), Shard(0), Shard(last))
        else:
            kind, placements = None, (Replicate(), Replicate(), Replicate())
        if kind is not None and ctx.mesh_shape[i] > 1 and not (kind == "rows" and node.kwargs.get("local_rows")):
            cut[kind].append(axis)
        x_out.append(placements[0])
        w_out.append(placements[1])
        out.append(placements[2])
    recipe = node.kwargs["recipe"]
    return RuleResult(
        output=spec_like(x, tuple(out), node.meta["val"]),
        required=[spec_like(x, tuple(x_out)), spec_like(weight, tuple(w_out))] + [None] * (len(specs) - 2),
        local_kernel=float8_matmul,
        kernel_kwargs={name: ("groups", ",".join(axes)) for name, axes in cut.items()},
        internal=_scale_collectives(node, cut, recipe, ctx, row_parts))


def _scale_collectives(node: torch.fx.Node, cut: dict[str, list[str]], recipe: str, ctx: RuleContext,
                       row_parts: int) -> list[InternalCollective]:
    """One all-reduce (max) per scale and per axis cutting a dimension the scale spans; bytes: the
    rank's largest magnitudes (one per row the scale keeps, or one for the tensor)."""
    x_val, w_val = node.args[0].meta["val"], node.args[1].meta["val"]
    size = dict(zip(ctx.mesh_names, ctx.mesh_shape))

    def local(extent: object, span: str) -> sympy.Expr:
        parts = 1
        for axis in cut[span]:
            parts *= size[axis]
        return sym_size(extent) / parts

    m = sympy.Integer(1)
    for extent in x_val.shape[:-1]:
        m *= sym_size(extent)
    m = m / row_parts
    k, n = local(x_val.shape[-1], "inner"), local(w_val.shape[0], "cols")
    # operand -> (dtype of its largest magnitudes, its local extents along (dim 0, dim 1))
    operands = {"x": (x_val.dtype, (m, k)), "wt": (w_val.dtype, (k, n)), "go": (x_val.dtype, (m, n))}
    collectives = []
    for reduction in reductions(RECIPES[recipe]):
        dtype, (rows, columns) = operands[reduction.operand]
        kept = {None: sympy.Integer(1), 0: columns, -1: rows}[reduction.dim]
        for span in reduction.spans:
            for axis in cut[span]:
                collectives.append(InternalCollective(
                    "all_reduce", axis, reduction.phase, simplified(kept * dtype.itemsize), dtype,
                    f"fp8 {RECIPES[recipe].name} scales of {_NAMES[reduction.operand]} for the {reduction.product} "
                    f"(largest magnitudes, max over {span})", operand=reduction.operand))
    return collectives


_NAMES = {"x": "the input", "wt": "the weight", "go": "the output gradient"}

