"""The scheduling pass (autopar/compiler/passes/schedule_collectives.py) and the deferred steps it emits
(autopar/core/ops/in_flight.py): where the halves land in the graph, what runs between them in a
real run (read by a dispatch mode, outside the code under test), and the same numbers as the
synchronous steps. Numerics of whole models with the pass on are the other test files' (it is
the default)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.core.ir import module_path
from autopar.compiler.passes.schedule_collectives import deferred_nodes, overlaps, small_values
from autopar.core.ops import collectives, in_flight, moe
from autopar.runtime.launch import launch
from autopar.tools.views.html import render_html
from examples.gpt import GPT, GPTConfig, example_batch
from examples.moe import MoEConfig, MoEGPT
from tests.dispatch_calls import CallNames


def _moe_plan(*declared):
    torch.manual_seed(0)
    config = MoEConfig()
    return autopar.plan(MoEGPT(config), "ep=2", strategies=[autopar.expert_parallel(), *declared],
                        example_inputs=example_batch(config, batch=8))


@pytest.fixture(scope="module")
def moe_plan():
    return _moe_plan()


def test_the_moe_statistics_reductions_land_after_the_next_block_has_run(moe_plan):
    graph = moe_plan.rank_graph(0).graph
    order = {node.name: index for index, node in enumerate(graph.nodes)}
    dispatches = [n.name for n in graph.nodes if n.target is moe.moe_dispatch]
    loss = [n.name for n in graph.nodes if "nll_loss" in getattr(n.target, "__name__", "")]
    assert len(dispatches) == 2 and len(loss) == 1
    by_name = {node.name: node for node in graph.nodes}
    in_flight_over = [o for o in overlaps(graph) if o.between and by_name[o.start].target is collectives.all_reduce]
    # layer 0's three statistics reductions (two routing-range checks, the mean router probability)
    # are in flight over layer 1's expert exchange, layer 1's over the output layer and the loss
    assert len(in_flight_over) == 6, [(o.start, len(o.between)) for o in overlaps(graph)]
    for over in in_flight_over:
        layer = module_path(by_name[over.start]).split(".")[1]
        assert order[over.start] < order[dispatches[1] if layer == "0" else loss[0]] < order[over.finish]
    # only small values move: no large tensor is kept alive longer than before
    deferred = deferred_nodes(moe_plan.stages[0].graph_module.graph)
    small = small_values(moe_plan.stages[0].graph_module.graph)
    assert deferred and all(node in small for node in deferred)
    # and the f before the lm_head, in flight over its weight gradient in backward
    assert "Collectives in flight (scheduling pass): 7 steps have nodes between" in moe_plan.document().overlap_report()


def test_the_html_page_lists_the_steps_in_flight(moe_plan):
    page = render_html(moe_plan.document().data)
    assert 'id="overlap-panel"' in page and "Collectives in flight over compute — 7 steps" in page
    assert "all_reduce (backward)" in page  # the f before the lm_head: its conjugate is what is in flight


def test_overlap_off_leaves_every_collective_synchronous_and_the_ledger_unchanged(moe_plan):
    off = _moe_plan(autopar.schedule(overlap=False))
    graph = off.rank_graph(0).graph
    assert not any(node.target is in_flight.finish for node in graph.nodes)
    assert not any(node.kwargs.get("deferred") for node in graph.nodes)
    ledger = lambda plan: [(e.phase, e.kind, e.axis, e.logical_bytes, e.times) for e in plan.comm.entries]  # noqa: E731
    assert sorted(ledger(off), key=str) == sorted(ledger(moe_plan), key=str)  # the same steps, in another order
    assert off.document().overlap_report() == ""


def _step(rank: int, world: int, deferred: bool) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """An all-gather (gradient partial: a reduce-scatter in backward) with a matmul chain made
    while it is in flight, forward and backward."""
    torch.manual_seed(rank)
    x = torch.randn(4, 3, 8, requires_grad=True)
    torch.manual_seed(10)
    w = torch.randn(32, 32, requires_grad=True)
    h = torch.randn(32, 32)
    group = dist.group.WORLD.group_name
    calls = CallNames()
    with calls:
        started = collectives.all_gather(x, group=group, size=world, index=rank, dim=1, grad_partial=True,
                                         deferred=deferred)
        other = (h @ w).tanh() @ w
        gathered = in_flight.finish(started) if deferred else started
        calls.names.append("<forward done>")
        loss = (gathered * gathered).sum() + other.sum()
        loss.backward()
    return calls.names, x.grad, w.grad


def _both(rank: int, world: int) -> dict:
    synchronous = _step(rank, world, False)
    deferred = _step(rank, world, True)
    return {"calls": deferred[0], "same": all(torch.equal(a, b) for a, b in zip(synchronous[1:], deferred[1:]))}


def test_a_deferred_step_is_in_flight_over_the_compute_between_its_halves_in_both_directions():
    results = launch(_both, 2, timeout_s=60, deadline_s=120)
    for result in results:
        assert result["same"]  # the same gradients, bit for bit, as the synchronous step
        calls = result["calls"]
        end = calls.index("<forward done>")
        forward, backward = calls[:end], calls[end:]
        issued, landed = forward.index("all_gather_into_tensor"), forward.index("wait_tensor")
        assert forward[issued:landed].count("mm") == 2  # both matmuls ran while the gather was in flight
        # backward: the conjugate reduce-scatter is issued before the matmuls' backward and landed after
        issued, landed = backward.index("reduce_scatter_tensor"), backward.index("wait_tensor")
        assert issued < landed and backward[issued:landed].count("mm") >= 3


def _tensor_parallel_calls(rank: int, world: int) -> list[str]:
    config = GPTConfig(n_layer=2)
    torch.manual_seed(0)
    batch = example_batch(config, batch=4)
    module = autopar.parallelize(GPT(config), "tp=2", strategies=[autopar.tensor_parallel()], example_inputs=batch)
    calls = CallNames()
    with calls:
        loss = module(*module.local_batch(*batch))
        calls.names.append("<forward done>")
        loss.backward()
    return calls.names


def test_the_input_gradient_all_reduce_is_in_flight_over_the_weight_gradient_gemms():
    """Megatron's overlap, by autograd's order: each column-parallel linear's input-gradient
    all-reduce (the conjugate of f) is issued before the weight-gradient GEMMs of the linears it
    feeds and waited after them (`autopar/core/ops/weight_gradients.py`)."""
    for calls in launch(_tensor_parallel_calls, 2, timeout_s=60, deadline_s=150):
        backward = calls[calls.index("<forward done>"):]
        issued = [i for i, name in enumerate(backward) if name == "all_reduce"]
        gemms = []
        for i in issued:
            waited = backward.index("wait_tensor", i)
            gemms.append(backward[i:waited].count("mm"))
        # the first is the vocabulary-parallel loss kernel's own reduction (`local_ops`), then, in
        # backward order: the lm_head behind the final norm's f; per layer from the last, up behind
        # the MLP's f, q, k and v behind the attention's
        assert gemms[0] == 0 and gemms[1:] == [1, 1, 3, 1, 3], backward
