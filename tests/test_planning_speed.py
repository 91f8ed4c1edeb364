"""Planning made faster changes no plan: fingerprints of small plans against saved ones.

The planning-time work (`benchmarks/planning_time.py`, issue 50) rewrites hot paths of tracing,
placement propagation, collective insertion and the plan-time check without changing what they
decide. Each case here plans a small model (the example GPT at several meshes and strategies, a
tiny Hugging Face Llama with symbolic batch and sequence) and compares a fingerprint of the plan
with the one saved in `tests/golden/planning_fingerprints.json`, part by part, so that a failure
names what changed:
- `graph`: every node of the planned graph and of each stage graph, in order: name, op, target,
  arguments, and the metadata the passes write (placements, argument placements, local arguments,
  rule, origin, collective, ZeRO unit, gradient-sync axes, recomputation marks);
- `rank_graphs`: the code of the first and last rank's graph of every stage (`Plan.rank_graph`);
- `comm`: the communication ledger's entries; `memory`: rank 0's memory ledger by category and in
  detail; `buckets` and `units`: the gradient buckets and ZeRO units;
- `checked`: what the plan-time check ran, reused and reached in backward for each rank graph.
A wrong reuse of one block's result for another (a node given another's placement, a copied
block's collective bound to the wrong parameter) changes one of these. The fingerprints were
written before the changes (`python tests/test_planning_speed.py --write` writes them again; a
change of plan must say why).
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

import autopar
from autopar.compiler.check_rank_graphs import check_rank_graphs
from autopar.core.ir import SPEC
from examples.gpt import GPT, GPTConfig, example_batch
from examples.hf_models import tiny_llama, token_batch

GOLDEN = Path(__file__).parent / "golden" / "planning_fingerprints.json"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _stable(value: Any) -> str:
    return _ADDRESS.sub("", repr(value))


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _node_record(node: torch.fx.Node) -> str:
    """A node's name, call and every metadata entry the passes write (their keys start `autopar_`),
    with its module path and traced value's shape."""
    meta = {key: value for key, value in node.meta.items() if key.startswith("autopar_")}
    value = node.meta.get("val")
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    return _stable((node.name, node.op, str(node.target), node.args, dict(node.kwargs), meta, shape,
                    node.meta.get("nn_module_stack")))


def fingerprint(plan: autopar.Plan) -> dict[str, str]:
    """The plan's parts, each as a short digest (module docstring)."""
    graphs = [plan.graph_module.graph] + [stage.graph_module.graph for stage in plan.stages]
    graph = [_node_record(node) for g in graphs for node in g.nodes]
    ranks = []
    for stage in plan.stages:
        holders = [r for r in range(plan.mesh.world_size) if stage in plan.stages_of_rank(r)]
        ranks += [plan.rank_graph(rank, stage=stage.index).code for rank in sorted({holders[0], holders[-1]})]
    memory = plan.memory(rank=0)
    return {
        "graph": _digest(graph),
        "rank_graphs": _digest(ranks),
        "comm": _digest([_stable(entry) for entry in plan.comm.entries]),
        "memory": _digest([_stable(memory.by_category()), memory.detail()]),
        "buckets": _digest([_stable(bucket) for bucket in plan.buckets]),
        "units": _digest([_stable(unit) for unit in plan.units]),
        "checked": _digest([_stable(checked) for checked in check_rank_graphs(plan)]),
    }


def _gpt(mesh: str, strategies: Callable[[], list], layers: int = 5) -> Callable[[], autopar.Plan]:
    def make() -> autopar.Plan:
        config = GPTConfig(n_layer=layers)
        torch.manual_seed(0)
        return autopar.plan(GPT(config), mesh, strategies=strategies(), example_inputs=example_batch(config))
    return make


def _llama(mesh: str, strategies: Callable[[], list]) -> Callable[[], autopar.Plan]:
    def make() -> autopar.Plan:
        torch.manual_seed(0)
        return autopar.plan(tiny_llama(layers=5, kv_heads=2), mesh, strategies=strategies(),
                            example_inputs=token_batch(), dynamic_dims={"b": 0, "s": 1})
    return make


CASES: dict[str, Callable[[], autopar.Plan]] = {
    "gpt_dp2_tp2_fsdp_tp": _gpt("dp=2,tp=2", lambda: [autopar.fsdp(), autopar.tensor_parallel()]),
    "gpt_dp2_tp2_dp_sp": _gpt("dp=2,tp=2", lambda: [autopar.data_parallel(), autopar.sequence_parallel()]),
    "gpt_tp4_tp": _gpt("tp=4", lambda: [autopar.tensor_parallel()]),
    "gpt_pp2_dp2_zero2": _gpt("pp=2,dp=2", lambda: [autopar.pipeline_parallel(schedule="1f1b", microbatches=2),
                                                   autopar.zero(stage=2)], layers=6),
    "llama_dp2_tp2_fsdp_tp_symbolic": _llama("dp=2,tp=2", lambda: [autopar.fsdp(), autopar.tensor_parallel()]),
    "llama_dp4_tp2_fsdp_tp_symbolic": _llama("dp=4,tp=2", lambda: [autopar.fsdp(), autopar.tensor_parallel()]),
}


def _saved() -> dict[str, dict[str, str]]:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_is_the_saved_plan(case, request):
    if case.startswith("llama"):
        request.getfixturevalue("transformers")  # skipped, naming it, without transformers
    plan = CASES[case]()
    assert plan.traced.copied_blocks, "the case must exercise copied blocks"
    saved = _saved()[case]
    got = fingerprint(plan)
    assert {part: got[part] for part in saved if got[part] != saved[part]} == {}


def test_a_changed_placement_changes_the_fingerprint():
    """The fingerprint sees one node's metadata: a copied block's node given another placement."""
    plan = CASES["gpt_tp4_tp"]()
    before = fingerprint(plan)
    node = next(n for n in plan.graph_module.graph.nodes if n.op == "call_function"
                and "layers.4" in str(n.meta.get("nn_module_stack")) and isinstance(n.meta.get(SPEC), DTensorSpec))
    spec = node.meta[SPEC]
    other = (Replicate(),) if spec.placements == (Shard(0),) else (Shard(0),)
    node.meta[SPEC] = DTensorSpec(spec.mesh, other, spec.tensor_meta)
    assert fingerprint(plan)["graph"] != before["graph"]


if __name__ == "__main__" and "--write" in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    GOLDEN.write_text(json.dumps({case: fingerprint(make()) for case, make in sorted(CASES.items())}, indent=1) + "\n")
