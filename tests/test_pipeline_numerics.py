"""Pipeline parallelism on gloo processes equals one device, and the ledgers equal what a run moves
and holds (`tests/numerics.py`, `tests/numerics_checks.py`).

The example GPT and HF Llama, 3 AdamW steps on the same global batches, loss, whole gradients
and whole parameters after every step compared with the single-device run on the same
micro-batches, their gradients accumulated (`single_device(microbatches=m)`), at fp32 rel <= 1e-5; every collective and point-to-point transfer counted from
outside equals the ledger of the rank's stages; bytes held after each step equal the memory
ledger; the step's peak lies within the ledger's bounds:
- pp=2 and pp=4 under every schedule (GPipe, 1F1B, interleaved 1F1B with two stages per rank,
  ZB-H1), the GPT and Llama on each; DualPipeV (two stages per rank in a V, its paired forwards
  and backwards side by side) with the GPT on pp=2, pp=2 × tp=2 + SP and pp=2 × cp=2 (ring) (an
  MoE on pp=2 × ep=2 and pp=4: tests/test_moe.py);
- dp=2 x tp=2 x pp=2 on 8 ranks (data parallel, Megatron TP+SP, 1F1B);
- ZeRO-1 x pp and FSDP x pp (DeepSeek-V3's and torchtitan's compositions);
- a tied GPT-2 embedding and head held by the first and last of 4 stages;
- clip_grad_norm_ over the stages and full_state_dict gathered from them.
Several configurations share one launch (one set of processes runs them one after another),
which keeps process start-up out of the CI budget.

Activations in flight are measured from outside during the schedule (`InFlight`: storages a
`LiveStorages` mode saw allocated inside a forward or backward action and still alive when an
action ends, less the parameters' gradients and the tensors handed to `c10d.send` or, between two
stages of one rank (DualPipeV's turn), to the in-memory hand-over — a send's buffer lives until
its receiver takes it, which the ledger does not claim to predict) and equal
the memory ledger's activations: 1F1B's first stage holds fewer than GPipe's at m=8.
"""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autopar
from autopar.core.ops import p2p
from autopar.measure.storages import LiveStorages, storage_key
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.numerics import STEPS, distributed_rank, single_device
from tests.numerics_checks import (assert_ledger_equals_measured, assert_matches, assert_memory_equals_ledger,
                                   max_relative_error)

GPT4 = GPTConfig(vocab_size=128, seq_len=16, n_layer=4, n_head=4, d_model=32, d_ff=64)
GPT8 = GPTConfig(vocab_size=128, seq_len=16, n_layer=8, n_head=4, d_model=32, d_ff=64)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("dualpipev", 2)]
# AdamW's eps here is 1e-2, not the harness's 1e-3. Measured: the 8-layer Llama (which the
# interleaved schedule on 4 ranks needs) trained through autopar differs from one device by
# 5.9e-7, 1.8e-6 and then 2.3e-5 in its gradients at steps 0, 1, 2 with eps=1e-3 — the same figures
# under 1F1B and interleaved on 2 ranks, so nothing the schedule does: ~1e-7 rounding differences
# between the traced graph's kernels and the eager module, amplified by Adam's normalisation of
# near-zero gradients. With eps=1e-2 the same runs agree to 5.9e-7, 9.2e-7, 1.4e-6.
EPS = 1e-2


def gpt(layers: int) -> GPT:
    return GPT(GPT4 if layers == 4 else GPT8)


def llama(layers: int) -> torch.nn.Module:
    from examples.hf_models import tiny_llama

    return tiny_llama(layers=layers, kv_heads=2)


def tied_gpt2() -> torch.nn.Module:
    from examples.hf_models import tiny_gpt2

    return tiny_gpt2(layers=4, tied=True)


def gpt_batches() -> list[tuple]:
    return [example_batch(GPT4, batch=8, seed=step) for step in range(STEPS)]


def token_batches() -> list[tuple]:
    from examples.hf_models import token_batch

    return [token_batch(batch=8, seq=16, vocab=128, seed=step) for step in range(STEPS)]


