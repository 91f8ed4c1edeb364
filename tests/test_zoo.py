"""The zoo: Hugging Face causal LMs as a new user builds them, trained by autopar on gloo processes.

Each architecture comes from a small config with every other default left as shipped
(`examples.hf_models.tiny_causal_lm`: `use_cache`, tied embeddings, padding index, attention
implementation untouched). Under each mesh of `CONFIGS` it must train like one device (losses,
whole gradients and parameters after each AdamW step, reassembled independently of autopar's
slicing by `tests/numerics.distributed_rank`, fp32 rel <= 1e-5; ledger == bytes handed to the
process groups in every phase; AdamW's eps is `ZOO_EPS`), its `full_state_dict()` must load
strictly into the original model with the trained values (memory is the numerics tests' to check,
not the zoo's: no memory ledger is built here), and on dense architectures tensor
parallelism must be found in the graph; or it is refused at plan time, where `REFUSED` says so,
with an error naming the op, module and fix. Never a run-time crash.

CI runs one short case per architecture (`CI_CONFIG`: tp=2 + SP, 2 steps); `AUTOPAR_ZOO=full` runs the
whole matrix (3 steps), `AUTOPAR_ZOO=gpt2,llama` chooses architectures. One launch per mesh runs
all its architectures one after another in the same processes (start-up is paid once).
`python -m tests.test_zoo [--full]` prints the README's table.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import pytest
import torch

import autopar
from autopar.runtime.launch import RankKilled, launch
from tests.numerics import distributed_rank, single_device
from tests.numerics_checks import assert_ledger_equals_measured, assert_matches, max_relative_error
from tests.zoo_architectures import DENSE, MOE

transformers = pytest.importorskip("transformers")
from examples.hf_models import tiny_causal_lm, token_batch  # noqa: E402

FULL_CONFIGS = {
    "dp2": ("dp=2", [autopar.data_parallel()]),
    "tp2": ("tp=2", [autopar.tensor_parallel()]),
    "dp2_tp2_sp": ("dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()]),
    "fsdp_tp2": ("dp=2,tp=2", [autopar.fsdp(), autopar.tensor_parallel()]),
}
# CI's column: tensor and sequence parallelism, where the architectures differ (which layout the
# graph holds, which ops meet sharded sequences), on 2 ranks. Data parallelism adds a batch split
# and gradient reductions that no architecture changes; it is the full matrix's (dp2, dp2_tp2_sp)
# and tests/test_hf_numerics.py's (GPT-2 and Llama on dp=2 x tp=2 + SP, every CI run).
CONFIGS = {**FULL_CONFIGS, "tp2_sp": ("tp=2", [autopar.sequence_parallel()])}
CI_CONFIG = "tp2_sp"
# (architecture, config) -> what the plan-time refusal names. None now: mixture-of-experts blocks
# (transformers' grouped experts) are lowered by autopar/compiler/passes/lower_moe.py and train under every config.
REFUSED: dict[tuple[str, str], str] = {}


# Architectures whose one-device training is itself not reproducible at fp32 rounding beyond the
# first step run in float64 (the tolerance stays 1e-5): OPT's ReLU kinks — parameters moved by
# 3e-8 after step 0 (the size of a summation-order difference) change one device's step-1
# embedding gradients by 2.6e-4.
FLOAT64 = {"opt"}


def build_for(arch: str) -> Any:
    """The builder of `arch`'s model (picklable: it runs in every rank)."""
    return functools.partial(tiny_causal_lm, arch, dtype=torch.float64 if arch in FLOAT64 else torch.float32)


def selected() -> tuple[list[str], list[str], int]:
    """(architectures, configs, steps) this run covers (module docstring)."""
    choice = os.environ.get("AUTOPAR_ZOO", "")
    archs = [a for a in choice.split(",") if a and a != "full"] or list(DENSE + MOE)
    return archs, (list(FULL_CONFIGS) if "full" in choice.split(",") else [CI_CONFIG]), 3 if "full" in choice else 2


# AdamW moves an entry by lr*g/(|g|+eps), so a gradient entry's rounding difference d (summation
# order: measured up to 5e-8 on gradients of max 0.14, i.e. 3e-7 relative, which the gradient
# check passes) moves the parameter differently by up to lr*d/eps, a relative parameter error
# (parameters move ~lr) of d/eps: 3e-5 at tests.numerics' eps=1e-3 on row biases of GPT-2, OPT,
# CodeGen, Persimmon. At eps=1e-2 that bound is 5e-6, so parameters are held to 1e-5 too.
ZOO_EPS = 1e-2


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [token_batch(batch=8, seq=16, vocab=128, seed=step) for step in range(steps)]


