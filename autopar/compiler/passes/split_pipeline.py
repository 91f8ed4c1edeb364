"""Pass: cut the planned graph by depth into pipeline stage graphs joined by send/recv steps.

Runs after `insert_grad_reductions` (every placement, collective and gradient reduction of the
whole graph is decided) and before `shard_parameters` (ZeRO units are per stage). Without a
pipeline strategy the program gets one stage: the whole graph.

1. Blocks (`repeated_blocks`): the children of the outermost module list (`layers.0`,
   `layers.1`, ...) in execution order. Stages start at blocks: the declared cut points (module
   paths, matched as suffixes: `layers.4` or `model.layers.4`; a layout string's are block
   indices, and it must list as many blocks as the model has), or a balanced cut
   (`balanced_starts`: contiguous blocks per stage minimising the largest stage's forward FLOPs,
   the first stage also carrying what runs before the blocks — the embedding — and the last what
   runs after them — the head and loss).
2. Assignment (`assign_stages`): a node inside a block belongs to its block's stage; any other
   node to the latest stage among its inputs (the embedding to the first, the head to the last);
   a communication step, and a node reading only graph inputs (a parameter's transpose), moves
   to the earliest stage that consumes it, so a tensor crosses a boundary before it is
   redistributed (a sequence shard is sent, not its all-gather) and a weight stays with its use.
   An edge going backwards in stage order is a cut inside a block or a residual branch: a
   PlanError.
3. Values crossing a boundary: a value that depends on no trainable parameter (positions,
   rotary tables, masks, label shifts) is recomputed in the stage that needs it; any other value
   is sent from its stage to each later stage that uses it (`send_activation` there,
   `recv_activation` here: a conjugate pair, the gradient travels back), also across several
   stages (a residual stream skipping one). A trainable parameter used by several stages (a tied
   embedding and LM head) is held by each, and its gradient is summed over the group of pipeline
   ranks holding it (a `pp@i,j` entry in its gradient-sync axes: an all-reduce over those ranks).
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.fx

from autopar.compiler.context import CompileContext, PlaceholderInfo
from autopar.compiler.flops import node_flops
from autopar.compiler.passes.insert_grad_reductions import GRAD_SYNC, REQUIRES_GRAD
from autopar.compiler.rules.random_rules import draws, what_to_zero
from autopar.core.comm_kinds import comm_step
from autopar.core.errors import PlanError
from autopar.core.ir import (
    COLLECTIVE,
    SPEC,
    CollectiveInfo,
    lazy_graph_module,
    local_numel,
    local_shape,
    module_path,
    module_stack,
    simplified,
)
from autopar.core.ops import p2p
from autopar.core.program import TOKEN, Boundary, PipelineLayout, Program, Stage
from autopar.core.schedules import SPLIT_BACKWARD, V_SHAPED

PIPELINE_STAGE = "autopar_pipeline_stage"  # on the whole graph's nodes: the stage(s) computing or holding it
_BLOCK = re.compile(r"^(.*)\.(\d+)$")
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson", "exponential")


def repeated_blocks(gm: torch.fx.GraphModule) -> tuple[list[str], dict[torch.fx.Node, int]]:
    """The blocks of the outermost module list, in execution order, and each node's block."""
    containers: dict[str, dict[int, int]] = defaultdict(dict)
    for position, node in enumerate(gm.graph.nodes):
        for path in module_stack(node):
            match = _BLOCK.match(path)
            if match:
                containers[match.group(1)].setdefault(int(match.group(2)), position)
    outer = [c for c in containers if not any(c.startswith(f"{o}.{i}.") for o in containers if o != c
                                               for i in containers[o])]
    if not outer:
        return [], {}
    container = max(outer, key=lambda c: (len(containers[c]), -len(c)))
    blocks = [f"{container}.{i}" for i, _ in sorted(containers[container].items(), key=lambda item: item[1])]
    index = {path: i for i, path in enumerate(blocks)}
    node_block = {}
    for node in gm.graph.nodes:
        found = next((index[p] for p in module_stack(node) if p in index), None)
        if found is not None:
            node_block[node] = found
    return blocks, node_block


