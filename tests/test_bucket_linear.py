"""Linears whose weight gradient is computed into its shared-memory gradient bucket
(`autopar/runtime/bucket_linear.py`), on 2 gloo ranks at dp=2 with `transport="shared_memory"`.

Measured from outside, under a dispatch mode over backward: no `copy_` writes a rewritten weight's
bucket slice (the synchroniser's), a `mm.out` writes each; the gradients equal one device's
(rel <= 1e-5). `torch.autograd.grad` gets gradients that are not the bucket's memory and leaves the
rows as they were; a weight read by two linears is left as it was (its second gradient would be
written over the first). Where a slice must not take the gradient (two forwards then one backward,
`create_graph`, autocast, a tensor hook that keeps the gradient, micro-batches under `no_sync` with
saved tensors packed as copies) the gradients are those of the same program through the process
group, which rewrites nothing; so do a plan traced with a symbolic batch, run at another size, and
(in one process) a reentrant checkpoint's inner backward. Accumulated micro-batches are also checked by
`test_shared_memory.py::test_accumulated_micro_batches_are_reduced_once`.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import autopar
from autopar.comm_kinds import SHARED_MEMORY
from autopar.runtime.bucket_linear import BucketLinears
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch

CONFIG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16, d_ff=32)
WORLD = 2


class _Writes(TorchDispatchMode):
    """What `copy_` (data pointer, shape) and `mm.out` (data pointer) write, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.copied, self.multiplied = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            self.copied.append((args[0].data_ptr(), tuple(args[0].shape)))
        elif func is torch.ops.aten.mm.out:
            self.multiplied.append(kwargs["out"].data_ptr())
        return func(*args, **kwargs)


def _bucket_linears(module) -> BucketLinears | None:
    targets = [node.target for node in module.stages[0].graph.graph.nodes if node.op == "call_function"]
    return next((t.__self__ for t in targets if getattr(t, "__func__", None) is BucketLinears.linear), None)


def _parallel(build, batch):
    torch.manual_seed(0)
    return autopar.parallelize(build(), f"dp={WORLD}", strategies=[autopar.data_parallel(transport=SHARED_MEMORY)],
                               example_inputs=batch)


def _gpt_rank(rank, world):
    batch = example_batch(CONFIG, batch=4)
    module = _parallel(lambda: GPT(CONFIG), batch)
    linears = _bucket_linears(module)
    shared = module.grad_sync.shared_slices()  # where the synchroniser reduces each gradient
    slices = {fqn: shared[fqn].data_ptr() for fqn in linears.slices}
    params = dict(module.named_parameters())
    shapes = {tuple(params[fqn].shape) for fqn in slices}
    loss = module(*module.local_batch(*batch))
    with _Writes() as writes:
        loss.backward()
    result = {"rewritten": sorted(slices), "count": module.stages[0].bucket_linears,
              # a hook's copy of a whole gradient into its slice (the all-reduce's copies are 2-D chunks)
              "copies_into_slices": [ptr for ptr, shape in writes.copied if ptr in slices.values() and shape in shapes],
              "products_into_slices": sorted(p for p in writes.multiplied if p in slices.values()),
              "slices": sorted(slices.values()),
              "grads": {fqn: params[fqn].grad.clone() for fqn in slices}}
    # torch.autograd.grad: no accumulation, so nothing is written into the rows
    module.zero_grad(set_to_none=True)
    rows = [view.clone() for view in linears.slices.values()]
    grads = torch.autograd.grad(module(*module.local_batch(*batch)), [params[fqn] for fqn in slices])
    row = linears.slices[next(iter(slices))]
    rows_start = row.untyped_storage().data_ptr()
    rows_end = rows_start + row.untyped_storage().nbytes()
    result["autograd_grad_in_rows"] = [fqn for fqn, g in zip(slices, grads) if rows_start <= g.data_ptr() < rows_end]
    result["rows_unchanged"] = all(torch.equal(a, b) for a, b in zip(rows, linears.slices.values()))
    result["local_grads"] = dict(zip(slices, grads))
    return result


