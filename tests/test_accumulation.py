"""Gradient accumulation has one device's semantics under every strategy: any number of backward
passes between optimizer steps add up their gradients, whether they synchronise or not.

Each case trains the example GPT (or the example MoE under expert parallelism) with library
defaults, only sizes changed, through a script of optimizer steps, each with its own way of
accumulating (`SCRIPT`):
- `twice`: two forwards and two synchronising `backward()` calls, as DDP users accumulate;
- `retain`: one forward, `backward(retain_graph=True)` then `backward()`: twice the gradient;
- `no_sync`: the first backward under `ParallelModule.no_sync()`, the last one synchronising;
- `mixed`: a synchronising backward, one under `no_sync()`, a synchronising one;
and the optimizer's `zero_grad` alternates between `set_to_none=True` and `False`. A pipeline
module accumulates over `train_step` calls (`PIPELINE_SCRIPT`: two before each step).
After every step each rank's losses, whole gradients and whole parameters equal the one-device
run of the same script at fp32 rel <= 1e-5 (`tests/numerics_checks.assert_matches`), and the
collectives of the `twice` and `no_sync` steps of a module without a pipeline (counted by
`autopar.measure.comm_counter.CommCounter`) equal the communication ledger's accumulation view:
keeping accumulation exact adds no collective.

The cases of one world size share one launch (process start-up is most of a small case's time).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import pytest
import torch

import autopar
from autopar.measure.comm_counter import CommCounter
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from examples.moe import MoEConfig, MoEGPT
from tests.numerics import comparison_mesh, parallel_trainer, reference_trainer, whole_tensors
from tests.numerics_checks import assert_matches

GPT_CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
MOE_CONFIG = MoEConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, n_experts=4, top_k=2, d_expert=32)
BATCH = 4
MICROBATCHES = 2  # of a pipeline step
# The key projection's bias has a gradient softmax cancels: rounding noise (|g| ~ 5e-10 here), which
# the harness's noise floor of 1e-4 turns into relative errors up to 9.8e-6 once two or three backward
# passes have added their noise (measured, with the fix; every other gradient agrees to ~1e-7). A floor
# of 1e-3 keeps the bound meaningful; an accumulation that counts a gradient twice is off by ~100%.
NOISE_FLOOR = 1e-3

# (how the step accumulates, zero_grad's set_to_none) per optimizer step
SCRIPT = [("twice", True), ("twice", False), ("retain", True), ("no_sync", False), ("mixed", True)]
PIPELINE_SCRIPT = [("twice", True), ("twice", False)]
FORWARDS = {"twice": 2, "retain": 1, "no_sync": 2, "mixed": 3}  # per step, one batch each
# the steps whose collectives the ledger's accumulation view models: whether under no_sync
LEDGER_VIEWS = {"twice": False, "no_sync": True}

CASES: dict[str, tuple[str, str, list]] = {
    "dp2": ("gpt", "dp=2", [autopar.data_parallel()]),
    "zero1_dp2": ("gpt", "dp=2", [autopar.zero(stage=1)]),
    "zero2_dp2": ("gpt", "dp=2", [autopar.zero(stage=2)]),
    "zero3_dp2": ("gpt", "dp=2", [autopar.zero(stage=3)]),
    "tp2_sp": ("gpt", "tp=2", [autopar.sequence_parallel()]),
    "cp2": ("gpt", "cp=2", [autopar.context_parallel()]),
    "ep2": ("moe", "ep=2", [autopar.expert_parallel()]),
    "dp2_tp2": ("gpt", "dp=2,tp=2", [autopar.data_parallel(), autopar.tensor_parallel()]),
    "fsdp_dp2_tp2_sp": ("gpt", "dp=2,tp=2", [autopar.fsdp(), autopar.sequence_parallel()]),
    "dp2_cp2": ("gpt", "dp=2,cp=2", [autopar.data_parallel(), autopar.context_parallel()]),  # one dp+cp group
    # the data-parallel axis gives the stages' gradients something to synchronise
    "pp2_dp2_1f1b": ("gpt", "pp=2,dp=2", [autopar.pipeline_parallel(schedule="1f1b", microbatches=MICROBATCHES),
                                          autopar.data_parallel()]),
    "pp2_dp2_zb_h1": ("gpt", "pp=2,dp=2", [autopar.pipeline_parallel(schedule="zb_h1", microbatches=MICROBATCHES),
                                           autopar.data_parallel()]),
}
BUILDS: dict[str, Callable[[], torch.nn.Module]] = {"gpt": functools.partial(GPT, GPT_CONFIG),
                                                    "moe": functools.partial(MoEGPT, MOE_CONFIG)}


def _pipelined(name: str) -> bool:
    return CASES[name][1].startswith("pp")


def _script(pipelined: bool) -> list[tuple[str, bool]]:
    return PIPELINE_SCRIPT if pipelined else SCRIPT


def _batches(model: str, pipelined: bool) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, one global batch per forward."""
    config = MOE_CONFIG if model == "moe" else GPT_CONFIG
    return [[example_batch(config, batch=BATCH, seed=10 * step + k) for k in range(FORWARDS[how])]
            for step, (how, _) in enumerate(_script(pipelined))]


