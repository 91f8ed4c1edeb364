"""Background checkpoint saves (`async_save`, `autopar/artifacts/checkpoint_async.py`) on real gloo
processes (world 2, dp=2 FSDP of a tiny GPT, AdamW).

- The snapshot: an async save, then more training steps that change parameters, AdamW's state (its
  `step` counter included) and an `extra` list in place, the write held until the first of them has
  run: the committed checkpoint equals a synchronous save taken at the same step, bit for bit, read
  whole into one process and loaded back by the ranks; the live state has moved on.
- The overlap: each rank's save is held after its shard files are written (phase "shards") while
  the rank takes a training step (its collectives on the default group): the step ran after
  `async_save` returned, on another thread than the save's phases, with the rank's shard files in
  the staging directory and the previous checkpoint still the committed one; the commit came after.
- Atomicity: a rank SIGKILLed at each phase of the background write while training goes on, as in
  tests/test_checkpoint.py's synchronous fault tests: the previous checkpoint loads bit-identically,
  the partial one is refused by name.
- Failures: `result()` raises a background save's failure; one never collected is raised by the
  next load; the previous checkpoint stays.
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import autopar
from autopar.artifacts import checkpoint_files as files
from autopar.artifacts.checkpoint import async_save, load, load_into_model, save
from autopar.core.errors import CheckpointError
from autopar.runtime.launch import launch
from examples.gpt import GPT, example_batch
from tests.test_checkpoint import (CRASHES, TINY, TINY_BATCH, _assert_equal, _assert_identical, _read_whole, _shifted,
                                   _tiny_module, _tiny_params, assert_what_a_crash_left)

pytestmark = pytest.mark.timeout(300)

BATCHES = [example_batch(TINY, batch=4, seed=step) for step in range(5)]
HOLD_S = 30.0  # how long a held phase waits for the training thread before going on regardless


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    """A runnable plan file of the tiny GPT under dp=2 FSDP: each launch below plans nothing."""
    path = tmp_path_factory.mktemp("async") / "plan"
    torch.manual_seed(0)
    tiny_plan = autopar.plan(GPT(TINY), "dp=2", strategies=[autopar.fsdp()], example_inputs=TINY_BATCH)
    autopar.save_runnable_plan(tiny_plan, path, model=GPT(TINY), example_inputs=TINY_BATCH,
                               strategies=[autopar.fsdp()])
    return path


def _trainer(plan: str):
    module = _tiny_module(plan)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return module, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _step(module, optimizer, scheduler, batch, losses: list) -> None:
    optimizer.zero_grad()
    loss = module(*module.local_batch(*batch))
    loss.backward()
    optimizer.step()
    scheduler.step()
    losses.append(loss.item())


def _local_state(module, optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards and AdamW state, copied."""
    names = {id(p): n for n, p in module.named_parameters()}
    state = {f"{names[id(p)]}.{k}": v.clone() for p, entries in optimizer.state.items() for k, v in entries.items()}
    return {**{n: p.detach().clone() for n, p in module.named_parameters()}, **state}


# ---- the snapshot: what an async save commits is the state of its step

def _extra_template(scheduler) -> dict:
    """What to read back of the saved `extra` (DCP fills a dict's keys, reads the rest whole)."""
    return {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(), "losses": []}


def _sync_and_async_at_one_step(rank: int, world: int, plan: str, root: str) -> dict:
    module, optimizer, scheduler = _trainer(plan)
    losses: list[float] = []
    for batch in BATCHES[:2]:
        _step(module, optimizer, scheduler, batch, losses)
    extra = {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(), "losses": losses}
    save(f"{root}/sync", module, optimizer, extra=extra)
    first_step_taken = threading.Event()

    def hold(phase: str) -> None:  # nothing is written before a step has changed the state in place
        if phase == "write":
            first_step_taken.wait(HOLD_S)

    pending = async_save(f"{root}/async", module, optimizer, extra=extra, on_phase=hold)
    _step(module, optimizer, scheduler, BATCHES[2], losses)  # losses grows in place too
    first_step_taken.set()
    _step(module, optimizer, scheduler, BATCHES[3], losses)  # beside the write
    pending.result()
    live = _local_state(module, optimizer)
    loaded = {}
    for name in ("sync", "async"):  # new ranks' modules and optimizers, loaded
        module, optimizer, scheduler = _trainer(plan)
        extra = load(f"{root}/{name}", module, optimizer, extra=_extra_template(scheduler))
        loaded[name] = {"state": _local_state(module, optimizer), "extra": extra}
    return {"live": live, "loaded": loaded}


def _whole_with_optimizer(path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    extra = load_into_model(path, model, optimizer, extra=_extra_template(scheduler))
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"{names[id(p)]}.{k}": v.clone() for p, entries in optimizer.state.items() for k, v in entries.items()}
    return {**{n: p.detach().clone() for n, p in model.named_parameters()}, **state,
            "extra.rng": extra["rng"], "extra.losses": torch.tensor(extra["losses"], dtype=torch.float64),
            "extra.lr": torch.tensor(extra["scheduler"]["_last_lr"], dtype=torch.float64)}