MODELS = {"gpt": (gpt, gpt_batches), "llama": (llama, token_batches), "tied_gpt2": (lambda layers: tied_gpt2(),
                                                                                   token_batches)}


def pipeline_step(module: Any, local: list) -> torch.Tensor:
    """The step body of a pipelined module: every micro-batch's forward and backward."""
    return module.train_step(*local)


def case(model: str, mesh: str, schedule: str = "1f1b", virtual: int = 1, *, layers: int = 4, data: str | None = None,
         tensor: str | None = None, microbatches: int = 4, context: str | None = None) -> dict:
    strategies = [autopar.pipeline_parallel(schedule=schedule, microbatches=microbatches, virtual_stages=virtual)]
    strategies += {None: [], "dp": [autopar.data_parallel()], "zero1": [autopar.zero(stage=1)],
                   "fsdp": [autopar.fsdp()]}[data]
    strategies += {None: [], "sp": [autopar.sequence_parallel()],
                   "sp_chunks": [autopar.sequence_parallel(), autopar.schedule(chunks=2)]}[tensor]
    strategies += [autopar.context_parallel(method=context)] if context else []
    name = (f"{model}{layers}-{mesh}-{schedule}" + (f"-{data}" if data else "") + (f"-{tensor}" if tensor else "")
            + (f"-cp-{context}" if context else ""))
    return {"name": name, "model": model, "layers": layers, "mesh": mesh, "strategies": strategies,
            "microbatches": microbatches}


def _build(model: str, layers: int):
    return functools.partial(MODELS[model][0], layers)


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Every case in this set of processes, one after another (tests/numerics.distributed_rank)."""
    results = []
    for one in cases:
        build, batches = _build(one["model"], one["layers"]), MODELS[one["model"]][1]()
        results.append(distributed_rank(rank, world, build, batches, one["mesh"], one["strategies"],
                                        step=pipeline_step, eps=EPS))
    return results


_references: dict[tuple[str, int], dict] = {}


def reference(model: str, layers: int, microbatches: int) -> dict:
    """One device on the same global batches, the micro-batches' gradients accumulated (the
    issue's definition of the pipeline's reference: the same arithmetic, in the same order)."""
    if (model, layers, microbatches) not in _references:
        _references[(model, layers, microbatches)] = single_device(_build(model, layers), MODELS[model][1](),
                                                                    microbatches=microbatches, eps=EPS)
    return _references[(model, layers, microbatches)]


def check(cases: list[dict], per_rank: list[list[dict]], *, aliases: dict | None = None) -> None:
    for index, one in enumerate(cases):
        results = [rank_results[index] for rank_results in per_rank]
        expected = reference(one["model"], one["layers"], one["microbatches"])
        try:
            assert_matches(expected, results, aliases=aliases if one["model"] == "tied_gpt2" else None)
            assert_ledger_equals_measured(results)
            assert_memory_equals_ledger(results, expected, activations=False)
        except AssertionError as error:
            raise AssertionError(f"{one['name']}: {error}") from None


def transformers_ready() -> None:
    pytest.importorskip("transformers")


# DualPipeV on the GPT only: what is Llama's own at a stage boundary does not depend on the schedule
# (FOUR); an MoE runs it on pp=2 × ep=2 and pp=4 (tests/test_moe.py)
TWO = [case(model, "pp=2", schedule, virtual) for model in ("gpt", "llama") for schedule, virtual in SCHEDULES
       if model == "gpt" or schedule != "dualpipev"]
# on four stages every schedule runs the GPT; what is Llama's own at a stage boundary (rotary
# tables and masks cut with the blocks) does not depend on the schedule: it runs 1F1B and
# interleaved here, every schedule on two stages (TWO)
FOUR = ([case(model, "pp=4", schedule, virtual, layers=8 if virtual > 1 else 4)
         for model in ("gpt", "llama") for schedule, virtual in SCHEDULES
         if schedule != "dualpipev" and (model == "gpt" or schedule in ("1f1b", "interleaved_1f1b"))]
        + [case("gpt", "pp=2,dp=2", data="zero1"), case("llama", "pp=2,dp=2", data="fsdp"),
           case("gpt", "pp=2,dp=2", "interleaved_1f1b", 2, layers=8, data="fsdp"),
           case("tied_gpt2", "pp=4", "1f1b"),
           # async TP in each stage: micro-batches of 4 rows, 2 per tp rank, in 2 pieces
           case("gpt", "pp=2,tp=2", tensor="sp_chunks", microbatches=2),
           # DualPipeV's paired forwards run their TP+SP collectives and context parallelism's ring on
           # the side thread's groups (the ring's backward on the main thread's)
           case("gpt", "pp=2,tp=2", "dualpipev", 2, tensor="sp"),
           case("gpt", "pp=2,cp=2", "dualpipev", 2, context="ring")])
EIGHT = [case("gpt", "pp=2,dp=2,tp=2", data="dp", tensor="sp"), case("llama", "pp=2,dp=2,tp=2", data="zero1",
                                                                          tensor="sp")]


@pytest.mark.timeout(600)
def test_two_stages_every_schedule():
    transformers_ready()
    check(TWO, launch(run_cases, 2, TWO, timeout_s=500))


@pytest.mark.timeout(900)
def test_four_stages_every_schedule_and_sharded_state():
    transformers_ready()
    check(FOUR, launch(run_cases, 4, FOUR, timeout_s=800),
          aliases={"model.transformer.wte.weight": "model.lm_head.weight"})


@pytest.mark.timeout(600)
def test_data_tensor_and_pipeline_parallel_on_eight_ranks():
    transformers_ready()
    check(EIGHT, launch(run_cases, 8, EIGHT, timeout_s=500))


# ---- activations in flight, measured from outside
class _SentStorages(TorchDispatchMode):
    """The storages of the tensors handed to c10d.send (a send's buffer lives until received)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func.__name__.startswith("send"):
            self.keys |= {storage_key(t) for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor)}
        return func(*args, **(kwargs or {}))


