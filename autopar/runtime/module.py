"""`ParallelModule`: one rank's share of the model, running its emitted graph.

Parameters are this rank's shards as ordinary `nn.Parameter`s under the original names (so any
`torch.optim` optimizer and name-based parameter groups work; a tied weight appears once, under
the name torch.export kept); buffers and constants are kept
whole (they are replicated). `forward` takes the rank's local inputs (see `local_batch` to cut
them from a global batch) and returns the outputs the original model returns, replicated.
Gradients that come out Partial are synchronised by `GradSynchronizer` during backward.
Under ZeRO/FSDP (`strategies.zero`) the parameters of each unit are this rank's dim-0 shards
(padded to equal rows) and `sharded_state.ShardedState` gathers and reduces them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from autopar.ir import shard_dim
from autopar.ledger.measure_activations import observe_saved
from autopar.plan import Plan, shard
from autopar.runtime import collectives, sharded_state
from autopar.runtime.collectives import raw_all_reduce
from autopar.runtime.grad_sync import GradSynchronizer
from autopar.zero_units import shard_of


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


def _unshard(tensor: torch.Tensor, placement: Any, group: str, size: int) -> torch.Tensor:
    """The inverse of `plan.shard` on one axis."""
    dim = shard_dim(placement)
    if dim is None:
        return tensor
    gathered = collectives.raw_all_gather(tensor, group, size, dim)
    if not isinstance(placement, _StridedShard):
        return gathered
    # each rank holds its chunk of every block: regroup (rank, block) pieces block by block
    pieces = [torch.chunk(rank_part, placement.split_factor, dim=dim) for rank_part in torch.chunk(gathered, size, dim=dim)]
    return torch.cat([pieces[r][k] for k in range(placement.split_factor) for r in range(size)], dim=dim)


def _original_names(weights: dict[str, torch.Tensor], traced: Any) -> dict[str, torch.Tensor]:
    """Keyed as the original model's `state_dict()`: a tied parameter under each of its names (one
    tensor), without the constants export lifted (an empty KV cache) or non-persistent buffers."""
    names = traced.state_keys or tuple(weights)
    return {key: weights[traced.aliases.get(key, key)] for key in names if traced.aliases.get(key, key) in weights}


@dataclass(frozen=True)
class _Regathered:
    how: tuple


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
        placements = self._placements = plan.parameter_placements()
        self._unit_of = {p.fqn: (u, p) for u in plan.units for p in u.params}
        self._shards: dict[int, list[torch.Tensor]] = {}
        self._fulls: dict[int, list[torch.Tensor]] = {}
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
                unit = self._unit_of.get(info.target)
                if unit is not None:
                    compute, local = local, shard_of(local, unit[1].rows, plan.mesh.coordinate(rank, unit[0].axis))
                    self._shards.setdefault(unit[0].index, []).append(local)
                    if unit[0].stage < 3:
                        self._fulls.setdefault(unit[0].index, []).append(compute.to(unit[0].dtype))
                local.requires_grad_(info.requires_grad)
                self._inputs.append(_set_path(self, info.target, local, parameter=True))
            else:
                state_copy = state[info.target].detach().clone()
                self._inputs.append(_set_path(self, "_state." + info.target, state_copy, parameter=False))
        self.grad_sync = GradSynchronizer(self, plan.buckets, groups)
        self.sharded = self._bind_sharded_state() if plan.units else None
        self._regathers = any(n.kwargs.get("regather") for n in self.graph.graph.nodes if n.op == "call_function")

    def _pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor policy: a re-gatherable all-gather output is kept as its shard (Megatron SP);
        a gathered ZeRO parameter as a handle (sharded_state); anything else as it is. These hooks
        hide saves from outer ones, so activations are reported to a measurement here."""
        regather = collectives.pack_regathered(tensor) if self._regathers else None
        if regather is not None:
            observe_saved(regather[0].shard)  # what autograd keeps now is the shard
            return _Regathered(regather)
        owner = self.sharded.owner(tensor) if self.sharded is not None else None
        if owner is not None:
            return self.sharded.pack(tensor, owner)
        observe_saved(tensor)
        return tensor

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Regathered):
            return collectives.unpack_regathered(saved.how)
        return self.sharded.unpack(saved) if self.sharded is not None else saved

    def _bind_sharded_state(self) -> "sharded_state.ShardedState":
        by_name = dict(self.named_parameters())
        shards = {index: [by_name[p.fqn] for p in self.plan.units[index].params] for index in self._shards}
        calls = [n for n in self.graph.graph.nodes if sharded_state.unit_call(n.target)]
        order = [n.kwargs["unit"] for n in calls if sharded_state.unit_call(n.target) == "gather_unit"]
        state = sharded_state.ShardedState(self.plan.units, shards=shards, fulls=self._fulls, order=order,
                                           groups=self.groups)
        for node in calls:
            node.target = getattr(state, sharded_state.unit_call(node.target))
        self.graph.recompile()
        del self._fulls
        return state

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside add gradients up locally and move nothing;
        the first backward after it reduces the sum. Under ZeRO-3 the gathered parameters stay
        gathered from the first micro-batch's forward to the end of that synchronising backward
        (one all-gather per unit for all micro-batches, none in backward), at the memory cost of
        the unsharded parameters and gradients (the ledger's `accumulation` view shows both)."""
        self.grad_sync.enabled = False
        if self.sharded is not None:
            self.sharded.start_accumulating()
        try:
            yield
        finally:
            self.grad_sync.enabled = True
            if self.sharded is not None:
                self.sharded.stop_accumulating()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole model, not over this rank's shards.

        Each gradient's contribution (sum of |g|^p, or max for inf) is summed over the mesh axes
        its parameter is sharded on (tensor-parallel shards, ZeRO dim-0 shards; padding rows are
        zero) and counted once over the axes it is replicated on: one scalar all-reduce per set of
        axes. Returns the total norm; gradients are scaled in place like PyTorch's
        (by min(1, max_norm / (norm + 1e-6)))."""
        norm_type = float(norm_type)
        by_axes: dict[tuple[str, ...], list[torch.Tensor]] = {}
        for fqn, param in self.named_parameters():
            if param.grad is not None:
                by_axes.setdefault(self._sharded_axes(fqn), []).append(param.grad)
        total = torch.zeros((), dtype=torch.float32)
        for axes, grads in by_axes.items():
            if norm_type == float("inf"):
                local = torch.stack([g.detach().abs().max().float() for g in grads]).max()
            else:
                local = torch.stack([g.detach().float().abs().pow(norm_type).sum() for g in grads]).sum()
            for axis in axes:
                local = raw_all_reduce(local, self.groups[axis], "max" if norm_type == float("inf") else "sum")
            total = torch.maximum(total, local) if norm_type == float("inf") else total + local
        norm = total if norm_type == float("inf") else total.pow(1.0 / norm_type)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grads in by_axes.values():
            torch._foreach_mul_(grads, scale)
        return norm

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (and the buffers), under the original names, on every rank: ZeRO
        units all-gathered, then tensor-parallel shards gathered axis by axis (innermost first).
        Keys are the original model's `state_dict()` keys (tied names included), so
        `model.load_state_dict(full)` loads strictly. For export or a single-device checkpoint;
        collective, so every rank must call it."""
        local = {fqn: param.detach() for fqn, param in self.named_parameters()}
        if self.sharded is not None:
            for unit in self.plan.units:
                for param, full in zip(unit.params, self.sharded._finish(unit.index)):
                    local[param.fqn] = full.to(self.sharded.shards[unit.index][0].dtype)
        result = {}
        for fqn, tensor in local.items():
            for axis, placement in reversed(list(zip(self.plan.mesh.names, self._placements[fqn]))):
                tensor = _unshard(tensor, placement, self.groups[axis], self.plan.mesh.size(axis))
            result[fqn] = tensor
        for fqn, buffer in self.named_buffers():
            result[fqn.removeprefix("_state.")] = buffer.detach().clone()
        return _original_names(result, self.plan.traced)

    def _sharded_axes(self, fqn: str) -> tuple[str, ...]:
        placements = self._placements[fqn]
        axes = [axis for axis, p in zip(self.plan.mesh.names, placements) if shard_dim(p) is not None]
        if fqn in self._unit_of:
            axes.append(self._unit_of[fqn][0].axis)
        return tuple(axes)

    def local_batch(self, *global_inputs: Any) -> list[Any]:
        """This rank's slice of a global batch, in the traced input order."""
        return self.plan.local_inputs(pytree.tree_leaves(list(global_inputs)), self.rank)

    def forward(self, *inputs: Any) -> Any:
        user = iter(pytree.tree_leaves(list(inputs)))
        args = [next(user) if slot == "input" else None if slot is None else getattr(*slot) for slot in self._inputs]
        if self.sharded is None and not self._regathers:
            outputs = self.graph(*args)
        else:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                outputs = self.graph(*args)
            if self.sharded is not None and not torch.is_grad_enabled():  # no backward will come to free them
                self.sharded.release_all()
        return pytree.tree_unflatten(list(outputs), self.plan.traced.out_spec)
