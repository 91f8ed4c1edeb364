"""Pass 0b: an attention mask the graph computes from positions alone, and that is the causal
triangle or allows everything, becomes `is_causal=True` or no mask.

Hugging Face models skip their mask in eager mode (`is_causal=True` when nothing is padded) but
build it in the graph when traced: a bool tensor of batch × sequence × sequence entries,
computed every step and kept by autograd for attention's backward. `mask_kind.static_mask_kind`
recognises it at plan time; replacing it by the flag gives what the model computes in eager
mode, lets every kernel take its causal path, and removes the mask's computation and its saved
bytes (sequence² per block, the largest activation of a long sequence). Only where the query and
key lengths are equal, so that the causal flag's triangle is the mask's.
"""
from __future__ import annotations

import torch
import torch.fx

from autopar.compiler.context import CompileContext
from autopar.compiler.passes.drop_empty_concats import erase_unused
from autopar.compiler.rules.mask_kind import static_mask_kind
from autopar.core.program import Program

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_LEADING = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")  # aten's positional arguments
_DEFAULTS = (None, None, None, None, 0.0, False)


def causal_masks(program: Program, ctx: CompileContext | None = None) -> Program:
    gm = program.graph_module
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        leading = dict(zip(_LEADING, list(node.args) + list(_DEFAULTS[len(node.args):])))
        leading.update({k: v for k, v in node.kwargs.items() if k in leading})
        mask = leading["attn_mask"]
        if not isinstance(mask, torch.fx.Node) or leading["is_causal"]:
            continue
        if node.args[0].meta["val"].shape[-2] != node.args[1].meta["val"].shape[-2]:
            continue
        kind = static_mask_kind(mask)
        if kind is None:
            continue
        leading["attn_mask"], leading["is_causal"] = None, kind == "causal"
        node.args = tuple(leading.values())
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in leading}
        erase_unused(mask)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return program