class InFlight:
    """Peak bytes allocated inside forward/backward actions and alive at an action's end (see the
    module docstring). Wraps the rank's stage runners' `run` and the executor's backward calls."""

    def __init__(self, module: Any) -> None:
        self.module, self.storages, self.sent = module, LiveStorages(), _SentStorages()
        self.epochs: list[tuple[int, int]] = []
        self.outputs: set[int] = set()  # what actions return (the loss the executor keeps, send tokens)
        self.handing: dict[int, int] = {}  # tag -> storage of a hand-over between two stages of this rank
        self.peak = 0

    def _timed(self, fn):
        def wrapped(*args, **kwargs):
            start = self.storages.mark()
            result = fn(*args, **kwargs)
            self.epochs.append((start, self.storages.mark()))
            self.outputs &= set(self.storages.live())  # a freed storage's key may be reused
            self.outputs |= {storage_key(t) for t in tree_leaves(result) if isinstance(t, torch.Tensor)}
            self._measure(exclude=self.outputs)
            return result
        return wrapped

    def _measure(self, *, exclude: set[int]) -> None:
        grads = {storage_key(p.grad) for p in self.module.parameters() if p.grad is not None}
        alive = 0
        for start, end in self.epochs:
            since, after = self.storages.live_since(start), self.storages.live_since(end)
            alive += sum(n for key, n in since.items() if key not in after and key not in grads
                         and key not in self.sent.keys and key not in exclude and key not in self.handing.values())
        self.peak = max(self.peak, alive)

    def step(self, local: list) -> torch.Tensor:
        executor = self.module.pipeline
        for runner in self.module.stages:
            original = runner.run
            runner.run = self._timed(lambda inputs, token=None, original=original: original(
                [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs], token))
        executor._backward = self._timed(executor._backward)
        send, recv = p2p.Exchange.send, p2p.Exchange.recv

        # a hand-over to a stage of this rank (DualPipeV's turn) is a send while it waits to be taken;
        # once taken, it is the receiving stage's own (saved for its backward, say)
        def handed_over(exchange, tensor, peer, group, tag):
            if peer == exchange.rank:
                self.handing[tag] = storage_key(tensor)
            return send(exchange, tensor, peer, group, tag)

        def taken(exchange, shape, dtype, peer, group, tag):
            self.handing.pop(tag, None)
            return recv(exchange, shape, dtype, peer, group, tag)

        p2p.Exchange.send, p2p.Exchange.recv = handed_over, taken
        try:
            with self.sent, self.storages:
                return self.module.train_step(*local)
        finally:
            p2p.Exchange.send, p2p.Exchange.recv = send, recv


