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


def _set_path(root: torch.nn.Module, fqn: str, value: torch.Tensor, *, parameter: bool) -> None:
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


class ParallelModule(torch.nn.Module):
    def __init__(self, plan: Plan, *, rank: int, groups: dict[str, str], state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.plan = plan
        self.rank = rank
        self.groups = groups
        self.graph = plan.rank_graph(rank, groups)
        self._inputs: list[tuple[str, str]] = []
        placements = plan.parameter_placements()
        for node in plan.graph_module.graph.nodes:
            if node.op != "placeholder":
                continue
            info = plan.context.placeholders[node.name]
            self._inputs.append((info.kind, info.target))
            if info.kind == "parameter" and not node.users:
                continue  # never read, e.g. the second name of a tied weight: export kept the other one
            if info.kind == "parameter":
                full = state[info.target].detach()
                local = shard(full, placements[info.target], plan.mesh, rank).clone()
                local.requires_grad_(info.requires_grad)
                _set_path(self, info.target, local, parameter=True)
            elif info.kind in ("buffer", "constant"):
                _set_path(self, "_state." + info.target, state[info.target].detach().clone(), parameter=False)
        self.grad_sync = GradSynchronizer(self, plan.buckets, groups)

    def _parameter_or_none(self, fqn: str) -> torch.nn.Parameter | None:
        try:
            return self.get_parameter(fqn)
        except AttributeError:
            return None  # an unread placeholder (see __init__); the graph ignores it

    def local_batch(self, *global_inputs: Any) -> list[Any]:
        """This rank's slice of a global batch, in the traced input order."""
        return self.plan.local_inputs(pytree.tree_leaves(list(global_inputs)), self.rank)

    def forward(self, *inputs: Any) -> Any:
        user = iter(pytree.tree_leaves(list(inputs)))
        args = []
        for kind, target in self._inputs:
            if kind == "parameter":
                args.append(self._parameter_or_none(target))
            elif kind == "input":
                args.append(next(user))
            else:
                args.append(self.get_buffer("_state." + target))
        outputs = self.graph(*args)
        return pytree.tree_unflatten(list(outputs), self.plan.traced.out_spec)