def _accumulate(how: str, forward: Callable[[Any], torch.Tensor], batches: list, no_sync: Callable) -> list:
    """One step's backward passes, `how` the script says; returns their losses."""
    if how == "retain":
        loss = forward(batches[0])
        loss.backward(retain_graph=True)
        loss.backward()
        return [loss.detach()]
    losses = []
    for k, batch in enumerate(batches):
        local = (how == "no_sync" and k < len(batches) - 1) or (how == "mixed" and k == 1)
        with no_sync() if local else contextlib.nullcontext():
            loss = forward(batch)
            loss.backward()
        losses.append(loss.detach())
    return losses


@functools.cache
def one_device(model: str, pipelined: bool) -> dict[str, list]:
    """The script on one device. A pipeline's `train_step` is its micro-batches' losses / m
    accumulated: the reference computes the same."""
    reference, optimizer = reference_trainer(BUILDS[model])
    microbatches = MICROBATCHES if pipelined else 1

    def forward(batch: tuple) -> torch.Tensor:
        pieces = [reference(*micro) / microbatches for micro in zip(*(t.chunk(microbatches) for t in batch))]
        return torch.stack(pieces).sum()

    result: dict[str, list] = {"losses": [], "grads": [], "params": []}
    for (how, set_to_none), batches in zip(_script(pipelined), _batches(model, pipelined)):
        optimizer.zero_grad(set_to_none=set_to_none)
        result["losses"] += _accumulate(how, forward, batches, contextlib.nullcontext)
        result["grads"].append({n: p.grad.detach().clone() for n, p in reference.named_parameters()})
        optimizer.step()
        result["params"].append({n: p.detach().clone() for n, p in reference.named_parameters()})
    return result


def _rank_case(rank: int, world: int, name: str) -> dict[str, list]:
    """The script on this rank; whole gradients (before the step) and parameters (after it)."""
    model, mesh, strategies = CASES[name]
    pipelined = _pipelined(name)
    batches = _batches(model, pipelined)
    module, optimizer = parallel_trainer(BUILDS[model], batches[0][0], mesh, strategies)
    check = comparison_mesh(module)

    if pipelined:
        def forward_backward(batch: tuple) -> torch.Tensor:
            return module.train_step(*module.local_batch(*batch))

        def step_losses(how: str, step_batches: list) -> list:
            return [forward_backward(batch) for batch in step_batches]
    else:
        def step_losses(how: str, step_batches: list) -> list:
            return _accumulate(how, lambda batch: module(*module.local_batch(*batch)), step_batches, module.no_sync)

    group_to_axis = module.group_keys()
    result: dict[str, list] = {"losses": [], "grads": [], "params": [], "comm": []}
    for (how, set_to_none), step_batches in zip(_script(pipelined), batches):
        optimizer.zero_grad(set_to_none=set_to_none)
        counted = how in LEDGER_VIEWS and not pipelined
        with CommCounter() if counted else contextlib.nullcontext() as counter:
            result["losses"] += step_losses(how, step_batches)
        if counted:
            result["comm"].append((how, _routed_calls_only(counter.by_key(group_to_axis)),
                                   _routed_calls_only(_ledger(module, how, len(step_batches)))))
        result["grads"].append(whole_tensors(module, check, grads=True))
        optimizer.step()
        result["params"].append(whole_tensors(module, check, grads=False))
    return result


def _ledger(module: Any, how: str, passes: int) -> dict[tuple[str, str], tuple[int, int]]:
    """The communication ledger's forward and backward passes of a step accumulated `how`:
    (kind, axis) -> (calls, bytes)."""
    expected: dict[tuple[str, str], tuple[int, int]] = {}
    for (phase, kind, axis), (calls, nbytes) in module.plan.comm.accumulation(
            micro_batches=passes, no_sync=LEDGER_VIEWS[how]).items():
        if phase != "optimizer":
            old = expected.get((kind, axis), (0, 0))
            expected[(kind, axis)] = (old[0] + calls, old[1] + nbytes)
    return expected


def _routed_calls_only(comm: dict[tuple[str, str], tuple[int, int]]) -> dict[tuple[str, str], tuple[int, ...]]:
    """Expert parallelism's all-to-alls move as many rows as the routing sends (tests/test_moe.py
    checks their bytes against the recorded routing): their calls are compared, not their bytes."""
    return {(kind, axis): (calls,) if (kind, axis) == ("all_to_all", "ep") else (calls, nbytes)
            for (kind, axis), (calls, nbytes) in comm.items()}


def run_cases(rank: int, world: int, names: list[str]) -> list[dict]:
    return [_rank_case(rank, world, name) for name in names]


def _check(world: int) -> None:
    names = [name for name in CASES if autopar.Mesh.parse(CASES[name][1]).world_size == world]
    per_rank = launch(run_cases, world, names, timeout_s=120 * len(names))
    failures = []
    for index, name in enumerate(names):
        try:
            reference = one_device(CASES[name][0], _pipelined(name))
            assert_matches(reference, [rank_results[index] for rank_results in per_rank], noise_floor=NOISE_FLOOR)
            for rank, rank_results in enumerate(per_rank):
                for how, measured, expected in rank_results[index]["comm"]:
                    assert measured == expected, f"rank {rank} step {how!r}: counted {measured}, ledger {expected}"
        except AssertionError as error:
            failures.append(f"{name} ({CASES[name][1]}): {error}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_accumulating_backward_passes_equals_one_device(world):
    """Every case of CASES on `world` ranks (see the module docstring)."""
    _check(world)
