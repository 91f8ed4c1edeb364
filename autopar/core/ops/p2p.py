"""Point-to-point steps at pipeline-stage boundaries, as autograd functions with conjugate backwards.

`split_pipeline` cuts the planned graph into stage graphs and joins them with these steps:

| forward                                    | backward                                        |
|--------------------------------------------|-------------------------------------------------|
| send_activation(x) -> token: isend x       | receive the gradient of x from the peer         |
| recv_activation(token) -> x: receive x     | isend the gradient of x back to the peer        |

A sending stage returns the (0-d) tokens of its sends; backward of those tokens is what pulls
the gradients in. A receiving stage has one `token` input (a 0-d tensor that requires grad),
so autograd reaches every receive when it computes gradients back to that token — which is also
how a zero-bubble schedule asks for "input gradients only" (`stage_backward_input`).

Sends are asynchronous (`dist.isend`; gloo and NCCL make progress without the sender waiting).
A forward send is waited, and its buffer let go, when the gradient of that value for that
micro-batch arrives (the peer has long received it); the other sends (gradients) are waited at
the end of the step (`Exchange.finish`); receives block until their tensor is
there. Messages are matched by tag: (boundary value, micro-batch, direction), so the order in
which a schedule posts them does not matter. The micro-batch comes from the `Turn` the pipeline
runtime makes current for each action (`active(exchange, microbatch)`), per thread: a rank that
runs a forward beside another micro-batch's backward (DualPipeV) has two turns at once, one per
thread, on one `Exchange`. A peer that is this rank itself (two virtual stages of one rank) hands
the tensor over in memory, moving nothing.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

_FORWARD, _BACKWARD = 0, 1


def _tag(value: int, microbatch: int, direction: int) -> int:
    return (microbatch * 4096 + value) * 2 + direction


@dataclass
class Exchange:
    """Point-to-point state of one rank for one step: sends in flight and the in-memory mailbox
    between two stages of this rank (its dicts are touched by one Python step at a time: the
    interpreter's lock makes each insertion and removal whole, across threads)."""

    rank: int
    pending: dict[int, tuple[Any, torch.Tensor]] = field(default_factory=dict)  # tag -> send in flight
    mailbox: dict[int, torch.Tensor] = field(default_factory=dict)
    device: "torch.device | None" = None  # where receive buffers live: the rank's (None: torch's default)
    # the group gradients travel on, where they have their own (`runtime/overlap.py`: a forward's
    # activations and another micro-batch's gradients in flight from two threads at once)
    gradient_groups: dict[str, str] = field(default_factory=dict)
    # the turn of the backward running (one at a time per rank): an accelerator's autograd engine
    # runs backward steps on threads of its own, which have no turn of their own
    backward_turn: "Turn | None" = None

    def _group_of(self, group: str, tag: int) -> str:
        return self.gradient_groups.get(group, group) if tag % 2 == _BACKWARD else group

    def send(self, tensor: torch.Tensor, peer: int, group: str, tag: int) -> None:
        if peer == self.rank:
            self.mailbox[tag] = tensor
            return
        group = self._group_of(group, tag)
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=peer, group=_group(group), tag=tag)
        self.pending[tag] = (work, tensor)  # the buffer must outlive the send

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int, group: str, tag: int) -> torch.Tensor:
        if peer == self.rank:
            return self.mailbox.pop(tag)
        group = self._group_of(group, tag)
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        start = time.perf_counter()
        dist.irecv(buffer, src=peer, group=_group(group), tag=tag).wait()
        turn = _turn(required=False) or self.backward_turn
        if turn is not None:
            turn.waited += time.perf_counter() - start
        if tag % 2 == _BACKWARD and tag - 1 in self.pending:
            # the gradient of what this rank sent forward is here: the peer received that send long
            # ago, so it is complete and its buffer can go (gloo's sends report completion only
            # when waited), instead of every forward send being held until the step ends
            work, _ = self.pending.pop(tag - 1)
            work.wait()
        return buffer

    def finish(self) -> None:
        """Wait for every send of the step (their buffers are released then)."""
        for work, _ in self.pending.values():
            work.wait()
        self.pending.clear()
        if self.mailbox:
            raise RuntimeError(f"pipeline step ended with {len(self.mailbox)} undelivered in-memory messages")


@dataclass
class Turn:
    """One action's use of the exchange: its micro-batch and the seconds it blocked in receives
    (the measured timeline subtracts them)."""

    exchange: Exchange
    microbatch: int
    waited: float = 0.0


