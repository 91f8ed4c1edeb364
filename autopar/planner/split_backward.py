"""What a split backward (ZB-H1, DualPipeV) keeps of a micro-batch from its B to its W, read off
the planner's one-block plan (`autopar/planner/block_ledgers.py`) as a pipeline stage would hold it.

The memory ledger's rule (`compiler/ledger/memory.held_until_w`): the saved activations of the ops
up to the last op where a trainable weight meets what the stage received (the weight pass reads
them) and the gradients B kept at those ops. A stage of blocks received the first block's input; the
last stage's head (the ops after the blocks) received the last block's output. The first stage
receives nothing and runs its whole backward at B.
"""
from __future__ import annotations

from typing import Any

import torch

from autopar.compiler.ledger.activations import saved_activations
from autopar.compiler.ledger.memory import held_until_w, weight_meets
from autopar.core.ir import module_stack


def split_backward_holds(plan: Any, block: str) -> tuple[int, int]:
    """Per micro-batch, (one block's hold, the head's hold), in bytes (module docstring)."""
    graph = plan.stages[0].graph_module.graph
    prefix = block + "."

    def inside(node: torch.fx.Node) -> bool:
        return any(path == block or path.startswith(prefix) for path in module_stack(node))

    seen, head = False, set()
    for node in graph.nodes:  # the head: every op after the block's first, outside it
        seen = seen or inside(node)
        if seen and node.op == "call_function" and not inside(node):
            head.add(node)
    block_nodes = {node for node in graph.nodes if node.op == "call_function" and inside(node)}
    entries = saved_activations(plan, rank=0).entries
    holds = []
    for mine, received in ((block_nodes, lambda n: n.op == "call_function" and not inside(n)),
                           (head, inside)):
        meets = weight_meets(plan, graph, received, within=mine.__contains__)
        retained, gradients = held_until_w(plan, meets, entries, saved_in={n.name for n in mine})
        holds.append(int(plan.comm.number(retained + gradients)))
    return holds[0], holds[1]
