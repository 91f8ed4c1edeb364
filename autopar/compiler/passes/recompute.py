"""Pass (activation recomputation): find the regions `recompute()` declares in the planned graph,
mark them, and — at emission — run each one through `torch.utils.checkpoint`.

`recompute(program, ctx)` runs after `shard_parameters`, on the stage graph, when the strategy
declares `strategies.recompute` (a no-op otherwise). It writes the region's name under
`node.meta[RECOMPUTE]` on every node of each region (`find_regions`):
- "selective": each attention core (`attention_cores`): a `scaled_dot_product_attention` node
  (with the items of a multi-output form), or an explicit core — a matmul both of whose operands
  are computed from the user's inputs (q·kᵀ), every node up to the first later such matmul that
  consumes it (probabilities·v), and that matmul; a region reading a parameter is no core;
- "full": each repeated block (the module path up to its first list index, `layers.3`);
- module globs: each module that matches, outermost first.
A region holds the computing nodes only: ZeRO's gathers, their items, releases and boundaries
(`sharded_state.unit_call`) stay outside (the gathered parameters enter the region as inputs,
saved as handles like any saved parameter), so recomputation never gathers twice. A region must
be convex (no path leaving it and coming back, `torch.fx`'s `validate_partition`), else a
plan-time error names it. Context-parallel attention inside a region is refused at plan time
(not supported yet), and so is the zb_h1 pipeline schedule; a pipeline stage's sends and
receives stay outside its regions. A mixture-of-experts block recomputes like any other: its
dispatch and combine run again with the forward's routing (`autopar/core/ops/moe.py` records
the dispatch as recomputed).

The comm ledger (`autopar/compiler/ledger/comm.py`) counts the forward collectives of a marked node a
second time in backward: recomputation runs them again (early stop is off, so every node of a
region runs again, whatever its saved tensors need). The activation ledger needs nothing: it
runs the emitted rank graph, whose checkpointed regions save only their inputs.

`wrap_recomputed_regions(graph)` (called last by `emit_rank_graph`) replaces each marked region
of a rank graph by one call of a `RecomputedRegion` — a GraphModule of the region's nodes run by
`torch.utils.checkpoint.checkpoint(use_reentrant=False, early_stop=False)`, which keeps the CPU
RNG state, so dropout inside draws the same masks again — and one getitem per value used after
it, which records the replaced node's name (`PLANNED_NAME`). The call stands where the region's first node stood; inputs
computed later (a ZeRO gather issued inside the block) move before it. Size arithmetic that
emission adds on a path leaving the region and coming back (dynamic dims: a size read off a
region's tensor and used by a later view in it) joins the region (`_convex`).
"""
from __future__ import annotations

import fnmatch
import operator
import re
from collections import defaultdict

import torch
import torch.fx
from torch.fx.passes.utils.fuser_utils import validate_partition

from autopar.compiler.context import CompileContext
from autopar.compiler.flops import node_flops
from autopar.core.errors import PlanError
from autopar.core.ir import PLANNED_NAME, module_path, reachable
from autopar.core.schedules import SPLIT_BACKWARD
from autopar.core.ops import sharded_state
from autopar.core.program import Program

RECOMPUTE = "autopar_recompute"  # node meta: the name of the recomputed region the node belongs to
_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")
_MATMULS = (torch.ops.aten.bmm.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default)
ATTENTION_OPS = (torch.ops.aten.scaled_dot_product_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default)


def _computes(node: torch.fx.Node) -> bool:
    """A node a region may hold: a computation, not ZeRO's unit calls, a pipeline stage's sends and
    receives (runtime/p2p.py) or graph boundaries."""
    return (node.op == "call_function" and sharded_state.unit_call(node.target) is None
            and getattr(node.target, "__module__", "") != "autopar.core.ops.p2p")


