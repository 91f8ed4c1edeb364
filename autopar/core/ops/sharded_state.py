"""Runtime of ZeRO-1/2/3 / FSDP units: gather parameters, reduce gradients to their owners.

The planned graph calls three methods of `UnitCalls` (inserted by autopar/compiler/passes/shard_parameters.py):
- `gather_unit(shards)` returns the unit's compute parameters. Stage 3 all-gathers them (waiting
  for a prefetch launched by the previous unit when there is one) and launches the next unit's
  all-gather (`unit.gather_kind == "broadcast"`: one broadcast per owner into its row of the
  gathered buffer); stages 1/2 return the persistent replicated copy, gathered again after each
  optimizer step. Its backward, `reduce_gradients`, lays the full gradients out flat and
  reduce-scatters them asynchronously (one in flight: the next unit's backward lands the last
  one; `unit.reduce_kind == "all_to_all"`: an all-to-all of the rank-major pieces, summed on
  landing); landing waits, all-reduces the shard over the unit's extra axes (HSDP's replicate axis)
  and adds the result to each shard's `.grad` (views of the reduced shard).
  Stage 1 first copies the full gradients into a persistent buffer (ZeRO-1 keeps them) and
  reduce-scatters every unit at the end of backward; stages 2/3 free them unit by unit.
  After each optimizer step, stages 1/2 gather every unit's updated shards in one collective
  (`refresh`; `unit.gather_kind == "broadcast"`: one broadcast per owner into its row).
- `release_unit` (stage 3, resharded units) drops the gathered parameters after their last use
  in forward. Autograd's saved copies are replaced by handles (`pack`/`unpack`, installed as
  saved-tensor hooks by ParallelModule), and the release frees the gathered storages themselves
  (`resize_(0)`): a reference left elsewhere (under compile, dynamo's resume frame keeps the
  gathered tuple a graph break returned until the forward ends) holds no bytes.
- `unit_boundary` marks tensors leaving a resharded block: its backward all-gathers the block
  again before the block's backward unpacks a parameter (and, with `backward_prefetch`, launches
  the all-gather of the block before it).
Optimizer steps are watched with torch.optim's global step hooks: an optimizer over shards must
update elementwise (SGD, Adam, AdamW, ...); others are refused before their first step.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from autopar.core.errors import PlanError
from autopar.core.ops import float8_gather
from autopar.core.ops.collective_calls import on_lane
from autopar.core.zero_units import ShardUnit, copy_gathered, gather_layout, grad_layout, refresh_groups, shard_views

_c10d = torch.ops._c10d_functional

ELEMENTWISE_OPTIMIZERS: set[type] = {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                                     torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                                     torch.optim.ASGD, torch.optim.Adadelta, torch.optim.Rprop}


def allow_optimizer(cls: type) -> type:
    """Declare an optimizer class elementwise (safe on shards); usable as a class decorator."""
    ELEMENTWISE_OPTIMIZERS.add(cls)
    return cls


class UnitCalls:
    """The three calls the planned graph makes, bound to a unit table (targets are bound methods,
    so generated code names them and carries no objects in its arguments).

    This base class is the planning stand-in: `gather_unit` returns fresh tensors of the gathered
    shapes (the activation ledger runs the rank graph on fake tensors); `ShardedState` is the
    real runtime."""

    def __init__(self, units: list[ShardUnit]) -> None:
        self.units = {u.index: u for u in units}
        torch.fx.node.has_side_effect(self.release_unit)

    def __reduce__(self) -> tuple:
        """Unpickled (a plan sent to another rank, autopar/artifacts/plan_codec.py) by calling __init__ again,
        which registers release_unit as a side effect there (dead-code elimination keeps it)."""
        if type(self) is not UnitCalls:
            raise TypeError(f"{type(self).__name__} is run-time state bound to process groups; it is not pickled")
        return UnitCalls, (list(self.units.values()),)

    def gather_unit(self, shards: tuple[torch.Tensor, ...], *, unit: int) -> tuple[torch.Tensor, ...]:
        """The gathered parameters, then one fp32 scale per FP8-gathered one (`float8_gather`)."""
        params = self.units[unit].params
        return tuple(torch.empty(p.shape, dtype=s.dtype, device=s.device).requires_grad_(s.requires_grad)
                     for p, s in zip(params, shards)) + tuple(
            torch.empty((), dtype=torch.float32, device=shards[0].device) for _ in self.units[unit].float8)

    def release_unit(self, *, unit: int) -> None:
        return None

    def unit_boundary(self, x: torch.Tensor, *, unit: int) -> torch.Tensor:
        return x


def unit_call(target: Any) -> str | None:
    """The name of the UnitCalls method a graph node calls, if it calls one."""
    owner = getattr(target, "__self__", None)
    return target.__name__ if isinstance(owner, UnitCalls) else None


class _GatherUnit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, index, *shards):
        ctx.state, ctx.index = state, index
        fulls = tuple(full.view_as(full) for full in state.gathered(index))
        scales = tuple(state.scales[index]) if state.units[index].float8 else ()
        ctx.mark_non_differentiable(*scales)
        return fulls + scales

    @staticmethod
    def backward(ctx, *grads):
        params = len(ctx.state.units[ctx.index].params)
        ctx.state.reduce_gradients(ctx.index, list(grads[:params]))
        return (None, None) + (None,) * params


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, state, index):
        ctx.state, ctx.index = state, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.state.before_backward(ctx.index)
        return grad, None, None


@dataclass(frozen=True)
class _Saved:
    """A saved view of a gathered parameter, kept as coordinates instead of memory."""

    unit: int
    param: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class ShardedState(UnitCalls):
    def __init__(self, units: list[ShardUnit], *, shards: dict[int, list[torch.nn.Parameter]],
                 fulls: dict[int, list[torch.Tensor]], order: list[int], groups: dict[str, str]) -> None:
        super().__init__(units)
        self.shards = shards
        self.groups = groups
        self.order = order  # units in forward (first-gather) order
        self.full: dict[int, list[torch.Tensor]] = dict(fulls)  # stages 1/2: persistent from the start
        self._pending: dict[int, Any] = {}  # gathers in flight (stage 3: prefetched): _Gather, or a pair with FP8's
        self.scales: dict[int, torch.Tensor] = {}  # FP8-gathered units: their weights' scales (`float8_gather`)
        self._scale_versions: dict[int, tuple[int, ...]] = {}  # the shards' versions those scales were taken of
        self._owner: dict[int, tuple[int, int]] = {full.untyped_storage().data_ptr(): (index, i)
                                                   for index, fulls in self.full.items() for i, full in enumerate(fulls)}
        self._grad_buffers = {u.index: torch.zeros(u.gathered_numel, dtype=u.reduce_dtype,
                                                   device=shards[u.index][0].device if u.index in shards else None)
                              for u in units if u.stage == 1}
        self._reducing: dict[int, torch.Tensor] = {}
        self._stage1_ready: list[int] = []
        self._callback_queued = False
        self.accumulating = False  # no_sync: add full gradients into _accumulated, reduce nothing
        self.holding = False  # no_sync and the backward after it: gathered units are not released
        self._saved_whole: set[int] = set()  # stage-3 units autograd saved as they are (`pack`), not as handles
        self._accumulated: dict[int, torch.Tensor] = {}
        self._shard_ids = {id(p) for params in shards.values() for p in params}
        self_ref = weakref.ref(self)
        self._hooks = [register_optimizer_step_pre_hook(
                           lambda opt, a, k: self_ref() and self_ref()._check_optimizer(opt)),
                       register_optimizer_step_post_hook(
                           lambda opt, a, k: self_ref() and self_ref()._after_step(opt))]

    def __del__(self) -> None:
        for hook in getattr(self, "_hooks", []):
            hook.remove()

    # ---- the graph's calls
    def gather_unit(self, shards: tuple[torch.Tensor, ...], *, unit: int) -> tuple[torch.Tensor, ...]:
        return _GatherUnit.apply(self, unit, *shards)

    def release_unit(self, *, unit: int) -> None:
        self.release(unit)

    def unit_boundary(self, x: torch.Tensor, *, unit: int) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        return _Boundary.apply(x, self, unit)

    # ---- forward
    def _launch(self, index: int) -> None:
        unit = self.units[index]
        if not unit.float8:
            self._pending[index] = _issue_gather(self.shards[index], unit, unit.shard_numel, self.groups[unit.axis])
            return
        rest, _ = float8_gather.split(unit)
        chosen = set(unit.float8)
        others = [s for i, s in enumerate(self.shards[index]) if i not in chosen]
        # the scales of the forward's gather serve its backward's while the shards are unchanged
        versions = tuple(self.shards[index][i]._version for i in unit.float8)
        known = self._scale_versions.get(index) == versions and index in self.scales
        fp8 = float8_gather.issue(self.shards[index], unit, self.groups, self.scales[index] if known else None)
        self.scales[index], self._scale_versions[index] = fp8.scales, versions
        self._pending[index] = (_issue_gather(others, rest, rest.shard_numel, self.groups[unit.axis]) if others
                                else None, fp8)

    def _finish(self, index: int) -> list[torch.Tensor]:
        if index not in self._pending:
            self._launch(index)
        unit, pending = self.units[index], self._pending.pop(index)
        if not unit.float8:
            return gather_layout(unit, pending.landed().view(-1))
        rest, fp8 = pending
        others = iter(gather_layout(float8_gather.split(unit)[0], rest.landed().view(-1)) if rest is not None else [])
        chosen = iter(fp8.landed())
        return [next(chosen) if i in unit.float8 else next(others) for i in range(len(unit.params))]

    def gathered(self, index: int) -> list[torch.Tensor]:
        unit = self.units[index]
        if unit.stage < 3:
            return self.full[index]
        if index not in self.full:
            self._store(index, self._finish(index))
        if unit.prefetch:
            self._prefetch(self.order.index(index) + 1)
        return self.full[index]

    def _store(self, index: int, fulls: list[torch.Tensor]) -> None:
        self._drop(index)
        self.full[index] = fulls
        for i, full in enumerate(fulls):
            self._owner[full.untyped_storage().data_ptr()] = (index, i)

    def _prefetch(self, position: int) -> None:
        if 0 <= position < len(self.order):
            index = self.order[position]
            if self.units[index].stage == 3 and index not in self.full and index not in self._pending:
                self._launch(index)

    def release(self, index: int) -> None:
        if not self.holding:
            self._drop(index)

    def _drop(self, index: int) -> None:
        storages = {}
        for full in self.full.pop(index, []):
            storage = full.untyped_storage()
            self._owner.pop(storage.data_ptr(), None)
            storages[storage.data_ptr()] = storage
        if self.units[index].stage == 3 and index not in self._saved_whole:
            # free the gathered bytes now, whoever still refers to them: under compile=True the
            # gathered tuple is the result of a graph break, which dynamo's resume frame keeps
            # until the forward returns — every block's gathered weights were alive at once
            # (FSDP2 frees its unsharded parameters the same way). A use after release fails
            # loudly (an empty storage), it cannot read stale values. Parameters autograd saved
            # as they are stay with autograd, which lets them go after the backward, or keeps them
            # for another one (retain_graph=True) as it keeps anything a retained graph saved.
            for storage in storages.values():
                storage.resize_(0)
        self._saved_whole.discard(index)

    def release_all(self) -> None:
        for index in [i for i in self.full if self.units[i].stage == 3]:
            self._drop(index)
            self.scales.pop(index, None)

    # ---- gradient accumulation without re-gathering (ParallelModule.no_sync)
    def start_accumulating(self) -> None:
        """Micro-batches until `stop_accumulating`: gathered units stay gathered (no re-gather in
        backward, none in the next forward) and full gradients add up locally, unreduced."""
        self.accumulating = self.holding = True

    def stop_accumulating(self) -> None:
        """The next backward reduces the accumulated gradients; units stay gathered until it ends."""
        self.accumulating = False

    # ---- saved-tensor hooks (resharded units)
    def owner(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(unit, parameter) when `tensor` is (a view of) a gathered parameter, else None."""
        return self._owner.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None

    def pack(self, tensor: torch.Tensor, owner: tuple[int, int]) -> Any:
        """A saved gathered parameter: a handle when its unit is freed after forward, else itself."""
        if not self.units[owner[0]].reshard or self.holding:
            if self.units[owner[0]].stage == 3:
                self._saved_whole.add(owner[0])
            return tensor
        return _Saved(owner[0], owner[1], tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        if saved.unit not in self.full:
            self.before_backward(saved.unit)
        return torch.as_strided(self.full[saved.unit][saved.param], saved.size, saved.stride, saved.offset)

    # ---- backward
    def before_backward(self, index: int) -> None:
        if index not in self.full:
            self._store(index, self._finish(index))
            if self.units[index].backward_prefetch:
                self._prefetch_backward(self.order.index(index) - 1)

    def _prefetch_backward(self, position: int) -> None:
        if position >= 0 and self.units[self.order[position]].reshard:
            self._prefetch(position)

    def reduce_gradients(self, index: int, grads: list[torch.Tensor | None]) -> None:
        unit = self.units[index]
        if unit.stage == 3:
            self.release(index)
            if not self.holding:  # FP8 gathers: the scales served their backward (held units keep theirs)
                self.scales.pop(index, None)
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        if unit.stage > 1 and not self.accumulating:
            self._land_reductions()  # at most one reduce-scatter (a whole unit's gradient) in flight
        flat = grad_layout(unit, grads, unit.reduce_dtype)
        del grads[:]  # the full gradients are in `flat` now: drop them before the next allocation
        if unit.stage == 1:  # ZeRO-1 keeps the full gradients until the end of backward
            buffer = self._grad_buffers[index]
            buffer.add_(flat) if index in self._accumulated else buffer.copy_(flat)
            self._accumulated[index] = buffer
            if not self.accumulating:
                self._stage1_ready.append(index)
            return
        if self.accumulating:
            if index in self._accumulated:
                self._accumulated[index].add_(flat)
            else:
                self._accumulated[index] = flat
            return
        earlier = self._accumulated.pop(index, None)
        if earlier is not None:
            flat = flat.add_(earlier)
        self._launch_reduction(index, flat)

    def _launch_reduction(self, index: int, flat: torch.Tensor) -> None:
        unit = self.units[index]
        group = on_lane(self.groups[unit.axis])
        if unit.reduce_kind == "all_to_all":  # each owner receives every rank's piece of its shard
            pieces = [unit.shard_numel] * unit.group_size
            self._reducing[index] = _c10d.all_to_all_single(flat, pieces, pieces, group)
        else:
            self._reducing[index] = _c10d.reduce_scatter_tensor(flat, "sum", unit.group_size, group)

    def _landed_shard(self, unit: ShardUnit, pending: torch.Tensor) -> torch.Tensor:
        arrived = _c10d.wait_tensor(pending)
        if unit.reduce_kind == "all_to_all":  # the group's pieces of this rank's shard, summed
            return arrived.view(unit.group_size, unit.shard_numel).sum(0)
        return arrived

    def _land_reductions(self) -> None:
        """Wait for launched reduce-scatters, reduce over extra axes, add into the shards' grads."""
        for index in list(self._reducing):  # each output let go as it lands (ZeRO-1 has every unit in flight)
            pending = self._reducing.pop(index)
            unit = self.units[index]
            shard_grad = self._landed_shard(unit, pending)
            for axis in unit.extra_axes:
                shard_grad = _c10d.wait_tensor(_c10d.all_reduce(shard_grad, "sum", on_lane(self.groups[axis])))
            shard_grad = shard_grad.to(unit.master_dtype)
            for param, grad in zip(self.shards[index], shard_views(unit, shard_grad)):
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)

    def _finish_backward(self) -> None:
        for index in self._stage1_ready:
            self._launch_reduction(index, self._grad_buffers[index])
            self._accumulated.pop(index, None)
        self._stage1_ready = []
        self._land_reductions()
        self._callback_queued = False
        if self.holding and not self.accumulating:  # the synchronising backward after no_sync is done
            self.holding = False
            self.release_all()

    # ---- optimizer
    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._shard_ids for group in optimizer.param_groups for p in group["params"])

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self._owns(optimizer) and type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
            raise PlanError(f"{type(optimizer).__name__} cannot run on ZeRO shards: it is not known to update each "
                            f"element independently (LBFGS, Adafactor, Muon and SparseAdam need whole tensors or "
                            f"cross-element statistics). Use an elementwise optimizer (SGD, Adam, AdamW, ...), or, if "
                            f"its update is elementwise, declare it with "
                            f"autopar.runtime.sharded_state.allow_optimizer({type(optimizer).__name__})")

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._owns(optimizer):
            self.refresh()

    def refresh(self) -> None:
        """ZeRO-1/2: gather the shards into the replicated compute parameters, every unit of a
        refresh group (`refresh_groups`) in one collective. Runs after every optimizer step over the
        shards; call it after changing shards any other way (loading)."""
        for units in refresh_groups(self.units.values()):
            with torch.no_grad():
                self._copy_group(units, self._gather_group(units))  # one group's buffer alive at a time

    def _copy_group(self, units: tuple[ShardUnit, ...], gathered: torch.Tensor) -> None:
        column = 0
        for unit in units:
            copy_gathered(unit, gathered[:, column:column + unit.shard_numel], self.full[unit.index])
            column += unit.shard_numel

    def _gather_group(self, units: tuple[ShardUnit, ...]) -> torch.Tensor:
        """The group's rank-major gathered buffer: row r holds rank r's shards of every unit."""
        shards = [p for unit in units for p in self.shards[unit.index]]
        return _issue_gather(shards, units[0], sum(u.shard_numel for u in units),
                             self.groups[units[0].axis]).landed()


