"""An exception that is not autopar's own, raised while planning, turned into a `PlanError`.

The tracer, a pass or a ledger can meet a model in a way no check of autopar foresaw; the user
must then read what autopar could not do and what to do instead, not a traceback from inside
torch. `planning_error(error, phase=...)` builds that `PlanError`: the phase (the pass that
failed, or tracing), the node being processed (`current_node`: the innermost traceback frame
that holds a `torch.fx.Node`, a pass's loop variable or `torch.fx.Interpreter.run_node`'s
argument), its op, module and source line, what is unsupported (`_unsupported`: a shape that
depends on tensor values, or else the op under the declared strategies) and the fix; the
internal text follows, indented, as "internal error: ...". Callers raise it `from error`, so the
chain is kept. KeyboardInterrupt and SystemExit are not `Exception`s and pass through.
"""
from __future__ import annotations

import textwrap

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from autopar.core.errors import PlanError
from autopar.core.ir import module_path, source_line

DATA_DEPENDENT_ERRORS = ("GuardOnDataDependentSymNode", "DataDependentOutputException",
                         "PendingUnbackedSymbolNotFound", "UserError")


def current_node(error: BaseException) -> torch.fx.Node | None:
    """The innermost traceback frame's `torch.fx.Node` (a local named `node` first), if any."""
    found = None
    trace = error.__traceback__
    while trace is not None:
        values = trace.tb_frame.f_locals
        named = values.get("node")
        candidates = [named] if isinstance(named, torch.fx.Node) else [v for v in values.values()
                                                                       if isinstance(v, torch.fx.Node)]
        found = candidates[0] if candidates else found
        trace = trace.tb_next
    return found


def _has_unbacked(node: torch.fx.Node | None) -> bool:
    if node is None:
        return False
    leaves = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, (torch.Tensor, torch.SymInt))]
    return any(free_unbacked_symbols(v) for v in leaves)


def data_dependent(error: BaseException, node: torch.fx.Node | None) -> bool:
    text = str(error)
    return (type(error).__name__ in DATA_DEPENDENT_ERRORS and ("data-dependent" in text or "unbacked" in text)) or \
        type(error).__name__.startswith("GuardOnDataDependent") or _has_unbacked(node)


def _unsupported(error: BaseException, node: torch.fx.Node | None, strategies: str) -> tuple[str, str]:
    """(what autopar does not support, the fix)."""
    op = f"{node.target}" if node is not None and node.op == "call_function" else "this model"
    if data_dependent(error, node):
        return (f"{op} has a shape that depends on tensor values (data-dependent, e.g. the rows routed to an "
                f"expert found with nonzero / where / a boolean mask), which autopar cannot plan",
                "compute such shapes from sizes, not from values (a fixed expert capacity, or every expert run "
                "on every token and masked); for a Hugging Face mixture of experts, an experts implementation of "
                "stacked weights (grouped matmuls) that autopar lowers itself; or plan the model without "
                "splitting it over this module")
    return (f"autopar does not support {op} here under {strategies}",
            f"plan this model without {strategies} (one strategy at a time shows which one it is), or keep the "
            f"module out of it; if the model runs on one device this is a gap in autopar: report it with the "
            f"internal error below")


def planning_error(error: BaseException, *, phase: str, strategies: str = "the declared strategies",
                   module: str | None = None, node: torch.fx.Node | None = None) -> PlanError:
    """A `PlanError` for `error`, raised in `phase` (e.g. "pass insert_collectives", "tracing");
    `module` names the model where no node is known."""
    node = node if node is not None else current_node(error)
    what, fix = _unsupported(error, node, strategies)
    internal = textwrap.indent(f"{type(error).__name__}: {error}".strip(), "      ").lstrip()
    lines = [f"{what} ({phase} failed)"]
    if node is not None:
        lines += [f"  node:   {node.format_node()}", f"  op:     {node.target}",
                  f"  module: {module_path(node) or '<top level>'}", f"  source: {source_line(node) or '<unknown>'}"]
    else:
        lines += [f"  module: {module or '<not known: no graph node was being processed>'}"]
    lines += [f"  fix:    {fix}", f"  internal error: {internal}"]
    return PlanError("\n".join(lines))
