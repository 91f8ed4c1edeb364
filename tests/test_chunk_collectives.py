"""Async TP (`autopar.schedule(chunks=k)`, autopar/compiler/passes/chunk_collectives.py): which collectives are cut,
the ledger's bytes kept, the sites left whole, and on 2 gloo ranks the order the pieces run in —
piece j+1's all-gather in flight over piece j's matmuls, piece j's reduce-scatter over piece j+1's
matmul. That the cut program equals one device (loss, gradients, parameters, the ledger against
gloo's calls, the memory ledger against the bytes held) is `tests/test_example_numerics.py`'s
`*_chunks` cases, under FSDP `tests/test_zero_numerics.py`'s `zero3_tp_sp_chunks_2x2`."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.compiler.passes.chunk_collectives import PIECE, chunked_sites
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.dispatch_calls import CallNames

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
BATCH = example_batch(CONFIG, batch=8)


def _plan(mesh: str, *strategies) -> autopar.Plan:
    return autopar.plan(GPT(CONFIG), mesh, strategies=list(strategies), example_inputs=BATCH)


def _ledger(plan) -> dict[tuple[str, str, str], tuple[int, int]]:
    """(phase, kind, axis) -> (calls, bytes) over the whole ledger."""
    totals: dict[tuple[str, str, str], tuple[int, int]] = {}
    for entry in plan.comm.entries:
        key = (entry.phase, entry.kind, entry.axis)
        calls, size = totals.get(key, (0, 0))
        totals[key] = (calls + int(entry.times), size + int(entry.times * entry.logical_bytes))
    return totals


def test_the_declaration_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="whole number"):
        autopar.schedule(chunks=0)
    with pytest.raises(ValueError, match="needs the overlap"):
        autopar.schedule(overlap=False, chunks=2)
    assert autopar.schedule(chunks=2).describe() == "overlap, linears' collectives in 2 chunks"


@pytest.mark.parametrize("mesh, strategy, sites, more_calls", [
    # o_proj's and down's all-reduce per layer (the embedding's is no linear's: it stays whole)
    ("tp=2", autopar.tensor_parallel, {"all_reduce": 4}, {("forward", "all_reduce"): 4}),
    # q/k/v's and up's gathers per layer and the lm_head's, o_proj's and down's reduce-scatters, and
    # their backward conjugates
    ("tp=4", autopar.sequence_parallel, {"all_gather": 5, "reduce_scatter": 4},
     {("forward", "all_gather"): 5, ("backward", "reduce_scatter"): 5, ("forward", "reduce_scatter"): 4,
      ("backward", "all_gather"): 4}),
])
def test_each_linear_collective_is_cut_and_the_ledger_keeps_its_bytes(mesh, strategy, sites, more_calls):
    whole, chunked = _plan(mesh, strategy()), _plan(mesh, strategy(), autopar.schedule(chunks=2))
    cut = chunked_sites(chunked.stages[0].graph_module.graph)
    assert set(cut.values()) == {2}
    assert {kind: sum(name.startswith(kind) for name in cut) for kind in sites} == sites
    before, after = _ledger(whole), _ledger(chunked)
    assert before.keys() == after.keys()
    for key, (calls, size) in before.items():
        # the same bytes, in one more call per site cut
        assert after[key] == (calls + more_calls.get(key[:2], 0), size), key


def test_a_second_piece_s_reduction_with_only_a_wait_to_overlap_runs_synchronous():
    """o_proj's and down's second reduce-scatter piece is issued after the last matmul: only the
    first piece's wait stands between its halves, so the scheduling pass joins it again; the first
    piece stays in flight over the second piece's matmul (autopar/compiler/passes/schedule_collectives.py)."""
    graph = _plan("tp=4", autopar.sequence_parallel(), autopar.schedule(chunks=2)).stages[0].graph_module.graph
    pieces = [node for node in graph.nodes if PIECE in node.meta and node.meta[PIECE][2].startswith("reduce_scatter")]
    assert [(node.meta[PIECE][0], bool(node.kwargs.get("deferred"))) for node in pieces] == \
        [(0, True), (1, False)] * 4


def test_a_site_whose_rows_do_not_divide_stays_whole():
    # tp=4 SP: 2 local rows of the batch per rank, which 3 pieces do not divide
    plan = _plan("tp=4", autopar.sequence_parallel(), autopar.schedule(chunks=3))
    assert chunked_sites(plan.stages[0].graph_module.graph) == {}
    assert _ledger(plan) == _ledger(_plan("tp=4", autopar.sequence_parallel()))


SP_SITES = {"all_gather": 5, "reduce_scatter": 4}


def _sites_by_kind(plan) -> dict[str, int]:
    """Collectives cut, per kind (every one in 2 pieces)."""
    cut = chunked_sites(plan.stages[0].graph_module.graph)
    assert set(cut.values()) <= {2}
    return {kind: n for kind in ("all_gather", "reduce_scatter", "all_reduce")
            if (n := sum(name.startswith(kind) for name in cut))}


def _numerics_cases():
    """Every `*_chunks` case the numerics tests run on the example GPT (the Hugging Face models'
    below)."""
    from tests import test_compile, test_example_numerics, test_zero_numerics

    cases = {name: (mesh, strategies) for module in (test_example_numerics, test_zero_numerics)
             for name, (mesh, strategies) in module.CASES.items() if "chunks" in name}
    cases.update({name: case[1:3] for name, case in test_compile.CASES.items() if "chunks" in name})
    return cases