def _declared_starts(cuts: tuple[str, ...], blocks: list[str], stages: int) -> list[int]:
    if len(cuts) != stages - 1:
        raise PlanError(f"stages={list(cuts)} gives {len(cuts) + 1} pipeline stages, but the pipeline axis needs "
                        f"{stages} (pp size x virtual_stages); list {stages - 1} module paths where stages start, "
                        f"or stages=None to balance them")
    starts = [0]
    for cut in cuts:
        found = [i for i, block in enumerate(blocks) if block == cut or block.endswith("." + cut)]
        inside = [b for b in blocks if cut.startswith(b + ".") or ("." + cut).find("." + b + ".") >= 0]
        if not found:
            where = (f"{cut!r} is inside block {inside[0]!r}: a cut inside a block (or a residual branch) would "
                     f"send more than the residual stream" if inside else f"no block is named {cut!r}")
            raise PlanError(f"pipeline cut {cut!r}: {where}. Stages start at blocks of the model's layer list: "
                            f"{', '.join(blocks[:4])}{', ...' if len(blocks) > 4 else ''}")
        if found[0] <= starts[-1]:
            raise PlanError(f"pipeline cut {cut!r} does not come after the previous cut; list cut points in "
                            f"increasing block order, each stage keeping at least one block")
        starts.append(found[0])
    return starts


def balanced_starts(costs: list[int], stages: int, *, head: int, tail: int) -> list[int]:
    """Contiguous groups of blocks minimising the largest stage cost (first stage + head, last + tail)."""
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    best: dict[tuple[int, int], tuple[int, list[int]]] = {}

    def solve(first: int, remaining: int) -> tuple[int, list[int]]:
        """Blocks first.. into `remaining` stages: (largest stage cost, starts)."""
        if (first, remaining) in best:
            return best[(first, remaining)]
        extra = head if first == 0 else 0
        if remaining == 1:
            result = (prefix[n] - prefix[first] + extra + tail, [first])
        else:
            result = None
            for end in range(first + 1, n - remaining + 2):
                rest, starts = solve(end, remaining - 1)
                cost = max(prefix[end] - prefix[first] + extra, rest)
                if result is None or cost < result[0]:
                    result = (cost, [first] + starts)
        best[(first, remaining)] = result
        return result

    return solve(0, stages)[1]


def _starts(gm: torch.fx.GraphModule, cuts: tuple[str, ...] | None, blocks: list[str], node_block: dict,
            stages: int) -> tuple[list[int], str]:
    if cuts is not None:
        return _declared_starts(cuts, blocks, stages), "declared"
    costs, head, tail = [0] * len(blocks), 0, 0
    first_block = min((p for p, n in enumerate(gm.graph.nodes) if n in node_block), default=0)
    for position, node in enumerate(gm.graph.nodes):
        flops = node_flops(node)
        if node in node_block:
            costs[node_block[node]] += flops
        elif position < first_block:
            head += flops
        else:
            tail += flops
    starts = balanced_starts(costs, stages, head=head, tail=tail)
    return starts, (f"balanced by forward FLOPs: blocks {min(costs):,} to {max(costs):,}, before the blocks "
                    f"{head:,}, after them {tail:,}")


def assign_stages(gm: torch.fx.GraphModule, node_block: dict, block_stage: list[int], last: int) -> dict:
    stage_of: dict[torch.fx.Node, int] = {}
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            stage_of[node] = last
            continue
        inputs = [stage_of[i] for i in node.all_input_nodes if i in stage_of]
        block = node_block.get(node)
        stage_of[node] = block_stage[block] if block is not None and comm_step(node.target) is None \
            else max(inputs, default=0)
    for node in reversed(nodes):  # redistribute on the consuming side; a view of a parameter next to its use
        late = comm_step(node.target) is not None or (
            node not in node_block and all(i.op == "placeholder" for i in node.all_input_nodes))
        if node.op == "call_function" and late and node.users:
            stage_of[node] = max(stage_of[node], min(stage_of[u] for u in node.users))
    for node in nodes:
        for source in node.all_input_nodes:
            if source in stage_of and stage_of[source] > stage_of[node]:
                raise PlanError.at(node, f"the pipeline cut puts this node in stage {stage_of[node]} before its input "
                                         f"{source.name} (stage {stage_of[source]}, module "
                                         f"{module_path(source) or '<top level>'})",
                                   fix="cut only between blocks of the layer list (stages=['layers.4', ...]); a cut "
                                       "inside a block or a residual branch cannot be pipelined")
    return stage_of