_turns = threading.local()  # .stack: this thread's turns, innermost last


def _group(name: str) -> Any:
    return _resolve_process_group(name)


def _turn(*, required: bool = True) -> "Turn | None":
    stack = getattr(_turns, "stack", None)
    if not stack and not required:
        return None
    if not stack:
        raise RuntimeError("a pipeline send/recv ran outside a pipeline schedule; pipeline-parallel modules "
                           "train with module.train_step(...)")
    return stack[-1]


def current() -> Exchange:
    return _turn().exchange


@contextlib.contextmanager
def active(exchange: Exchange, microbatch: int) -> Iterator[Turn]:
    """Make `microbatch`'s turn on `exchange` current in this thread."""
    if not hasattr(_turns, "stack"):
        _turns.stack = []
    turn = Turn(exchange, microbatch)
    _turns.stack.append(turn)
    try:
        yield turn
    finally:
        _turns.stack.pop()


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, peer, value):
        turn = _turn()
        exchange = turn.exchange
        ctx.args = (tuple(x.shape), x.dtype, peer, group, _tag(value, turn.microbatch, _BACKWARD), exchange)
        exchange.send(x.detach(), peer, group, _tag(value, turn.microbatch, _FORWARD))
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad):
        shape, dtype, peer, group, tag, exchange = ctx.args
        return exchange.recv(shape, dtype, peer, group, tag), None, None, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, group, peer, value, shape, dtype):
        turn = _turn()
        ctx.args = (peer, group, _tag(value, turn.microbatch, _BACKWARD), turn.exchange)
        return turn.exchange.recv(tuple(shape), dtype, peer, group, _tag(value, turn.microbatch, _FORWARD))

    @staticmethod
    def backward(ctx, grad):
        peer, group, tag, exchange = ctx.args
        exchange.send(grad, peer, group, tag)
        return None, None, None, None, None, None


# Compiled rank graphs (`parallelize(compile=True)`): dynamo must not trace into a send or a receive:
# they post gloo/NCCL work with Python-side state (the current `Exchange`, its pending sends) that a
# traced graph would replay from guards — tracing `recv` guarded on the float `time.perf_counter()`
# returned and recompiled at every call until dynamo's recompile limit. Disabled, each is a graph
# break that runs eagerly, as an autograd function, between two compiled pieces.
@torch._dynamo.disable
def send_activation(x: torch.Tensor, *, group: str, peer: int, value: int) -> torch.Tensor:
    """Send `x` to `peer` (forward); its gradient comes back from `peer` in backward. Returns a token."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        turn = _turn()
        turn.exchange.send(x.detach(), peer, group, _tag(value, turn.microbatch, _FORWARD))
        return x.new_zeros(())
    return _Send.apply(x, group, peer, value)


@torch._dynamo.disable
def recv_activation(token: torch.Tensor, *, group: str, peer: int, value: int, shape: list[int],
                    dtype: torch.dtype, requires_grad: bool = True) -> torch.Tensor:
    """Receive a value from `peer` (forward); send its gradient back in backward."""
    if not (requires_grad and torch.is_grad_enabled()):
        turn = _turn()
        return turn.exchange.recv(tuple(shape), dtype, peer, group, _tag(value, turn.microbatch, _FORWARD))
    return _Recv.apply(token, group, peer, value, shape, dtype)


def plan_send(x: torch.Tensor, *, group: str, peer: Any, value: int) -> torch.Tensor:
    """Planning stand-in of `send_activation` (fake runs: the activation ledger, the plan-time run
    check): moves nothing, saves nothing, and lets backward reach `x` as a real send's would."""
    return x.sum() * 0.0


class _PlanRecv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=token.device)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None


def plan_recv(token: torch.Tensor, *, group: str, peer: Any, value: int, shape: list[int], dtype: torch.dtype,
              requires_grad: bool = True) -> torch.Tensor:
    """Planning stand-in of `recv_activation`: a fresh tensor of the received shape, reached by
    backward from the token as a real receive is (and saving nothing)."""
    if not (requires_grad and torch.is_grad_enabled()):
        return torch.empty(shape, dtype=dtype, device=token.device)
    return _PlanRecv.apply(token, shape, dtype)


PLANNING_STAND_INS = {send_activation: plan_send, recv_activation: plan_recv}
