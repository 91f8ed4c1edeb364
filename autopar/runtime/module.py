"""`ParallelModule`: one rank's share of the model, running its stage graphs.

Parameters are this rank's shards as ordinary `nn.Parameter`s under the original names (so any
`torch.optim` optimizer and name-based parameter groups work; a tied weight appears once, under
the name torch.export kept); buffers and constants are kept whole (they are replicated). Under
pipeline parallelism a rank holds the parameters of its own stages only.

Each stage the rank runs is a `StageRunner` (runtime/stage.py). Without a pipeline there is one:
`forward` takes the rank's local inputs (see `local_batch` to cut them from a global batch) and
returns the outputs the original model returns, replicated; gradients that come out Partial are
synchronised during backward. Inputs are checked against the plan's shapes first
(`runtime/input_shapes.py`: a static dimension must keep the example's size, a dynamic one split
over its shard degree). `train_step(*local_inputs)` runs forward and backward of a whole
step and returns the loss — the one way to train a pipeline-parallel module, whose step is the
schedule's forwards and backwards over every micro-batch (`runtime/pipeline.py`). Under
ZeRO/FSDP (`strategies.zero`) the parameters of each unit are this rank's dim-0 shards (padded to
equal rows) and `sharded_state.ShardedState` gathers and reduces them.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from autopar.core.ir import shard_dim
from autopar.core.mesh import JOIN
from autopar.core.ops.collective_calls import raw_all_gather, raw_all_reduce
from autopar.core.shards import shard
from autopar.core.zero_units import shard_of
from autopar.runtime import progress
from autopar.runtime.input_shapes import check_global_inputs, check_local_inputs
from autopar.runtime.pipeline import PipelineExecutor
from autopar.runtime.stage import StageRunner

if TYPE_CHECKING:  # the runtime runs a plan the compiler made; it never imports the compiler
    from autopar.compiler.plan import Plan


def _set_path(root: torch.nn.Module, fqn: str, value: torch.Tensor, *, parameter: bool) -> torch.Tensor:
    """Register `value` under `fqn`, creating empty parent modules; returns what was registered."""
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
    return getattr(module, leaf)


def _unshard(tensor: torch.Tensor, placement: Any, group: str, size: int) -> torch.Tensor:
    """The inverse of `core.shards.shard` on one axis."""
    dim = shard_dim(placement)
    if dim is None:
        return tensor
    gathered = raw_all_gather(tensor, group, size, dim)
    if not isinstance(placement, _StridedShard):
        return gathered
    # each rank holds its chunk of every block: regroup (rank, block) pieces block by block
    pieces = [torch.chunk(rank_part, placement.split_factor, dim=dim) for rank_part in torch.chunk(gathered, size, dim=dim)]
    return torch.cat([pieces[r][k] for k in range(placement.split_factor) for r in range(size)], dim=dim)


def sync_groups(plan: Plan) -> dict[str, str]:
    """Process groups for the keys that are no mesh axis: `pp@i,j` (a parameter held by several
    pipeline stages), `dp+cp` (a gradient reduction over several axes at once, `Mesh.sync_keys`),
    `ep+tp` (experts folded onto another strategy's axis, `expert_parallel(fold=)`).
    Created on every rank in the same order (torch.distributed.new_group is collective); name by key."""
    keys = sorted(({key for stage in plan.stages for bucket in stage.buckets for key in bucket.axes}
                   | {key for unit in plan.units for key in unit.extra_axes}
                   | {entry.axis for entry in plan.comm.entries if JOIN in entry.axis})  # folded experts' exchange
                  - set(plan.mesh.names))
    names = {}
    for key in keys:
        slices = plan.mesh.group_slices(key)
        for ranks in slices:
            group = dist.new_group(list(ranks))
            if dist.get_rank() in ranks:
                names[key] = group.group_name
    return names


def _original_names(weights: dict[str, torch.Tensor], traced: Any) -> dict[str, torch.Tensor]:
    """Keyed as the original model's `state_dict()`: a tied parameter under each of its names (one
    tensor), without the constants export lifted (an empty KV cache) or non-persistent buffers."""
    names = traced.state_keys or tuple(weights)
    return {key: weights[traced.aliases.get(key, key)] for key in names if traced.aliases.get(key, key) in weights}


class ParallelModule(torch.nn.Module):
    def __init__(self, plan: Plan, *, rank: int, groups: dict[str, str], state: dict[str, torch.Tensor],
                 compile_options: dict | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.rank = rank
        self._forwards = 0  # forwards run: the step number in progress marks (runtime/progress.py)
        if dist.is_initialized():
            progress.install()
        self.groups = dict(groups, **sync_groups(plan))
        self._placements = plan.parameter_placements()
        stages = plan.stages_of_rank(rank)
        self._unit_of = {p.fqn: (u, p) for stage in stages for u in stage.units for p in u.params}
        parameters, buffers, shards, fulls = self._register(plan, stages, state)
        self.stages = [StageRunner(plan, stage, rank=rank, groups=self.groups, parameters=parameters, state=buffers,
                                   shards=shards, fulls=fulls, compile_options=compile_options) for stage in stages]
        self.pipeline = None
        if plan.pipeline is not None:
            self.pipeline = PipelineExecutor(plan, rank=rank, runners=self.stages, groups=self.groups)

    def group_keys(self) -> dict[str, str]:
        """Every process group this rank's program hands work to, by name -> the mesh key it spans
        (an axis, `dp+cp`, `pp@0,3`): `groups`, and the copies a pipeline's side thread issues on
        (`runtime/overlap.py`)."""
        keys = {name: key for key, name in self.groups.items()}
        if self.pipeline is not None and self.pipeline.lanes is not None:
            keys.update(self.pipeline.lanes.axes(self.groups))
        return keys

    def _register(self, plan: Plan, stages: list, state: dict[str, torch.Tensor]) -> tuple[dict, dict, dict, dict]:
        """This rank's parameter shards (ZeRO units' dim-0 shards and replicated compute copies)
        and buffers, registered under their original names."""
        parameters: dict[str, torch.nn.Parameter] = {}
        buffers: dict[str, torch.Tensor] = {}
        shards: dict[int, list[torch.Tensor]] = {}
        fulls: dict[int, list[torch.Tensor]] = {}
        for stage in stages:
            for node in stage.graph_module.graph.nodes:
                info = plan.context.placeholders.get(node.name)
                if node.op != "placeholder" or info.kind in ("input", "token"):
                    continue
                if info.kind != "parameter":
                    if info.target not in buffers:
                        buffers[info.target] = _set_path(self, "_state." + info.target,
                                                         state[info.target].detach().clone(), parameter=False)
                    continue
                if info.target in parameters or not node.users:  # unread: a tied weight's second name
                    continue
                local = shard(state[info.target].detach(), self._placements[info.target], plan.mesh, self.rank).clone()
                unit = self._unit_of.get(info.target)
                if unit is not None:
                    compute, local = local, shard_of(local, unit[1].rows, plan.mesh.coordinate(self.rank, unit[0].axis))
                    shards.setdefault(unit[0].index, []).append(local)
                    if unit[0].stage < 3:
                        fulls.setdefault(unit[0].index, []).append(compute.to(unit[0].dtype))
                local.requires_grad_(info.requires_grad)
                parameters[info.target] = _set_path(self, info.target, local, parameter=True)
        for index in shards:  # the registered Parameters, in the unit's order
            unit = next(u for stage in stages for u in stage.units if u.index == index)
            shards[index] = [parameters[p.fqn] for p in unit.params]
        return parameters, buffers, shards, fulls

    @property
    def grad_sync(self):
        """The gradient synchroniser of a module with one stage."""
        return self._only_stage().grad_sync

    @property
    def sharded(self):
        """The ZeRO state of a module with one stage (None without units)."""
        return self._only_stage().sharded

    def _only_stage(self) -> StageRunner:
        if len(self.stages) != 1:
            raise AttributeError("this rank runs several pipeline stages; see ParallelModule.stages")
        return self.stages[0]

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication: backward passes inside add gradients up
        locally and move nothing; the first backward after it reduces the sum, giving what
        synchronising every backward gives (which accumulates too, `runtime/grad_sync.py`). Under
        ZeRO-3 the gathered parameters stay gathered from the first micro-batch's forward to the
        end of that synchronising backward (one all-gather per unit for all micro-batches, none in
        backward), at the memory cost of the unsharded parameters and gradients (the ledger's
        `accumulation` view shows both)."""
        if self.pipeline is not None:
            raise RuntimeError("a pipeline-parallel module accumulates over its micro-batches inside train_step; "
                               "no_sync does not apply")
        for runner in self.stages:
            runner.hold()
        try:
            yield
        finally:
            for runner in self.stages:
                runner.release()

    def train_step(self, *inputs: Any) -> torch.Tensor:
        """Forward and backward of one training step on this rank's local inputs; returns the loss
        (detached). Under pipeline parallelism: every micro-batch through the schedule, gradients
        accumulated and synchronised once, the loss (mean over micro-batches) on every rank.
        Called again before `optimizer.step()`, it adds to the gradients, as backward does."""
        if self.pipeline is not None:
            local = pytree.tree_leaves(list(inputs))
            check_local_inputs(self.plan, local)
            self._forwards += 1
            progress.mark(0, self._forwards)
            loss = self.pipeline.step(local)
            progress.mark(3)
            return loss
        loss = self(*inputs)
        loss.backward()
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole model, not over this rank's shards.

        Each gradient's contribution (sum of |g|^p, or max for inf) is summed over the mesh axes
        its parameter is sharded on (tensor-parallel shards, ZeRO dim-0 shards; padding rows are
        zero) and over the pipeline axis (each stage holds its own parameters; a parameter tied
        across stages counts on its first holder), and counted once over the axes it is
        replicated on: one scalar all-reduce per set of axes. Returns the total norm; gradients
        are scaled in place like PyTorch's (by min(1, max_norm / (norm + 1e-6)))."""
        norm_type = float(norm_type)
        by_axes: dict[tuple[str, ...], list[torch.Tensor]] = {}
        counted: dict[tuple[str, ...], list[torch.Tensor]] = {}
        for fqn, param in self.named_parameters():
            if param.grad is not None:
                axes = self._sharded_axes(fqn)
                by_axes.setdefault(axes, []).append(param.grad)
                if self._counts_here(fqn):
                    counted.setdefault(axes, []).append(param.grad)
        device = next(p.device for p in self.parameters())  # the rank's: all-reduced over its process groups
        total = torch.zeros((), dtype=torch.float32, device=device)
        for axes in self._norm_groups():  # the same list on every rank: the all-reduces line up
            grads = counted.get(axes, [])
            if norm_type == float("inf"):
                local = torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads else total.clone()
            else:
                local = torch.stack([g.detach().float().abs().pow(norm_type).sum() for g in grads]).sum() if grads \
                    else total.clone()
            for axis in axes:
                reduce_op = "max" if norm_type == float("inf") else "sum"
                local = raw_all_reduce(local, self.groups[axis], reduce_op)
            total = torch.maximum(total, local) if norm_type == float("inf") else total + local
        norm = total if norm_type == float("inf") else total.pow(1.0 / norm_type)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grads in by_axes.values():
            torch._foreach_mul_(grads, scale)
        return norm

    def _norm_groups(self) -> list[tuple[str, ...]]:
        """Every set of axes some trainable parameter's norm is reduced over, over all stages."""
        units = {p.fqn: u.axis for u in self.plan.units for p in u.params}
        trainable = {i.target for i in self.plan.context.placeholders.values() if i.kind == "parameter"
                     and i.requires_grad}
        groups = set()
        for fqn, placements in self._placements.items():
            if fqn not in trainable:
                continue
            axes = [axis for axis, p in zip(self.plan.mesh.names, placements) if shard_dim(p) is not None]
            axes += [units[fqn]] if fqn in units else []
            axes += [self.plan.pipeline.axis] if self.plan.pipeline is not None else []
            groups.add(tuple(axes))
        return sorted(groups)

    def _counts_here(self, fqn: str) -> bool:
        ties = self.plan.program.ties
        if self.plan.pipeline is None or fqn not in ties:
            return True
        return self.plan.mesh.coordinate(self.rank, self.plan.pipeline.axis) == ties[fqn][0]

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (and the buffers), under the original names, on every rank: ZeRO
        units all-gathered, then tensor-parallel shards gathered axis by axis (innermost first),
        then under a pipeline each stage's parameters broadcast from a rank holding them. Keys are
        the original model's `state_dict()` keys (tied names included), so `model.load_state_dict(
        full)` loads strictly. For export or a single-device checkpoint; collective, so every rank
        must call it. The values are a snapshot: training on does not change them."""
        local = {fqn: param.detach() for fqn, param in self.named_parameters()}
        for runner in self.stages:
            if runner.sharded is not None:
                for unit in runner.stage.units:
                    for param, full in zip(unit.params, runner.sharded._finish(unit.index)):
                        local[param.fqn] = full.to(runner.sharded.shards[unit.index][0].dtype)
        result = {}
        parameters = dict(self.named_parameters())
        for fqn, tensor in local.items():
            for axis, placement in reversed(list(zip(self.plan.mesh.names, self._placements[fqn]))):
                tensor = _unshard(tensor, placement, self.groups[axis], self.plan.mesh.size(axis))
            # a parameter replicated everywhere comes back as itself: a snapshot, not the live tensor
            live = tensor.untyped_storage().data_ptr() == parameters[fqn].untyped_storage().data_ptr()
            result[fqn] = tensor.clone() if live else tensor
        for fqn, buffer in self.named_buffers():
            result[fqn.removeprefix("_state.")] = buffer.detach().clone()
        if self.pipeline is not None:
            result.update(self.pipeline.share_parameters(result))
        return _original_names(result, self.plan.traced)

    def _sharded_axes(self, fqn: str) -> tuple[str, ...]:
        placements = self._placements[fqn]
        axes = [axis for axis, p in zip(self.plan.mesh.names, placements) if shard_dim(p) is not None]
        if fqn in self._unit_of:
            axes.append(self._unit_of[fqn][0].axis)
        if self.plan.pipeline is not None:
            axes.append(self.plan.pipeline.axis)
        return tuple(axes)

    def local_batch(self, *global_inputs: Any) -> list[Any]:
        """This rank's slice of a global batch, in the traced input order; sizes checked against
        the plan (runtime/input_shapes.py)."""
        flat = pytree.tree_leaves(list(global_inputs))
        check_global_inputs(self.plan, flat)
        return self.plan.local_inputs(flat, self.rank)

    def forward(self, *inputs: Any) -> Any:
        if self.pipeline is not None:
            raise RuntimeError("a pipeline-parallel module runs its stages under a schedule: train with "
                               "module.train_step(*module.local_batch(*batch)), which runs forward and backward of "
                               "every micro-batch and returns the loss")
        local = pytree.tree_leaves(list(inputs))
        check_local_inputs(self.plan, local)
        self._forwards += 1
        progress.mark(0, self._forwards)
        outputs = self.stages[0].run(local)
        progress.mark(1)
        return pytree.tree_unflatten(list(outputs), self.plan.traced.out_spec)
