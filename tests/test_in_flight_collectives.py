"""Collectives in flight, watched from outside (issue 45): a Llama step under tensor + sequence
parallelism with async TP's chunks and data parallelism on real gloo ranks, where several
collectives of one process group are in flight at once (the scheduling pass's deferred steps, the
conjugates their finishes issue in backward, the weight-gradient taps between them, the gradient
buckets' all-reduces), and with Megatron's f / g under plain tensor parallelism.

`InFlightWatch` is a `TorchDispatchMode` over the whole step (forward, backward, optimizer). It
sees every functional collective the rank hands to a process group, and every other op, and checks
what a collective needs from its caller until it has been waited (`wait_tensor`):
- no op other than a view reads or writes its output (the buffer the process group's thread
  writes), and no op writes its input (which a backend may still be reading);
- it is waited before the step ends;
- on each process group, every member issues the same collectives (kind and shape) in the same
  order (what `TORCH_DISTRIBUTED_DEBUG=DETAIL` checks before each collective, here over the whole
  step at once: two collectives issued in different orders pair the wrong buffers).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autopar
from autopar.runtime.launch import launch

pytestmark = pytest.mark.usefixtures("transformers")

# the functional collectives whose input the process group may read after they return (an
# out-of-place all_reduce copies its input first)
_INPUT_IN_FLIGHT = {"all_gather_into_tensor", "all_to_all_single", "all_reduce_", "reduce_scatter_tensor"}


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class InFlightWatch(TorchDispatchMode):
    """The checks of the module docstring, recorded per rank (`violations`, `unwaited`, `issued`)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: list[dict[str, Any]] = []
        self.violations: list[str] = []
        self.unwaited: list[str] = []
        self.issued: list[tuple[str, str, tuple]] = []  # (group, kind, input shape) in issue order
        self.most_in_flight = 0  # on one process group at once

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name == "wait_tensor":
            waited = _storage(args[0])
            self.in_flight = [f for f in self.in_flight if f["output"] != waited]
            return func(*args, **kwargs)
        if func.namespace == "_c10d_functional":
            out = func(*args, **kwargs)
            group = args[-1]
            self.issued.append((group, name, tuple(args[0].shape)))
            # the record holds both tensors: a storage freed while its collective is watched could
            # come back at the same address as another tensor's
            self.in_flight.append({"what": f"{name} #{len(self.issued)} on group {group}", "output": _storage(out),
                                   "input": _storage(args[0]) if name in _INPUT_IN_FLIGHT else None,
                                   "group": group, "held": (args[0], out)})
            self.most_in_flight = max(self.most_in_flight, sum(f["group"] == group for f in self.in_flight))
            return out
        if self.in_flight:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func, args, kwargs) -> None:
        touched = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        written = set()
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[index] if index < len(args) else kwargs.get(argument.name)
                written |= {_storage(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)}
        for flight in self.in_flight:
            if flight["output"] in touched and not func.is_view:
                self.violations.append(f"{func} used the output of {flight['what']} before its wait")
            if flight["input"] is not None and flight["input"] in written:
                self.violations.append(f"{func} wrote the input of {flight['what']} before its wait")

    def end_step(self) -> None:
        self.unwaited += [flight["what"] for flight in self.in_flight]
        self.in_flight = []


CASES = {
    "dp2_tp2_sp_chunks": [autopar.data_parallel(), autopar.sequence_parallel(), autopar.schedule(chunks=2)],
    "dp2_tp2": [autopar.data_parallel(), autopar.tensor_parallel()],
}


def watched_rank(rank: int, world: int, mesh: str, steps: int) -> dict[str, dict[str, Any]]:
    """Each case's plan trained `steps` steps under the watch; what it recorded."""
    from examples.hf_models import tiny_llama, token_batch  # transformers is optional: imported where it runs

    batches = [token_batch(batch=8, seq=16, vocab=128, seed=step) for step in range(steps)]
    found = {}
    for case, strategies in CASES.items():
        torch.manual_seed(0)
        module = autopar.parallelize(tiny_llama(), mesh, strategies=strategies, example_inputs=batches[0])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        watch = InFlightWatch()
        for batch in batches:
            optimizer.zero_grad()
            local = module.local_batch(*batch)
            with watch:
                module(*local).backward()
                optimizer.step()
            watch.end_step()
        found[case] = {"violations": sorted(set(watch.violations)), "unwaited": watch.unwaited,
                       "issued": watch.issued, "most_in_flight": watch.most_in_flight}
    return found


def test_in_flight_collectives_keep_their_buffers_and_their_order():
    per_rank = launch(watched_rank, 4, "dp=2,tp=2", 2, timeout_s=120)
    # what the checks are for: several collectives of one process group in flight at once
    assert max(found["dp2_tp2_sp_chunks"]["most_in_flight"] for found in per_rank) >= 2
    for case in CASES:
        for rank, found in enumerate(per_rank):
            assert not found[case]["violations"], f"{case}, rank {rank}: {found[case]['violations'][:10]}"
            assert not found[case]["unwaited"], f"{case}, rank {rank}: never waited: {found[case]['unwaited'][:10]}"
        by_group: dict[str, dict[int, list]] = {}
        for rank, found in enumerate(per_rank):
            for group, kind, shape in found[case]["issued"]:
                by_group.setdefault(group, {}).setdefault(rank, []).append((kind, shape))
        assert len(by_group) >= 3, f"{case}: collectives on {sorted(by_group)} only"  # tp, dp, and the loss's
        for group, members in by_group.items():
            first_rank, first = next(iter(members.items()))
            for rank, calls in members.items():
                differ = next((i for i, (a, b) in enumerate(zip(first, calls)) if a != b), min(len(first), len(calls)))
                assert calls == first, (f"{case}: on group {group}, rank {rank} issued {calls[differ:differ + 3]} "
                                        f"where rank {first_rank} issued {first[differ:differ + 3]} (call {differ})")