def attention_cores(graph: torch.fx.Graph, kinds: dict[str, str]) -> list[list[torch.fx.Node]]:
    """The attention cores of a graph, each as its nodes in graph order (module docstring)."""
    cores: list[set[torch.fx.Node]] = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in ATTENTION_OPS:
            cores.append({node} | {u for u in node.users if u.target is operator.getitem})
    data: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and kinds.get(node.name) == "input") or data & set(node.all_input_nodes):
            data.add(node)
    state = {n for n in graph.nodes if n.op == "placeholder" and kinds.get(n.name) == "parameter"}
    matmuls = [n for n in graph.nodes if n.op == "call_function" and n.target in _MATMULS
               and len(n.all_input_nodes) == 2 and set(n.all_input_nodes) <= data]
    index = 0
    while index < len(matmuls):
        first, descendants = matmuls[index], reachable(matmuls[index], forward=True)
        partner = next((m for m in matmuls[index + 1:] if m in descendants), None)
        if partner is None:
            index += 1
            continue
        region = {first, partner} | (descendants & reachable(partner, forward=False))
        if any(state & set(n.all_input_nodes) for n in region) or not all(_computes(n) for n in region):
            index += 1
            continue
        cores.append(region)
        index = matmuls.index(partner) + 1
    order = {node: i for i, node in enumerate(graph.nodes)}
    return [sorted(core, key=order.__getitem__) for core in cores]


def _module_region(path: str, declared) -> str | None:
    """The region a node of module `path` belongs to under "full" or module globs (None: none)."""
    if declared.policy == "full":
        match = _BLOCK.match(path)
        return match.group(1) if match else None
    parts = path.split(".") if path else []
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if any(fnmatch.fnmatchcase(prefix, glob) for glob in declared.modules):
            return prefix
    return None


def find_regions(graph: torch.fx.Graph, declared, kinds: dict[str, str]) -> dict[str, list[torch.fx.Node]]:
    """Region name -> its nodes in graph order, for the declared policy."""
    if declared.policy == "selective":
        regions = {}
        for core in attention_cores(graph, kinds):
            name = f"{module_path(core[0]) or '<top>'} attention core"
            regions[name if name not in regions else f"{name} #{len(regions)}"] = core
        return regions
    found: dict[str, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        region = _module_region(module_path(node), declared) if _computes(node) else None
        if region is not None:
            found[region].append(node)
    return dict(found)


def _refuse_unsupported(ctx: CompileContext, declared) -> None:
    what = f"recompute({declared.describe()})"
    pipeline = ctx.strategy.pipeline()
    if pipeline is not None and pipeline[1].schedule in SPLIT_BACKWARD:
        raise PlanError(f"{what} under the {pipeline[1].schedule} schedule is not supported yet (its split backward "
                        f"unpacks a recomputed region's tensors twice)\n  fix: schedule='1f1b', 'gpipe' or "
                        f"'interleaved_1f1b'")
    if ctx.strategy.context_axes():
        raise PlanError(f"{what} under context parallelism is not supported yet (its attention kernels issue their "
                        f"own messages)\n  fix: leave recompute out, or context_parallel out")


def _check_region(name: str, nodes: list[torch.fx.Node], declared) -> None:
    first = nodes[0]
    if not validate_partition(list(nodes)):
        raise PlanError.at(first, f"recompute({declared.describe()}): region {name} is not convex (a value leaves it "
                                  f"and comes back), so it cannot run as one recomputed call",
                           fix="recompute smaller modules (module globs)")


def refuses(ctx: CompileContext) -> None:
    """What this pass refuses of the strategies alone, before any pass runs (`passes.run_passes`):
    the planner meets these combinations by the dozen and need not propagate a graph to hear no."""
    if ctx.strategy.recompute is not None:
        _refuse_unsupported(ctx, ctx.strategy.recompute)


def recompute(program: Program, ctx: CompileContext) -> Program:
    declared = ctx.strategy.recompute
    if declared is None:
        return program
    _refuse_unsupported(ctx, declared)
    kinds = {name: info.kind for name, info in ctx.placeholders.items()}
    for stage in program.stages:
        regions = find_regions(stage.graph_module.graph, declared, kinds)
        if not regions:
            looked = {"selective": "attention (scaled_dot_product_attention or q·kᵀ … ·v)",
                      "full": "repeated blocks (modules such as layers.0)"}.get(declared.policy,
                                                                             f"modules matching {declared.modules}")
            raise PlanError(f"recompute({declared.describe()}) found no region to recompute: the graph has no "
                            f"{looked}\n  fix: choose another policy, or module globs naming modules of the model")
        for name, nodes in regions.items():
            _check_region(name, nodes, declared)
            for node in nodes:
                node.meta[RECOMPUTE] = name
    return program


def recomputed_flops(graph: torch.fx.Graph) -> dict[str, int]:
    """Forward FLOPs (global, at the traced sizes) each region runs again in backward."""
    flops: dict[str, int] = defaultdict(int)
    for node in graph.nodes:
        if RECOMPUTE in node.meta:
            flops[node.meta[RECOMPUTE]] += node_flops(node)
    return dict(flops)


class RecomputedRegion:
    """One region of a rank graph, run under non-reentrant activation checkpointing."""

    def __init__(self, name: str, graph_module: torch.fx.GraphModule) -> None:
        self.name = name
        self.graph_module = graph_module

    def run(self, *args):
        return torch.utils.checkpoint.checkpoint(self.graph_module, *args, use_reentrant=False, early_stop=False)


def is_region_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(getattr(node.target, "__self__", None), RecomputedRegion)


def _region_graph(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node],
                  outputs: list[torch.fx.Node]) -> torch.fx.Graph:
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for value in inputs:
        env[value] = sub.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in nodes:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[node] for node in outputs))
    return sub


