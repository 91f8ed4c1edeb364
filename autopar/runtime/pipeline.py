"""The pipeline runtime: one rank's schedule of stage forwards and backwards over micro-batches.

`PipelineExecutor.step(local_inputs)` splits the rank's local batch into m micro-batches along
the batch dimension, then runs the rank's list of actions (`autopar.core.schedules.actions`):

- F(stage, k): the stage graph on micro-batch k (`StageRunner.run`); its receives block until
  the previous stage's activations arrive, its sends leave asynchronously (`runtime/p2p.py`);
- B(stage, k): backward of what F returned — the last stage's loss scaled by 1/m, other stages'
  send tokens, whose backward receives the gradients from the next stage — with the schedule's
  split backward only towards the stage's inputs (PyTorch's `stage_backward_input`), which
  sends the input gradients back and keeps what the weight gradient needs; a B whose W is the
  next action (DualPipeV's full backwards) runs whole, and that W has nothing left to do;
- W(stage, k): the weight gradient (`stage_backward_weight`).

Under DualPipeV (`PipelineLayout.overlap`) on CPU ranks, each forward the schedule pairs with the
full backward after it (`schedules.overlapped`) runs beside it, on a side thread with its own
copies of the process groups (`runtime/overlap.py`): one micro-batch's all-to-alls and receives
wait while the other computes. On accelerator ranks the pairs run one after the other
(`schedules.SIDE_BY_SIDE_DEVICES`).

Every stage holds its gradients until its last backward of the step (`StageRunner.hold`): the
data-parallel all-reduce, ZeRO's reduce-scatter and a tied parameter's sum over its stages run
once per step, not per micro-batch (with a split backward, explicitly after the last W); a step run
again before the optimizer's adds to the synchronised gradients (`runtime/grad_sync.py`). Under
ZeRO-3 the units stay gathered for all micro-batches. The loss returned is the mean over
micro-batches (exact for a mean loss when every micro-batch counts the same number of tokens),
broadcast from the last stage's rank to the others of the pipeline axis.

Why our own executor rather than `torch.distributed.pipelining`'s schedule runtime: its
`PipelineStage` wraps an `nn.Module` and synchronises gradients only for DDP/FSDP modules it
recognises, and sends exactly the previous stage's outputs to the next; autopar's stages are
emitted graphs whose send/recv steps are conjugate pairs inside autograd, which carry values
across several stages, hold tensor-parallel collectives, and fire our own gradient and ZeRO
synchronisation once per step. Its backward split (`stage_backward_input` /
`stage_backward_weight`) is reused as is. `timeline` keeps each action's start, end and the time
it waited on receives, for the measured bubble and the timeline picture.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from autopar.core import schedules
from autopar.core.ops import p2p
from autopar.runtime.overlap import Lanes, SideThread
from autopar.runtime.stage import StageRunner


PAIR_ABANDON_S = 10.0  # how long a failed backward waits for the forward beside it before raising


@dataclass(frozen=True)
class TimedAction:
    """One executed action: perf_counter seconds (a clock shared by the processes of a machine)."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    waited: float  # blocked in receives: not computing


