"""Shapes at run time: a plan traced with `dynamic_dims` runs other batch sizes and sequence
lengths and trains like one device at the new shape; a size the plan cannot run is refused
before anything runs, naming the input, the dimension, the sizes and the fix.

In one process: every rank graph of a dynamic dp=2 x tp=2 + SP plan runs forward and backward
on fake tensors of another size's local shapes (the plan-time check runs them at the example's).

Real gloo processes (world 2, one launch for every case): data parallel (batch split), tensor
parallel, and sequence parallel (the sequence split inside the model: its sizes are computed
from the inputs as global sizes and divided by the shard degree, `autopar/compiler/passes/emit_rank_graph.py`).
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.compiler.check_rank_graphs import _CheckedRun, _check_backward
from autopar.core.ir import SPEC, local_shape, sym_size
from autopar.compiler.ledger.fake_tensors import kernel_device, on_device, traced_mode
from autopar.runtime.input_shapes import InputShapeError
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch
from tests.numerics import comparison_mesh, whole_tensors
from tests.numerics_checks import max_relative_error

pytestmark = pytest.mark.timeout(300)

CONFIG = GPTConfig(n_layer=1)  # seq_len 16: the example is (4, 16); positions allow up to 16
EXAMPLE = example_batch(CONFIG, batch=4)
DYNAMIC = {"b": 0, "s": 1}
CASES = {"dp2": [autopar.data_parallel()], "tp2": [autopar.tensor_parallel()],
         "tp2_sp": [autopar.sequence_parallel()]}
MESHES = {"dp2": "dp=2", "tp2": "tp=2", "tp2_sp": "tp=2"}


def other_batch(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, targets = example_batch(CONFIG, batch=batch, seed=3)
    return idx[:, :seq].contiguous(), targets[:, :seq].contiguous()


NEW = other_batch(6, 8)  # batch 6 = 3 per dp rank, sequence 8 = 4 per sp rank


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _error(call) -> str:
    try:
        call()
    except InputShapeError as error:
        return str(error)
    return "no error"


def _rank(rank: int, world: int) -> dict:
    results, modules = {}, {}
    for case, strategies in CASES.items():
        module = modules[case] = autopar.parallelize(build(), MESHES[case], strategies=strategies,
                                                     example_inputs=EXAMPLE, dynamic_dims=DYNAMIC)
        loss = module(*module.local_batch(*NEW))
        loss.backward()
        results[case] = {"loss": loss.detach(), "grads": whole_tensors(module, comparison_mesh(module), grads=True),
                         "example_loss": module(*module.local_batch(*EXAMPLE)).detach()}
    static = autopar.parallelize(build(), "dp=2", strategies=[autopar.data_parallel()], example_inputs=EXAMPLE)
    results["errors"] = {
        "indivisible": _error(lambda: modules["dp2"].local_batch(*other_batch(5, 8))),
        "static_global": _error(lambda: static.local_batch(*other_batch(4, 8))),
        "static_local": _error(lambda: static(*other_batch(4, 16))),
        "dynamic_ndim": _error(lambda: modules["tp2"](EXAMPLE[0][0], EXAMPLE[1])),
    }
    return results


def _single_device(batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    model = build()
    loss = model(*batch)
    loss.backward()
    return {"loss": loss.detach(), "grads": {name: p.grad for name, p in model.named_parameters()}}


def test_dynamic_dims_run_other_shapes_and_static_ones_are_refused_by_name():
    results = launch(_rank, 2, timeout_s=150)
    reference, at_example = _single_device(NEW), _single_device(EXAMPLE)
    for rank, result in enumerate(results):
        for case in CASES:
            got = result[case]
            assert max_relative_error(got["loss"], reference["loss"]) <= 1e-5, (rank, case)
            assert max_relative_error(got["example_loss"], at_example["loss"]) <= 1e-5, (rank, case)
            assert set(got["grads"]) == set(reference["grads"]), (rank, case)
            for name, grad in got["grads"].items():
                assert grad.shape == reference["grads"][name].shape, (rank, case, name)
                assert max_relative_error(grad, reference["grads"][name]) <= 1e-5, (rank, case, name)
        errors = result["errors"]
        assert "input 0 ('idx') has size 5 in dimension 0" in errors["indivisible"], errors["indivisible"]
        assert "2 ranks of dp" in errors["indivisible"] and "multiple of 2" in errors["indivisible"]
        assert "input 0 ('idx') has size 8 in dimension 1, but the plan expects 16" in errors["static_global"]
        assert "dynamic_dims" in errors["static_global"]
        assert "has size 4 in dimension 0, but the plan expects 2 (this rank's share: 4 split over 2 ranks of dp)" \
            in errors["static_local"], errors["static_local"]
        assert "input 0 ('idx') has 1 dimensions" in errors["dynamic_ndim"], errors["dynamic_ndim"]


def _fake_inputs_at(plan, graph, mode, sizes: dict[str, int]) -> list:
    """Fake local inputs of `graph` at the global sizes `sizes` ({"b": 6, "s": 8})."""
    values = {symbol: sizes[str(name)] for symbol, name in plan.traced.symbols.items()}
    inputs = []
    with mode:
        for node in graph.nodes:
            if node.op != "placeholder":
                continue
            value, info = node.meta["val"], plan.context.placeholders[node.name]
            shape = [int(sym_size(d).subs(values)) for d in value.shape]
            local = local_shape(shape, node.meta[SPEC].placements, plan.mesh.shape)
            tensor = torch.empty(local, dtype=value.dtype)
            inputs.append(tensor.requires_grad_(info.kind == "parameter" and info.requires_grad))
    return inputs


def test_dynamic_rank_graphs_run_on_fake_tensors_of_another_size():
    plan = autopar.plan(build(), "dp=2,tp=2", strategies=[autopar.data_parallel(), autopar.sequence_parallel()],
                        example_inputs=EXAMPLE, dynamic_dims=DYNAMIC)
    mode = traced_mode(plan)
    for rank in (0, 3):
        graph = on_device(plan.rank_graph(rank), kernel_device(plan, None))
        assert "floordiv" in graph.code and "sym_size" in graph.code, "sizes are not computed from the inputs"
        run = _CheckedRun(graph, rank)
        with mode, torch.enable_grad():
            outputs = run.run(*_fake_inputs_at(plan, plan.stages[0].graph_module.graph, mode, {"b": 6, "s": 8}))
            _check_backward(run, outputs)
        assert outputs[0].shape == ()
