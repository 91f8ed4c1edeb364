"""FP8 matrix products of linear layers with dynamic scaling: torchao's float8 training recipes,
computed on a rank's shards with the scales one device would compute.

`float8_matmul(x, weight, recipe=...)` is `x @ weight.T` (x [..., K], weight [N, K]) as torchao's
`Float8Linear` computes it (`torchao/float8/float8_linear.py`, `matmul_with_hp_or_float8_args`):
each operand of each of the three products (the output, the input gradient, the weight gradient) is
cast to an 8-bit float with a scale from its largest magnitude, `scale = finfo.max / max|t|`
(computed in float64, then float32; rounded down to a power of 2 where the recipe says so),
`fp8 = saturate(t·scale)`, and the product is taken of the dequantized operands `fp8 / scale`,
rounded to the high-precision operand's dtype. Each recipe is data (`RECIPES`):
- `tensorwise`: one scale per tensor; input and weight e4m3, output gradient e5m2 (torchao's default);
- `rowwise`: one scale per row of each operand along the dimension its product reduces (torchao's
  "axiswise" scaling), every operand e4m3, power-of-2 scales (torchao's `rowwise` recipe).

Why our own and not torchao's `Float8Linear`: torch.export cannot trace torchao's float8 tensor
subclass (`Unable to cast NotImplemented to Tensor` under 2.13), and the scales of sharded operands
need collectives torchao's module does not issue (its data-parallel ranks scale their own rows).
Here a largest magnitude taken over a dimension that a mesh axis cuts is all-reduced (max) over
that axis first, so every rank quantizes with one device's scale:
- `rows`: axes cutting the rows M (data, context or sequence shards of the tokens);
- `inner`: axes cutting K (row-parallel tensor parallelism: x and weight cut on K, output partial);
- `cols`: axes cutting N (column-parallel: weight cut on N, output cut on N).
What each reduction moves is declared for the ledger by `autopar/compiler/rules/float8_rules.py`,
which also lists them (`reductions`); the kernel and the rule read the same table.

The products run as torchao's emulation does (`torch.mm` of the dequantized fp32 operands); on a
CUDA device of compute capability 8.9 or more they run `torch._scaled_mm` as torchao calls it
there (`_scaled_mm`; not yet run on such a device).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autopar.core.ops.collective_calls import raw_all_reduce

_EPS = 1e-12  # torchao's floor on a largest magnitude (float8_utils.EPS)


@dataclass(frozen=True)
class Float8Recipe:
    """One recipe: the 8-bit dtype of the input, the weight and the output gradient, whether scales
    are per row (along the dimension each product reduces) or per tensor, and whether scales are
    rounded down to a power of 2."""

    name: str
    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    grad_dtype: torch.dtype
    rowwise: bool
    power_of_2: bool


RECIPES = {
    "tensorwise": Float8Recipe("tensorwise", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2,
                               rowwise=False, power_of_2=False),
    "rowwise": Float8Recipe("rowwise", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e4m3fn,
                            rowwise=True, power_of_2=True),
}


@dataclass(frozen=True)
class Reduction:
    """One scale's largest magnitude: which operand (`x` [M, K], `wt` = weight.T [K, N], `go` [M, N]),
    the dimension it is taken over (None: the whole tensor), the product it serves, the phase, and
    which cut dimensions ("rows", "inner", "cols") it spans: the axes cutting them reduce it."""

    operand: str
    dim: int | None
    product: str
    phase: str
    spans: tuple[str, ...]


def reductions(recipe: Float8Recipe) -> tuple[Reduction, ...]:
    """Every scale the kernel computes, in order. Tensorwise scales of x and the weight are kept
    from the forward for backward; the output gradient's one scale serves both of its products."""
    if recipe.rowwise:
        return (Reduction("x", -1, "output", "forward", ("inner",)),
                Reduction("wt", 0, "output", "forward", ("inner",)),
                Reduction("go", -1, "input gradient", "backward", ("cols",)),
                Reduction("wt", -1, "input gradient", "backward", ("cols",)),
                Reduction("go", 0, "weight gradient", "backward", ("rows",)),
                Reduction("x", 0, "weight gradient", "backward", ("rows",)))
    return (Reduction("x", None, "output", "forward", ("rows", "inner")),
            Reduction("wt", None, "output", "forward", ("inner", "cols")),
            Reduction("go", None, "both gradients", "backward", ("rows", "cols")))


