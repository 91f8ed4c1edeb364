"""Redistribution steps split in two: started where their input is ready, finished where their
output is first needed (`autopar/compiler/passes/schedule_collectives.py` places the halves).

A deferred step is two graph nodes. The start (`collectives.all_reduce(..., deferred=True)` and
its siblings) hands the tensor to the process group and returns the collective's output buffer
before it has arrived; `finish(buffer)` waits for it and lays it out. What the rank graph runs
between them runs while the collective is in flight. Backward mirrors it: autograd reaches the
finish first (it was made later) and issues the conjugate collective there, then runs the nodes
made between the two halves in forward (autograd runs ready nodes newest first), then the
start's backward waits for it. The two halves share one `InFlight`, carried on the buffer.

The kinds, as data (`FLIGHTS`): each says how its forward and its conjugate are issued and
landed, with the same halves as the synchronous steps (`collectives.issue_*` / `land_*`), so a
deferred step moves exactly the bytes its synchronous form moves.

Under `torch.compile` (dynamo tracing the rank graph) a start runs its synchronous step and the
finish passes its tensor through: inductor schedules the functional collectives itself.
"""
from __future__ import annotations

from typing import Any

import torch

from autopar.core.ops import collective_calls as c
from autopar.core.sequence_chunks import natural_order, rank_order, take

_ATTRIBUTE = "_autopar_in_flight"


class InFlight:
    """One deferred step between its halves: its arguments, its buffer's shape, and in backward
    the conjugate collective issued by the finish and not yet landed by the start."""

    def __init__(self, kind: str, **args: Any) -> None:
        self.kind, self.args = kind, args
        self.buffer_shape: tuple = ()
        self.input_shape: tuple = ()
        self.pending: Any = None

    # forward
    def issue(self, x: torch.Tensor) -> torch.Tensor:
        self.input_shape = tuple(x.shape)
        buffer, self.pending = FLIGHTS[self.kind][0](self, x)
        self.buffer_shape = tuple(buffer.shape)
        return buffer

    def land(self, buffer: torch.Tensor) -> torch.Tensor:
        out = FLIGHTS[self.kind][1](self, buffer, self.pending)
        self.pending = None
        return out

    # backward
    def issue_conjugate(self, grad: torch.Tensor) -> None:
        self.pending = FLIGHTS[self.kind][2](self, grad)

    def land_conjugate(self) -> torch.Tensor:
        grad, self.pending = FLIGHTS[self.kind][3](self, self.pending), None
        return grad


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        buffer = flight.issue(x)
        setattr(buffer, _ATTRIBUTE, flight)
        return buffer

    @staticmethod
    def backward(ctx, _placeholder):
        return ctx.flight.land_conjugate(), None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, flight):
        ctx.flight = flight
        return flight.land(buffer)

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        flight.issue_conjugate(grad)
        # the start's backward takes the conjugate from the flight, not from this gradient: a zero
        # of the buffer's shape, expanded (no memory), stands for it on the autograd edge
        return grad.new_zeros(()).expand(flight.buffer_shape), None


def start(x: torch.Tensor, kind: str, **args: Any) -> torch.Tensor:
    """The buffer of step `kind` issued on `x` (autograd-aware; `finish` lands it)."""
    return _Start.apply(x, InFlight(kind, **args))


def finish(buffer: torch.Tensor) -> torch.Tensor:
    """The step's output, once its collective has arrived. Under dynamo the start already ran the
    whole step (module docstring)."""
    if torch.compiler.is_compiling():
        return buffer
    flight = getattr(buffer, _ATTRIBUTE, None)
    if flight is None:
        raise RuntimeError("finish() of a tensor no deferred collective started")
    return _Finish.apply(buffer, flight)


# --- the kinds: (issue forward, land forward, issue conjugate, land conjugate) -------------------
# issue forward returns (buffer, what land needs); the buffer is what autograd carries between
# the halves (the collective's own output, so the zero stand-in has its shape).

