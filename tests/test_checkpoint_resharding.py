"""Resharding a checkpoint, then training: every target layout resumes the uninterrupted run.

A checkpoint written under dp=2×tp=2 FSDP+TP after 3 AdamW steps is loaded under dp=4 ZeRO-1,
dp=4 FSDP, tp=4 and dp=2×tp=2 ZeRO-1+TP and written again; each checkpoint, read into a plain
single-device GPT and AdamW without a process group (`load_into_model`: DCP assembles the whole
tensors from the saved boxes), holds bit-identical parameters and optimizer state, equal to the
writing job's `full_state_dict()` (all-gather, another path; a snapshot: training on does not
change it); each layout then takes 2 steps whose losses and parameters equal the uninterrupted
run's (rel <= 1e-5).
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.artifacts.checkpoint import load, save
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.numerics_checks import max_relative_error
from tests.test_checkpoint import _assert_identical, _whole, train

pytestmark = pytest.mark.timeout(300)

DENSE = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64, dropout=0.0)
DENSE_BATCHES = [example_batch(DENSE, batch=8, seed=step) for step in range(5)]
RESUMED_LAYOUTS = {
    "dp4_zero1": ("dp=4", lambda: [autopar.zero(stage=1)]),
    "dp4_fsdp": ("dp=4", lambda: [autopar.fsdp()]),
    "tp4": ("tp=4", lambda: [autopar.tensor_parallel()]),
    "dp2_tp2_zero1": ("dp=2,tp=2", lambda: [autopar.zero(stage=1), autopar.tensor_parallel()]),
}


def _dense_trainer(mesh: str, strategies: list, seed: int):
    torch.manual_seed(seed)
    module = autopar.parallelize(GPT(DENSE), mesh, strategies=strategies, example_inputs=DENSE_BATCHES[0])
    # eps=1e-3 as in tests/numerics.py: AdamW's first steps would otherwise amplify summation-order noise
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-3)


def _reshard_and_train(rank: int, world: int, root: str) -> dict:
    """dp=2×tp=2 FSDP+TP: 3 steps, save, 2 more (the uninterrupted run); then, per layout, a model
    of another seed loads the checkpoint, saves it again (`<root>/<layout>`) and takes the same 2 steps."""
    module, optimizer = _dense_trainer("dp=2,tp=2", [autopar.fsdp(), autopar.tensor_parallel()], seed=0)
    train(module, optimizer, DENSE_BATCHES[:3])
    save(f"{root}/step3", module, optimizer)
    runs = {"uninterrupted": {"loaded": module.full_state_dict()}}
    runs["uninterrupted"].update(losses=train(module, optimizer, DENSE_BATCHES[3:]), params=module.full_state_dict())
    for name, (mesh, strategies) in RESUMED_LAYOUTS.items():
        module, optimizer = _dense_trainer(mesh, strategies(), seed=1)
        load(f"{root}/step3", module, optimizer)
        save(f"{root}/{name}", module, optimizer)
        runs[name] = {"loaded": module.full_state_dict()}
        runs[name].update(losses=train(module, optimizer, DENSE_BATCHES[3:]), params=module.full_state_dict())
    return {name: run if rank == 0 else {"losses": run["losses"]} for name, run in runs.items()}


def test_a_checkpoint_reshards_into_every_layout_and_trains_on_like_the_uninterrupted_run(tmp_path):
    """Written under dp=2×tp=2 FSDP+TP after 3 AdamW steps, loaded under ZeRO-1 (dp=4 and dp=2×tp=2),
    FSDP (dp=4) and tp=4. Each layout's checkpoint written again right after loading, read whole
    into one process (DCP assembles the whole tensors from the saved boxes), holds parameters and
    AdamW state bit-identical to the original's, which equal the writing job's gathered
    `full_state_dict()` (all-gather, another path), as does each layout's right after loading.
    Loading must also leave each layout ready to train: ZeRO-1's replicated compute copies refreshed
    from the loaded shards, FSDP's and tensor-parallel shards cut right, AdamW's state in place. The
    losses of 2 resumed steps on every rank, and the parameters after them, equal the uninterrupted
    run's (fp32, relative error <= 1e-5: other layouts sum in other orders)."""
    results = launch(_reshard_and_train, 4, str(tmp_path), timeout_s=150)
    reference = results[0]["uninterrupted"]
    params, state = _whole(tmp_path / "step3", DENSE)
    assert len(state) == 3 * len(params)  # step, exp_avg, exp_avg_sq per parameter
    _assert_identical(params, {k: v for k, v in reference["loaded"].items() if k in params}, "written vs gathered")
    for name in RESUMED_LAYOUTS:
        again, again_state = _whole(tmp_path / name, DENSE)
        _assert_identical(params, again, f"parameters via {name}")
        _assert_identical(state, again_state, f"optimizer state via {name}")
        _assert_identical(params, {k: v for k, v in results[0][name]["loaded"].items() if k in params},
                          f"{name}'s gathered parameters after loading")
        for rank, result in enumerate(results):
            for step, (got, expected) in enumerate(zip(result[name]["losses"], result["uninterrupted"]["losses"]), 3):
                error = max_relative_error(got, expected)
                assert error <= 1e-5, f"{name}, rank {rank}, step {step}: loss {got} vs {expected} (rel {error:.1e})"
        for param, expected in reference["params"].items():
            error = max_relative_error(results[0][name]["params"][param], expected)
            assert error <= 1e-5, f"{name}: {param} after 2 resumed steps, rel err {error:.1e}"