def _free_nodes(gm: torch.fx.GraphModule, ctx: CompileContext) -> set[torch.fx.Node]:
    """Nodes computed from user inputs, buffers, constants and frozen parameters only, without
    randomness: recomputed by each stage that needs them instead of sent."""
    free = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            info = ctx.placeholders[node.name]
            if not (info.kind == "parameter" and info.requires_grad):
                free.add(node)
        elif node.op == "get_attr":
            free.add(node)
        elif node.op == "call_function" and not any(word in str(node.target) for word in _RANDOM) \
                and all(i in free for i in node.all_input_nodes):
            free.add(node)
    return free


def _refuse_random_draws(graph: torch.fx.Graph) -> None:
    """Random ops under a pipeline: each stage's process draws from its own generator, micro-batch
    by micro-batch, where one device draws each tensor for the whole batch, every layer's draws
    after the layers before it — not one device's values (`autopar/core/ops/dropout.py` keeps them
    equal for the other strategies)."""
    for node in graph.nodes:
        if draws(node):
            raise PlanError.at(node, f"{node.target} draws random values, and under pipeline parallelism it would not "
                                     f"draw the single-device model's (each stage draws from its own generator, one "
                                     f"micro-batch at a time)",
                               fix=f"set {what_to_zero(node)} for pipeline-parallel training, or train this model "
                                   f"without pipeline_parallel (random ops match one device under DP, ZeRO, FSDP, TP, "
                                   f"SP, CP and EP)")


def split_pipeline(program: Program, ctx: CompileContext) -> Program:
    gm = program.graph_module
    declared = ctx.strategy.pipeline()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if declared is None:
        program.stages = [Stage(index=0, graph_module=gm, user_outputs=len(output.all_input_nodes))]
        return program
    axis, pipeline = declared
    if pipeline.schedule in SPLIT_BACKWARD and ctx.strategy.sharded_state() is not None:
        raise PlanError(f"schedule {pipeline.schedule!r} splits each backward into input- and weight-gradient passes, "
                        f"which ZeRO/FSDP units (gathered weights reduced as their gradient arrives) do not support "
                        f"yet; fix: use schedule='1f1b' or 'interleaved_1f1b' with ZeRO, or data_parallel() with "
                        f"{pipeline.schedule!r}")
    _refuse_random_draws(gm.graph)
    degree = ctx.mesh.size(axis)
    count = degree * pipeline.virtual_stages
    blocks, node_block = repeated_blocks(gm)
    if not blocks:
        raise PlanError("pipeline parallelism cuts the model between repeated blocks (a module list such as "
                        "layers.0, layers.1, ...), and this model has none; fix: drop the pipeline strategy, or "
                        "structure the model as a list of blocks")
    if count > len(blocks):
        raise PlanError(f"{count} pipeline stages (pp={degree} x virtual_stages={pipeline.virtual_stages}) but the "
                        f"model has only {len(blocks)} blocks ({', '.join(blocks[:4])}"
                        f"{', ...' if len(blocks) > 4 else ''}); fix: fewer stages, or a deeper model")
    if pipeline.schedule == "interleaved_1f1b" and pipeline.microbatches % degree:
        raise PlanError(f"schedule 'interleaved_1f1b' needs the micro-batch count ({pipeline.microbatches}) to be a "
                        f"multiple of the pipeline degree ({degree}); fix: microbatches={degree * -(-pipeline.microbatches // degree)}")
    if pipeline.schedule in V_SHAPED and pipeline.microbatches < 2 * degree:
        raise PlanError(f"schedule {pipeline.schedule!r} needs at least as many micro-batches as stages (2 × pp = "
                        f"{2 * degree}), got {pipeline.microbatches}; fix: microbatches={2 * degree} or more")
    if pipeline.layout_blocks is not None and pipeline.layout_blocks != len(blocks):
        raise PlanError(f"pipeline layout {pipeline.layout!r} lists {pipeline.layout_blocks} blocks (t) but the model "
                        f"has {len(blocks)} ({', '.join(blocks[:2])}, ...); fix: a layout with {len(blocks)} t")
    starts, balance = _starts(gm, pipeline.stages, blocks, node_block, count)
    if pipeline.layout is not None:
        balance = f"declared by layout {pipeline.layout!r}"
    block_stage = [sum(1 for s in starts if s <= b) - 1 for b in range(len(blocks))]
    stage_of = assign_stages(gm, node_block, block_stage, count - 1)
    layout = PipelineLayout(axis=axis, degree=degree, virtual=pipeline.virtual_stages,
                            microbatches=pipeline.microbatches, schedule=pipeline.schedule,
                            batch_dim=pipeline.batch_dim, starts=tuple(blocks[s] for s in starts[1:]), balance=balance,
                            overlap=pipeline.overlap)
    program.pipeline = layout
    program.stages, program.ties = _Builder(gm, ctx, layout, stage_of).build()
    return program


