"""Plan-time errors: one exception type that names the node, op, module and source line.

`PlanError.at(node, message, fix=...)` formats a message the way torch.fx's ShapeProp does:
the node (`node.format_node()`), its op, the module path that produced it and the user's
source line, then the fix.
"""
from __future__ import annotations

import torch.fx

from autopar.core.ir import module_path, source_line


class PlanError(ValueError):
    """Raised while planning: the model, mesh or strategy cannot be compiled as declared."""

    @classmethod
    def at(cls, node: torch.fx.Node, message: str, *, fix: str) -> "PlanError":
        return cls(
            f"{message}\n"
            f"  node:   {node.format_node()}\n"
            f"  op:     {node.target}\n"
            f"  module: {module_path(node) or '<top level>'}\n"
            f"  source: {source_line(node) or '<unknown>'}\n"
            f"  fix:    {fix}"
        )
