"""Sharded checkpoints (`autopar/artifacts/checkpoint.py`, DCP format) on real gloo processes.

- Resharding, then training: tests/test_checkpoint_resharding.py.
- Exact resume: 3 steps, save, new processes load, 2 more steps: every loss equals the
  uninterrupted 5-step run's bit for bit, with dropout 0.1 (the generator's state and a StepLR
  scheduler's saved as `extra`).
- Atomic saves: a rank SIGKILLs itself at each phase of a save (`save(..., on_phase=...)`), into a
  directory holding a checkpoint and into a fresh one; the previous checkpoint still loads
  bit-identically, the partial one is refused by name; after a kill between commit's two renames
  `load` finds the previous checkpoint and the next save cleans up.
- Refusals, each a `CheckpointError` (an `Exception`) naming the file: a wrong model (wider,
  deeper, shallower, an `nn.Linear`; `strict=False` loads what matches), a file of another save,
  a flipped byte, a truncated or missing shard, a corrupt header with verification off, a save
  over a directory that holds no checkpoint.
- Export: a Hugging Face Llama trained under tp=2, its `full_state_dict()` loaded strictly into the
  user's model and written by `save_pretrained`, reloads with `from_pretrained` bit-identically.
"""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import autopar
from autopar.artifacts.checkpoint import load, load_into_model, save
from autopar.core.errors import CheckpointError
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch

pytestmark = pytest.mark.timeout(300)

# dropout on: resuming must restore the generator too (passed as `extra`, with the LR scheduler)
CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64, dropout=0.1)
BATCHES = [example_batch(CONFIG, batch=8, seed=step) for step in range(5)]
LAYOUTS = {
    "dp2_tp2_fsdp": ("dp=2,tp=2", lambda: [autopar.fsdp(), autopar.tensor_parallel()]),
}


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _trainer(layout: str):
    mesh, strategies = LAYOUTS[layout]
    module = autopar.parallelize(build(), mesh, strategies=strategies(), example_inputs=BATCHES[0])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return module, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def train(module, optimizer, batches, scheduler=None) -> list[torch.Tensor]:
    """One AdamW step per batch (and the scheduler's, if any); the losses."""
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = module(*module.local_batch(*batch))
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.detach().clone())
    return losses


def _extra(scheduler) -> dict:
    return {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}


def _write(rank: int, world: int, layout: str, path: str, steps: int) -> dict:
    module, optimizer, scheduler = _trainer(layout)
    losses = train(module, optimizer, BATCHES[:steps], scheduler)
    save(path, module, optimizer, extra=_extra(scheduler))
    return {"losses": losses, "full": module.full_state_dict()}


def _resume(rank: int, world: int, layout: str, source: str, first: int) -> dict:
    module, optimizer, scheduler = _trainer(layout)
    extra = load(source, module, optimizer, extra=_extra(scheduler))
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    return {"losses": train(module, optimizer, BATCHES[first:], scheduler), "lr": optimizer.param_groups[0]["lr"]}


def _whole(path, config: GPTConfig = CONFIG) -> tuple[dict, dict]:
    """Parameters and AdamW state of a checkpoint, read whole into one process."""
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_into_model(path, model, optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"{names[id(p)]}.{k}": v.clone() for p, entries in optimizer.state.items() for k, v in entries.items()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def _assert_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())[:4]}"
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


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


# ---- atomic saves: a rank killed at each phase of a save; what loads afterwards

TINY = GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16, d_ff=32, dropout=0.0)
WIDE = GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=32, d_ff=32, dropout=0.0)
DEEP = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16, d_ff=32, dropout=0.0)
TINY_BATCH = example_batch(TINY, batch=4, seed=0)
# (phase, the rank killed there): `save`'s phases in order; rank 0 alone reaches metadata and commit's.
# Into a fresh directory there is nothing to set aside: no "swap" or "cleanup".
PHASES = [("write", 1), ("shards", 1), ("metadata", 0), ("manifest", 1), ("commit", 0), ("swap", 0), ("cleanup", 0)]
CRASHES = [(phase, victim, existing) for existing in (True, False) for phase, victim in PHASES
           if existing or phase not in ("swap", "cleanup")]


def _tiny_params(config: GPTConfig = TINY, shift: float = 0.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach() + shift for n, p in GPT(config).named_parameters()}


def _tiny_module(plan: str, config: GPTConfig = TINY):
    torch.manual_seed(0)
    return autopar.parallelize(GPT(config), strategies=[autopar.fsdp()], plan_file=plan)


