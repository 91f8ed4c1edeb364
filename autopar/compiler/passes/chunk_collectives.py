"""Pass (async tensor parallelism): cut each tensor- or sequence-parallel linear's forward
collective, with the linear, into `autopar.schedule(chunks=k)` pieces of rows, so that one piece's
collective is in flight while another piece's matmul runs (Megatron's and PyTorch's async /
micro-pipelined TP, here with the process group's own collectives on each piece).

Runs after `recompute` and before `schedule_collectives`, which splits each piece's collective into
a start and a finish, only where k > 1 is declared. Two sites:
1. **Gather, then linears** (sequence parallelism's all-gather feeding q, k, v or an MLP's up
   projection): the all-gather's input is cut into k pieces of rows (dim 0), each gathered on its
   own, and each linear that reads the gathered tensor (through a view to 2-D rows) runs once per
   piece; `row_chunks.join` puts the pieces' output rows back in the gathered order. In forward,
   piece j+1's gather is in flight over piece j's matmuls; in backward (autograd's mirror) piece
   j's reduce-scatter is in flight over the matmuls of the pieces before it.
2. **Linear, then reduction** (the row-parallel o_proj or down projection, its partial sum
   all-reduced under TP or reduce-scattered under SP): the linear's input rows are cut into k
   pieces, each multiplied and reduced on its own; piece j's reduction is in flight over piece
   j+1's matmul, and the pieces' results are joined.
A collective on dimension 0 takes piece j of each rank's block of rows (`row_chunks.rows`), so
every piece is itself an all-gather / reduce-scatter of whole rows and the joined result is the
unchunked one row for row; on another dimension (the sequence) the pieces are consecutive rows of
dimension 0 (the batch), which the collective does not mix.

Each piece's collective keeps the original's kind, group and arguments, and its ledger record with
1/k of the bytes: the communication ledger's totals are the unchunked plan's, in k times the calls.
A site stays whole where: its rows (local, per rank) do not divide into k (into k per rank block for
a collective on dimension 0), a size is symbolic, the collective or the linear is in a recomputed
region, the gathered tensor has a reader other than linears' 2-D views, the linear's output has a
reader other than the reduction, an addmm adds more than a bias (a row broadcast to every row), the
reduction is an all-reduce other than a sum or its value is 1-D, the gather re-gathers in backward
(`sequence_parallel(regather_in_backward=True)`), a layout is cut in strides (a load-balanced or
strided axis), or a side effect (a ZeRO unit's release) stands between the linears a gather feeds (their pieces run
where the last of them ran). A reduction's pieces run where its linear ran, so a unit released after
that linear is released after every piece. `chunked_sites(graph)` lists the collectives cut; the report's
"Collectives in flight" table lists each piece's step with the nodes it is in flight over.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autopar.compiler.context import CompileContext
from autopar.compiler.passes.recompute import RECOMPUTE
from autopar.core.ir import COLLECTIVE, LOCAL_ARGS, SPEC, local_shape, simplified, tensor_meta
from autopar.core.ops import collectives, row_chunks
from autopar.core.program import Program

_aten = torch.ops.aten
_LAYOUTS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")
PIECE = "autopar_chunk"  # meta on each piece's collective: (index, chunks, the original's name)


def chunk_collectives(program: Program, ctx: CompileContext) -> Program:
    declared = ctx.strategy.schedule
    chunks = declared.chunks if declared is not None and declared.overlap else 1
    if chunks == 1:
        return program
    mesh_shape = tuple(ctx.mesh.shape)
    for stage in program.stages:
        graph = stage.graph_module.graph
        changed = False
        for node in list(graph.nodes):
            if node._erased or node.op != "call_function":
                continue  # erased by an earlier site
            if node.target is collectives.all_gather:
                changed |= _cut_gather(graph, node, chunks, mesh_shape)
            elif node.target in (collectives.all_reduce, collectives.reduce_scatter):
                changed |= _cut_reduction(graph, node, chunks, mesh_shape)
        if changed:
            graph.lint()
            stage.graph_module.recompile()
    return program


def chunked_sites(graph: torch.fx.Graph) -> dict[str, int]:
    """Each collective this pass cut (by its original name) and into how many pieces."""
    return {node.meta[PIECE][2]: node.meta[PIECE][1] for node in graph.nodes if PIECE in node.meta}


# --- the two sites ---------------------------------------------------------------------------

def _cut_gather(graph: torch.fx.Graph, gather: torch.fx.Node, chunks: int, mesh_shape: tuple[int, ...]) -> bool:
    """all_gather -> view to rows -> linears, as k gathered pieces each feeding its own linears."""
    source = gather.args[0]
    dim, ranks = gather.kwargs["dim"], gather.kwargs["size"]
    if not _plain_step(gather) or not _static(source) or dim >= source.meta["val"].dim() - 1:
        return False
    readers = _row_views_to_linears(gather)
    if readers is None or local_shape(_shape(source), _placements(source), mesh_shape)[0] % chunks:
        return False
    linears = [linear for _, users in readers for linear in users]
    nodes = list(graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    first, last = (f(linears, key=order.__getitem__) for f in (min, max))
    if any(node.op == "call_function" and not node.users for node in nodes[order[first]:order[last]]):
        return False  # a side effect between the linears (a ZeRO unit's release): the pieces run at the last
    blocks = ranks if dim == 0 else 1
    pieces = []
    with graph.inserting_before(gather):
        for index in range(chunks):
            piece = _like(graph.call_function(row_chunks.rows, (source,),
                                              {"blocks": 1, "chunks": chunks, "index": index}),
                          source, _rows_over(_shape(source), chunks), gather)
            pieces.append(_piece_of_step(graph, gather, piece, index, chunks))
    joined = {}
    with graph.inserting_before(last):
        outputs = {linear: [] for linear in linears}
        for index, piece in enumerate(pieces):
            for view, users in readers:
                piece_view = _view(graph, view, piece, chunks, mesh_shape)
                for linear in users:
                    outputs[linear].append(_piece_linear(graph, linear, piece_view, chunks))
        for linear in linears:
            joined[linear] = _like(graph.call_function(row_chunks.join, (outputs[linear],), {"blocks": blocks}),
                                   linear, _shape(linear), linear)
    _move_readers_after(graph, linears, last, anchor=last.prev)
    for linear in linears:
        linear.replace_all_uses_with(joined[linear])
    _erase(graph, [*linears, *(view for view, _ in readers), gather])
    return True


def _cut_reduction(graph: torch.fx.Graph, reduction: torch.fx.Node, chunks: int,
                   mesh_shape: tuple[int, ...]) -> bool:
    """linear -> (view) -> all_reduce / reduce_scatter, as k linears on pieces of the rows, each
    reduced on its own."""
    partial = reduction.args[0]
    linear = partial.args[0] if partial.target in _LAYOUTS else partial
    if (not _plain_step(reduction) or not _is_linear(linear) or len(linear.users) != 1 or len(partial.users) != 1
            or reduction.target is collectives.all_reduce and reduction.kwargs.get("reduce_op") != "sum"
            or not _static(partial) or not _static(linear) or len(_shape(partial)) < 2):
        return False
    dim = reduction.kwargs.get("dim")
    x = _left(linear)
    rows = math.prod(_shape(partial)[:-1])
    if dim is not None and dim >= len(_shape(partial)) - 1 or rows != _shape(x)[0] or RECOMPUTE in linear.meta:
        return False
    blocks = reduction.kwargs["size"] if dim == 0 else 1
    if (local_shape(_shape(partial), _placements(partial), mesh_shape)[0] % (chunks * blocks)
            or local_shape(_shape(x), _placements(x), mesh_shape)[0] % (chunks * blocks)):
        return False
    results = []
    # before the linear, not the reduction: a ZeRO unit's release after the linear's weight's last
    # use (autopar/compiler/passes/shard_parameters.py) stays after every piece's use of it
    with graph.inserting_before(linear):
        for index in range(chunks):
            piece = _like(graph.call_function(row_chunks.rows, (x,),
                                              {"blocks": blocks, "chunks": chunks, "index": index}),
                          x, _rows_over(_shape(x), chunks), linear)
            product = _piece_linear(graph, linear, piece, chunks)
            if partial is not linear:
                product = _view(graph, partial, product, chunks, mesh_shape)
            results.append(_piece_of_step(graph, reduction, product, index, chunks))
        joined = _like(graph.call_function(row_chunks.join, (results,), {"blocks": 1}), reduction,
                       _shape(reduction), reduction)
    reduction.replace_all_uses_with(joined)
    _erase(graph, [reduction, *([partial] if partial is not linear else []), linear])
    return True


# --- what a site needs ------------------------------------------------------------------------

def _plain_step(step: torch.fx.Node) -> bool:
    """A collective with whole rows: not re-gathered in backward, not cut in strides or balanced
    chunks, not already cut, outside recomputed regions, over Shard / Replicate / Partial only."""
    spec = step.meta.get(SPEC)
    return (not any(step.kwargs.get(key) for key in ("regather", "layout", "blocks", "deferred"))
            and RECOMPUTE not in step.meta and PIECE not in step.meta and spec is not None
            and all(type(p) in (Shard, Replicate, Partial) for p in spec.placements)
            and all(type(p) in (Shard, Replicate, Partial) for p in step.args[0].meta[SPEC].placements))


def _static(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and all(isinstance(size, int) for size in value.shape)


def _is_linear(node: torch.fx.Node) -> bool:
    """mm, or addmm whose added term is a bias (one row, broadcast to every row of a piece)."""
    if node.op != "call_function" or node.target not in (_aten.addmm.default, _aten.mm.default):
        return False
    bias = node.args[0] if node.target is _aten.addmm.default else None
    value = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
    return bias is None or isinstance(value, torch.Tensor) and (value.dim() <= 1 or value.shape[0] == 1)


def _left(linear: torch.fx.Node) -> torch.fx.Node:
    return linear.args[1] if linear.target is _aten.addmm.default else linear.args[0]


def _row_views_to_linears(gather: torch.fx.Node) -> list[tuple[torch.fx.Node, list[torch.fx.Node]]] | None:
    """The gathered tensor's readers as (its view to rows, the linears reading that view as their
    left operand), or None if anything else reads it."""
    shape = _shape(gather)
    rows = [math.prod(shape[:-1]), shape[-1]]
    found = []
    for view in gather.users:
        if (view.target not in _LAYOUTS or view.args[0] is not gather or list(_shape(view)) != rows
                or RECOMPUTE in view.meta or not view.users):
            return None
        users = list(view.users)
        if not all(_is_linear(user) and _left(user) is view and RECOMPUTE not in user.meta for user in users):
            return None
        found.append((view, users))
    return found or None


# --- building the pieces ----------------------------------------------------------------------

def _shape(node: torch.fx.Node) -> list[int]:
    return list(node.meta["val"].shape)


def _placements(node: torch.fx.Node) -> tuple:
    return node.meta[SPEC].placements


def _rows_over(shape: list[int], chunks: int) -> list[int]:
    return [shape[0] // chunks, *shape[1:]]


def _like(node: torch.fx.Node, model: torch.fx.Node, shape: list[int], origin: torch.fx.Node) -> torch.fx.Node:
    """`node` valued as `model` (dtype, placements) at global `shape`, attributed to `origin`."""
    value = model.meta["val"].new_empty(shape)
    spec = model.meta[SPEC]
    node.meta.update(val=value, **{SPEC: DTensorSpec(spec.mesh, spec.placements, tensor_meta(value))})
    node.meta.update({key: origin.meta[key] for key in _PROVENANCE if key in origin.meta})
    return node


def _piece_of_step(graph: torch.fx.Graph, step: torch.fx.Node, piece: torch.fx.Node, index: int,
                   chunks: int) -> torch.fx.Node:
    """The collective `step` on one piece: same kind and arguments, 1/chunks of its bytes."""
    copied = graph.call_function(step.target, (piece,), dict(step.kwargs))
    copied.meta.update(step.meta)
    _like(copied, step, _rows_over(_shape(step), chunks), step)
    copied.meta[COLLECTIVE] = [dataclasses.replace(info, logical_bytes=simplified(info.logical_bytes / chunks),
                                                   tensor=f"{info.tensor} [{index + 1}/{chunks}]")
                               for info in step.meta.get(COLLECTIVE, [])]
    copied.meta[PIECE] = (index, chunks, step.name)
    return copied


def _view(graph: torch.fx.Graph, view: torch.fx.Node, piece: torch.fx.Node, chunks: int,
          mesh_shape: tuple[int, ...]) -> torch.fx.Node:
    """`view` applied to a piece: its shape with 1/chunks of the rows, locally as globally."""
    shape = _rows_over(_shape(view), chunks)
    copied = _like(graph.call_function(view.target, (piece, shape)), view, shape, view)
    copied.meta[LOCAL_ARGS] = ((None, local_shape(shape, _placements(view), mesh_shape)), {})
    return copied


def _piece_linear(graph: torch.fx.Graph, linear: torch.fx.Node, piece: torch.fx.Node, chunks: int) -> torch.fx.Node:
    """`linear` on a piece of its rows. Its transposed weight (t, or permute [1, 0]) is copied per
    piece when the linear was its only reader, so the scheduling pass can give each piece's linear
    its own tap; any other right operand is shared (computed once)."""
    weight_t = linear.args[2] if linear.target is _aten.addmm.default else linear.args[1]
    if _transpose(weight_t) and len(weight_t.users) == 1:
        weight_t = graph.node_copy(weight_t)
    args = list(linear.args)
    args[1 if linear.target is _aten.addmm.default else 0] = piece
    args[2 if linear.target is _aten.addmm.default else 1] = weight_t
    copied = graph.call_function(linear.target, tuple(args), dict(linear.kwargs))
    copied.meta.update(linear.meta)
    return _like(copied, linear, _rows_over(_shape(linear), chunks), linear)


def _move_readers_after(graph: torch.fx.Graph, linears: list[torch.fx.Node], last: torch.fx.Node, *,
                        anchor: torch.fx.Node) -> None:
    """The joined outputs stand just before the last linear (`anchor` the last of them); what reads
    an earlier linear between it and there (q's reshapes before k's linear) moves after them, in
    its order."""
    nodes = list(graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    first = min(order[linear] for linear in linears)
    dependent = set(linears)
    moved = []
    for node in nodes[first:order[last]]:
        if node not in dependent and any(i in dependent for i in node.all_input_nodes):
            dependent.add(node)
            moved.append(node)
    for node in moved:
        anchor.append(node)
        anchor = node


def _erase(graph: torch.fx.Graph, replaced: list[torch.fx.Node]) -> None:
    """The nodes a site replaced (users first), and the transposed weights only they read."""
    for node in replaced:
        inputs = node.all_input_nodes
        graph.erase_node(node)
        for weight_t in inputs:
            if _transpose(weight_t) and not weight_t.users:
                graph.erase_node(weight_t)


def _transpose(node: torch.fx.Node) -> bool:
    """A 2-D weight's transpose: t, permute [1, 0] (what export writes for a linear's weight)."""
    return (node.op == "call_function" and (node.target is _aten.t.default
                                            or node.target is _aten.permute.default and list(node.args[1]) == [1, 0]))
