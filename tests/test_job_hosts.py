"""The node size a job runs with (`autopar/runtime/job_hosts.py`): read off the ranks' host names where
nothing declares it, and a declared one checked against them.

The multi-process test gives each rank a host name of the test's choosing (`socket.gethostname`,
which is what `job_hosts` reads), so one machine stands for several hosts: the node size each
job gets, what a node size that spans hosts is told, and that a job whose data-parallel axis stays
on each host trains as one device."""
from __future__ import annotations

import socket

import pytest
import torch

import autopar
from autopar.runtime.job_hosts import check_node_size, node_size
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16, d_ff=32)


def test_node_size_from_hosts():
    assert node_size(["a"] * 4) is None  # one host: the whole world is one node
    assert node_size(["a", "a", "b", "b"]) == 2
    assert node_size(["a", "a", "b", "b", "c", "c"]) == 2
    assert node_size(["a", "a", "b", "b", "b", "b"]) == 2  # blocks of 2 each lie on one host
    assert node_size(["a", "a", "b", "b", "a", "a"]) == 2
    assert node_size(["a", "b"]) == 1
    # hosts that interleave their ranks: every axis counts as crossing nodes
    assert node_size(["a", "b", "a", "b"]) == 1
    assert node_size(["a", "a", "a", "b"]) == 1


def test_a_declared_node_that_spans_hosts_is_refused():
    check_node_size(2, ["a", "a", "b", "b"], "ranks_per_node=")
    check_node_size(2, ["a"] * 4, "ranks_per_node=")  # a multi-node rehearsal on one host
    check_node_size(1, ["a", "b", "a", "b"], "ranks_per_node=")
    with pytest.raises(autopar.PlanError, match=r"ranks 0\.\.3 share one, but they run on hosts \['a', 'b'\]"
                                                r"(.|\n)*fix: ranks_per_node=2"):
        check_node_size(4, ["a", "a", "b", "b"], "ranks_per_node=")
    with pytest.raises(autopar.PlanError, match=r"ranks 0\.\.1 share one(.|\n)*fix: write ;node=1 in the mesh"):
        check_node_size(2, ["a", "b", "a", "b"], "the mesh's ;node=", "write ;node={size} in the mesh")


def _bucket_axes(module) -> set[tuple[str, ...]]:
    return {bucket.axes for bucket in module.stages[0].stage.buckets}


def _jobs_on_hosts(rank: int, world: int) -> dict:
    batch = example_batch(CONFIG, batch=4)
    strategies = [autopar.data_parallel(), autopar.tensor_parallel()]
    found = {}

    def parallelize(hosts, mesh, **options):
        socket.gethostname = lambda: hosts[rank]
        torch.manual_seed(0)
        try:
            module = autopar.parallelize(GPT(CONFIG), mesh, strategies=strategies, example_inputs=batch, **options)
        except autopar.PlanError as error:
            return str(error)
        return module

    for name, hosts, mesh, options in [
            ("dp_across", "aabb", "dp=2,tp=2", {}), ("interleaved", "abab", "dp=2,tp=2", {}),
            ("declared_too_big", "aabb", "dp=2,tp=2", {"ranks_per_node": 4}),
            ("mesh_too_big", "aabb", "dp=2,tp=2;node=4", {}), ("rehearsal", "aaaa", "dp=2,tp=2", {"ranks_per_node": 2}),
            # rank 1 alone declares a node that spans hosts: every rank fails, none waits for it
            ("one_rank_differs", "aabb", "dp=2,tp=2", {"ranks_per_node": 4 if rank == 1 else 2})]:
        module = parallelize(hosts, mesh, **options)
        found[name] = module if isinstance(module, str) else (str(module.plan.mesh), _bucket_axes(module))
    # dp inside each host (tp across): one step as one device
    module = parallelize("aabb", "tp=2,dp=2")
    found["dp_inside"] = (str(module.plan.mesh), _bucket_axes(module))
    loss = module(*module.local_batch(*batch))
    loss.backward()
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    expected = reference(*batch)
    expected.backward()
    found["loss"] = (float(loss), float(expected))
    # a replicated parameter's gradient, summed over dp
    grad = dict(module.named_parameters())["norm.weight"].grad
    found["grad"] = float((grad - reference.norm.weight.grad).abs().max() / reference.norm.weight.grad.abs().max())
    return found


@pytest.mark.timeout(180)
def test_the_node_size_comes_from_the_hosts_where_none_is_declared():
    every = launch(_jobs_on_hosts, 4, timeout_s=120)
    assert all(isinstance(ranks["one_rank_differs"], str) for ranks in every), [r["one_rank_differs"] for r in every]
    found = every[0]
    # dp's groups {0, 2} and {1, 3} cross hosts a and b
    assert found["dp_across"] == ("dp=2,tp=2;node=2", {("dp",)})
    assert found["interleaved"] == ("dp=2,tp=2;node=1", {("dp",)})
    assert "ranks_per_node= gives 4 ranks per node, so ranks 0..3 share one" in found["declared_too_big"]
    assert "the mesh's ;node= gives 4 ranks per node" in found["mesh_too_big"]
    assert "fix: write ;node=2 in the mesh" in found["mesh_too_big"]
    assert found["rehearsal"] == ("dp=2,tp=2;node=2", {("dp",)})
    assert found["dp_inside"] == ("tp=2,dp=2;node=2", {("dp",)})
    autopar_loss, single = found["loss"]
    assert abs(autopar_loss - single) <= 1e-5 * abs(single)
    assert found["grad"] <= 1e-5
