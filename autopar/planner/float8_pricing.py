"""What FP8 linears change in a layout's composed price: the scale all-reduces a data-parallel axis
adds (`data_axis_scales`), and the weights ZeRO-3 would gather in FP8 (`fp8_gathered_weights`).

The planner plans each in-node layout without its data axis and composes that axis by formula
(`composed_cost.py`). An FP8 linear (`autopar/core/ops/float8_matmul.py`) whose rows a data axis cuts
all-reduces (max) the largest magnitudes of every scale that spans the rows over that axis, one
call per scale and micro-batch, the product waiting on it: rowwise, the output gradient's and the
input's column maxima for the weight gradient in backward ([1, N] and [1, K] of the rank's
columns); tensorwise, the input's and the output gradient's one magnitude each. `data_axis_scales`
reads those from a plan's FP8 nodes, in the plan's own local sizes, so the composition prices them
over the candidate's dp like the plan's own collectives.

Under ZeRO-3 on dp a tensorwise FP8 linear's weight travels as one byte an element
(`autopar/core/ops/float8_gather.py`); the layout's plan has no ZeRO units, so
`fp8_gathered_weights` reads which weights those would be (parameters read only as tensorwise FP8
products' weights) and their local size, which `composed_cost` prices as the units' FP8 gather.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable

import torch

from autopar.compiler.passes.shard_parameters import gathered_in_float8
from autopar.core.ir import RULE, SPEC, hint, local_numel, module_path
from autopar.core.ops.float8_matmul import RECIPES, float8_matmul, reductions


def data_axis_scales(plan: Any, inside: Callable[[str], bool] | None = None) -> Counter:
    """(phase, bytes per call) -> calls per micro-batch of the scale all-reduces a data axis adds,
    over the plan's FP8 products (those whose module `inside` accepts, when given)."""
    size = dict(zip(plan.mesh.names, plan.mesh.shape))
    found: Counter = Counter()
    for node in plan.graph_module.graph.nodes:
        if node.op != "call_function" or node.target is not float8_matmul:
            continue
        if (inside is not None and not inside(module_path(node))) or node.kwargs.get("local_rows"):
            continue
        cut = node.meta[RULE].kernel_kwargs

        def parts(name: str) -> int:
            return math.prod(size[axis] for axis in cut[name][1].split(",") if axis)

        x, weight = node.args[0].meta["val"], node.args[1].meta["val"]
        columns = {"x": int(hint(x.shape[-1])) // parts("inner"), "go": int(hint(weight.shape[0])) // parts("cols")}
        for reduction in reductions(RECIPES[node.kwargs["recipe"]]):
            if "rows" in reduction.spans:
                kept = 1 if reduction.dim is None else columns[reduction.operand]
                found[(reduction.phase, kept * x.dtype.itemsize)] += 1
    return found


def fp8_gathered_weights(plan: Any, inside: Callable[[str], bool] | None = None) -> Counter:
    """{"bytes": in their compute dtype, "elements", "tensors"} on one rank of the parameters a ZeRO-3 unit would
    gather in FP8: read only as the weight of tensorwise FP8 products (through mixed precision's cast);
    those named by a parameter path `inside` accepts, when given."""
    nbytes = elements = tensors = 0
    for node in plan.graph_module.graph.nodes:
        info = plan.context.placeholders.get(node.name)
        if node.op != "placeholder" or info is None or info.kind != "parameter" or not node.users:
            continue
        if inside is not None and not inside(info.target):
            continue
        if not gathered_in_float8(node):
            continue
        reader = next(iter(node.users))
        reader = next(iter(reader.users)) if reader.target is torch.ops.aten._to_copy.default else reader
        spec = reader.args[1].meta[SPEC]
        count = int(plan.comm.number(local_numel(spec.tensor_meta.shape, spec.placements, plan.mesh.shape)))
        nbytes += count * spec.tensor_meta.dtype.itemsize
        elements += count
        tensors += 1
    return Counter(bytes=nbytes, elements=elements, tensors=tensors)