def _wrap(graph: torch.fx.Graph, name: str, nodes: list[torch.fx.Node], order: dict[torch.fx.Node, int]) -> None:
    members = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
    outputs = [n for n in nodes if any(user not in members for user in n.users)]
    region = RecomputedRegion(name, torch.fx.GraphModule(torch.nn.Module(), _region_graph(nodes, inputs, outputs),
                                                         class_name="RecomputedRegion"))
    first = nodes[0]
    late, stack = set(), [a for a in inputs if order[a] > order[first]]
    while stack:  # inputs computed after the region's first node (and what they need) move before it
        value = stack.pop()
        if value not in late:
            late.add(value)
            stack.extend(a for a in value.all_input_nodes if order[a] > order[first])
    for value in sorted(late, key=order.__getitem__):
        first.prepend(value)
    with graph.inserting_before(first):
        call = graph.call_function(region.run, tuple(inputs))
    for key in ("nn_module_stack", "stack_trace"):
        if key in first.meta:
            call.meta[key] = first.meta[key]
    items = []
    with graph.inserting_after(call):
        for index, node in reversed(list(enumerate(outputs))):
            items.append((node, graph.call_function(operator.getitem, (call, index))))
    for node, item in items:
        item.meta = dict(node.meta, **{PLANNED_NAME: node.name})  # the activation ledger finds the planned node
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
    for node in reversed(nodes):
        graph.erase_node(node)


def _convex(nodes: list[torch.fx.Node], order: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    """The region with the nodes emission added on paths that leave it and come back (sizes read off
    its tensors and computed with, under dynamic dims), so that it can run as one call."""
    members, first, last = set(nodes), order[nodes[0]], order[nodes[-1]]

    def inside(node: torch.fx.Node) -> bool:  # a path out of the region and back lies between its ends
        return first <= order[node] <= last

    between = (reachable(nodes, forward=True, within=inside) & reachable(nodes, forward=False, within=inside)) - members
    if any(not _computes(node) for node in between):
        raise PlanError.at(nodes[0], f"recomputed region {nodes[0].meta[RECOMPUTE]} is not convex in the rank graph",
                           fix="recompute smaller modules (module globs)")
    return sorted(members | between, key=order.__getitem__)


def wrap_recomputed_regions(graph: torch.fx.Graph) -> None:
    """Replace each region marked by `recompute` with one checkpointed call (module docstring)."""
    regions: dict[str, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if RECOMPUTE in node.meta:
            regions[node.meta[RECOMPUTE]].append(node)
    for name, nodes in regions.items():
        order = {node: i for i, node in enumerate(graph.nodes)}
        _wrap(graph, name, _convex(nodes, order), order)


recompute.refuses = refuses
