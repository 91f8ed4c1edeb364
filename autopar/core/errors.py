"""autopar's own exceptions: plan-time errors that name the node, op, module and source line, and
checkpoint errors that name the file.

`PlanError.at(node, message, fix=...)` formats a message the way torch.fx's ShapeProp does:
the node (`node.format_node()`), its op, the module path that produced it and the user's
source line, then the fix. `CheckpointError` is what every failure to save or load a checkpoint
reaches the user as (`autopar/artifacts/checkpoint.py`), DCP's own `CheckpointException` (a
`BaseException`) and torch.load's errors included.
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


class CheckpointError(Exception):
    """A checkpoint cannot be saved or loaded: the message names the file or directory, the cause
    (incomplete, corrupt, from another save, from another model) and the fix."""