@pytest.mark.parametrize("case", sorted(_numerics_cases()))
def test_every_numerics_case_of_async_tp_is_cut(case):
    """So those cases cannot pass with every site left whole."""
    mesh, strategies = _numerics_cases()[case]
    expected = {"all_reduce": 4} if case.startswith("tp2") else SP_SITES
    assert _sites_by_kind(_plan(mesh, *strategies)) == expected


@pytest.mark.usefixtures("transformers")
@pytest.mark.parametrize("model", ["tiny_gpt2", "tiny_llama"])
def test_the_hugging_face_numerics_case_is_cut(model):
    """GPT-2's Conv1D (addmm of an untransposed weight, shared by the pieces) and Llama's gate / up
    pair reading one gather: `tests/test_hf_numerics.py`'s async-TP case cuts every site."""
    from examples import hf_models
    from tests.test_hf_numerics import BATCHES, CASES

    mesh, strategies = CASES["dp2_tp2_sp_chunks"]
    plan = autopar.plan(getattr(hf_models, model)(), mesh, strategies=strategies, example_inputs=BATCHES[0])
    assert _sites_by_kind(plan) == SP_SITES


def test_each_pipeline_stage_is_cut():
    """`tests/test_pipeline_numerics.py`'s pp=2 x tp=2 async-TP case: a micro-batch of 4 rows."""
    from tests.test_pipeline_numerics import FOUR

    one = next(c for c in FOUR if c["name"].endswith("sp_chunks"))
    plan = autopar.plan(GPT(CONFIG), one["mesh"], strategies=one["strategies"], example_inputs=BATCH)
    cut = [chunked_sites(stage.graph_module.graph) for stage in plan.stages]
    # stage 0: the first layer's two gathers and two reductions; stage 1: the second's and the lm_head's gather
    assert [len(sites) for sites in cut] == [4, 5], cut


def test_symbolic_sizes_and_recomputed_regions_stay_whole():
    dynamic = autopar.plan(GPT(CONFIG), "tp=2", strategies=[autopar.tensor_parallel(), autopar.schedule(chunks=2)],
                           example_inputs=BATCH, dynamic_dims={"b": 0})
    assert _sites_by_kind(dynamic) == {}
    # full recomputation: the blocks' collectives stay whole, the lm_head's gather (no block's) is cut
    recomputed = _plan("tp=2", autopar.sequence_parallel(), autopar.recompute("full"), autopar.schedule(chunks=2))
    assert _sites_by_kind(recomputed) == {"all_gather": 1}


def _calls(rank: int, world: int) -> tuple[list[str], list[str]]:
    """The ATen / c10d calls of a forward and of its backward, tp=2 SP, chunks=2."""
    config = GPTConfig(vocab_size=128, seq_len=16, n_layer=1, n_head=4, d_model=32, d_ff=64)
    torch.manual_seed(0)
    batch = example_batch(config, batch=8)
    module = autopar.parallelize(GPT(config), "tp=2", strategies=[autopar.sequence_parallel(),
                                                                  autopar.schedule(chunks=2)], example_inputs=batch)
    forward, backward = CallNames(), CallNames()
    with forward:
        loss = module(*module.local_batch(*batch))
    with backward:
        loss.backward()
    return forward.names, backward.names


def _between(calls: list[str], issued: int) -> list[str]:
    """The calls from the collective issued at `issued` to the wait that lands it (gloo's
    functional collectives land in issue order)."""
    pending = sum(1 for name in calls[:issued] if name in _ISSUES) - sum(1 for name in calls[:issued]
                                                                           if name == "wait_tensor")
    waits = [i for i in range(issued + 1, len(calls)) if calls[i] == "wait_tensor"]
    return calls[issued:waits[pending]]


_ISSUES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def test_each_piece_s_collective_is_in_flight_over_another_piece_s_matmuls():
    for calls, backward in launch(_calls, 2, timeout_s=60, deadline_s=150):
        gathers = [i for i, name in enumerate(calls) if name == "all_gather_into_tensor"]
        scatters = [i for i, name in enumerate(calls) if name == "reduce_scatter_tensor"]
        # the attention's, the MLP's and the lm_head's gathers; the embedding's reduce-scatter
        # (whole), then o_proj's and down's; each linear's in two pieces
        assert len(gathers) == 6 and len(scatters) == 1 + 4, calls
        # the second piece's gather is issued before the first piece's linears and lands after them:
        # q, k and v (3 addmm) in attention, up in the MLP, the lm_head's mm
        matmuls = [_between(calls, i) for i in gathers[1::2]]
        assert [c.count("addmm") + c.count("mm") for c in matmuls] == [3, 1, 1], calls
        # o_proj's and down's first piece is reduced while the second piece's addmm runs
        matmuls = [_between(calls, i) for i in scatters[1:]]
        assert [c.count("addmm") for c in matmuls] == [1, 0, 1, 0], calls
        # backward, from the lm_head down: each gather's conjugate reduce-scatter (a piece's input
        # gradient) is in flight over the other piece's input-gradient GEMMs and the weight-gradient
        # taps (lm_head, up: 1 + 1 each; q, k, v: 3 + 3); of down's and o_proj's conjugate all-gathers,
        # the second piece's is in flight over the first piece's two GEMMs; the embedding's is whole
        scatters = [_between(backward, i).count("mm") for i, name in enumerate(backward)
                    if name == "reduce_scatter_tensor"]
        gathers = [_between(backward, i).count("mm") for i, name in enumerate(backward)
                   if name == "all_gather_into_tensor"]
        assert (scatters, gathers) == ([2, 2, 2, 2, 6, 6], [0, 2, 0, 2, 0]), backward
