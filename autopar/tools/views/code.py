"""Text views of a rank's program: code annotated with placements, and a diff against the trace.

`annotated_code(gm, mesh_names)` appends to every assignment line of the emitted code the
placement of the value it defines (one per mesh axis) and, for inserted steps, the collective and
axis: `all_gather = ...  # S(0),R  <- all_gather over tp`. `traced_vs_rank(original, emitted)`
is a unified diff from the traced single-device graph to the rank's graph.
"""
from __future__ import annotations

import difflib
import re

import torch.fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from autopar.core.ir import SPEC, describe

_ASSIGNMENT = re.compile(r"^(\s+)(\w+) = ")


def _comment(node: torch.fx.Node) -> str:
    spec = node.meta.get(SPEC)
    if isinstance(spec, (tuple, list)):
        spec = next((s for s in spec if isinstance(s, DTensorSpec)), None)
    parts = [describe(spec.placements)] if isinstance(spec, DTensorSpec) else []
    group = node.kwargs.get("group") if node.op == "call_function" else None
    name = getattr(node.target, "__name__", "")
    if group is not None and isinstance(group, str) and "collectives" in getattr(node.target, "__module__", ""):
        parts.append(f"<- {name} over {group}")
    return f"  # {'  '.join(parts)}" if parts else ""


def annotated_code(gm: torch.fx.GraphModule) -> str:
    nodes = {node.name: node for node in gm.graph.nodes}
    lines = []
    for line in gm.code.strip().splitlines():
        match = _ASSIGNMENT.match(line)
        node = nodes.get(match.group(2)) if match else None
        lines.append(line.split(";  ")[0] + _comment(node) if node is not None else line)
    return "\n".join(lines)


def traced_vs_rank(original_code: str, rank_code: str, *, rank: int) -> str:
    diff = difflib.unified_diff(original_code.strip().splitlines(), rank_code.strip().splitlines(),
                                fromfile="traced (one device)", tofile=f"rank {rank}", lineterm="", n=1)
    return "\n".join(diff)
