"""A linear whose weight gradient is computed later in backward, while a collective is in flight.

Megatron overlaps the all-reduce (or, under sequence parallelism, the reduce-scatter) of a
column-parallel linear's input gradient with that linear's weight-gradient GEMM. autograd computes
both gradients of a matmul in one node, so the scheduling pass (`autopar/compiler/passes/schedule_collectives.py`)
splits them: `tap(weight)` (a view of the weight, made between the halves of the deferred step
that feeds the linear) and `linear(x, weight_t, bias, tapped)` (x·weight_t + bias). In backward
the linear computes the input gradient (and the bias's) at once and leaves x and the output
gradient in a `Later`; the deferred step's finish then issues its conjugate collective; autograd
runs the tap next (it was made between the halves), which computes dW = gradᵀ·x and hands it to
the weight's gradient accumulation as any gradient (hooks, bucketed synchronisation, ZeRO's
reduce-scatter all see it there); the start's backward lands the collective after it.

Under `torch.compile` the linear is a plain addmm / mm and the tap passes its weight through.
"""
from __future__ import annotations

import torch

_ATTRIBUTE = "_autopar_weight_grad_later"
TAP_BACKWARD = "_TapBackward"  # autograd's name of a tap's node: the op ledger counts its calls apart


class Later:
    """One linear's weight gradient between its backward and its tap's: x and the output gradient."""

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, later):
        ctx.later = later
        tapped = weight.view_as(weight)
        setattr(tapped, _ATTRIBUTE, later)
        return tapped

    @staticmethod
    def backward(ctx, _placeholder):
        later = ctx.later
        weight_grad = later.grad.t().mm(later.x)
        later.x = later.grad = None
        return weight_grad, None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_t, bias, later):
        ctx.save_for_backward(x, weight_t)
        ctx.later, ctx.has_bias = later, bias is not None
        return torch.addmm(bias, x, weight_t) if bias is not None else torch.mm(x, weight_t)

    @staticmethod
    def backward(ctx, grad):
        x, weight_t = ctx.saved_tensors
        grad_x = grad.mm(weight_t.t()) if ctx.needs_input_grad[0] else None
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        placeholder = None
        if ctx.needs_input_grad[1]:
            ctx.later.x, ctx.later.grad = x, grad
            # the tap's backward computes the weight gradient from the Later; a zero of weight_t's
            # shape, expanded (no memory), stands for it on the autograd edge
            placeholder = grad.new_zeros(()).expand(weight_t.shape)
        return grad_x, placeholder, grad_bias, None


def tap(weight: torch.Tensor) -> torch.Tensor:
    """The weight, through a node whose backward computes the weight gradient the linear left."""
    if torch.compiler.is_compiling():
        return weight
    return _Tap.apply(weight, Later())


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, tapped: torch.Tensor) -> torch.Tensor:
    """x·weight_t (+ bias), weight_t a transpose of `tapped`; its weight gradient is left to the tap."""
    if torch.compiler.is_compiling():
        return torch.addmm(bias, x, weight_t) if bias is not None else torch.mm(x, weight_t)
    return _Linear.apply(x, weight_t, bias, getattr(tapped, _ATTRIBUTE))