@dataclass
class _Gather:
    """A gather in flight: the rank-major buffer (n rows of one owner's shards each) and what to
    wait for — the all-gather's output, or each owner's broadcast of its row."""

    buffer: torch.Tensor | None
    waits: list[torch.Tensor]
    group_size: int

    def landed(self) -> torch.Tensor:
        arrived = [_c10d.wait_tensor(t) for t in self.waits]
        return (self.buffer if self.buffer is not None else arrived[0]).view(self.group_size, -1)


def _issue_gather(shards: list[torch.Tensor], unit: ShardUnit, row_numel: int, group: str) -> _Gather:
    """Launch the gather of `shards` (this rank's, concatenated: one row) in `unit.gather_kind`,
    in `unit.dtype` (mixed precision: cast on the way in)."""
    flat = [p.detach().reshape(-1) for p in shards]
    if unit.gather_kind == "broadcast":
        return _issue_broadcasts(flat, unit, row_numel, group)
    send = torch.cat(flat).to(unit.dtype)
    return _Gather(None, [_c10d.all_gather_into_tensor(send, unit.group_size, on_lane(group))], unit.group_size)


# run eagerly under compile=True (a stage-3 gather is launched inside a compiled forward): AOT
# autograd cannot functionalize an in-place functional collective (`broadcast_` returns its input)
@torch.compiler.disable
def _issue_broadcasts(flat: list[torch.Tensor], unit: ShardUnit, row_numel: int, group: str) -> _Gather:
    """Each owner's row straight into the gathered buffer (no send copy), then broadcast from it."""
    buffer = torch.empty(unit.group_size, row_numel, dtype=unit.dtype, device=flat[0].device)
    row, column = buffer[dist.get_rank(_resolve_process_group(on_lane(group)))], 0
    for shard in flat:
        row[column:column + shard.numel()].copy_(shard)
        column += shard.numel()
    return _Gather(buffer, [_c10d.broadcast_(buffer[owner], owner, on_lane(group)) for owner in range(unit.group_size)],
                   unit.group_size)