def _shifted(module) -> None:
    """Save B of the fault tests: every saved entry of save A plus one, exactly."""
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1.0)


def _read_whole(path, config: GPTConfig = TINY, **options) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = GPT(config)
    load_into_model(path, model, **options)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """Runnable plan files of the tiny GPTs under dp=2 FSDP (each launch below then plans nothing), and
    two committed checkpoints of the tiny GPT: "a" (as built, seed 0), "b" (every entry plus one)."""
    root = tmp_path_factory.mktemp("tiny")
    for name, config in (("plan", TINY), ("wide_plan", WIDE), ("deep_plan", DEEP)):
        torch.manual_seed(0)
        plan = autopar.plan(GPT(config), "dp=2", strategies=[autopar.fsdp()], example_inputs=TINY_BATCH)
        autopar.save_runnable_plan(plan, root / name, model=GPT(config), example_inputs=TINY_BATCH,
                                   strategies=[autopar.fsdp()])
    refusals = launch(_save_a_and_b, 2, str(root / "plan"), str(root), timeout_s=60)
    return {"root": root, "plan": root / "plan", "wide_plan": root / "wide_plan", "deep_plan": root / "deep_plan",
            "a": root / "a", "b": root / "b", "refusals": refusals[0]}


def _save_a_and_b(rank: int, world: int, plan: str, root: str) -> list[str]:
    module = _tiny_module(plan)
    save(f"{root}/a", module)
    _shifted(module)
    save(f"{root}/b", module)
    Path(f"{root}/not_a_checkpoint").mkdir(exist_ok=True)
    if rank == 0:
        Path(f"{root}/not_a_checkpoint/notes.txt").write_text("the user's own file")
        Path(f"{root}/a_file").write_text("")
    refusals = []
    for target in ("not_a_checkpoint", "a_file"):
        torch.distributed.barrier()
        try:
            save(f"{root}/{target}", module)
        except Exception as error:  # CheckpointError, on every rank
            refusals.append(f"{type(error).__name__}: {error}")
    return refusals


def _save_and_crash(rank: int, world: int, plan: str, path: str, existing: bool, phase: str, victim: int) -> None:
    module = _tiny_module(plan)
    if existing:
        save(path, module)
    _shifted(module)

    def crash(reached: str) -> None:
        if reached == phase and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)

    save(path, module, on_phase=crash)


def _assert_equal(found: dict, expected: dict, what: str) -> None:
    assert found.keys() == expected.keys(), what
    for name in expected:
        assert torch.equal(found[name], expected[name]), f"{what}: {name} differs"


def _assert_refused(path: Path, *words: str) -> str:
    with pytest.raises(CheckpointError) as error:
        load_into_model(path, GPT(TINY))
    text = str(error.value)
    assert f"checkpoint {path} " in text and any(word in text for word in words), text
    return text


@pytest.mark.parametrize("phase,victim,existing", CRASHES,
                         ids=[f"{p}-{'existing' if e else 'fresh'}" for p, _, e in CRASHES])
def test_a_save_killed_at_any_phase_leaves_the_previous_checkpoint_and_refuses_the_partial_one(
        tiny, tmp_path, phase, victim, existing):
    """A rank SIGKILLs itself at `phase` of saving B into a directory holding A (existing) or
    nothing (fresh). Until the rename that commits B, `path` loads A bit-identically (after a kill
    between the two renames, from where A was set aside) or, fresh, is refused by name as
    incomplete; a staged save without its manifest is refused by name; a staged save with its
    manifest (killed at or after "commit") is complete and loads B."""
    path = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="exited abnormally|a rank failed"):
        launch(_save_and_crash, 2, str(tiny["plan"]), str(path), existing, phase, victim, timeout_s=30)
    assert_what_a_crash_left(tmp_path, phase, existing)


def assert_what_a_crash_left(tmp_path: Path, phase: str, existing: bool) -> None:
    """After a rank died at `phase` of saving B into `tmp_path / "ckpt"` (holding A when `existing`):
    the path loads A (B once committed), or, fresh, is refused by name; a staged save is complete
    (B) from "commit" on, refused by name as incomplete before."""
    path = tmp_path / "ckpt"
    a, b = _tiny_params(), _tiny_params(shift=1.0)
    if phase == "cleanup":
        _assert_equal(_read_whole(path), b, "committed B")
    elif existing:
        _assert_equal(_read_whole(path), a, f"A after a kill at {phase}")
    else:
        _assert_refused(path, "incomplete", "does not exist")
    staged = sorted(tmp_path.glob("ckpt.tmp-*"))
    assert staged or phase in ("write", "cleanup"), list(tmp_path.iterdir())
    for partial in staged:
        if phase in ("commit", "swap"):
            _assert_equal(_read_whole(partial), b, "the staged, complete B")
        else:
            assert "is incomplete" in _assert_refused(partial, "incomplete")


