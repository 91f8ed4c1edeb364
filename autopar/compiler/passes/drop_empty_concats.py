"""Pass 0: drop empty tensors from concatenations before anything is placed.

Hugging Face models built with `use_cache=True` (their default) export an empty KV cache: each
attention layer lifts empty constants (`lifted_tensor_*`, shape [0]) and `aten.cat`s them with
its keys and values. Partial rotary embeddings concatenate a zero-width slice the same way. An
empty input adds nothing to a concatenation (`aten.cat` skips 1-D empty tensors, and a tensor of
size 0 on the cat dimension contributes no elements), so the pass removes it; a concatenation
left with one input becomes a contiguous clone of it (a cat's result is contiguous, and the
views after it may rely on that). Nothing then asks for a placement of the empty constant, which
a sharding rule would otherwise slice along a dimension it does not have (an IndexError at run
time). A concatenation whose dtype differs from its remaining input's (type promotion by the
empty tensor) is kept as it is; so is a list input that is not a graph node.
"""
from __future__ import annotations

import torch
import torch.fx

from autopar.compiler.context import CompileContext
from autopar.core.program import Program

_CAT = torch.ops.aten.cat.default
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def _is_empty_for(node: object, dim: int) -> bool:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.numel() != 0:
        return False
    return value.dim() == 1 or (dim < value.dim() and value.shape[dim] == 0)


def erase_unused(node: torch.fx.Node) -> None:
    """Erase `node` and then its inputs, while they are unused computations (read by nothing but
    export's checks of their own dtype and device, which go with them)."""
    stack, erased = [node], set()
    while stack:
        current = stack.pop()
        if current in erased or current.op != "call_function" \
                or any(user.target is not _ASSERT_METADATA for user in current.users):
            continue
        for check in list(current.users):
            current.graph.erase_node(check)
        inputs = current.all_input_nodes
        current.graph.erase_node(current)
        erased.add(current)
        stack.extend(inputs)


def drop_empty_concats(program: Program, ctx: CompileContext | None = None) -> Program:
    gm = program.graph_module
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _CAT:
            continue
        value = node.meta.get("val")
        tensors = list(node.args[0])
        if not isinstance(value, torch.Tensor) or not all(isinstance(t, torch.fx.Node) for t in tensors):
            continue
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim = dim % value.dim() if value.dim() else 0
        kept = [t for t in tensors if not _is_empty_for(t, dim)]
        if len(kept) == len(tensors) or not kept:
            continue
        if any(t.meta["val"].dtype != value.dtype for t in kept):
            continue  # the empty tensor promoted the result's dtype
        dropped = [t for t in tensors if t not in kept]
        if len(kept) == 1:  # a concatenation is a fresh contiguous tensor: later views may rely on that
            node.target = torch.ops.aten.clone.default
            node.args, node.kwargs = (kept[0],), {"memory_format": torch.contiguous_format}
        else:
            node.args = (kept, *node.args[1:])
        for empty in dropped:
            erase_unused(empty)
    graph.lint()
    gm.recompile()
    return program
