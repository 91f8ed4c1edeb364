"""Pass (scheduling): split each redistribution step into a start and a finish, and put compute
between them, so that the collective is in flight while the rank computes.

Runs last, on every stage graph, unless `autopar.schedule(overlap=False)` is declared.

1. Split: an all-reduce, reduce-scatter, all-gather (not a re-gathering one), all-to-all or
   `grad_all_reduce` (Megatron's f: identity forward, all-reduce backward) node
   becomes the start (the same node, `deferred=True`: it keeps its registry entry, its ledger
   records and its bindings) and a `finish` node that every user now reads
   (`autopar.core.ops.in_flight`). The start stays where `insert_collectives` put it: after its
   input, before its first consumer; the finish moves to just before its first user (after the
   other steps `insert_collectives` put before the same consumer, say a sequence-parallel add's
   slice), whatever its size: the buffer it lands was allocated by the start, so a later finish
   holds no more memory. A step with no call between its halves once placed (other steps'
   finishes alone do not count) is joined again (synchronous, as before the pass).
2. Weight gradients behind the input gradient's reduction: the linears (addmm / mm of a
   transposed 2-D weight) that read an f or a sequence-parallel all-gather (whose backward
   reduces their input gradient) compute that gradient at once in backward and leave the weight
   gradient to a `tap` of the weight made between the step's halves (`autopar/core/ops/weight_gradients.py`):
   autograd runs it after the finish's backward has issued the reduction and before the start's
   lands it — Megatron's overlap of the input-gradient all-reduce with the weight-gradient GEMM,
   by autograd's own order. The output gradients wait for their taps, so backward holds them a
   little longer (the memory ledger's fake runs run this graph). Not under zb_h1 (it splits
   weight gradients its own way), not in a recomputed region.
3. Defer: a finish whose output is small (`small_values`: at most `SMALL_BYTES` and at most the
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
   (`autopar/compiler/passes/recompute.py`).

Backward mirrors the order (autograd runs the nodes made later first): a deferred finish's
conjugate collective is issued early in backward and landed where its start's backward runs.
Under `torch.compile` the halves run as one synchronous step (inductor schedules collectives
itself). `overlaps(graph)` lists, per start, the call nodes between it and its finish — the
report's and the HTML view's "in flight over".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from autopar.compiler.context import CompileContext
from autopar.compiler.passes.recompute import RECOMPUTE
from autopar.core.ir import SPEC, hint
from autopar.core.ops import collectives, in_flight, weight_gradients
from autopar.core.program import Program
from autopar.core.schedules import SPLIT_BACKWARD

SMALL_BYTES = 64 * 1024  # at most this, and at most the graph's largest value / SMALL_FRACTION
SMALL_FRACTION = 1024
DEFERRABLE = (collectives.all_reduce, collectives.reduce_scatter, collectives.all_gather, collectives.all_to_all,
              collectives.grad_all_reduce)
_aten = torch.ops.aten
_LAYOUTS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")
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
            _split_weight_gradients(gm.graph, finishes, zb_h1=_zb_h1(ctx))
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


def _zb_h1(ctx: CompileContext) -> bool:
    """zb_h1 and dualpipev compute weight gradients in a pass of their own already (runtime/pipeline.py)."""
    return any(s.pipeline is not None and s.pipeline.schedule in SPLIT_BACKWARD for s in ctx.strategy.strategies)


def _input_gradient_conjugate(start: torch.fx.Node) -> bool:
    """Steps whose backward reduces the input gradient of the linears after them (Megatron's f,
    sequence parallelism's all-gather): the weight-gradient GEMMs can hide it."""
    return (start.target is collectives.grad_all_reduce
            or start.target is collectives.all_gather and bool(start.kwargs.get("grad_partial")))


def _linears_reading(value: torch.fx.Node) -> list[torch.fx.Node]:
    """addmm / mm nodes whose left operand is `value` or a view of it."""
    found, stack = [], [value]
    while stack:
        current = stack.pop()
        for user in current.users:
            if user.target in _LAYOUTS and user.args[0] is current:
                stack.append(user)
            elif (user.target is _aten.addmm.default and user.args[1] is current
                  or user.target is _aten.mm.default and user.args[0] is current):
                found.append(user)
    return found


def _split_weight_gradients(graph: torch.fx.Graph, finishes: list[torch.fx.Node], *, zb_h1: bool) -> None:
    """Each linear fed by an f or SP all-gather gets its weight gradient computed by a tap made
    between the step's halves (`autopar/core/ops/weight_gradients.py`): in backward the tap runs after the
    step's conjugate is issued and before it lands."""
    if zb_h1:
        return
    order = {node: index for index, node in enumerate(graph.nodes)}
    for finish in finishes:
        start = finish.args[0]
        if not _input_gradient_conjugate(start) or RECOMPUTE in start.meta:
            continue
        for linear in _linears_reading(finish):
            weight_t = linear.args[2] if linear.target is _aten.addmm.default else linear.args[1]
            if (RECOMPUTE in linear.meta or weight_t.target not in (_aten.permute.default, _aten.t.default)
                    or weight_t.target is _aten.permute.default and list(weight_t.args[1]) != [1, 0]
                    or len(weight_t.users) != 1):
                continue
            weight = weight_t.args[0]
            if order[weight] >= order[start] or weight.meta.get("val") is None or weight.meta["val"].dim() != 2:
                continue
            with graph.inserting_before(finish):
                tapped = graph.call_function(weight_gradients.tap, (weight,))
            tapped.meta.update({key: weight.meta[key] for key in ("val", SPEC) if key in weight.meta})
            tapped.meta.update({key: linear.meta[key] for key in _PROVENANCE if key in linear.meta})
            weight_t.replace_input_with(weight, tapped)
            tapped.append(weight_t)  # the transpose may have stood before the step; its one user is later
            bias = linear.args[0] if linear.target is _aten.addmm.default else None
            x = linear.args[1] if linear.target is _aten.addmm.default else linear.args[0]
            with graph.inserting_before(linear):
                split = graph.call_function(weight_gradients.linear, (x, weight_t, bias, tapped))
            split.meta.update({key: linear.meta[key] for key in ("val", SPEC, *_PROVENANCE) if key in linear.meta})
            linear.replace_all_uses_with(split)
            graph.erase_node(linear)


def _bytes(node: torch.fx.Node) -> float:
    """Global bytes of a node's value (its tensors'; sizes and other values weigh nothing)."""
    total = 0.0
    for value in torch.utils._pytree.tree_leaves(node.meta.get("val", math.inf)):
        if isinstance(value, torch.Tensor):
            total += float(math.prod(hint(s) for s in value.shape) * value.dtype.itemsize)
        elif isinstance(value, float) and value == math.inf:
            return math.inf
    return total


def small_values(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose value a deferral may move: at most `SMALL_BYTES` and at most the graph's
    largest value / `SMALL_FRACTION` (a statistic, not an activation, whatever the model's size),
    and the checks. Each node's size is read once."""
    sizes = {node: _bytes(node) for node in graph.nodes}
    largest = max((b for b in sizes.values() if b != math.inf), default=0.0)
    limit = min(SMALL_BYTES, largest / SMALL_FRACTION)
    return {node for node, size in sizes.items() if node.target in _CHECKS or size <= limit}


def deferred_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The small finishes and what computes only from them and other small values, in graph order."""
    deferred: set[torch.fx.Node] = set()
    small = small_values(graph)
    for node in graph.nodes:
        if (node.op != "call_function" or RECOMPUTE in node.meta or node not in small
                or node.is_impure() and node.target not in _CHECKS):
            continue
        inputs = node.all_input_nodes
        if node.target is in_flight.finish or (any(i in deferred for i in inputs)
                                                and all(i in deferred or i in small for i in inputs)):
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
    autograd functions and a flight object would cost time and overlap nothing. Other steps'
    finishes alone between do not count (a second piece's reduction issued after the first's
    compute, `autopar/compiler/passes/chunk_collectives.py`: it would wait where it is issued all the same), but
    those of steps with weight-gradient taps do: joined, the step's conjugate would queue behind
    theirs before the taps run."""
    by_name = {node.name: node for node in graph.nodes}
    tapped = tapped_starts(graph)  # their conjugate must stay in flight over their taps, not queue behind

    def other_finish(name: str) -> bool:
        return by_name[name].target is in_flight.finish and by_name[name].args[0] not in tapped

    for over in overlaps(graph):
        if all(other_finish(name) for name in over.between):
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


def tapped_starts(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The deferred steps with weight-gradient taps between their halves: in backward their
    conjugate reduction is in flight while the taps compute the weight gradients (step 2)."""
    found, open_starts = set(), set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.kwargs.get("deferred") and _input_gradient_conjugate(node):
            open_starts.add(node)
        elif node.target is in_flight.finish:
            open_starts.discard(node.args[0])
        elif node.target is weight_gradients.tap:
            found |= open_starts
    return found


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