def _refusal(source: str, module) -> str | None:
    try:
        load(source, module)
    except Exception as error:  # CheckpointError on every rank
        return f"{type(error).__name__}: {error}"
    return None


def _saved_and_reloaded(rank: int, world: int, plans: dict[str, str], path: str, other: str) -> dict:
    """After a kill between commit's two renames (A set aside, B staged): `load` finds A; the tiny
    plan refuses a wider GPT's checkpoint (shapes), a deeper GPT's plan the tiny checkpoint
    (missing entries) unless strict=False, on every rank; the next save commits and removes what
    the interrupted one left."""
    module = _tiny_module(plans["plan"])
    _shifted(module)
    load(path, module)
    loaded = {n: p.detach().clone() for n, p in module.named_parameters()}
    save(other, _tiny_module(plans["wide_plan"], WIDE))
    deep = _tiny_module(plans["deep_plan"], DEEP)
    refusals = {"wide": _refusal(other, module), "deep": _refusal(path, deep)}
    _shifted(deep)
    load(path, deep, strict=False)
    save(path, module)
    reference = _tiny_module(plans["plan"])
    return {"loaded": loaded, "reference": {n: p.detach().clone() for n, p in reference.named_parameters()},
            "deep": {n: p.detach().clone() for n, p in deep.named_parameters()}, "refusals": refusals,
            "left": sorted(p.name for p in Path(path).parent.iterdir())}


def test_load_after_a_kill_between_the_renames_finds_the_previous_checkpoint_and_the_next_save_cleans_up(
        tiny, tmp_path):
    path = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="exited abnormally|a rank failed"):
        launch(_save_and_crash, 2, str(tiny["plan"]), str(path), True, "swap", 0, timeout_s=30)
    plans = {name: str(tiny[name]) for name in ("plan", "wide_plan", "deep_plan")}
    results = launch(_saved_and_reloaded, 2, plans, str(path), str(tmp_path / "wide"), timeout_s=60)
    for rank, result in enumerate(results):
        _assert_equal(result["loaded"], result["reference"], f"rank {rank}: A's shards loaded")
        wide, deep = result["refusals"]["wide"], result["refusals"]["deep"]
        assert wide.startswith(f"CheckpointError: checkpoint {tmp_path / 'wide'} does not fit the model: ")
        assert "shapes differ: embed_positions.weight (checkpoint [8, 32], model [8, 16])" in wide, wide
        assert deep.startswith(f"CheckpointError: checkpoint {path}.old-"), deep  # where A was set aside
        assert " does not fit the model: missing from the checkpoint: layers.1.attn.k_proj.bias, " in deep, deep
        matching = {n: t for n, t in result["deep"].items() if not n.startswith("layers.1.")}
        _assert_equal(matching, result["reference"], f"rank {rank}: strict=False loads the matching shards")
    assert results[0]["left"] == ["ckpt", "wide"]
    _assert_equal(_read_whole(path), _tiny_params(), "A saved again")


def test_a_save_refuses_to_replace_what_is_not_a_checkpoint(tiny):
    not_checkpoint, a_file = tiny["refusals"]
    assert not_checkpoint.startswith("CheckpointError: cannot save a checkpoint to ")
    assert "not_a_checkpoint: it is a directory that holds no checkpoint" in not_checkpoint
    assert (tiny["root"] / "not_a_checkpoint" / "notes.txt").read_text() == "the user's own file"
    assert "a_file: it is a file" in a_file


# ---- strict loads: the wrong model is refused, naming what does not fit

