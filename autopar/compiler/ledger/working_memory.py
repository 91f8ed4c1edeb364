"""The backward's working memory: what it allocates beyond the saved activations, from a fake run.

The memory ledger's peak is a moment, not a sum (`autopar/compiler/ledger/memory.py`): when backward starts, a
rank holds every saved activation plus what the first backward ops allocate before anything is
freed — the loss's gradient over the vocabulary ([tokens, vocab] for the log-probabilities, then
again for the logits), a pipeline stage's received output gradient and the one it sends back.
The op ledger's fake run of the rank's emitted graph, forward and backward (`autopar/compiler/ledger/fake_run.py`:
local shapes at the traced hints, the activation ledger's inputs) carries `LiveFakeStorages`,
which follows every storage the run allocates while it is alive (weak references on the
storages, as `autopar.measure.storages.LiveStorages` does for real ones); `Working` is the most
bytes alive during backward beyond those alive when backward started, and how many of them were
a weight gradient at that moment (a fixed size, where the rest grows with the batch).
`backward_working(plan, rank=, stage=)` reads it off that run.

Backward starts from the graph's outputs with gradients of ones (the loss; an earlier pipeline
stage's send tokens: the planning stand-in of a send hands its input a gradient of the input's
size, as a real receive would). Parameter gradients are taken as soon as they are accumulated: where they live (bucket
buffers, a parameter's own `.grad`, a ZeRO unit's hand-over) is the memory ledger's business, and
ZeRO-3's gathered parameters (the planning stand-in's fresh tensors) are not followed at all:
the runtime gathers and frees them, the ledger counts them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.core.ops.sharded_state import unit_call

if TYPE_CHECKING:
    pass


class LiveFakeStorages(TorchDispatchMode):
    """The storages ops allocate, as a list of events (allocation, ±bytes); `paused` while a node's
    outputs are not to be followed. An allocation is numbered in order, not named by its address:
    a freed storage's address is given to the next one, which must not inherit what the freed one
    was (a weight gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_at: dict[int, int] = {}  # storage address -> its allocation, while alive
        self.sizes: dict[int, int] = {}  # allocation -> bytes, while alive
        self.events: list[tuple[int, int]] = []
        self.live = 0
        self.paused = False
        self.weight_gradients: set[int] = set()  # allocations
        self.start = 0
        # given: each allocation's label when it was made (`fake_run`: whether a block's node made it)
        self.label: Callable[[], Any] | None = None
        self.labels: dict[int, Any] = {}

    def backward_starts(self) -> None:
        self.start = len(self.events)

    def mark_weight_gradient(self, tensor: torch.Tensor) -> None:
        allocation = self.live_at.get(tensor.untyped_storage()._cdata)
        if allocation is not None:
            self.weight_gradients.add(allocation)

    def working(self) -> "Working":
        """Most bytes alive beyond those at `backward_starts`, and the weight gradients among them."""
        live = grads_live = most = most_grads = 0
        for allocation, change in self.events[self.start:]:
            live += change
            grads_live += change if allocation in self.weight_gradients else 0
            if live > most:
                most, most_grads = live, grads_live
        return Working(bytes=most, weight_gradients=max(0, most_grads))

    def _freed(self, address: int, allocation: int) -> None:
        nbytes = self.sizes.pop(allocation, 0)
        if self.live_at.get(address) == allocation:
            del self.live_at[address]
        self.live -= nbytes
        self.events.append((allocation, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        inputs = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
        for value in tensors_in(out):
            storage = value.untyped_storage()
            address = storage._cdata
            if address in inputs or address in self.live_at:  # a view, an in-place or out= op: nothing allocated
                continue
            allocation = len(self.events)
            self.live_at[address] = allocation
            self.sizes[allocation] = storage.nbytes()
            self.live += storage.nbytes()
            self.events.append((allocation, storage.nbytes()))
            if self.label is not None:
                self.labels[allocation] = self.label()
            weakref.finalize(storage, self._freed, address, allocation)
        return out


def tensors_in(values: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts (a lean pytree walk: it runs for every op).
    `autopar.measure.storages` has its own copy on purpose: the measuring tools import nothing of
    autopar (`tests/test_measure.py`), so that what they measure does not ask the code under test."""
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, (list, tuple)):
        for value in values:
            yield from tensors_in(value)
    elif isinstance(values, dict):
        for value in values.values():
            yield from tensors_in(value)


@dataclass(frozen=True)
class Working:
    """Backward's most bytes beyond what was alive when it started, and how many of them were a
    parameter's gradient (alive for a moment, until the runtime takes it: it does not grow with
    the batch, the rest does)."""

    bytes: int
    weight_gradients: int


class _Runner(torch.fx.Interpreter):
    """Runs the rank graph; ZeRO-3's gathered parameters are neither followed nor given gradients;
    `around(node, run)`, when given, runs each node (`fake_run`'s block attribution)."""

    def __init__(self, gm: torch.fx.GraphModule, tracker: LiveFakeStorages,
                 around: "Callable[[torch.fx.Node, Callable[[torch.fx.Node], Any]], Any] | None" = None) -> None:
        super().__init__(gm)
        self.tracker, self.around = tracker, around

    def run_node(self, node: torch.fx.Node) -> Any:
        if self.around is not None:
            return self.around(node, self._run_node)
        return self._run_node(node)

    def _run_node(self, node: torch.fx.Node) -> Any:
        if node.op == "call_function" and unit_call(node.target) == "gather_unit":
            self.tracker.paused = True
            try:
                result = super().run_node(node)
            finally:
                self.tracker.paused = False
            for full in result:
                if full.requires_grad:
                    full.register_post_accumulate_grad_hook(_drop_grad)
            return result
        return super().run_node(node)


def _drop_grad(tensor: torch.Tensor) -> None:
    tensor.grad = None


def gather_free_runner(gm: torch.fx.GraphModule, tracker: "LiveFakeStorages",
                       around: "Callable[[torch.fx.Node, Callable[[torch.fx.Node], Any]], Any] | None" = None
                       ) -> Callable[..., Any]:
    """`gm` as a callable whose ZeRO-3 gathered parameters `tracker` does not follow (an
    interpreter where the graph gathers units or `around` runs each node; its generated code
    elsewhere)."""
    if around is not None or any(n.op == "call_function" and unit_call(n.target) == "gather_unit"
                                 for n in gm.graph.nodes):
        return _Runner(gm, tracker, around).run
    return gm


def taking_weight_gradients(inputs: list, tracker: "LiveFakeStorages") -> None:
    """Hooks that take each trainable input's gradient as soon as it is accumulated, as the runtime
    does (into a bucket, a ZeRO unit), remembering its storage as a weight gradient."""
    def taken(tensor: torch.Tensor) -> None:
        if tensor.grad is not None:
            tracker.mark_weight_gradient(tensor.grad)
            tensor.grad = None

    for value in inputs:
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf:
            value.register_post_accumulate_grad_hook(taken)