def _tensor_parallel_summary(plan: autopar.Plan) -> dict[str, Any]:
    if "tp" not in plan.mesh.names:
        return {}
    axis = plan.mesh.names.index("tp")
    sharded = [f for f, p in plan.parameter_placements().items() if not isinstance(p[axis], torch.distributed.tensor.Replicate)]
    notes = [n for s in plan.strategy.strategies if s.axis == "tp" for n in s.notes]
    return {"tp_sharded": sharded, "tp_notes": notes}


def _reload(arch: str, module: Any, rank: int) -> dict[str, Any]:
    """After training: the whole state dict, loaded strictly into a fresh model of `arch`."""
    full = module.full_state_dict()
    try:
        build_for(arch)().load_state_dict(full, strict=True)
        reload = "ok"
    except RuntimeError as error:
        reload = str(error)
    return {"reload": reload, "aliases": dict(module.plan.traced.aliases), "full": full if rank == 0 else None,
            **_tensor_parallel_summary(module.plan)}


def zoo_rank(rank: int, world_size: int, archs: list[str], data: list[tuple], mesh: str, strategies: list) -> dict:
    """Every architecture in turn on this rank: plan (a refusal is recorded: plans are the same on
    every rank), train (`tests/numerics.distributed_rank`), gather the full state dict and load it
    strictly into a fresh model."""
    results = {}
    for arch in archs:
        try:
            results[arch] = distributed_rank(rank, world_size, build_for(arch), data, mesh, strategies, eps=ZOO_EPS,
                                             after=functools.partial(_reload, arch), memory=False)
        except autopar.PlanError as error:
            results[arch] = {"refused": str(error)}
    return results


class LaunchFailed(AssertionError):
    """The launch of a config failed as a whole (a rank killed by a signal, a rank's exception, the
    deadline): every test of the config fails with its message, and nothing is launched again."""


@functools.lru_cache(maxsize=None)
def _launch_config(config: str, archs: tuple[str, ...], steps: int, rank: Callable = zoo_rank
                   ) -> tuple[list | None, str]:
    """(per-rank results, "") of one launch that runs every architecture under `config` (each rank
    running `rank`), or (None, what failed) where the launch failed: the failure is kept, as a result
    is, so that each architecture's test reports it instead of launching the whole job again."""
    mesh, strategies = CONFIGS[config]
    world = autopar.Mesh.parse(mesh).world_size
    try:
        return launch(rank, world, list(archs), batches(steps), mesh, strategies,
                      timeout_s=120 + 60 * len(archs)), ""
    except RankKilled as crash:
        # a crash in native code (an abort, a segmentation fault) is a failure like any other, never
        # retried: the message holds every rank's stderr with faulthandler's stacks (runtime/launch.py)
        return None, f"zoo launch under {config}: a rank was killed ({crash})"
    except Exception as error:  # noqa: BLE001 - a rank's exception or the deadline: kept and reported the same
        return None, f"zoo launch under {config} failed: {type(error).__name__}: {error}"


def run_config(config: str, archs: tuple[str, ...], steps: int, rank: Callable = zoo_rank) -> dict[str, list[dict]]:
    """arch -> per-rank results of one launch that runs every architecture under `config` (launched
    once per session; `LaunchFailed` if that launch failed)."""
    per_rank, failure = _launch_config(config, archs, steps, rank)
    if per_rank is None:
        raise LaunchFailed(failure)
    return {arch: [ranks[arch] for ranks in per_rank] for arch in archs}


@functools.lru_cache(maxsize=None)
def reference(arch: str, steps: int) -> dict:
    return single_device(build_for(arch), batches(steps), eps=ZOO_EPS)


def check_refusal(arch: str, config: str, results: list[dict]) -> str:
    """The refusal `REFUSED` expects: on every rank, naming the op, its module and the fix."""
    expected = REFUSED[(arch, config)]
    assert all("refused" in r for r in results), f"{arch} under {config} planned; REFUSED expects: {expected}"
    text = results[0]["refused"]
    assert expected in text and "module:" in text and "fix:" in text, text
    return text


def check_trained(arch: str, config: str, results: list[dict], steps: int) -> None:
    """Equal to one device; the gathered state dict loads strictly with the trained values."""
    assert not any("refused" in r for r in results), results[0].get("refused")
    mesh = CONFIGS[config][0]
    expected = reference(arch, steps)
    names = expected["params"][0]
    aliases = {name: kept for name, kept in results[0]["aliases"].items() if name in names and name != kept}
    assert_matches(expected, results, aliases=aliases)
    assert_ledger_equals_measured(results)
    assert all(r["reload"] == "ok" for r in results), results[0]["reload"]
    full = results[0]["full"]
    assert list(full) == list(build_for(arch)().state_dict()), "full_state_dict keys differ from the model's"
    for name, value in expected["params"][-1].items():
        assert max_relative_error(full[name], value) <= 1e-5, f"{arch} full_state_dict()[{name!r}]"
    if "tp" in mesh and arch in DENSE:  # at least a column and a row in each of the 2 layers
        assert len([f for f in results[0]["tp_sharded"] if ".0." in f or ".1." in f]) >= 4, \
            f"{arch}: tensor parallelism found too little: {results[0]['tp_sharded']} {results[0]['tp_notes']}"