def _issued(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
    return tensor, None


def _all_reduce_issue(f: InFlight, x):
    return _issued(c.issue_all_reduce(x, f.args["group"], "sum" if f.args["reduce_op"] == "avg" else f.args["reduce_op"]))


def _all_reduce_land(f: InFlight, buffer, _):
    out = c.wait(buffer)
    return out / f.args["size"] if f.args["reduce_op"] == "avg" else out


def _all_reduce_conjugate(f: InFlight, grad):  # Partial -> Replicate: identity in backward
    return grad * (1.0 / f.args["size"]) if f.args["reduce_op"] == "avg" else grad


def _passed(f: InFlight, grad):
    return grad


def _reduce_scatter_issue(f: InFlight, x):
    return _issued(c.issue_reduce_scatter(x, f.args["group"], f.args["size"], f.args["dim"]))


def _reduce_scatter_land(f: InFlight, buffer, _):
    return c.wait(buffer)


def _reduce_scatter_conjugate(f: InFlight, grad):
    return c.issue_all_gather(grad, f.args["group"], f.args["size"]), tuple(grad.shape)


def _reduce_scatter_conjugate_land(f: InFlight, pending):
    gathered, shape = pending
    return c.land_all_gather(gathered, shape, f.args["size"], f.args["dim"])


def _all_gather_issue(f: InFlight, x):
    return _issued(c.issue_all_gather(x, f.args["group"], f.args["size"]))


def _all_gather_land(f: InFlight, buffer, _):
    a = f.args
    return natural_order(c.land_all_gather(buffer, f.input_shape, a["size"], a["dim"]), a["dim"], a["size"],
                         a["layout"], a["blocks"])


def _all_gather_conjugate(f: InFlight, grad):
    a = f.args
    if a["grad_partial"]:
        return c.issue_reduce_scatter(rank_order(grad, a["dim"], a["size"], a["layout"], a["blocks"]), a["group"],
                                      a["size"], a["dim"])
    return take(grad, a["dim"], a["size"], a["index"], a["layout"], a["blocks"]).contiguous()


def _all_gather_conjugate_land(f: InFlight, pending):
    return c.wait(pending) if f.args["grad_partial"] else pending


def _all_to_all_issue(f: InFlight, x):
    return c.issue_all_to_all(x, f.args["group"], f.args["size"], split_dim=f.args["to_dim"])


def _all_to_all_land(f: InFlight, buffer, chunk_shape):
    return c.land_all_to_all(buffer, chunk_shape, concat_dim=f.args["from_dim"])


def _all_to_all_conjugate(f: InFlight, grad):
    return c.issue_all_to_all(grad, f.args["group"], f.args["size"], split_dim=f.args["from_dim"])


def _all_to_all_conjugate_land(f: InFlight, pending):
    received, chunk_shape = pending
    return c.land_all_to_all(received, chunk_shape, concat_dim=f.args["to_dim"])


def _grad_all_reduce_issue(f: InFlight, x):  # Megatron's f: identity in forward
    return _issued(x.view_as(x))


def _grad_all_reduce_land(f: InFlight, buffer, _):
    return buffer.view_as(buffer)


def _grad_all_reduce_conjugate(f: InFlight, grad):
    return c.issue_all_reduce(grad, f.args["group"], "sum")


def _landed(f: InFlight, pending):
    return c.wait(pending)


FLIGHTS = {
    "all_reduce": (_all_reduce_issue, _all_reduce_land, _all_reduce_conjugate, _passed),
    "reduce_scatter": (_reduce_scatter_issue, _reduce_scatter_land, _reduce_scatter_conjugate,
                       _reduce_scatter_conjugate_land),
    "all_gather": (_all_gather_issue, _all_gather_land, _all_gather_conjugate, _all_gather_conjugate_land),
    "all_to_all": (_all_to_all_issue, _all_to_all_land, _all_to_all_conjugate, _all_to_all_conjugate_land),
    "grad_all_reduce": (_grad_all_reduce_issue, _grad_all_reduce_land, _grad_all_reduce_conjugate, _landed),
}
