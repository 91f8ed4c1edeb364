"""`parallelize(compile=True)`: every rank graph through torch.compile (inductor, C++ kernels on
this CPU) trains like one device — loss, whole gradients and parameters after each of 3 AdamW
steps — on gloo processes, with the collectives captured in the compiled graph where dynamo can
trace them (all of dp×tp+SP's: one graph, no break), and what keeps state in Python (ZeRO's unit
calls, a pipeline's sends and receives, ring and all-gather context attention) running eagerly
between compiled pieces: every strategy the compiler lowers, recomputation and a symbolic batch
included. Plans that compile cannot run as planned (zb_h1, experts) are refused before anything
runs.

No dispatch mode measures these runs (the harness's counters in `tests/numerics.py`): dynamo does
not compile under an active Python dispatch mode, it runs the code eagerly, so a measured run
would not be a compiled one. The collectives of the last (compiled) step are counted by PyTorch's
profiler instead (`autopar.measure.profiled_collectives`) and equal the comm ledger, per kind;
the compiled steps' peak memory, read from the profiler's allocator events
(`autopar.measure.profiled_memory`), is bounded per case against the memory ledger's
(`MEMORY_BOUND`: the measured ratio plus a margin).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import pytest
from torch.profiler import ProfilerActivity, profile

import autopar
from autopar.core.errors import PlanError
from autopar.compiler.ledger.peak import moments, peak_terms
from autopar.measure import profiled_collectives, profiled_memory
from autopar.runtime.launch import launch
from autopar.runtime.compiled import compile_options, refuse_uncompilable
from examples.gpt import GPT, GPTConfig, example_batch
from examples.moe import MoEConfig, MoEGPT
from tests.numerics import STEPS, comparison_mesh, parallel_trainer, single_device, whole_tensors
from tests.numerics_checks import assert_matches

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
DEEP = GPTConfig(vocab_size=128, seq_len=16, n_layer=4, n_head=4, d_model=32, d_ff=64)  # interleaving: 2 x 2 stages


def _gpt(config: GPTConfig, sizes: tuple[int, ...] = (8,) * STEPS):
    return functools.partial(GPT, config), [example_batch(config, batch=size, seed=step)
                                            for step, size in enumerate(sizes)]


def _llama():
    from examples.hf_models import tiny_llama, token_batch

    return tiny_llama, [token_batch(batch=8, seed=step) for step in range(STEPS)]


def _pipeline(schedule: str, **options):
    return [autopar.pipeline_parallel(schedule=schedule, microbatches=2, **options)]


CASES = {
    # (model, mesh, strategies, micro-batches of the reference, compiled graphs per rank, graph breaks per rank)
    "dp2_tp2_sp": (CONFIG, "dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()], 1, 1, 0),
    # async TP: the linears' collectives in two pieces each (autopar/compiler/passes/chunk_collectives.py)
    "dp2_tp2_sp_chunks": (CONFIG, "dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel(),
                                                autopar.schedule(chunks=2)], 1, 1, 0),
    "zero3_dp2": (CONFIG, "dp=2", [autopar.zero(stage=3)], 1, None, None),
    "tp2_sp_regather": (CONFIG, "tp=2", [autopar.sequence_parallel(regather_in_backward=True)], 1, None, None),
    # pipelines: the sends and receives are graph breaks (runtime/p2p.py), the stage graph between them
    # compiled; ring and all-gather context attention: eager between two compiled pieces per layer
    # (runtime/context_attention._blockwise), Ulysses compiled with the graph
    "pp2_1f1b": (CONFIG, "pp=2", _pipeline("1f1b"), 2, None, None),
    "pp2_gpipe": (CONFIG, "pp=2", _pipeline("gpipe"), 2, None, None),
    "pp2_interleaved": (DEEP, "pp=2", _pipeline("interleaved_1f1b", virtual_stages=2), 2, None, None),
    "cp2_ring": (CONFIG, "cp=2", [autopar.context_parallel()], 1, 3, 3),
    "cp2_allgather": (CONFIG, "cp=2", [autopar.context_parallel(method="allgather")], 1, 3, 3),
    "cp2_alltoall": (CONFIG, "cp=2", [autopar.context_parallel(method="alltoall")], 1, 1, 0),
    "hsdp_2x2": (CONFIG, "dp_rep=2,dp_shard=2", list(autopar.hsdp()), 1, None, None),
    "llama_tp2": ("llama", "tp=2", [autopar.tensor_parallel()], 1, 1, 0),
    # recomputation: AOT autograd recomputes the checkpointed regions itself
    "dp2_recompute_full": (CONFIG, "dp=2", [autopar.data_parallel(), autopar.recompute("full")], 1, None, None),
    "tp2_recompute_selective": (CONFIG, "tp=2", [autopar.tensor_parallel(), autopar.recompute("selective")], 1,
                                None, None),
}
# CI compiles one case per mechanism the runtime gives dynamo (a whole graph with its collectives, async
# TP's pieces included; ZeRO's eager unit calls; SP's regathering saved-tensor hooks; a pipeline's
# sends and receives, interleaved too; ring attention's eager blocks and Ulysses' compiled all-to-all;
# checkpointed regions; a Hugging Face model; a symbolic batch): inductor's compilation is most of
# this file's time. `AUTOPAR_COMPILE=full` adds the cases that repeat a mechanism: dp×tp+SP without
# chunks, HSDP (ZeRO-3's unit calls over two axes), selective recomputation, GPipe, all-gather CP.
REPEATS = ("dp2_tp2_sp", "hsdp_2x2", "tp2_recompute_selective", "pp2_gpipe", "cp2_allgather")
RUN_CASES = list(CASES) if os.environ.get("AUTOPAR_COMPILE") == "full" else [c for c in CASES if c not in REPEATS]
# Inductor fuses and reorders reductions (layer norm, softmax, the loss) differently from eager
# ATen. Measured worst relative errors against one device over the 3 steps, every rank (2026-12-03):
# dp2_tp2_sp grads 3.1e-6 / params 2.3e-6, zero3_dp2 3.5e-6 / 1.2e-6, tp2_sp_regather 2.5e-6 /
# 1.9e-6, the pipelines, context parallelism, HSDP and recomputation 2.7e-6 ... 3.5e-6 / 8.7e-7 ...
# 2.2e-6, llama_tp2 8.1e-7 / 5.3e-7; the same programs eager: 2.5e-6 / 2.2e-6, 2.5e-6 / 3.8e-7,
# 2.8e-6 / 1.9e-6 (tp2+SP) — the same order, so the bound is the suite's 1e-5. dp2_tp2_sp_chunks
# (async TP, 2026-12-05): 2.7e-6 / 2.4e-6 (dp2_tp2_sp in the same run: 4.3e-6 / 2.4e-6).
TOLERANCE = 1e-5


def compiled_rank(rank: int, world: int, build, batches: list[tuple], mesh: str, strategies: list,
                  options: dict | None = None) -> dict:
    module, optimizer = parallel_trainer(build, batches[0], mesh, strategies, options={"compile": True, **(options or {})})
    check = comparison_mesh(module)
    result = {"losses": [], "grads": [], "params": []}
    rises = []
    for step, batch in enumerate(batches):
        optimizer.zero_grad()
        # compiled from the second step on: the profiler watches the compiled steps (the last one's collectives)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) if step else \
                contextlib.nullcontext() as prof:
            loss = module.train_step(*module.local_batch(*batch))
            optimizer.step()
        if step:
            rises.append(profiled_memory.peak_rise(prof))
        result["losses"].append(loss.detach().clone())
        result["grads"].append(whole_tensors(module, check, grads=True))
        result["params"].append(whole_tensors(module, check, grads=False))
    from torch._dynamo.utils import counters

    result["profiled"] = profiled_collectives.collectives(prof)
    result["peak_rise"] = min(rises)  # gloo's late frees read high at random (see MEMORY_BOUND)
    terms = peak_terms(module.plan, module.plan.memory(rank=rank), rank=rank)
    result["predicted_rise"] = max(moments(terms).values()) - terms.steady
    comm = module.plan.comm
    if comm.symbol_values:  # a plan with symbolic sizes: its ledger at the last step's batch
        last = {"b": batches[-1][0].shape[0]}
        comm = dataclasses.replace(comm, symbol_values={s: last.get(s.name, v) for s, v in comm.symbol_values.items()})
    ledger: dict[str, tuple[int, int]] = {}
    for (_, kind, _), (calls, nbytes) in comm.by_key(rank=rank).items():
        ledger[kind] = (ledger.get(kind, (0, 0))[0] + calls, ledger.get(kind, (0, 0))[1] + nbytes)
    result["ledger"] = ledger
    result["graphs"] = counters["stats"]["unique_graphs"]
    result["breaks"] = sum(counters["graph_break"].values())
    return result


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", RUN_CASES)
def test_compiled_rank_graphs_train_like_one_device(case):
    model, mesh, strategies, microbatches, graphs, breaks = CASES[case]
    build, batches = _llama() if model == "llama" else _gpt(model, (8,) * (STEPS + (case in ONE_MORE_STEP)))
    world = autopar.Mesh.parse(mesh).world_size
    results = launch(compiled_rank, world, build, batches, mesh, strategies, timeout_s=300)
    assert_matches(single_device(build, batches, microbatches=microbatches), results, tolerance=TOLERANCE)
    _assert_compiled_steps(results, graphs, breaks, MEMORY_BOUND[case])


# A compiled step's peak (`profiled_memory.peak_rise`, beyond what the step starts with, the lower
# of the compiled steps') over the memory ledger's for the eager program (its largest moment less
# what the rank always holds), per case: the measured ratio (2026-12-03, worst rank) plus a margin,
# so that a compiled program holding more than it did fails. Inductor frees intermediates sooner, so
# most hold less than the eager program: dp×tp+SP 0.838 (in pieces, async TP: 0.922, 2026-12-05), cp
# ring / all-gather / all-to-all 0.903 / 0.922 / 0.905, full / selective recomputation 0.798 /
# 0.825, the Llama 0.652, pipelines 1.027 / 1.027 / 1.014 (their other stage 0.834 / 0.875 / 0.849;
# the eager stage reads 1.013), tp+SP re-gathering 1.058, ZeRO-3 0.937 and HSDP 1.006. ZeRO-3 read
# 1.057 and HSDP 1.143 before two fixes: a released unit's gathered weights stayed alive to the end
# of the compiled forward (dynamo's resume frame holds the gathered tuple a graph break returned;
# the release now frees the storage: autopar/core/ops/sharded_state.py), and the ledger left out the head's
# whole gradient (tests/test_planner.py's four-rank peak test). ZeRO-3's bound is 1.02 (margin
# 0.083, more than the 0.055 of eager ZeRO-3's one high read) so that the first departure, 1.057,
# fails. Margin 0.10, 0.12 where a step can read high at random (ZeRO, HSDP, re-gathering: a
# collective's buffer dropped last by gloo's worker thread is a free the profiler does not see;
# eager ZeRO-3 read 1.055 in one run of four); even dp×tp+SP read 0.879 in a CI run (0.838 here).
# AOT's partitioner merging the cp all-gather's backward re-gather with the forward's (fixed in
# autopar/core/ops/context_attention.py) reads 1.040 there: it fails 1.02.
# The cases whose compiled step can read high at random get a third compiled step to take the
# least of (`compiled_rank`): in a CI run of 2026-12-04 hsdp_2x2 read 1.234 on one rank in both
# of its two compiled steps, on a loaded machine (1.006 otherwise; it passed alone three times).
ONE_MORE_STEP = {"zero3_dp2", "tp2_sp_regather", "hsdp_2x2"}
MEMORY_BOUND = {"dp2_tp2_sp": 0.94, "dp2_tp2_sp_chunks": 1.02, "zero3_dp2": 1.02, "tp2_sp_regather": 1.18,
                "pp2_1f1b": 1.13, "pp2_gpipe": 1.13, "pp2_interleaved": 1.12, "cp2_ring": 1.00, "cp2_allgather": 1.02,
                "cp2_alltoall": 1.01, "hsdp_2x2": 1.13, "llama_tp2": 0.76, "dp2_recompute_full": 0.90,
                "tp2_recompute_selective": 0.93}


def _assert_compiled_steps(results: list[dict], graphs: int | None = None, breaks: int | None = None,
                           memory: float = 1.0) -> None:
    """Every rank's compiled last step moved what the ledger says, its steps held at most `memory`
    × the memory ledger's peak (above), and something was compiled (so many graphs and breaks,
    where given)."""
    for result in results:
        assert result["peak_rise"] <= memory * result["predicted_rise"], \
            f"a compiled step held {result['peak_rise']} B, {result['peak_rise'] / result['predicted_rise']:.3f} × the ledger's"
        assert result["profiled"] == result["ledger"], "collectives of a compiled step (profiler) != the comm ledger"
        assert result["graphs"] >= 1, "nothing was compiled"
        if graphs is not None:
            assert (result["graphs"], result["breaks"]) == (graphs, breaks)


@pytest.mark.timeout(600)
def test_a_compiled_plan_with_a_symbolic_batch_trains_like_one_device_at_every_size():
    """dynamic_dims: the rank graphs compile with the batch size left to dynamo, and steps of 8, 4
    and 6 sequences train like one device; the last step's collectives equal the ledger at 6."""
    build, batches = _gpt(CONFIG, (8, 4, 6))
    results = launch(compiled_rank, 2, build, batches, "dp=2", [autopar.data_parallel()], {"dynamic_dims": {"b": 0}},
                     timeout_s=300)
    assert_matches(single_device(build, batches), results, tolerance=TOLERANCE)
    _assert_compiled_steps(results)  # the ledger at the example batch, 8; the compiled steps ran 4 and 6