ARCHS, RUN_CONFIGS, STEPS = selected()


# the first architecture's test runs the launch for all of them (about 3 minutes on 2 quiet cores)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", RUN_CONFIGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_zoo_trains_like_one_device_or_is_refused_at_plan_time(arch, config):
    results = run_config(config, tuple(ARCHS), STEPS)[arch]
    if (arch, config) in REFUSED:
        check_refusal(arch, config, results)
    else:
        check_trained(arch, config, results, STEPS)


def aborted_rank(rank: int, world_size: int, archs: list[str], data: list[tuple], mesh: str, strategies: list) -> dict:
    """A zoo rank whose process dies of SIGABRT (native code aborting, as rank 0 did once in CI);
    the other one returns at once and waits at the launch's closing barrier until it is killed."""
    if rank == 1:
        os.abort()
    return {}


def test_a_rank_killed_by_a_signal_fails_every_architecture_with_its_stacks_and_is_not_relaunched(monkeypatch):
    launched, real_launch = [], launch

    def counted(*args: Any, **kwargs: Any) -> list:
        launched.append(args[0])
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(sys.modules[__name__], "launch", counted)
    for _arch in ("gpt2", "llama"):  # each architecture's test of the config asks for the launch's results
        with pytest.raises(LaunchFailed) as failure:
            run_config(CI_CONFIG, ("gpt2", "llama"), 1, aborted_rank)
        message = str(failure.value)
        assert "SIGABRT" in message and "rank 1 stderr" in message and "rank 0 stderr" in message, message
        assert "Fatal Python error: Aborted" in message and "aborted_rank" in message, message  # faulthandler's stack
    assert launched == [aborted_rank]


def test_key_value_heads_fewer_than_the_axis_train_like_one_device():
    """Mistral ships grouped-query attention (2 key/value heads here): on tp=4 they are replicated
    and each rank slices the repeated heads its query heads need."""
    results = launch(zoo_rank, 4, ["mistral"], batches(STEPS), "tp=4", [autopar.tensor_parallel()], timeout_s=180)
    results = [r["mistral"] for r in results]
    assert "model.model.layers.0.self_attn.k_proj.weight" not in results[0]["tp_sharded"]
    assert "model.model.layers.0.self_attn.q_proj.weight" in results[0]["tp_sharded"]
    assert_matches(reference("mistral", STEPS), results)
    assert_ledger_equals_measured(results)


def _cell(arch: str, config: str, results: list[dict], steps: int) -> str:
    if "refused" in results[0]:
        lines = results[0]["refused"].splitlines()
        module = next((line.split("module:", 1)[1].strip() for line in lines if "module:" in line), "")
        return f"refused: {lines[0].split(' with inputs')[0][:80]} in `{module}`"
    try:
        check_trained(arch, config, results, steps)
    except AssertionError as error:
        return f"FAILS: {str(error).splitlines()[0][:160]}"
    return "✓"


def table(archs: list[str], configs: list[str], steps: int) -> str:
    """The README's zoo table: one row per architecture, one column per config, plus what TP shards."""
    rows = {arch: [] for arch in archs}
    tp_found = {}
    for config in configs:
        runs = run_config(config, tuple(archs), steps)
        for arch in archs:
            rows[arch].append(_cell(arch, config, runs[arch], steps))
            if arch not in tp_found and "tp_sharded" in runs[arch][0]:
                notes = runs[arch][0]["tp_notes"]
                kinds = sorted({n.split(" pattern")[0] for n in notes})
                tp_found[arch] = (f"{len(runs[arch][0]['tp_sharded'])} sharded"
                                  + (f"; replicated: {', '.join(kinds)}" if kinds else ""))
    lines = ["| architecture | " + " | ".join(configs) + " | tensor-parallel parameters |",
             "|---" * (len(configs) + 2) + "|"]
    lines += [f"| {arch} | " + " | ".join(rows[arch]) + f" | {tp_found.get(arch, '')} |" for arch in archs]
    return "\n".join(lines)


if __name__ == "__main__":
    full = "--full" in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(DENSE + MOE)
    print(table(names, list(FULL_CONFIGS) if full else [CI_CONFIG], 3 if full else 2))
