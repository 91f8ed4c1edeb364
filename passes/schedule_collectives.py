"""Pass (scheduling): split each redistribution step into a start and a finish, and put compute
between them, so that the collective is in flight while the rank computes.

Runs last, on every stage graph, unless `autopar.schedule(overlap=False)` is declared.

1. Split: an all-reduce, reduce-scatter, all-gather (not a re-gathering one) or all-to-all node
   becomes the start (the same node, `deferred=True`: it keeps its registry entry, its ledger
   records and its bindings) and a `finish` node that every user now reads
   (`autopar.runtime.in_flight`). The start stays where `insert_collectives` put it: after its
   input, before its first consumer; the finish moves to just before its first user (after the
   other steps `insert_collectives` put before the same consumer, say a sequence-parallel add's
   slice), whatever its size: the buffer it lands was allocated by the start, so a later finish
   holds no more memory. A step with no call between its halves once placed is joined again
   (synchronous, as before the pass).
2. Defer: a finish whose output is small (`small_limit`: at most `SMALL_BYTES` and at most the
   graph's largest value / `SMALL_FRACTION`, global sizes), and every node that
   computes only from small values and deferred ones (a later start included), moves to just
   before the first node that needs it (the graph's output at the latest). These are the
   reductions of statistics — a mixture-of-experts block's load-balancing and z-loss terms, a
   scalar loss — whose results nothing needs until the loss is summed: their collectives, issued
   where the statistics are computed, land while the blocks after them run, instead of each
   stopping every rank until all have arrived. Only small values move, so no large tensor
   lives longer than before: what the memory ledger measures is this order (its fake runs run
   the emitted graph).
   Nodes of a recomputed region do not move; a deferred node a region reads lands among the
   region's nodes, and emission moves it before the region's call with the region's other inputs
   (`passes/recompute.py`).

Backward mirrors the order (autograd runs the nodes made later first): a deferred finish's
conjugate collective is issued early in backward and landed where its start's backward runs.
Under `torch.compile` the halves run as one synchronous step (inductor schedules collectives
itself). `overlaps(graph)` lists, per start, the compute nodes between it and its finish — the
report's "in flight over" column.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from autopar.context import CompileContext
from autopar.ir import SPEC, hint
from autopar.passes.recompute import RECOMPUTE
from autopar.program import Program
from autopar.runtime import collectives, in_flight

SMALL_BYTES = 64 * 1024  # at most this, and at most the graph's largest value / SMALL_FRACTION
SMALL_FRACTION = 1024
DEFERRABLE = (collectives.all_reduce, collectives.reduce_scatter, collectives.all_gather, collectives.all_to_all)
# checks a deferred value feeds (one_hot's range checks on globally reduced flags): they raise in
# the same step, a little later, and nothing reads their (empty) result
_CHECKS = (torch.ops.aten._assert_async.msg, torch.ops.aten._assert_async.default)
_CARRIED_META = ("val", SPEC, "nn_module_stack", "stack_trace", RECOMPUTE)


def schedule_collectives(program: Program, ctx: CompileContext) -> Program:
    declared = ctx.strategy.schedule
    if declared is not None and not declared.overlap:
        return program
    for stage in program.stages:
        gm = stage.graph_module
        finishes = [_split(gm.graph, node) for node in list(gm.graph.nodes) if _deferrable(node)]
        if finishes:
            _defer_small_tails(gm.graph)
            _join_what_nothing_separates(gm.graph)
            gm.graph.lint()
            gm.recompile()
    return program


def _deferrable(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in DEFERRABLE and not node.kwargs.get("regather")
            and not node.kwargs.get("deferred"))


def _split(graph: torch.fx.Graph, start: torch.fx.Node) -> torch.fx.Node:
    with graph.inserting_after(start):
        finish = graph.create_node("call_function", in_flight.finish, (start,), name=f"{start.name}_finished")
    start.replace_all_uses_with(finish, delete_user_cb=lambda user: user is not finish)
    start.kwargs = {**start.kwargs, "deferred": True}
    finish.meta.update({key: start.meta[key] for key in _CARRIED_META if key in start.meta})
    return finish


def _bytes(node: torch.fx.Node) -> float:
    """Global bytes of a node's value (its tensors'; sizes and other values weigh nothing)."""
    total = 0.0
    for value in torch.utils._pytree.tree_leaves(node.meta.get("val", math.inf)):
        if isinstance(value, torch.Tensor):
            total += float(math.prod(hint(s) for s in value.shape) * value.dtype.itemsize)
        elif isinstance(value, float) and value == math.inf:
            return math.inf
    return total


def small_limit(graph: torch.fx.Graph) -> float:
    """Bytes a deferred value may have: a statistic, not an activation, whatever the model's size."""
    largest = max((b for node in graph.nodes if (b := _bytes(node)) != math.inf), default=0.0)
    return min(SMALL_BYTES, largest / SMALL_FRACTION)