class _Builder:
    """Builds the stage graphs: own nodes, recomputed free nodes, placeholders, send/recv steps."""

    def __init__(self, gm: torch.fx.GraphModule, ctx: CompileContext, layout: PipelineLayout, stage_of: dict):
        self.gm, self.ctx, self.layout, self.stage_of = gm, ctx, layout, stage_of
        self.free = _free_nodes(gm, ctx)
        self.boundaries: dict[tuple[torch.fx.Node, int], Boundary] = {}

    def _needs(self, stage: int) -> set[torch.fx.Node]:
        """Nodes stage `stage` computes: its own, and free nodes (with their inputs) it recomputes."""
        own = {n for n, s in self.stage_of.items() if s == stage}
        needed, stack = set(own), list(own)
        while stack:
            node = stack.pop()
            for source in node.all_input_nodes:
                if source in needed:
                    continue
                if source.op == "placeholder" or source in self.free:
                    needed.add(source)
                    stack.append(source)
                elif self.stage_of[source] != stage:
                    self._boundary(source, stage)
        return needed

    def _boundary(self, source: torch.fx.Node, target: int) -> Boundary:
        key = (source, target)
        if key not in self.boundaries:
            self.boundaries[key] = Boundary(value=len(self.boundaries), name=source.name, source=self.stage_of[source],
                                            target=target, requires_grad=bool(source.meta.get(REQUIRES_GRAD)))
        return self.boundaries[key]

    def build(self) -> tuple[list[Stage], dict[str, tuple[int, ...]]]:
        needs = [self._needs(stage) for stage in range(self.layout.stages)]
        for node in self.gm.graph.nodes:
            node.meta[PIPELINE_STAGE] = tuple(s for s, needed in enumerate(needs) if node in needed)
        ties = self._ties(needs)
        stages = [self._stage(index, needs[index], ties) for index in range(self.layout.stages)]
        for boundary in self.boundaries.values():
            stages[boundary.source].sends.append(boundary)
            stages[boundary.target].receives.append(boundary)
        return stages, ties

    def _ties(self, needs: list[set[torch.fx.Node]]) -> dict[str, tuple[int, ...]]:
        ties = {}
        for node in self.gm.graph.nodes:
            info = self.ctx.placeholders.get(node.name)
            if node.op != "placeholder" or info.kind != "parameter" or not info.requires_grad:
                continue
            holders = [s for s, needed in enumerate(needs) if node in needed]
            coordinates = sorted({self.layout.coordinate(s) for s in holders})
            if len(holders) > len(coordinates):
                raise PlanError(f"parameter {info.target} is used by stages {holders}, two of which run on the same "
                                f"pipeline rank; fix: choose cuts (or virtual_stages) that keep its uses on "
                                f"different ranks or in one stage")
            if len(holders) > 1:
                ties[info.target] = tuple(coordinates)
        return ties

    def _collective(self, kind: str, phase: str, source: torch.fx.Node, boundary: Boundary) -> CollectiveInfo:
        spec, value = source.meta[SPEC], source.meta["val"]
        nbytes = local_numel(tuple(value.shape), spec.placements, self.ctx.mesh.shape) * value.dtype.itemsize
        return CollectiveInfo(kind=kind, axis=self.layout.axis, phase=phase, logical_bytes=simplified(nbytes),
                              dtype=value.dtype, tensor=source.name, module=module_path(source),
                              why=f"pipeline boundary: {source.name} from stage {boundary.source} to {boundary.target}")

    def _offset(self, here: int, there: int) -> tuple[str, int]:
        return (self.layout.axis, self.layout.coordinate(there) - self.layout.coordinate(here))

    def _stage(self, index: int, needed: set[torch.fx.Node], ties: dict) -> Stage:
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        receiving = [b for (s, t), b in self.boundaries.items() if t == index]
        for node in self.gm.graph.nodes:
            if node.op == "placeholder" and node in needed:
                env[node] = graph.node_copy(node)
                self._tie(env[node], ties)
        token = graph.placeholder(TOKEN) if receiving else None
        if token is not None:
            token.meta["val"] = next(iter(env.values()), None)
            self.ctx.placeholders[TOKEN] = PlaceholderInfo("token", "", -1, True)

        def lookup(node: torch.fx.Node) -> torch.fx.Node:
            if node not in env:
                env[node] = self._recv(graph, token, node, self.boundaries[(node, index)], index)
            return env[node]

        tokens = []
        user_outputs = 0
        for node in self.gm.graph.nodes:
            if node.op == "output" and index == self.layout.stages - 1:
                leaves = [lookup(n) if isinstance(n, torch.fx.Node) else n for n in node.args[0]]
                user_outputs = len(leaves)
                graph.output(tuple(leaves) + tuple(tokens))
            elif node.op not in ("placeholder", "output") and node in needed:
                env[node] = graph.node_copy(node, lookup)
                for (source, target), boundary in self.boundaries.items():
                    if source is node and self.stage_of[node] == index:
                        tokens.append(self._send(graph, env[node], node, boundary, index))
        if index < self.layout.stages - 1:
            graph.output(tuple(tokens))
        graph.eliminate_dead_code()
        for node in [n for n in graph.nodes if n.op == "placeholder" and not n.users and n.name != TOKEN]:
            graph.erase_node(node)
        graph.lint()
        return Stage(index=index, graph_module=lazy_graph_module(self.gm, graph, class_name=f"Stage{index}"),
                     user_outputs=user_outputs)

    def _tie(self, copy: torch.fx.Node, ties: dict) -> None:
        info = self.ctx.placeholders[copy.name]
        copy.meta[GRAD_SYNC] = list(copy.meta.get(GRAD_SYNC, []))
        if info.kind == "parameter" and info.target in ties:
            copy.meta[GRAD_SYNC].append(f"{self.layout.axis}@{','.join(map(str, ties[info.target]))}")

    def _recv(self, graph: torch.fx.Graph, token: torch.fx.Node, source: torch.fx.Node, boundary: Boundary,
              index: int) -> torch.fx.Node:
        spec, value = source.meta[SPEC], source.meta["val"]
        shape = local_shape(spec.tensor_meta.shape, spec.placements, self.ctx.mesh.shape)
        node = graph.call_function(p2p.recv_activation, (token,), {
            "group": self.layout.axis, "peer": self._offset(index, boundary.source), "value": boundary.value,
            "shape": shape, "dtype": value.dtype, "requires_grad": boundary.requires_grad})
        node.meta.update({"val": value, SPEC: spec})
        return self._p2p_meta(node, source, boundary, index, peer=boundary.source, forward="recv", backward="send")

    def _send(self, graph: torch.fx.Graph, value: torch.fx.Node, source: torch.fx.Node, boundary: Boundary,
              index: int) -> torch.fx.Node:
        node = graph.call_function(p2p.send_activation, (value,), {
            "group": self.layout.axis, "peer": self._offset(index, boundary.target), "value": boundary.value})
        node.meta["val"] = source.meta["val"].new_zeros(())
        return self._p2p_meta(node, source, boundary, index, peer=boundary.target, forward="send", backward="recv")

    def _p2p_meta(self, node: torch.fx.Node, source: torch.fx.Node, boundary: Boundary, index: int, *, peer: int,
                  forward: str, backward: str) -> torch.fx.Node:
        """Provenance of the crossing value, and the ledger records of a send or receive and its
        backward conjugate (none when both stages sit on the same pp rank)."""
        node.meta.update({REQUIRES_GRAD: boundary.requires_grad,
                          "nn_module_stack": source.meta.get("nn_module_stack", {}),
                          "stack_trace": source.meta.get("stack_trace")})
        local = self.layout.coordinate(peer) == self.layout.coordinate(index)
        node.meta[COLLECTIVE] = [] if local else [self._collective(forward, "forward", source, boundary)] + (
            [self._collective(backward, "backward", source, boundary)] if boundary.requires_grad else [])
        return node