def _scaled(t: torch.Tensor, dtype: torch.dtype, dim: int | None, groups: tuple[str, ...], power_of_2: bool,
            priced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit values, scale) of `t` as torchao casts it; the largest magnitude reduced over `groups`.
    `priced` (the planner's fake runs, which hold no values): the ops a compiled cast runs, one read
    of `t` for the magnitudes and one read with an 8-bit write for the cast (torchao's recipes are
    meant to be compiled; the eager chain of abs, amax, multiply, clamp and cast moves ~6x the bytes)."""
    if priced:
        amax = torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=dim is not None)
    else:
        amax = t.abs().max() if dim is None else torch.amax(t.abs(), dim=dim, keepdim=True)
    for group in groups:
        amax = raw_all_reduce(amax, group, "max")
    if priced:
        return t.to(dtype), (torch.finfo(dtype).max / amax.to(torch.float32))
    scale = scale_of(amax, dtype, power_of_2)
    return cast_to_float8(t, scale, dtype, False), scale


def scale_of(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """torchao's scale for largest magnitudes `amax` (`float8_utils.amax_to_scale`): the 8-bit
    dtype's largest value over them, in float64 then float32, optionally rounded down to a power of 2."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=_EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def cast_to_float8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, priced: bool) -> torch.Tensor:
    """`t` cast with a scale computed before (`_scaled`'s cast; `priced`: its compiled ops)."""
    if priced:
        return t.to(dtype)
    top = torch.finfo(dtype).max
    return (t.to(torch.float32) * scale).clamp(min=-top, max=top).to(dtype)


def _product(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             out_dtype: torch.dtype, scaled_kernel: bool) -> torch.Tensor:
    """a [M, K] times b [K, N] of 8-bit values with their scales, rounded to `out_dtype`;
    `scaled_kernel`: `torch._scaled_mm` whatever the device (the planner's fake runs pricing an
    accelerator, `ledger/fake_tensors.on_device`; with it the casts are priced as compiled, `_scaled`).
    Sizes the FP8 kernel does not take (K or N not a multiple of 16) run the emulation anywhere."""
    aligned = a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0
    accelerated = a.is_cuda and torch.cuda.get_device_capability(a.device) >= (8, 9)
    if aligned and (scaled_kernel or accelerated):
        return _scaled_mm(a, a_scale, b, b_scale, out_dtype)
    return torch.mm(a.float() / a_scale, b.float() / b_scale).to(out_dtype)


def _scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """`torch._scaled_mm` as torchao calls it (`float8_ops.addmm_float8_unwrapped`): a row-major,
    b column-major; per-row scales applied after the product, into bf16 where fp16/fp32 was asked."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b.t().contiguous().t() if b.stride(-1) == 1 else b
    a_inverse, b_inverse = a_scale.reciprocal(), b_scale.reciprocal()
    rowwise = a_scale.dim() == 2 and b_scale.dim() == 2
    after = a_inverse * b_inverse if rowwise else None
    if rowwise:
        a_inverse = b_inverse = a_inverse.new_ones(())
    produced = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(a, b, scale_a=a_inverse, scale_b=b_inverse, out_dtype=produced)
    if after is not None:
        out *= after
    return out.to(out_dtype)


def _groups(spans: tuple[str, ...], cut: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(group for span in spans for group in cut[span])


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe,
                cut: dict[str, tuple[str, ...]], scaled_kernel: bool, weight_scale: torch.Tensor | None
                ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        wt = weight.t()
        fx, fw = (r for r in reductions(recipe) if r.phase == "forward")
        xq, xs = _scaled(x2, recipe.input_dtype, fx.dim, _groups(fx.spans, cut), recipe.power_of_2, scaled_kernel)
        if weight_scale is None:
            wq, ws = _scaled(wt, recipe.weight_dtype, fw.dim, _groups(fw.spans, cut), recipe.power_of_2, scaled_kernel)
        else:  # gathered in FP8 and dequantized by its ZeRO unit (`float8_gather`): cast back exactly
            wq, ws = cast_to_float8(wt, weight_scale, recipe.weight_dtype, scaled_kernel), weight_scale
        out = _product(xq, xs, wq, ws, x.dtype, scaled_kernel)
        ctx.recipe, ctx.cut, ctx.scaled_kernel = recipe, cut, scaled_kernel
        # what torchao keeps: the high-precision input and weight (and, tensorwise, their scales)
        ctx.save_for_backward(x, weight, *(() if recipe.rowwise else (xs, ws)))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        recipe, cut, fused = ctx.recipe, ctx.cut, ctx.scaled_kernel
        x, weight, *kept = ctx.saved_tensors
        x2, wt = x.reshape(-1, x.shape[-1]), weight.t()
        go = grad.reshape(-1, grad.shape[-1])
        power = recipe.power_of_2
        if recipe.rowwise:
            _, _, g_in, w_in, g_w, x_w = reductions(recipe)
            gq, gs = _scaled(go, recipe.grad_dtype, g_in.dim, _groups(g_in.spans, cut), power, fused)
            wq, ws = _scaled(wt, recipe.weight_dtype, w_in.dim, _groups(w_in.spans, cut), power, fused)
            gq2, gs2 = _scaled(go, recipe.grad_dtype, g_w.dim, _groups(g_w.spans, cut), power, fused)
            xq, xs = _scaled(x2, recipe.input_dtype, x_w.dim, _groups(x_w.spans, cut), power, fused)
        else:
            g_both = reductions(recipe)[2]
            xs, ws = kept
            gq, gs = gq2, gs2 = _scaled(go, recipe.grad_dtype, None, _groups(g_both.spans, cut), power, fused)
            xq = cast_to_float8(x2, xs, recipe.input_dtype, fused)
            wq = cast_to_float8(wt, ws, recipe.weight_dtype, fused)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(gq, gs, wq.t(), ws.t(), grad.dtype, fused).reshape(*x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _product(gq2.t(), gs2.t(), xq, xs, grad.dtype, fused)
        return grad_x, grad_w, None, None, None, None


def float8_matmul(x: torch.Tensor, weight: torch.Tensor, *, recipe: str, rows: tuple[str, ...] = (),
                  inner: tuple[str, ...] = (), cols: tuple[str, ...] = (), scaled_kernel: bool = False,
                  weight_scale: torch.Tensor | None = None, local_rows: bool = False) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T in FP8 under `RECIPES[recipe]`; `rows`, `inner`, `cols`: the
    process groups of the mesh axes cutting M, K and N on this rank (module docstring);
    `scaled_kernel`: see `_product`; `weight_scale` (tensorwise): the whole weight's scale, where its
    ZeRO unit gathered it in FP8 (`autopar/core/ops/float8_gather.py`): the weight holds those 8-bit
    values dequantized, and casts back to them exactly with it. `local_rows` marks the plan's choice
    (`float8(data_scales="local")`): its rule passes no `rows` groups; the kernel reads nothing else of it."""
    cut = {"rows": tuple(rows), "inner": tuple(inner), "cols": tuple(cols)}
    return _Float8Matmul.apply(x, weight, RECIPES[recipe], cut, scaled_kernel, weight_scale)