def _small(node: torch.fx.Node, limit: float) -> bool:
    return node.target in _CHECKS or _bytes(node) <= limit


def deferred_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The small finishes and what computes only from them and other small values, in graph order."""
    deferred: set[torch.fx.Node] = set()
    limit = small_limit(graph)
    for node in graph.nodes:
        if (node.op != "call_function" or RECOMPUTE in node.meta or not _small(node, limit)
                or node.is_impure() and node.target not in _CHECKS):
            continue
        inputs = node.all_input_nodes
        if node.target is in_flight.finish or (any(i in deferred for i in inputs)
                                                and all(i in deferred or _small(i, limit) for i in inputs)):
            deferred.add(node)
    return [node for node in graph.nodes if node in deferred]


def _defer_small_tails(graph: torch.fx.Graph) -> None:
    deferred = set(deferred_nodes(graph)) | {node for node in graph.nodes
                                             if node.target is in_flight.finish and RECOMPUTE not in node.meta}
    waiting: list[torch.fx.Node] = []  # deferred nodes not placed yet, in graph order
    for node in list(graph.nodes):
        if node in deferred:
            waiting.append(node)
            continue
        if not waiting:
            continue
        needed = _needed(node, set(waiting)) if node.op != "output" else set(waiting)
        if not needed:
            continue
        for moved in [w for w in waiting if w in needed]:
            node.prepend(moved)
        waiting = [w for w in waiting if w not in needed]


def _join_what_nothing_separates(graph: torch.fx.Graph) -> None:
    """A step whose finish follows its start with no call between runs synchronous again: two
    autograd functions and a flight object would cost time and overlap nothing."""
    by_name = {node.name: node for node in graph.nodes}
    for over in overlaps(graph):
        if not over.between:
            finish = by_name[over.finish]
            start = finish.args[0]
            finish.replace_all_uses_with(start)
            graph.erase_node(finish)
            start.kwargs = {k: v for k, v in start.kwargs.items() if k != "deferred"}


def _needed(node: torch.fx.Node, waiting: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The waiting nodes `node` reads, directly or through other waiting nodes."""
    needed, stack = set(), [i for i in node.all_input_nodes if i in waiting]
    while stack:
        current = stack.pop()
        if current not in needed:
            needed.add(current)
            stack.extend(i for i in current.all_input_nodes if i in waiting)
    return needed


@dataclass(frozen=True)
class InFlightOver:
    """A deferred step and the nodes the rank graph runs between its start and its finish."""
    start: str
    finish: str
    between: tuple[str, ...]


def overlaps(graph: torch.fx.Graph) -> list[InFlightOver]:
    """Per deferred step (in graph order), the call nodes the graph runs between its halves."""
    nodes = list(graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    found = []
    for node in nodes:
        if node.op == "call_function" and node.target is in_flight.finish:
            start = node.args[0]
            between = [n.name for n in nodes[order[start] + 1:order[node]] if n.op == "call_function"]
            found.append(InFlightOver(start.name, node.name, tuple(between)))
    return found