def _reference(build, batch, parts: int) -> tuple[dict, list[dict]]:
    """One device's gradients of the global batch, and of each rank's slice (its mean loss)."""
    torch.manual_seed(0)
    model = build()
    model(*batch).backward()
    whole = {name: p.grad.clone() for name, p in model.named_parameters()}
    slices = []
    for index in range(parts):
        model.zero_grad(set_to_none=True)
        model(*[t.chunk(parts)[index] for t in batch]).backward()
        slices.append({name: p.grad.clone() for name, p in model.named_parameters()})
    return whole, slices


@pytest.mark.timeout(120)
def test_weight_gradients_are_computed_into_their_rows():
    results = launch(_gpt_rank, WORLD, timeout_s=90)
    whole, per_rank = _reference(lambda: GPT(CONFIG), example_batch(CONFIG, batch=4), WORLD)
    linears = [f"layers.{i}.{name}.weight" for i in range(CONFIG.n_layer)
               for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj",
                            "mlp.down_proj")] + ["lm_head.weight"]
    for rank, result in enumerate(results):
        assert result["rewritten"] == sorted(linears) and result["count"] == len(linears)
        assert result["copies_into_slices"] == []  # the hooks copied nothing into these slices
        assert result["products_into_slices"] == result["slices"]  # each slice written by its GEMM
        for fqn in linears:
            torch.testing.assert_close(result["grads"][fqn], whole[fqn], rtol=1e-5, atol=1e-7)
            # the rank's own loss is the global mean: its gradient is its slice's mean over the ranks
            torch.testing.assert_close(result["local_grads"][fqn], per_rank[rank][fqn] / WORLD, rtol=1e-5, atol=1e-7)
        assert result["autograd_grad_in_rows"] == [] and result["rows_unchanged"]