def test_an_async_save_commits_the_state_of_its_step_while_training_goes_on(plan, tmp_path):
    results = launch(_sync_and_async_at_one_step, 2, str(plan), str(tmp_path), timeout_s=120)
    sync, saved = _whole_with_optimizer(tmp_path / "sync"), _whole_with_optimizer(tmp_path / "async")
    assert "layers.0.mlp.up_proj.weight.exp_avg" in saved and "layers.0.mlp.up_proj.weight.step" in saved, sorted(saved)
    _assert_identical(saved, sync, "the async checkpoint, read whole, against the synchronous one")
    assert saved["extra.losses"].numel() == 2 and saved["extra.lr"].tolist() == [1e-2 / 4]
    for rank, result in enumerate(results):
        loaded = result["loaded"]
        _assert_identical(loaded["async"]["state"], loaded["sync"]["state"], f"rank {rank}: loaded by the ranks")
        ours, theirs = loaded["async"]["extra"], loaded["sync"]["extra"]
        assert torch.equal(ours.pop("rng"), theirs.pop("rng")) and ours == theirs, f"rank {rank}: {ours} != {theirs}"
        moved = [n for n, t in result["live"].items() if not torch.equal(t, loaded["sync"]["state"][n])]
        assert len(moved) == len(result["live"]), f"rank {rank}: training did not change {result['live'].keys() - moved}"


# ---- the overlap: a training step runs while the background save is between its write and its commit

def _step_during_the_save(rank: int, world: int, plan: str, path: str) -> dict:
    module, optimizer, scheduler = _trainer(plan)
    save(path, module, optimizer)
    previous = files.read_manifest(Path(path))["save_id"]
    log: list[tuple[str, str]] = []
    written, stepped = threading.Event(), threading.Event()

    def hold(phase: str) -> None:
        log.append((phase, threading.current_thread().name))
        if phase == "shards":  # this rank's shard files written; the metadata, manifest and commit to come
            written.set()
            stepped.wait(HOLD_S)

    pending = async_save(path, module, optimizer, on_phase=hold)
    log.append(("returned", threading.current_thread().name))
    written.wait(HOLD_S)
    _step(module, optimizer, scheduler, BATCHES[0], [])
    staging = files.staging_path(Path(path), pending.save_id)
    seen = {"own shards": sorted(p.name for p in staging.glob(f"__{pending.save_id}_{rank}_*.distcp")),
            "committed": files.read_manifest(Path(path))["save_id"], "done": pending.done()}
    log.append(("stepped", threading.current_thread().name))
    stepped.set()
    pending.result()
    return {"log": log, "seen": seen, "previous": previous, "save id": pending.save_id,
            "committed": files.read_manifest(Path(path))["save_id"]}


def test_training_steps_run_while_the_background_save_is_between_its_write_and_its_commit(plan, tmp_path):
    path = tmp_path / "ckpt"
    results = launch(_step_during_the_save, 2, str(plan), str(path), timeout_s=120)
    for rank, result in enumerate(results):
        log, seen = result["log"], result["seen"]
        order = [phase for phase, _ in log]
        main = dict(log)["returned"]
        assert order.index("returned") < order.index("stepped"), order
        assert order.index("shards") < order.index("stepped") < order.index("manifest"), order
        if rank == 0:
            assert order.index("stepped") < order.index("commit") < order.index("cleanup"), order
        assert all(thread != main for phase, thread in log if phase not in ("returned", "stepped")), log
        assert seen["own shards"] and not seen["done"], seen
        assert seen["committed"] == result["previous"] != result["save id"], seen
        assert result["committed"] == result["save id"]


# ---- atomicity: a rank killed during the background write

def _async_save_and_crash(rank: int, world: int, plan: str, path: str, existing: bool, phase: str,
                          victim: int) -> None:
    module = _tiny_module(plan)
    if existing:
        save(path, module)
    _shifted(module)

    def crash(reached: str) -> None:
        if reached == phase and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)

    pending = async_save(path, module, on_phase=crash)
    _shifted(module)  # training goes on: the live parameters move past B, the snapshot holds B
    module(*module.local_batch(*TINY_BATCH)).backward()
    pending.result()


@pytest.mark.parametrize("phase,victim,existing", CRASHES,
                         ids=[f"{p}-{'existing' if e else 'fresh'}" for p, _, e in CRASHES])
def test_a_background_save_killed_at_any_phase_leaves_the_previous_checkpoint_and_refuses_the_partial_one(
        plan, tmp_path, phase, victim, existing):
    """tests/test_checkpoint.py's fault test, the save in the background: until the rename that
    commits B, `path` loads A bit-identically (or, fresh, is refused by name); a staged save
    without its manifest is refused by name, one with it loads B (the snapshot, not the live state)."""
    path = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="exited abnormally|a rank failed"):
        launch(_async_save_and_crash, 2, str(plan), str(path), existing, phase, victim, timeout_s=60)
    assert_what_a_crash_left(tmp_path, phase, existing)


# ---- failures reach the caller

def _failing_saves(rank: int, world: int, plan: str, path: str) -> dict:
    module = _tiny_module(plan)
    save(path, module)

    def disk_full(phase: str) -> None:  # on every rank, after its shards: no rank waits for another
        if phase == "manifest":
            raise OSError(28, "No space left on device")

    _shifted(module)
    errors = {}
    try:
        async_save(path, module, on_phase=disk_full).result()
    except OSError as error:
        errors["result"] = f"{type(error).__name__}: {error}"
    async_save(path, module, on_phase=disk_full)  # its result() never called
    try:
        load(path, module)
    except CheckpointError as error:
        errors["next load"] = str(error)
    load(path, module)  # every rank still in step: the load after the raised one works
    return errors


def test_a_failed_background_save_is_raised_by_result_or_else_by_the_next_load(plan, tmp_path):
    path = tmp_path / "ckpt"
    results = launch(_failing_saves, 2, str(plan), str(path), timeout_s=120)
    for result in results:
        assert result["result"] == "OSError: [Errno 28] No space left on device", result
        assert result["next load"].startswith(f"the background save into {path} (async_save) failed and its "
                                              f"result() was never called: "), result["next load"]
        assert "No space left on device" in result["next load"]
    _assert_equal(_read_whole(path), _tiny_params(), "A, after two failed saves")