@pytest.mark.parametrize("model,words", [
    (lambda: GPT(WIDE), ["shapes differ: ", "embed_tokens.weight (checkpoint [64, 16], model [64, 32])"]),
    (lambda: GPT(GPTConfig(**{**TINY.__dict__, "n_layer": 2})), ["missing from the checkpoint: layers.1."]),
    (lambda: GPT(GPTConfig(**{**TINY.__dict__, "n_layer": 0})), ["not in the model: layers.0."]),
    (lambda: torch.nn.Linear(16, 16), ["missing from the checkpoint: bias, weight",
                                       "not in the model: embed_positions.weight"]),
], ids=["wider", "deeper", "shallower", "linear"])
def test_load_into_the_wrong_model_is_refused_naming_the_entries(tiny, model, words):
    target = model()
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    with pytest.raises(CheckpointError) as error:
        load_into_model(tiny["a"], target)
    text = str(error.value)
    assert text.startswith(f"checkpoint {tiny['a']} does not fit the model: ") and "strict=False" in text, text
    assert all(word in text for word in words), text
    _assert_equal({n: p.detach() for n, p in target.named_parameters()}, before, "the refused model is untouched")


def test_strict_false_loads_the_entries_that_match_and_still_refuses_other_shapes(tiny):
    deeper = GPTConfig(**{**TINY.__dict__, "n_layer": 2})
    loaded, a = _read_whole(tiny["a"], deeper, strict=False), _tiny_params()
    _assert_equal({n: t for n, t in loaded.items() if n in a}, a, "the matching entries")
    torch.manual_seed(1)
    untouched = {n: p.detach() for n, p in GPT(deeper).named_parameters() if n not in a}
    _assert_equal({n: t for n, t in loaded.items() if n not in a}, untouched, "layers.1, not in the checkpoint")
    with pytest.raises(CheckpointError, match="shapes differ"):
        load_into_model(tiny["a"], GPT(WIDE), strict=False)


# ---- one save per checkpoint, verified: mixed, corrupt and truncated files are refused by name

def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.distcp"))


def _mix_a_shard_of_b(a: Path, b: Path) -> Path:
    """A's metadata and manifest, one of its shard files replaced by B's (renamed to A's name)."""
    shutil.copyfile(_shards(b)[1], _shards(a)[1])
    return _shards(a)[1]


def _mix_the_manifest_of_b(a: Path, b: Path) -> Path:
    shutil.copyfile(b / "autopar_manifest.json", a / "autopar_manifest.json")
    return a / ".metadata"


def _mix_the_metadata_of_b(a: Path, b: Path) -> Path:
    shutil.copyfile(b / ".metadata", a / ".metadata")
    return a / ".metadata"


def _flip_a_byte(a: Path, b: Path) -> Path:
    shard = _shards(a)[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard


def _truncate(a: Path, b: Path) -> Path:
    shard = _shards(a)[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    return shard


def _remove_a_shard(a: Path, b: Path) -> Path:
    shard = _shards(a)[0]
    shard.unlink()
    return shard


@pytest.mark.parametrize("damage,cause", [
    (_mix_a_shard_of_b, "is corrupt: its CRC-32 is"),
    (_mix_the_manifest_of_b, "the directory mixes two saves"),
    (_mix_the_metadata_of_b, "the directory mixes two saves"),
    (_flip_a_byte, "is corrupt: its CRC-32 is"),
    (_truncate, "is corrupt: it holds"),
    (_remove_a_shard, "is missing"),
], ids=["shard-of-another-save", "manifest-of-another-save", "metadata-of-another-save", "flipped-byte",
        "truncated", "missing-shard"])
def test_a_checkpoint_whose_files_are_not_one_intact_save_is_refused_naming_the_file(tiny, tmp_path, damage, cause):
    a = _copy(tiny["a"], tmp_path / "a")
    named = damage(a, tiny["b"])
    try:
        load_into_model(a, GPT(TINY))
    except Exception as error:  # the point: catchable as Exception, unlike DCP's CheckpointException
        assert isinstance(error, CheckpointError), repr(error)
        assert f"checkpoint {named} " in str(error) and cause in str(error), str(error)
    else:
        pytest.fail(f"{damage.__name__}: loaded without an error")


def test_without_verification_a_corrupt_header_still_names_the_file(tiny, tmp_path):
    """verify=False skips the CRC-32s: a flipped byte in a shard's pickle header then fails inside
    DCP (its CheckpointException, a BaseException, around torch.load's weights-only error) and
    still reaches the user as CheckpointError naming the file."""
    a = _copy(tiny["a"], tmp_path / "a")
    shard = _shards(a)[0]
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as error:
        load_into_model(a, GPT(TINY), verify=False)
    assert str(error.value).startswith(f"checkpoint {shard} is corrupt: "), str(error.value)
    assert "CheckpointException" not in str(error.value)
