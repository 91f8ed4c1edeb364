"""A model torch.export could not trace, refused in autopar's words: where it failed and what to change.

torch.export's exception names PyTorch's internals; the user needs the module of their model whose
code raised it, the source line, and the fix. `untraceable(model, error)` walks the traceback to
the innermost frame outside PyTorch and autopar (the model's own code, or the library it calls,
such as transformers) for the line, names the innermost of the model's modules whose method was
running (its path in the model), and gives the fix of the first `KNOWN_CAUSES` entry whose text
the error contains, or the general one.
"""
from __future__ import annotations

import os
import traceback
from types import TracebackType

import torch

from autopar.core.errors import PlanError

# (text in the error, the fix): causes met on models users bring
KNOWN_CAUSES: tuple[tuple[str, str], ...] = (
    ("FlexAttention does not support backward on CPU",
     "build the model with attn_implementation=\"sdpa\" (transformers builds document and padding masks for it "
     "too): PyTorch's FlexAttention has no backward on the CPU"),
)
GENERAL_FIX = ("make forward traceable (no data-dependent Python control flow on tensor values, no unsupported "
               "side effects; for HF models set use_cache=False), or trace a wrapper that returns the loss")
_OURS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _frames_outside(tb: TracebackType | None) -> list[tuple[str, int, str, object]]:
    """(file, line, function, the frame's `self`) of each frame not in PyTorch or autopar, outermost first."""
    found = []
    while tb is not None:
        frame = tb.tb_frame
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_OURS) and not path.startswith("<"):
            found.append((path, tb.tb_lineno, frame.f_code.co_name, frame.f_locals.get("self")))
        tb = tb.tb_next
    return found


def untraceable(model: torch.nn.Module, error: BaseException) -> PlanError:
    """The PlanError for `model`, which torch.export failed to trace with `error` (module docstring)."""
    text = str(error)
    fix = next((fix for cause, fix in KNOWN_CAUSES if cause in text), GENERAL_FIX)
    module, where = f"{type(model).__name__} (its forward)", ""
    frames = _frames_outside(error.__traceback__)
    names = {id(m): name for name, m in model.named_modules()}
    owners = [owner for *_, owner in frames if isinstance(owner, torch.nn.Module) and id(owner) in names]
    if owners:  # the innermost of the model's modules whose code was running
        module = f"{names[id(owners[-1])] or 'the model'} ({type(owners[-1]).__name__})"
    if frames:
        path, line, function, _ = frames[-1]
        where = f"\n  line: {path}:{line}, in {function}"
        source = traceback.extract_tb(error.__traceback__)
        code = next((f.line for f in reversed(source) if os.path.abspath(f.filename) == path and f.lineno == line), "")
        where += f"\n    {code.strip()}" if code else ""
    return PlanError(
        f"{type(model).__name__} could not be traced by torch.export (non-strict): {type(error).__name__}: "
        f"{text.splitlines()[0] if text else ''}\n"
        f"  fix: {fix}\n"
        f"  module: {module}{where}")