def _in_flight_rank(rank: int, world: int, schedules: list[tuple[str, int]]) -> dict:
    batch = example_batch(GPT4, batch=16, seed=0)
    result = {}
    for schedule, microbatches in schedules:
        torch.manual_seed(0)
        # DualPipeV's pairs one after the other: `InFlight` tells actions' allocations apart by
        # time, and a pair's forward and backward allocate at the same time on two threads
        overlap = {"overlap": False} if schedule == "dualpipev" else {}
        module = autopar.parallelize(gpt(4), "pp=2", strategies=[autopar.pipeline_parallel(
            schedule=schedule, microbatches=microbatches, **overlap)], example_inputs=batch)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        for _ in range(2):  # the second step: optimizer state exists, as in the ledger
            optimizer.zero_grad()
            measured = InFlight(module)
            measured.step(module.local_batch(*batch))
            optimizer.step()
        result[schedule] = {"measured": measured.peak,
                            "ledger": module.plan.memory(rank=rank).by_category()["activations"]}
    return result


@pytest.mark.timeout(300)
def test_activations_in_flight_follow_the_schedule():
    """m=8 on 2 stages: the first stage holds 8 micro-batches under GPipe, 2 under 1F1B; ZB-H1 also
    holds what its weight passes start from; DualPipeV's first rank holds 4 micro-batches of its
    first stage (half the model's blocks are in its two stages). Measured equals the ledger on
    every rank."""
    schedules = [("gpipe", 8), ("1f1b", 8), ("zb_h1", 8), ("dualpipev", 8)]
    results = launch(_in_flight_rank, 2, schedules, timeout_s=250)
    for rank, result in enumerate(results):
        for schedule, figures in result.items():
            assert figures["measured"] == figures["ledger"], f"rank {rank} {schedule}: {figures}"
    first = results[0]
    assert first["1f1b"]["measured"] < first["gpipe"]["measured"]
    assert first["1f1b"]["measured"] * 4 == first["gpipe"]["measured"]


def _clip_and_export_rank(rank: int, world: int) -> dict:
    batches = gpt_batches()
    torch.manual_seed(0)
    module = autopar.parallelize(gpt(4), "pp=2,dp=2", strategies=[autopar.pipeline_parallel(microbatches=2),
                                                                  autopar.zero(stage=2)], example_inputs=batches[0])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-3)
    norms = []
    for batch in batches:
        optimizer.zero_grad()
        module.train_step(*module.local_batch(*batch))
        norms.append(module.clip_grad_norm_(0.05))
        optimizer.step()
    return {"norms": norms, "state": module.full_state_dict()}


@pytest.mark.timeout(300)
def test_clip_grad_norm_and_full_state_dict_span_the_stages():
    """The global norm counts every stage's parameters once; full_state_dict gathers every stage's."""
    reference_run = single_device(_build("gpt", 4), gpt_batches(), clip_norm=0.05, microbatches=2)
    for result in launch(_clip_and_export_rank, 4, timeout_s=250):
        assert all(max_relative_error(n, r) <= 1e-5 for n, r in zip(result["norms"], reference_run["norms"],
                                                                     strict=True))
        assert set(result["state"]) == set(reference_run["params"][-1])
        for name, expected in reference_run["params"][-1].items():
            assert max_relative_error(result["state"][name], expected) <= 1e-5, name
