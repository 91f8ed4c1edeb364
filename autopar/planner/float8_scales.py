"""The FP8 scale all-reduces a data-parallel axis adds to a layout's plan, for the composed price.

The planner plans each in-node layout without its data axis and composes that axis by formula
(`composed_cost.py`). An FP8 linear (`autopar/core/ops/float8_matmul.py`) whose rows a data axis cuts
all-reduces (max) the largest magnitudes of every scale that spans the rows over that axis, one
call per scale and micro-batch, the product waiting on it: rowwise, the output gradient's and the
input's column maxima for the weight gradient in backward ([1, N] and [1, K] of the rank's
columns); tensorwise, the input's and the output gradient's one magnitude each. `data_axis_scales`
reads those from a plan's FP8 nodes, in the plan's own local sizes, so the composition prices them
over the candidate's dp like the plan's own collectives.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable

from autopar.core.ir import RULE, hint, module_path
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