class _Twice(nn.Module):
    """`first` applied twice: its weight is read by two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.second(self.first(torch.relu(self.first(x)))), target)


def _twice_rank(rank, world, batch):
    module = _parallel(_Twice, batch)
    module(*module.local_batch(*batch)).backward()
    linears = _bucket_linears(module)
    return {"rewritten": sorted(linears.slices) if linears else [],
            "grads": {name: p.grad.clone() for name, p in module.named_parameters()}}


@pytest.mark.timeout(120)
def test_a_weight_read_twice_keeps_autograds_gradient():
    generator = torch.Generator().manual_seed(3)
    batch = (torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator))
    results = launch(_twice_rank, WORLD, batch, timeout_s=90)
    whole, _ = _reference(_Twice, batch, WORLD)
    for result in results:
        assert result["rewritten"] == ["second.weight"]
        for name, grad in whole.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-7)


def _two_forwards(module, batch, kept):
    first, second = module.local_batch(*batch), module.local_batch(*[t.flip(0) for t in batch])
    (module(*first) + module(*second)).backward()


def _double_backward_graph(module, batch, kept):
    module(*module.local_batch(*batch)).backward(create_graph=True)


def _autocast(module, batch, kept):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module(*module.local_batch(*batch))
    loss.backward()


def _hook_keeps_the_gradient(module, batch, kept):
    weight = dict(module.named_parameters())["layers.0.mlp.up_proj.weight"]
    handle = weight.register_hook(lambda grad: kept.append(grad))
    module(*module.local_batch(*batch)).backward()
    handle.remove()


def _copied_saved_tensors_under_no_sync(module, batch, kept):
    """Micro-batches under no_sync with saved tensors packed as copies: the unpacked weight is not
    the parameter, whose gradient is already there in the second backward."""
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t)
    with module.no_sync(), hooks:
        module(*module.local_batch(*batch)).backward()
    with hooks:
        module(*module.local_batch(*[t.flip(0) for t in batch])).backward()


SCENARIOS = {"two_forwards": _two_forwards, "create_graph": _double_backward_graph, "autocast": _autocast,
             "hook_keeps_the_gradient": _hook_keeps_the_gradient,
             "copied_saved_tensors_under_no_sync": _copied_saved_tensors_under_no_sync}


def _scenario_rank(rank, world, name):
    batch = example_batch(CONFIG, batch=8)
    results = {}
    for transport in (SHARED_MEMORY, "process_group"):
        torch.manual_seed(0)
        module = autopar.parallelize(GPT(CONFIG), f"dp={world}", example_inputs=batch,
                                     strategies=[autopar.data_parallel(transport=transport)])
        kept = []
        SCENARIOS[name](module, batch, kept)
        results[transport] = {"bucket_linears": module.stages[0].bucket_linears,
                              "grads": {n: p.grad.detach().clone() for n, p in module.named_parameters()},
                              "kept": [grad.detach().clone() for grad in kept]}
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_where_the_rows_cannot_take_a_gradient_autograds_runs(name):
    """Against the same program through the process group (no linear rewritten, the same GEMMs; two
    ranks' gradients summed either way give the same bits): the same gradients, and the same
    gradient seen by a tensor hook, where a rewritten linear must not write its slice."""
    for result in launch(_scenario_rank, WORLD, name, timeout_s=90):
        shared, plain = result[SHARED_MEMORY], result["process_group"]
        assert shared["bucket_linears"] > 0 and plain["bucket_linears"] == 0
        for fqn, grad in plain["grads"].items():
            assert torch.equal(shared["grads"][fqn], grad), fqn
        assert len(shared["kept"]) == len(plain["kept"])
        assert all(torch.equal(a, b) for a, b in zip(shared["kept"], plain["kept"]))


def _linear_pair():
    """One weight behind a rewritten linear (`BucketLinears`, a plain tensor for the row) and the
    same weight behind autograd's own mm."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 4))
    row = torch.zeros(16)
    linears = BucketLinears({"w": row.view(4, 4)}, {"w": weight})
    return weight, row, (lambda x: linears.linear(x, weight, None, fqn="w")), (lambda x: torch.mm(x, weight.t()))


@pytest.mark.parametrize("order", ["penalty_first", "nested"])
def test_a_reentrant_backward_does_not_write_over_a_pending_gradient(order):
    """A reentrant checkpoint's inner backward runs while the outer one still holds the weight's
    first gradient (written into the slice, not yet accumulated): it must not write the slice again.
    Single process: the slice is a plain tensor; autograd's mm is the reference."""
    weight, row, rewritten, plain = _linear_pair()
    x = torch.randn(3, 4, requires_grad=True)

    def gradient(linear):
        weight.grad = None
        if order == "penalty_first":  # the penalty's gradient reaches AccumulateGrad last
            penalty = (weight ** 2).sum()
            (linear(checkpoint(linear, x, use_reentrant=True)).sum() + penalty).backward()
        else:
            linear(checkpoint(linear, linear(x), use_reentrant=True)).sum().backward()
        return weight.grad.clone()

    expected = gradient(plain)
    for _ in range(2):  # the second time after a first step's slice was accumulated
        assert torch.equal(gradient(rewritten), expected)
    gradient(rewritten)
    weight.grad = None
    rewritten(x).sum().backward()  # alone: the slice takes it
    assert weight.grad.data_ptr() == row.data_ptr()


def _dynamic_rank(rank, world):
    results = {}
    for transport in (SHARED_MEMORY, "process_group"):
        torch.manual_seed(0)
        module = autopar.parallelize(GPT(CONFIG), f"dp={world}", example_inputs=example_batch(CONFIG, batch=8),
                                     strategies=[autopar.data_parallel(transport=transport)],
                                     dynamic_dims={"idx": 0, "targets": 0})
        batch = example_batch(CONFIG, batch=12, seed=3)  # another batch size than the traced one
        module(*module.local_batch(*batch)).backward()
        grads = {name: param.grad.clone() for name, param in module.named_parameters()}
        results[transport] = (module.stages[0].bucket_linears, grads)
    return results


@pytest.mark.timeout(120)
def test_a_plan_with_dynamic_dims_computes_into_the_rows_at_any_batch():
    """The linears of a plan traced with a symbolic batch are rewritten too (the slice's shape is
    the weight's), and a batch of another size gives the process-group program's gradients."""
    for result in launch(_dynamic_rank, WORLD, timeout_s=90):
        (rewritten, shared), (plain_rewritten, plain) = result[SHARED_MEMORY], result["process_group"]
        assert rewritten == 2 * 6 + 1 and plain_rewritten == 0
        assert all(torch.equal(shared[name], grad) for name, grad in plain.items())
