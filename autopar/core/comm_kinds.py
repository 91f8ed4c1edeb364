"""The vocabulary of communication, as data: one registry read by every pass, the emitter, the
ledgers, plan files and views.

Two tables:
- `KINDS`: what moves on the wire. Each `CommKind` says whether it joins a group of ranks along
  a mesh axis or one peer (point-to-point), its wire bytes per logical byte S for a group
  of n ranks, NCCL's bus-bandwidth convention: all-reduce 2(n-1)/n, all-gather / reduce-scatter /
  all-to-all (n-1)/n, broadcast 1, send / recv 1 (wire = logical for point-to-point), and the
  messages a ring sends one after another (all-reduce 2(n-1), the others n-1, a send 1): the α
  count of the α-β time model (`autopar/cost/cluster.py`).
- `STEPS`: the graph steps that move a tensor (functions of `autopar.core.ops.collectives` and
  `autopar.core.ops.p2p`), each with the kind it issues in forward, its conjugate kind in
  backward, and how its keyword arguments bind to one rank (`BINDINGS`): `group` (axis name ->
  process-group name), `index` (axis name or group key -> the rank's place in its group), `size`, `groups`
  (comma-separated axes -> names), `peer` ((axis, offset) -> the global rank of that neighbour),
  `none`, `value` (a constant, as declared). The emitter binds steps and lowered kernels (`op_rules.RuleResult.kernel_kwargs`) with
  the same table.

Adding a kind of communication is adding entries here (and its runtime function); nothing else
keeps its own list.

`gradient_exchange_kind` says how a ZeRO unit's gradients reach their owners on the backend that
will run them: a reduce-scatter, or (gloo) an all-to-all of the rank-major pieces summed by each
owner on arrival, the same bytes on the wire (`EXCHANGE_FOR_REDUCE_SCATTER`);
`parameter_gather_kind` how ZeRO's parameters are gathered from their shards (stage 3 before use,
stages 1/2 after the optimizer step): an all-gather, or (gloo) one broadcast from each owner into
its row of the gathered buffer (`BROADCASTS_FOR_ALL_GATHER`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch.distributed as dist

from autopar.core.ir import simplified
from autopar.core.mesh import Mesh
from autopar.core.ops import collectives, p2p


@dataclass(frozen=True)
class CommKind:
    name: str
    peer: bool  # point-to-point (one peer rank) rather than a group along an axis
    wire_factor: Callable[[int], sympy.Expr]  # wire bytes per logical byte, for a group of n ranks
    latency_steps: Callable[[int], int]  # messages in sequence on a ring of n ranks (the α-β model's α count)


def _ring(n: int) -> sympy.Expr:
    return sympy.Rational(n - 1, n)


def _ring_steps(n: int) -> int:
    return n - 1


KINDS: dict[str, CommKind] = {kind.name: kind for kind in (
    CommKind("all_reduce", False, lambda n: sympy.Rational(2 * (n - 1), n), lambda n: 2 * (n - 1)),
    CommKind("all_gather", False, _ring, _ring_steps),
    CommKind("reduce_scatter", False, _ring, _ring_steps),
    CommKind("all_to_all", False, _ring, _ring_steps),
    CommKind("broadcast", False, lambda n: sympy.Integer(1), _ring_steps),
    CommKind("send", True, lambda n: sympy.Integer(1), lambda n: 1),
    CommKind("recv", True, lambda n: sympy.Integer(1), lambda n: 1),
)}


@functools.lru_cache(maxsize=None)
def wire_factor(kind: str, group_size: int) -> float:
    """`KINDS[kind].wire_factor(group_size)` as a float, once per (kind, size): the planner's cost
    model asks it for every collective of every candidate (sympy's exact form costs ~4 µs each)."""
    return float(KINDS[kind].wire_factor(group_size))


def wire_bytes(kind: str, group_size: int, logical: sympy.Expr) -> sympy.Expr:
    return simplified(KINDS[kind].wire_factor(group_size) * logical)


# Backends whose reduce-scatter is slower than an all-to-all followed by a local sum of the n
# pieces that arrive (gloo: measured 2x faster at 4 ranks from 16 KiB to 13 MiB, benchmarks/RESULTS.md).
# Both put (n-1)/n of the input on the wire per rank;
# the exchange receives the whole input size where the reduce-scatter receives 1/n of it.
EXCHANGE_FOR_REDUCE_SCATTER = ("gloo",)


# gloo with one worker thread per process group (`autopar/runtime/serial_gloo.py`): gloo here
SERIAL_GLOO = "gloo_serial"


def runtime_backend() -> str | None:
    """The initialised default process group's backend for CPU tensors where it names one per
    device ("cpu:gloo,cuda:nccl": gloo, as `parallelize` places a mesh of such a group on the CPU);
    "gloo" for `SERIAL_GLOO`; None when planning without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = dist.get_backend()
    by_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    backend = by_device.get("cpu", backend) if by_device else backend
    return "gloo" if backend == SERIAL_GLOO else backend


# Backends whose all-gather is slower than one broadcast from each rank into its row of the
# gathered buffer (gloo: measured 1.5x faster at 2 and 4 ranks, and inside a ZeRO-2 step,
# benchmarks/RESULTS.md).
BROADCASTS_FOR_ALL_GATHER = ("gloo",)


def _on_backend(declared: str, backend: str | None, backends: tuple[str, ...], chosen: str, otherwise: str) -> str:
    if declared != "auto":
        return declared
    return chosen if (backend or runtime_backend()) in backends else otherwise


def parameter_gather_kind(declared: str, backend: str | None = None) -> str:
    """"all_gather" or "broadcast" for `zero(gather=declared)`: "auto" picks the owners'
    broadcasts on a backend of BROADCASTS_FOR_ALL_GATHER (the initialised process group's, or
    `backend`), and the all-gather without one."""
    return _on_backend(declared, backend, BROADCASTS_FOR_ALL_GATHER, "broadcast", "all_gather")


def gradient_exchange_kind(declared: str, backend: str | None = None) -> str:
    """"reduce_scatter" or "all_to_all" for `zero(reduce=declared)`: "auto" picks the exchange on
    a backend of EXCHANGE_FOR_REDUCE_SCATTER (the initialised process group's, or `backend`), and
    the reduce-scatter without one (plans made for a cluster, not for this process group)."""
    return _on_backend(declared, backend, EXCHANGE_FOR_REDUCE_SCATTER, "all_to_all", "reduce_scatter")


def _bind_peer(value: Any, mesh: Mesh, rank: int, groups: dict[str, str]) -> int:
    axis, offset = value
    return mesh.neighbour(rank, axis, offset)


# binding kind -> (unbound value, mesh, rank, groups) -> what the rank's code receives
BINDINGS: dict[str, Callable[[Any, Mesh, int, dict[str, str]], Any]] = {
    "group": lambda axis, mesh, rank, groups: groups[axis],
    "groups": lambda axes, mesh, rank, groups: tuple(groups[a] for a in axes.split(",") if a),
    "index": lambda axis, mesh, rank, groups: mesh.group_index(rank, axis),
    "size": lambda axis, mesh, rank, groups: mesh.group_size(axis),
    "peer": _bind_peer,
    "none": lambda value, mesh, rank, groups: None,
    "value": lambda value, mesh, rank, groups: value,  # a constant of the lowering (a method's name)
}


@dataclass(frozen=True)
class CommStep:
    """A graph step that moves one tensor: the kinds it issues and how its kwargs bind to a rank."""

    function: Callable[..., Any]
    forward: str | None  # kind issued in forward (None: local, no communication)
    backward: str | None  # the conjugate kind issued in backward
    binds: tuple[tuple[str, str], ...]  # (keyword argument, binding kind)

    @property
    def name(self) -> str:
        return self.function.__name__


STEPS: dict[Callable[..., Any], CommStep] = {}


def register_step(function: Callable[..., Any], *, forward: str | None, backward: str | None,
                  binds: dict[str, str]) -> None:
    for kind in (forward, backward):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; known: {sorted(KINDS)}")
    if function in STEPS:
        raise ValueError(f"communication step {function.__name__} is already registered")
    STEPS[function] = CommStep(function, forward, backward, tuple(binds.items()))


def comm_step(target: Any) -> CommStep | None:
    """The registry entry of a graph node's target, if it is a communication step."""
    try:
        return STEPS.get(target)
    except TypeError:  # unhashable targets are not steps
        return None


def bind(values: dict[str, Any], binds: "tuple[tuple[str, str], ...] | dict[str, str]", mesh: Mesh, rank: int,
         groups: dict[str, str]) -> dict[str, Any]:
    """`values` with every declared keyword bound for `rank` (see BINDINGS)."""
    bound = dict(values)
    for name, how in (binds.items() if isinstance(binds, dict) else binds):
        if name in bound:
            bound[name] = BINDINGS[how](bound[name], mesh, rank, groups)
    return bound


# An all_gather's backward is a local slice unless insert_grad_reductions finds its gradient partial
# (then a reduce_scatter: the pass records it); grad_all_reduce is Megatron's f.
register_step(collectives.all_reduce, forward="all_reduce", backward=None, binds={"group": "group"})
register_step(collectives.reduce_scatter, forward="reduce_scatter", backward="all_gather", binds={"group": "group"})
register_step(collectives.all_gather, forward="all_gather", backward=None, binds={"group": "group", "index": "index"})
register_step(collectives.shard_slice, forward=None, backward="all_gather", binds={"group": "group", "index": "index"})
register_step(collectives.all_to_all, forward="all_to_all", backward="all_to_all", binds={"group": "group"})
register_step(collectives.partial_from_replicate, forward=None, backward=None, binds={"group": "group", "index": "index"})
register_step(collectives.grad_all_reduce, forward=None, backward="all_reduce", binds={"group": "group"})
# pipeline boundaries: a forward send's backward receives the gradient, a forward recv's sends it
register_step(p2p.send_activation, forward="send", backward="recv", binds={"group": "group", "peer": "peer"})
register_step(p2p.recv_activation, forward="recv", backward="send", binds={"group": "group", "peer": "peer"})
