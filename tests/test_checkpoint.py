"""Sharded checkpoints (`autopar/artifacts/checkpoint.py`, DCP format) on real gloo processes.

- Resharding: a checkpoint written under dp=2×tp=2 FSDP+TP after 2 AdamW steps is loaded under
  tp=4 and under dp=4 ZeRO-1 and written again; each checkpoint, read into a plain single-device
  GPT and AdamW without a process group (`load_into_model`: DCP assembles the whole tensors from
  the saved boxes), holds bit-identical parameters and optimizer state, and the parameters equal
  the writing job's `full_state_dict()` (gathered by all-gather, another path).
- Exact resume: 3 steps, save, new processes load, 2 more steps: every loss equals the
  uninterrupted 5-step run's bit for bit, with dropout 0.1 (the generator's state and a StepLR
  scheduler's saved as `extra`).
- Export: a Hugging Face Llama trained under tp=2, its `full_state_dict()` loaded strictly into the
  user's model and written by `save_pretrained`, reloads with `from_pretrained` bit-identically.
"""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.artifacts.checkpoint import load, load_into_model, save
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch

pytestmark = pytest.mark.timeout(300)

# dropout on: resuming must restore the generator too (passed as `extra`, with the LR scheduler)
CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64, dropout=0.1)
BATCHES = [example_batch(CONFIG, batch=8, seed=step) for step in range(5)]
LAYOUTS = {
    "dp2_tp2_fsdp": ("dp=2,tp=2", lambda: [autopar.fsdp(), autopar.tensor_parallel()]),
    "tp4": ("tp=4", lambda: [autopar.tensor_parallel()]),
    "dp4_zero1": ("dp=4", lambda: [autopar.zero(stage=1)]),
}


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _trainer(layout: str):
    mesh, strategies = LAYOUTS[layout]
    module = autopar.parallelize(build(), mesh, strategies=strategies(), example_inputs=BATCHES[0])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return module, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _train(module, optimizer, scheduler, batches) -> list[torch.Tensor]:
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = module(*module.local_batch(*batch))
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach().clone())
    return losses


def _extra(scheduler) -> dict:
    return {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}


def _write(rank: int, world: int, layout: str, path: str, steps: int) -> dict:
    module, optimizer, scheduler = _trainer(layout)
    losses = _train(module, optimizer, scheduler, BATCHES[:steps])
    save(path, module, optimizer, extra=_extra(scheduler))
    return {"losses": losses, "full": module.full_state_dict()}


def _reshard(rank: int, world: int, layout: str, source: str, path: str) -> dict:
    module, optimizer, scheduler = _trainer(layout)
    load(source, module, optimizer)
    save(path, module, optimizer)
    return {"full": module.full_state_dict()}


def _resume(rank: int, world: int, layout: str, source: str, first: int) -> dict:
    module, optimizer, scheduler = _trainer(layout)
    extra = load(source, module, optimizer, extra=_extra(scheduler))
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    return {"losses": _train(module, optimizer, scheduler, BATCHES[first:]), "lr": optimizer.param_groups[0]["lr"]}


def _whole(path) -> tuple[dict, dict]:
    """Parameters and AdamW state of a checkpoint, read whole into one process."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_into_model(path, model, optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"{names[id(p)]}.{k}": v.clone() for p, entries in optimizer.state.items() for k, v in entries.items()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def _assert_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())[:4]}"
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


def test_a_checkpoint_reshards_across_meshes_bit_identically(tmp_path):
    written = launch(_write, 4, "dp2_tp2_fsdp", str(tmp_path / "a"), 2, timeout_s=150)
    params, state = _whole(tmp_path / "a")
    assert len(state) == 3 * len(params)  # step, exp_avg, exp_avg_sq per parameter
    _assert_identical(params, {k: v for k, v in written[0]["full"].items() if k in params}, "written vs gathered")
    for layout in ("tp4", "dp4_zero1"):
        resharded = launch(_reshard, 4, layout, str(tmp_path / "a"), str(tmp_path / layout), timeout_s=150)
        again, again_state = _whole(tmp_path / layout)
        _assert_identical(params, again, f"parameters via {layout}")
        _assert_identical(state, again_state, f"optimizer state via {layout}")
        _assert_identical(params, {k: v for k, v in resharded[0]["full"].items() if k in params},
                          f"{layout}'s gathered parameters")


def test_resume_after_a_checkpoint_equals_an_uninterrupted_run(tmp_path):
    """Also the learning rate the scheduler reached (1e-2 halved at steps 2 and 4)."""
    uninterrupted = launch(_write, 4, "dp2_tp2_fsdp", str(tmp_path / "all"), 5, timeout_s=150)
    launch(_write, 4, "dp2_tp2_fsdp", str(tmp_path / "three"), 3, timeout_s=150)
    resumed = launch(_resume, 4, "dp2_tp2_fsdp", str(tmp_path / "three"), 3, timeout_s=150)
    for rank in range(4):
        expected = uninterrupted[rank]["losses"][3:]
        got = resumed[rank]["losses"]
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(expected, got)), f"rank {rank}: {got} != {expected}"
        assert resumed[rank]["lr"] == 1e-2 / 4


def _export_hf(rank: int, world: int, path: str) -> dict:
    from examples.hf_models import tiny_llama, token_batch

    torch.manual_seed(0)
    batch = token_batch(batch=4, seq=16)
    module = autopar.parallelize(tiny_llama(kv_heads=2), "tp=2", strategies=[autopar.tensor_parallel()],
                                 example_inputs=batch)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(*module.local_batch(*batch)).backward()
    optimizer.step()
    full = module.full_state_dict()
    if rank == 0:  # export: the user's own model class, loaded strictly, saved by transformers
        model = tiny_llama(kv_heads=2)
        model.load_state_dict(full)
        model.model.save_pretrained(path)
    torch.distributed.barrier()
    return {"full": full}


def test_a_hugging_face_model_exported_from_full_state_dict_reloads_with_from_pretrained(tmp_path, transformers):
    from transformers import LlamaForCausalLM

    full = launch(_export_hf, 2, str(tmp_path / "hf"), timeout_s=150)[0]["full"]
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, full[f"model.{name}"]), name
