"""Floating-point operations of a graph's forward, per node and per module: the compute ledger,
read by the passes that balance or choose by compute and by the ledgers that price it.

`node_flops(node)` counts one node of a planned graph at the traced (hint) sizes: matrix products and attention by
PyTorch's own formulas (`torch.utils.flop_counter.flop_registry`: 2·m·n·k for a matmul), the
unlowered `scaled_dot_product_attention` as its two products (4·b·h·s_q·s_k·d), views and
metadata ops as 0, and any other op as one operation per output element. The pipeline split
balances stages with it (`autopar/compiler/passes/split_pipeline.py`) and the bubble ledger prices forward and
backward actions with it (backward = 2 × forward: the input and the weight gradient each cost a
forward's matmuls).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from autopar.core.ir import hint
from autopar.core.ops import weight_gradients

aten = torch.ops.aten
_FREE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
         aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
         aten.expand.default, aten.alias.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
         aten.split_with_sizes.default, aten.detach.default, operator.getitem}


def _numel(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return math.prod(int(hint(d)) for d in value.shape)
    if isinstance(value, (tuple, list)):
        return sum(_numel(v) for v in value)
    return 0


def node_flops(node: torch.fx.Node) -> int:
    """Forward FLOPs of one call_function node (global shapes, traced sizes)."""
    if node.op != "call_function" or node.target in _FREE:
        return 0
    out = node.meta.get("val")
    if node.target is aten.scaled_dot_product_attention.default:
        q, k = (a.meta["val"] for a in node.args[:2])
        batch_heads = math.prod(int(hint(d)) for d in q.shape[:-2])
        return 4 * batch_heads * int(hint(q.shape[-2])) * int(hint(k.shape[-2])) * int(hint(q.shape[-1]))
    if node.target is weight_gradients.linear:  # x·weight_t (+ bias), as addmm counts it
        (m, k), n = (int(hint(d)) for d in node.args[0].meta["val"].shape), int(hint(node.args[1].meta["val"].shape[-1]))
        return 2 * m * k * n
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None and packet in flop_registry:
        args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
        kwargs = {k: (v.meta.get("val") if isinstance(v, torch.fx.Node) else v) for k, v in node.kwargs.items()}
        return int(hint(flop_registry[packet](*args, **kwargs, out_val=out)))
    return _numel(out)
