"""`StageRunner`: one stage graph of one rank, ready to run once per micro-batch.

It binds the stage's emitted rank graph (`Plan.rank_graph(rank, stage=...)`) to the module's
parameter shards and buffers, owns the stage's gradient synchronisation (`GradSynchronizer` over
the stage's buckets) and ZeRO state (`ShardedState` over the stage's units), and the saved-tensor
policy its forward runs under: an all-gather output that sequence parallelism regathers is kept
as its shard, a gathered ZeRO parameter as a handle, anything else as it is. With
`compile_options` (`parallelize(compile=...)`) the graph runs through torch.compile
(`runtime/compiled.py`).

Gradient accumulation over micro-batches (`ParallelModule.no_sync`, every pipeline step):
`hold()` keeps gathered ZeRO units gathered and lets gradients add up locally; `release()`
makes the next backward the synchronising one; `synchronise_now()` reduces gradients that were
accumulated without autograd's hooks (a zero-bubble schedule's weight-gradient passes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autopar.core.ops import collectives, sharded_state
from autopar.core.program import Stage
from autopar.runtime.compiled import compiled, warn_if_watched
from autopar.runtime.grad_sync import GradSynchronizer


@dataclass(frozen=True)
class _Regathered:
    how: tuple


class StageRunner:
    def __init__(self, plan: Any, stage: Stage, *, rank: int, groups: dict[str, str],
                 parameters: dict[str, torch.nn.Parameter], state: dict[str, torch.Tensor],
                 shards: dict[int, list[torch.nn.Parameter]], fulls: dict[int, list[torch.Tensor]],
                 compile_options: dict | None = None) -> None:
        self.stage = stage
        self.graph = plan.rank_graph(rank, groups, stage=stage.index)
        self.is_last = plan.pipeline is None or stage.index == plan.pipeline.stages - 1
        self.receives = bool(stage.receives)
        self.slots: list[tuple[str, Any]] = []
        for node in self.graph.graph.nodes:
            if node.op != "placeholder":
                continue
            info = plan.context.placeholders[node.name]
            if info.kind == "input":
                self.slots.append(("input", info.index))
            elif info.kind == "token":
                self.slots.append(("token", None))
            elif info.kind == "parameter":
                self.slots.append(("value", parameters.get(info.target)))  # None: never read
            else:
                self.slots.append(("value", state[info.target]))
        names = {plan.context.placeholders[n.name].target for n in self.graph.graph.nodes if n.op == "placeholder"}
        self.parameters = {fqn: p for fqn, p in parameters.items() if fqn in names}
        self.grad_sync = GradSynchronizer(self.parameters, stage.buckets, groups)
        self.sharded = self._bind_sharded_state(stage, shards, fulls, groups) if stage.units else None
        self._regathers = any(n.kwargs.get("regather") for n in self.graph.graph.nodes if n.op == "call_function")
        self._forward = self.graph if compile_options is None else compiled(self.graph, compile_options)

    def _bind_sharded_state(self, stage: Stage, shards: dict, fulls: dict,
                            groups: dict[str, str]) -> "sharded_state.ShardedState":
        calls = [n for n in self.graph.graph.nodes if sharded_state.unit_call(n.target)]
        order = [n.kwargs["unit"] for n in calls if sharded_state.unit_call(n.target) == "gather_unit"]
        indices = {unit.index for unit in stage.units}
        state = sharded_state.ShardedState(stage.units, shards={i: shards[i] for i in indices if i in shards},
                                           fulls={i: fulls[i] for i in indices if i in fulls}, order=order,
                                           groups=groups)
        for node in calls:
            node.target = getattr(state, sharded_state.unit_call(node.target))
        self.graph.recompile()
        return state

    # ---- the saved-tensor policy
    def _pack(self, tensor: torch.Tensor) -> Any:
        """A re-gatherable all-gather output is kept as its shard (Megatron SP); a gathered ZeRO
        parameter as a handle (sharded_state); anything else as it is."""
        regather = collectives.pack_regathered(tensor) if self._regathers else None
        if regather is not None:
            return _Regathered(regather)
        owner = self.sharded.owner(tensor) if self.sharded is not None else None
        if owner is not None:
            return self.sharded.pack(tensor, owner)
        return tensor

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Regathered):
            return collectives.unpack_regathered(saved.how)
        return self.sharded.unpack(saved) if self.sharded is not None else saved

    def run(self, inputs: list[Any], token: torch.Tensor | None = None) -> tuple[Any, ...]:
        """The stage's graph on one (micro-)batch: the user's inputs in traced order."""
        args = [inputs[where] if kind == "input" else token if kind == "token" else where
                for kind, where in self.slots]
        if self._forward is not self.graph:
            warn_if_watched()
        if self.sharded is None and not self._regathers:
            return tuple(self._forward(*args))
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            outputs = tuple(self._forward(*args))
        if self.sharded is not None and not torch.is_grad_enabled():  # no backward will come to free them
            self.sharded.release_all()
        return outputs

    # ---- gradient accumulation
    def hold(self) -> None:
        """Backward passes until `release` add gradients up locally and move nothing."""
        self.grad_sync.enabled = False
        if self.sharded is not None:
            self.sharded.start_accumulating()

    def release(self) -> None:
        """The next backward reduces what was accumulated (and, under ZeRO-3, frees the units after)."""
        self.grad_sync.enabled = True
        if self.sharded is not None:
            self.sharded.stop_accumulating()

    def synchronise_now(self) -> None:
        """Reduce gradients accumulated without autograd's hooks (split backward's weight passes)."""
        self.grad_sync.enabled = True
        self.grad_sync.synchronise_all()