def _plan(model, mesh: str, strategies: list, batch: tuple):
    return autopar.plan(model, mesh, strategies=strategies, example_inputs=batch)


def test_plans_that_compile_cannot_run_as_planned_are_refused():
    with pytest.raises(PlanError, match=r"zb_h1.*\n  fix: schedule='1f1b'"):
        refuse_uncompilable(_plan(GPT(CONFIG), "pp=2", [autopar.pipeline_parallel(schedule="zb_h1", microbatches=2)],
                                  example_batch(CONFIG, batch=4)))
    moe = MoEConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, n_experts=4, top_k=2, d_expert=32)
    with pytest.raises(PlanError, match=r"mixture-of-experts block: node \w+ \(module layers\.0\..*recompiles"):
        refuse_uncompilable(_plan(MoEGPT(moe), "ep=2", [autopar.expert_parallel()], example_batch(moe, batch=4)))
    refuse_uncompilable(_plan(GPT(CONFIG), "pp=2", [autopar.pipeline_parallel(schedule="1f1b", microbatches=2)],
                              example_batch(CONFIG, batch=4)))


def test_compile_takes_true_or_torch_compile_options():
    assert compile_options(False, dynamic=False) is None
    assert compile_options(True, dynamic=False) == {"backend": "inductor", "dynamic": False}
    assert compile_options({"backend": "aot_eager"}, dynamic=True) == {"dynamic": None, "backend": "aot_eager"}
    with pytest.raises(PlanError, match="compile='inductor': give True"):
        compile_options("inductor", dynamic=False)


def test_a_compiled_graph_called_under_a_dispatch_mode_warns_once(monkeypatch):
    import warnings

    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.runtime import compiled

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(compiled, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled.warn_if_watched()  # no mode: nothing to say
    with pytest.warns(UserWarning, match="dynamo runs it eagerly now and from then on"), Watching():
        compiled.warn_if_watched()
    with warnings.catch_warnings(), Watching():
        warnings.simplefilter("error")
        compiled.warn_if_watched()  # once only
