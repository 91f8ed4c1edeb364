"""What input sizes a `ParallelModule` accepts, checked before anything runs.

A plan is traced at the example's shapes. A dimension declared dynamic (`dynamic_dims=` to
`autopar.plan` / `autopar.parallelize`) keeps a symbolic size, and the rank graphs compute every
size from the inputs they get (`autopar/compiler/passes/emit_rank_graph.py`): such a dimension may take any size
its shard degree divides. Every other dimension is fixed at the example's size. Without this
check a wrong size fails deep inside a rank graph (`shape '[128, 64]' is invalid for input of
size 4096`) or, worse, on some ranks only; here it is an `InputShapeError` naming the input, the
dimension, the size expected and the size given, and the fix.

Index inputs' values (token ids against the embedding's rows) are checked after their sizes
(`runtime/input_values.py`). `check_global_inputs` checks a global batch (`ParallelModule.local_batch`), `check_local_inputs`
a rank's share (`ParallelModule.forward`, `train_step`). Under pipeline parallelism the plan is
traced at one micro-batch: the batch dimension of a (global or local) batch is m micro-batches.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from autopar.core.ir import SPEC, shard_dim
from autopar.core.sequence_chunks import chunks_total
from autopar.runtime.input_values import check_index_ranges


class InputShapeError(ValueError):
    """An input whose size the plan cannot run (a static dimension changed, or a dynamic one that
    does not split over its shard degree)."""


def _degree(node: torch.fx.Node, dim: int, plan: Any) -> tuple[int, int, list[str]]:
    """(ranks the dimension is split over, equal chunks it is cut into, their axes): a load-balanced
    context-parallel axis cuts 2 chunks per rank (`sequence_chunks`)."""
    mesh = plan.mesh
    axes = [axis for axis, placement in zip(mesh.names, node.meta[SPEC].placements) if shard_dim(placement) == dim]
    chunks = math.prod(chunks_total(mesh.size(axis), plan.context.strategy.sequence_layout(axis)) for axis in axes)
    return math.prod(mesh.size(axis) for axis in axes), chunks, axes


def _check(plan: Any, inputs: Sequence[Any], *, local: bool) -> None:
    nodes = plan.placeholder_nodes("input")
    if len(inputs) != len(nodes):
        raise InputShapeError(f"expected {len(nodes)} inputs (as traced: {', '.join(n.name for n in nodes)}), "
                              f"got {len(inputs)}")
    microbatches = plan.pipeline.microbatches if plan.pipeline is not None else 1
    batch_dim = plan.pipeline.batch_dim if plan.pipeline is not None else None
    for position, (value, node) in enumerate(zip(inputs, nodes)):
        traced = node.meta.get("val")
        if not isinstance(traced, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        name = f"input {position} ({node.name!r})"
        if value.dim() != traced.dim():
            raise InputShapeError(f"{name} has {value.dim()} dimensions {tuple(value.shape)}; the plan was traced "
                                  f"with {traced.dim()} {tuple(traced.shape)}")
        for dim, (size, planned) in enumerate(zip(value.shape, traced.shape)):
            degree, chunks, axes = _degree(node, dim, plan)
            times = microbatches if dim == batch_dim else 1
            if isinstance(planned, torch.SymInt):
                if not local and size % (chunks * times):
                    split = f"{degree} ranks of {'x'.join(axes)}" if degree > 1 else "1 rank"
                    if chunks != degree:
                        split += f" ({chunks} load-balanced chunks)"
                    extra = f" times {microbatches} micro-batches" if times > 1 else ""
                    raise InputShapeError(
                        f"{name} has size {size} in dimension {dim}, which is dynamic but does not split over the "
                        f"{split}{extra}\n  fix: make it a multiple of {chunks * times}")
                continue
            expected = int(planned) * times // (degree if local else 1)
            if size != expected:
                whose = (f"this rank's share: {int(planned) * times} split over {degree} ranks of {'x'.join(axes)}"
                         if local and degree > 1 else "as in the example inputs")
                raise InputShapeError(
                    f"{name} has size {size} in dimension {dim}, but the plan expects {expected} ({whose}); "
                    f"dimension {dim} is static in this plan\n  fix: feed the example's size, or declare the "
                    f"dimension dynamic when planning: autopar.parallelize(..., dynamic_dims={{'<name>': {dim}}}) "
                    f"(every input's dimension {dim})")


def check_global_inputs(plan: Any, inputs: Sequence[Any]) -> None:
    """A global batch (flattened user inputs, traced order) against the plan's input shapes."""
    _check(plan, inputs, local=False)
    check_index_ranges(plan, inputs, local=False)


def check_local_inputs(plan: Any, inputs: Sequence[Any]) -> None:
    """A rank's local inputs against its share of the plan's input shapes."""
    _check(plan, inputs, local=True)
    check_index_ranges(plan, inputs, local=True)