class PipelineExecutor:
    def __init__(self, plan: Any, *, rank: int, runners: list[StageRunner], groups: dict[str, str]) -> None:
        layout = plan.pipeline
        self.layout, self.rank, self.plan = layout, rank, plan
        self.runners = {runner.stage.index: runner for runner in runners}
        coordinate = plan.mesh.coordinate(rank, layout.axis)
        self.actions = schedules.actions(layout.schedule, degree=layout.degree, virtual=layout.virtual,
                                         microbatches=layout.microbatches)[coordinate]
        self.split = layout.schedule in schedules.SPLIT_BACKWARD
        # a B whose W comes right after it (DualPipeV's full backwards) runs as one backward: the
        # input- and weight-gradient passes apart cost more than the one pass (its W moves nothing)
        self.whole = schedules.whole_backwards(self.actions) if self.split else frozenset()
        closing = "W" if self.split else "B"
        self.last_backward = {a.stage: i for i, a in enumerate(self.actions) if a.kind == closing}
        self.group = groups[layout.axis]
        # the rank's device (its stages' parameters): receive buffers, tokens and the shared loss live there
        self.device = next((param.device for runner in runners for param in runner.parameters.values()), None)
        self.pairs = frozenset()  # positions of forwards run beside the backward after them
        self.lanes = None
        if layout.overlap:
            device = (self.device or torch.device("cpu")).type
            if device in schedules.SIDE_BY_SIDE_DEVICES:
                self.pairs = schedules.overlapped(layout.schedule, degree=layout.degree, virtual=layout.virtual,
                                                  microbatches=layout.microbatches)[coordinate]
                # collective: every rank of the job makes the same copies (all its ranks are on one kind of device)
                self.lanes = Lanes(plan, groups, layout.axis)
            elif rank == 0:
                warnings.warn(f"{layout.schedule}: the paired forwards and backwards run one after the other on "
                              f"{device} ranks (side by side they need a stream each, not written yet: "
                              f"docs/pipeline.md); overlap=False says so without this warning", stacklevel=2)
        self.side = SideThread(self.lanes) if self.lanes is not None else None
        self.loss_source = plan.mesh.neighbour(rank, layout.axis, layout.coordinate(layout.stages - 1) - coordinate)
        self.timeline: list[TimedAction] = []

    def _microbatches(self, inputs: list[Any]) -> list[list[Any]]:
        count, dim = self.layout.microbatches, self.layout.batch_dim
        tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > dim]
        batch = tensors[0].shape[dim]
        if batch % count:
            raise ValueError(f"the local batch has {batch} rows on dimension {dim}, which do not split into "
                             f"{count} micro-batches")
        split = [list(torch.chunk(t, count, dim=dim)) if isinstance(t, torch.Tensor) and t.dim() > dim
                 and t.shape[dim] == batch else [t] * count for t in inputs]
        return [[pieces[k].clone() if isinstance(pieces[k], torch.Tensor) else pieces[k] for pieces in split]
                for k in range(count)]

    def _backward_targets(self, runner: StageRunner, outputs: tuple) -> tuple[list, list]:
        tensors, grads = [], []
        if runner.is_last:
            loss = outputs[0]
            tensors.append(loss)
            grads.append(torch.full_like(loss, 1.0 / self.layout.microbatches))
        for token in outputs[runner.stage.user_outputs:]:
            if isinstance(token, torch.Tensor) and token.requires_grad:
                tensors.append(token)
                grads.append(torch.ones_like(token))
        return tensors, grads

    def step(self, inputs: list[Any]) -> torch.Tensor:
        micro = self._microbatches(inputs)
        exchange = p2p.Exchange(self.rank, device=self.device,
                                gradient_groups=self.lanes.gradients if self.lanes is not None else {})
        for runner in self.runners.values():
            runner.hold()
        live: dict[tuple[int, int], Any] = {}
        losses: dict[int, torch.Tensor] = {}  # micro-batch -> its loss (the last stage's forwards)
        self.timeline = []
        position = 0
        while position < len(self.actions):
            if position in self.pairs:  # this forward beside the full backward after it (module docstring)
                join = self.side.start(self._run, position, exchange, micro, live, losses)
                try:
                    backward = self._run(position + 1, exchange, micro, live, losses)
                except BaseException:
                    # the forward may wait on a peer that waits on this backward: give it a moment, then go
                    join(timeout=PAIR_ABANDON_S, raise_error=False)
                    raise
                forward = join()
                self.timeline += [forward, backward]
                position += 2
            else:
                self.timeline.append(self._run(position, exchange, micro, live, losses))
                position += 1
        exchange.finish()
        return self._shared_loss([losses[k] for k in sorted(losses)])

    def _run(self, position: int, exchange: p2p.Exchange, micro: list[list[Any]], live: dict,
             losses: dict[int, torch.Tensor]) -> TimedAction:
        """The action at `position` of the rank's list, timed."""
        action = self.actions[position]
        runner = self.runners[action.stage]
        key = (action.stage, action.microbatch)
        start = time.perf_counter()
        with p2p.active(exchange, action.microbatch) as turn:
            if action.kind != "F":  # its receives may run on the autograd engine's own threads
                exchange.backward_turn = turn
            if action.kind == "F":
                token = torch.zeros((), requires_grad=True, device=self.device) if runner.receives else None
                outputs = runner.run(micro[action.microbatch], token)
                live[key] = (outputs, token)
                if runner.is_last:
                    losses[action.microbatch] = outputs[0].detach()
            elif action.kind == "B":
                self._backward(runner, key, live, closing=self.last_backward[action.stage] == position,
                               whole=position in self.whole)
            else:
                stage_backward_weight(iter(runner.parameters.values()), live.pop(key))
                if self.last_backward[action.stage] == position:
                    runner.synchronise_now()
        return TimedAction(action.kind, action.stage, action.microbatch, start, time.perf_counter(), turn.waited)

    def _backward(self, runner: StageRunner, key: tuple[int, int], live: dict, *, closing: bool,
                  whole: bool = False) -> None:
        outputs, token = live.pop(key)
        tensors, grads = self._backward_targets(runner, outputs)
        if self.split and token is not None and not whole:
            weights = [p for p in runner.parameters.values() if p.requires_grad]
            _, groups = stage_backward_input(tensors, grads, [token], iter(weights))
            live[key] = groups
            return
        if closing:
            runner.release()  # this backward synchronises what the step accumulated
        torch.autograd.backward(tensors, grads)
        if self.split:
            live[key] = []  # the whole backward ran here (the first stage receives nothing, or W follows): W has nothing left

    def _shared_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=self._loss_dtype(), device=self.device)
        dist.broadcast(loss, src=self.loss_source, group=p2p._group(self.group))
        return loss

    def _loss_dtype(self) -> torch.dtype:
        last = self.plan.stages[-1].graph_module.graph
        return next(n for n in last.nodes if n.op == "output").args[0][0].meta["val"].dtype

    def gather_timeline(self) -> list[list[TimedAction]]:
        """The last step's actions of every rank of this rank's pipeline group, by pp coordinate
        (collective over the pipeline axis)."""
        timelines: list[Any] = [None] * self.layout.degree
        dist.all_gather_object(timelines, self.timeline, group=p2p._group(self.group))
        return timelines

    @torch.no_grad()
    def share_parameters(self, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every parameter whole on every rank: each broadcast over the pipeline axis from the
        first stage holding it (its shape and dtype from the plan)."""
        result = {}
        for fqn, placements in self.plan.parameter_placements().items():
            holder = self._holder(fqn)
            if holder is None:
                continue
            tensor = held.get(fqn)
            if tensor is None:
                node = next(n for n in self.plan.graph_module.graph.nodes if n.op == "placeholder"
                            and self.plan.context.placeholders[n.name].target == fqn)
                meta = node.meta["val"]
                tensor = torch.empty(tuple(int(d) for d in meta.shape), dtype=meta.dtype, device=self.device)
            source = self.plan.mesh.neighbour(self.rank, self.layout.axis,
                                              holder - self.plan.mesh.coordinate(self.rank, self.layout.axis))
            dist.broadcast(tensor, src=source, group=p2p._group(self.group))
            result[fqn] = tensor
        return result

    def _holder(self, fqn: str) -> int | None:
        for stage in self.plan.stages:
            for node in stage.graph_module.graph.nodes:
                if node.op == "placeholder" and node.users and self.plan.context.placeholders[node.name].target == fqn:
                    return self.layout.coordinate(stage.index)
        return None
