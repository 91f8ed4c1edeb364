"""`ParallelModule`: one rank's share of the model, running its emitted graph.

Parameters are this rank's shards as ordinary `nn.Parameter`s under the original names (so any
`torch.optim` optimizer and name-based parameter groups work; a tied weight appears once, under
the name torch.export kept); buffers and constants are kept
whole (they are replicated). `forward` takes the rank's local inputs (see `local_batch` to cut
them from a global batch) and returns the outputs the original model returns, replicated.
Gradients that come out Partial are synchronised by `GradSynchronizer` during backward.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.plan import Plan, shard
from autopar.runtime.grad_sync import GradSynchronizer


def _set_path(root: torch.nn.Module, fqn: str, value: torch.Tensor, *, parameter: bool) -> tuple[torch.nn.Module, str]:
    """Register `value` under `fqn`, creating empty parent modules; returns (owner, attribute name)."""
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if parameter:
        module.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=value.requires_grad))
    else:
        module.register_buffer(leaf, value)
    return module, leaf


class ParallelModule(torch.nn.Module):
    def __init__(self, plan: Plan, *, rank: int, groups: dict[str, str], state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.plan = plan
        self.rank = rank
        self.groups = groups
        self.graph = plan.rank_graph(rank, groups)
        # per graph input: (owner module, attribute) of a parameter or buffer, "input" for user data,
        # None for a parameter the graph never reads (e.g. the second name of a tied weight)
        self._inputs: list[tuple[torch.nn.Module, str] | str | None] = []
        placements = plan.parameter_placements()
        for node in plan.graph_module.graph.nodes:
            if node.op != "placeholder":
                continue
            info = plan.context.placeholders[node.name]
            if info.kind == "input":
                self._inputs.append("input")
            elif info.kind == "parameter" and not node.users:
                self._inputs.append(None)
            elif info.kind == "parameter":
                local = shard(state[info.target].detach(), placements[info.target], plan.mesh, rank).clone()
                local.requires_grad_(info.requires_grad)
                self._inputs.append(_set_path(self, info.target, local, parameter=True))
            else:
                state_copy = state[info.target].detach().clone()
                self._inputs.append(_set_path(self, "_state." + info.target, state_copy, parameter=False))
        self.grad_sync = GradSynchronizer(self, plan.buckets, groups)

    def local_batch(self, *global_inputs: Any) -> list[Any]:
        """This rank's slice of a global batch, in the traced input order."""
        return self.plan.local_inputs(pytree.tree_leaves(list(global_inputs)), self.rank)

    def forward(self, *inputs: Any) -> Any:
        user = iter(pytree.tree_leaves(list(inputs)))
        args = [next(user) if slot == "input" else None if slot is None else getattr(*slot) for slot in self._inputs]
        outputs = self.graph(*args)
        return pytree.tree_unflatten(list(outputs), self.plan.traced.out_spec)
