"""Pass 0c (FP8 linears): the products of the linears `float8()` names become FP8 products.

Under `float8(recipe=...)` (`autopar/compiler/strategies/mixed_precision.py`), every linear layer's
product in the traced graph (what `torch.nn.functional.linear` records: `mm(x, permute(weight))`,
`addmm(bias, x, permute(weight))`, or `matmul(x, t(weight))` for a non-contiguous input; weight a
2-D parameter) whose module the declaration selects is replaced by `float8_matmul(x, weight,
recipe=...)` (`autopar/core/ops/float8_matmul.py`), plus the bias added after it (torchao's
`Float8Linear` order); with `float8(data_scales="local")` the node carries `local_rows=True`, which
its rule reads (no all-reduce over the axes cutting the rows). Runs before placements are
propagated, so that the rule of `float8_matmul` (`autopar/compiler/rules/float8_rules.py`) places it
and declares its scales' collectives like any op's. The selection is recorded in
`CompileContext.float8_linears` (module path -> weight).

Refused by name: a selected linear whose input or output features are not multiples of 16, and globs
that select no linear (a typo would otherwise silently keep everything in high precision)."""
from __future__ import annotations

import fnmatch

import torch
import torch.fx

from autopar.compiler.context import CompileContext
from autopar.core.errors import PlanError
from autopar.core.ir import module_path
from autopar.core.ops.float8_matmul import float8_matmul
from autopar.core.program import Program

aten = torch.ops.aten
_TRANSPOSES = {aten.permute.default, aten.t.default}
_ALIGN = 16


def float8_linears(program: Program, ctx: CompileContext) -> Program:
    declared = ctx.strategy.float8
    if declared is None:
        return program
    graph = program.graph_module.graph
    found = [(node, weight, module_path(node)) for node in graph.nodes for weight in [_linear_weight(node, ctx)]
             if weight is not None]
    chosen = _selected(found, declared)
    for node, weight, path in chosen:
        _check_aligned(node, weight, path)
        _replace(graph, node, weight, declared.recipe, local=declared.data_scales == "local")
        ctx.float8_linears[path or "(root)"] = ctx.placeholders[weight.name].target
    graph.eliminate_dead_code()
    graph.lint()
    program.graph_module.recompile()
    return program


def _linear_weight(node: torch.fx.Node, ctx: CompileContext) -> torch.fx.Node | None:
    """The weight placeholder of a linear's product, or None for any other node."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default, aten.matmul.default):
        return None
    transposed = node.args[2] if node.target is aten.addmm.default else node.args[1]
    if not isinstance(transposed, torch.fx.Node) or transposed.target not in _TRANSPOSES:
        return None
    if transposed.target is aten.permute.default and list(transposed.args[1]) != [1, 0]:
        return None
    weight = transposed.args[0]
    info = ctx.placeholders.get(weight.name) if isinstance(weight, torch.fx.Node) else None
    if info is None or info.kind != "parameter" or weight.meta["val"].dim() != 2:
        return None
    return weight


def _selected(found: list, declared: object) -> list:
    """The declaration's linears: its globs' matches, or every linear but the head; less `exclude`."""
    if declared.modules is None:
        chosen = list(found)
        if chosen and not any(part.isdigit() for part in chosen[-1][2].split(".")):
            chosen = chosen[:-1]  # the head: the last linear, outside the repeated blocks
    else:
        chosen = [item for item in found if any(fnmatch.fnmatchcase(item[2], glob) for glob in declared.modules)]
        for glob in declared.modules:
            if not any(fnmatch.fnmatchcase(path, glob) for _, _, path in found):
                raise PlanError(f"float8(modules={list(declared.modules)}): {glob!r} matches no linear; the model's "
                                f"linears are {sorted({path for _, _, path in found})}")
    return [item for item in chosen if not any(fnmatch.fnmatchcase(item[2], glob) for glob in declared.exclude)]


def _check_aligned(node: torch.fx.Node, weight: torch.fx.Node, path: str) -> None:
    out_features, in_features = (int(d) for d in weight.meta["val"].shape)
    if out_features % _ALIGN or in_features % _ALIGN:
        raise PlanError.at(node, f"float8: linear {path or '(root)'} has {in_features} input and {out_features} "
                                 f"output features; FP8 matrix kernels need multiples of {_ALIGN}",
                           fix=f"float8(exclude=[{path!r}]), or sizes that are multiples of {_ALIGN}")


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, weight: torch.fx.Node, recipe: str, *, local: bool) -> None:
    x = node.args[1] if node.target is aten.addmm.default else node.args[0]
    bias = node.args[0] if node.target is aten.addmm.default else None
    with graph.inserting_before(node):
        kwargs = {"recipe": recipe, **({"local_rows": True} if local else {})}
        product = graph.call_function(float8_matmul, (x, weight), kwargs)
        with torch.no_grad():
            product.meta["val"] = float8_matmul(x.meta["val"], weight.meta["val"], recipe=recipe)
        result = product
        if bias is not None:
            result = graph.call_function(aten.add.Tensor, (product, bias))
            result.meta["val"] = product.meta["val"] + bias.meta["val"]
    for made in {product, result}:
        for key in ("nn_module_stack", "stack_trace"):
            if key in node.meta:
                made.meta[key] = node.meta[key]
    node.replace_all_uses_with(result)
    graph.erase_node(node)
