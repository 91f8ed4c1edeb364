"""Shared harness of the numerics tests: train the single-device model and the autopar program
side by side for a few AdamW steps and collect losses, gradients, parameters and comm counts."""
from __future__ import annotations

from typing import Any, Callable

import torch

import autopar
from autopar.ledger.measure_activations import measure_saved_activations
from autopar.ledger.memory import build_memory_ledger, measure_held_bytes
from autopar.plan import local_tensor
from autopar.runtime.comm_counter import CommCounter

STEPS = 3
LR = 1e-2
# AdamW's first steps move every entry by ~lr*g/(|g|+eps): an entry with |g| ~ 1e-7 (cancellation) whose
# last bits differ between summation orders (1e-9 absolute, measured) then moves differently by ~1e-6, a
# relative parameter error above 1e-5 that says nothing about parallelisation. eps=1e-3 keeps such entries
# in Adam's linear regime; gradients themselves are compared at 1e-5 before the optimizer sees them.
EPS = 1e-3


def reference_trainer(build: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The single-device model (seeded like every rank) and its AdamW."""
    torch.manual_seed(0)
    model = build()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)


def parallel_trainer(build: Callable[[], torch.nn.Module], example_inputs: Any, mesh: str,
                     strategies: list) -> tuple[Any, torch.optim.Optimizer]:
    """This rank's ParallelModule of the same seeded model, and AdamW over its parameters (shards)."""
    torch.manual_seed(0)
    module = autopar.parallelize(build(), mesh, strategies=strategies, example_inputs=example_inputs)
    return module, torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)


def parameter_layout(module: Any) -> dict[str, Any]:
    """What `assert_matches` needs to cut the reference for a rank: placements and ZeRO rows."""
    return {"placements": module.plan.parameter_placements(),
            "zero": {p.fqn: (u.axis, p.rows) for u in module.plan.units for p in u.params}}


def single_device(build: Callable[[], torch.nn.Module], batches: list[tuple], *,
                  clip_norm: float | None = None) -> dict[str, Any]:
    """Losses, gradients and parameters per step; with `clip_norm`, gradients are clipped (and the
    norms recorded) before the step."""
    model, optimizer = reference_trainer(build)
    losses, grads, params, norms = [], [], [], []
    for batch in batches:
        optimizer.zero_grad()
        loss = model(*batch)
        loss.backward()
        losses.append(loss.detach())
        if clip_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm))
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "grads": grads, "params": params, "norms": norms}


def distributed_rank(rank: int, world_size: int, build: Callable[[], torch.nn.Module], batches: list[tuple],
                     mesh: str, strategies: list) -> dict[str, Any]:
    module, optimizer = parallel_trainer(build, batches[0], mesh, strategies)
    group_to_axis = {name: axis for axis, name in module.groups.items()}
    losses, grads, params, measured, memory = [], [], [], [], {}
    for batch in batches:
        optimizer.zero_grad()
        local = module.local_batch(*batch)
        with CommCounter() as forward_counter, measure_saved_activations(
                exclude=[*module.parameters(), *module.buffers()]) as saved:
            loss = module(*local)
        with CommCounter() as backward_counter:
            loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.detach().clone() for n, p in module.named_parameters()})
        with CommCounter() as optimizer_counter:
            optimizer.step()
        measured.append({"forward": forward_counter.by_key(group_to_axis),
                         "backward": backward_counter.by_key(group_to_axis),
                         "optimizer": optimizer_counter.by_key(group_to_axis)})
        params.append({n: p.detach().clone() for n, p in module.named_parameters()})
        if not memory:
            memory.update(measured=dict(measure_held_bytes(module, optimizer), activations=saved.bytes),
                          ledger=build_memory_ledger(module.plan, rank=rank).by_category())
    ledger = module.plan.comm.by_key()
    return {"losses": losses, "grads": grads, "params": params, "measured": measured, "ledger": ledger,
            "memory": memory, **parameter_layout(module)}


# Some gradients are mathematically zero and numerically rounding noise (~1e-9): the key-projection bias,
# whose shift softmax cancels. Relative error against such a tensor is meaningless, so the error is taken
# relative to max(|expected|, NOISE_FLOOR).
NOISE_FLOOR = 1e-4


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor, noise_floor: float = NOISE_FLOOR) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(noise_floor))


def assert_matches(reference: dict[str, Any], results: list[dict[str, Any]], mesh: str, *, tolerance: float = 1e-5,
                   aliases: dict[str, str] | None = None, tolerances: dict[str, float] | None = None,
                   noise_floor: float = NOISE_FLOOR) -> None:
    """Loss, every gradient shard and every parameter shard after each step, on every rank.

    `aliases` maps a reference parameter name to the name the distributed module trains it under
    (a tied weight: torch.export keeps one of its names); `tolerances` overrides the bound per kind
    (losses, grads, params)."""
    aliases = aliases or {}
    bound = {"losses": tolerance, "grads": tolerance, "params": tolerance, **(tolerances or {})}
    parsed = autopar.Mesh.parse(mesh)
    for rank, result in enumerate(results):
        for step in range(len(reference["losses"])):
            error = max_relative_error(result["losses"][step], reference["losses"][step])
            assert error <= bound["losses"], f"rank {rank} step {step} loss rel err {error}"
            for kind in ("grads", "params"):
                for name, full in reference[kind][step].items():
                    name_here = aliases.get(name, name)
                    expected = local_tensor(full, result["placements"][name_here], parsed, rank,
                                            zero=result.get("zero", {}).get(name_here))
                    error = max_relative_error(result[kind][step][aliases.get(name, name)], expected, noise_floor)
                    assert error <= bound[kind], f"rank {rank} step {step} {kind} {name} rel err {error}"


def assert_ledger_equals_measured(results: list[dict[str, Any]]) -> None:
    """The static ledger's (kind, axis) -> (calls, bytes) equals what each step handed to the process groups."""
    for rank, result in enumerate(results):
        expected = {"forward": {}, "backward": {}, "optimizer": {}}
        for (phase, kind, axis), (calls, nbytes) in result["ledger"].items():
            side = expected[phase if phase in ("forward", "optimizer") else "backward"]
            old = side.get((kind, axis), (0, 0))
            side[(kind, axis)] = (old[0] + calls, old[1] + nbytes)
        for step, measured in enumerate(result["measured"]):
            assert measured == expected, f"rank {rank} step {step}: measured {measured} != ledger {expected}"


def assert_memory_equals_ledger(results: list[dict[str, Any]]) -> None:
    """Bytes held in parameters, buffers, gradients and optimizer state after a step equal the ledger,
    and so do the bytes autograd saved in the first forward (distinct storages, saved-tensor hooks)."""
    for rank, result in enumerate(results):
        measured, ledger = result["memory"]["measured"], result["memory"]["ledger"]
        for category, nbytes in measured.items():
            assert nbytes == ledger[category], f"rank {rank} {category}: measured {nbytes} != ledger {ledger[category]}"
