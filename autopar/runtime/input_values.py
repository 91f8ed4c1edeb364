"""Index inputs checked against the tables they index, before anything runs.

A token id outside an embedding's vocabulary (or a target outside the classes of a loss) fails on
one device with an `IndexError` from the kernel. On a job it fails on the rank that holds that
token, inside its rank graph, while the other ranks wait in their next collective and then report
a closed connection: nothing tells them which input was wrong. `check_index_ranges` finds, once
per plan, every user input that reaches an index argument unchanged in value (through views,
slices, copies: `_VALUE_PRESERVING`) — `aten.embedding`'s indices, `aten.nll_loss*`'s targets
(their `ignore_index` allowed) — and checks each value's range (one `aminmax` per such input), so
that a bad id is an `InputValueError` naming the input, the offending value and where it sits,
the table (its module and size) and the fix.

`ParallelModule.local_batch` checks the global batch, which every rank holds: every rank refuses
it, with the same message. `forward` / `train_step` check a rank's own share: only the ranks
holding a bad id can see it (their peers then see a closed connection; the message says so).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autopar.core.ir import module_path, source_line

aten = torch.ops.aten
_VALUE_PRESERVING = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor, aten.select.int,
    aten.clone.default, aten.contiguous.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.expand.default, aten.t.default, aten.transpose.int, aten.permute.default,
    aten.flatten.using_ints, aten._to_copy.default, aten.alias.default, aten.detach.default,
    aten.split.Tensor, aten.chunk.default, aten.split_with_sizes.default,
}
_GETITEM = "getitem"
_LOSSES = {aten.nll_loss_forward.default, aten.nll_loss.default, aten.nll_loss2d_forward.default,
           aten.nll_loss_nd.default}


class InputValueError(ValueError):
    """An index input (token ids, class targets) with a value outside the table it indexes."""


@dataclass(frozen=True)
class _Bound:
    position: int  # the input's position among the user's inputs (traced order)
    name: str  # the input's placeholder name
    size: int  # valid ids are 0 .. size - 1
    ignored: int | None  # a loss's ignore_index, also allowed
    what: str  # "embedding 'embed_tokens' (128 rows)"
    node: torch.fx.Node  # the op that reads the ids (for its source line)


_CACHE = "_autopar_index_bounds"  # on the plan object: its (input, table) pairs, found once


def _readers(start: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(op, the value it reads) for every embedding or loss reached from `start` unchanged in value."""
    found, frontier, seen = [], [start], {start}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            reads_indices = user.target is aten.embedding.default or user.target in _LOSSES
            if reads_indices and len(user.args) > 1 and user.args[1] is node:
                found.append((user, node))
            elif user.target in _VALUE_PRESERVING or getattr(user.target, "__name__", "") == _GETITEM:
                seen.add(user)
                frontier.append(user)
    return found


def _bound(position: int, placeholder: torch.fx.Node, reader: torch.fx.Node) -> _Bound | None:
    where = module_path(reader) or "<top level>"
    if reader.target is aten.embedding.default:
        weight = reader.args[0].meta.get("val")
        if not isinstance(weight, torch.Tensor) or not isinstance(weight.shape[0], int):
            return None
        rows = int(weight.shape[0])
        return _Bound(position, placeholder.name, rows, None, f"the embedding in {where!r} ({rows} rows)", reader)
    scores = reader.args[0].meta.get("val")
    if not isinstance(scores, torch.Tensor) or scores.dim() == 0:
        return None
    classes = scores.shape[1] if scores.dim() > 1 else scores.shape[0]
    if not isinstance(classes, int):
        return None
    ignored = reader.args[4] if len(reader.args) > 4 else -100
    return _Bound(position, placeholder.name, int(classes), int(ignored),
                  f"the loss in {where!r} ({classes} classes, ignore_index {ignored})", reader)


def index_bounds(plan: Any) -> list[_Bound]:
    """Every (input, table) pair of the plan: computed once per plan."""
    cached = plan.__dict__.get(_CACHE)
    if cached is not None:
        return cached
    bounds = []
    for position, node in enumerate(plan.placeholder_nodes("input")):
        for reader, _ in _readers(node):
            bound = _bound(position, node, reader)
            if bound is not None:
                bounds.append(bound)
    plan.__dict__[_CACHE] = bounds
    return bounds


def check_index_ranges(plan: Any, inputs: Sequence[Any], *, local: bool) -> None:
    """Every index input's values against its table (module docstring)."""
    for bound in index_bounds(plan):
        value = inputs[bound.position] if bound.position < len(inputs) else None
        if not isinstance(value, torch.Tensor) or value.numel() == 0 or value.is_floating_point():
            continue
        bad = (value < 0) | (value >= bound.size)
        if bound.ignored is not None:
            bad &= value != bound.ignored
        if not bool(bad.any()):
            continue
        index = tuple(int(i) for i in bad.nonzero()[0])
        share = (" (this rank's share; ranks not holding it will see a closed connection: pass the global batch "
                 "through module.local_batch(...) to have every rank refuse it)") if local else ""
        raise InputValueError(
            f"input {bound.position} ({bound.name!r}) holds {int(value[index])} at index {index}{share}, outside "
            f"{bound.what}: valid values are 0..{bound.size - 1}"
            + (f" or {bound.ignored}" if bound.ignored is not None else "")
            + f"\n  read at: {source_line(bound.node) or '<unknown>'}"
            f"\n  fix: map ids into the table (check the tokenizer's vocabulary size against the model config's)")
