"""DualPipeV's overlapped pairs: a forward beside another micro-batch's full backward
(`autopar.core.schedules.overlapped`, run by `autopar/runtime/overlap.py`).

- The pairs are PyTorch's: `ScheduleDualPipeV`'s OVERLAP_F_B actions, at the same places of the
  same lists, for several pipeline sizes and micro-batch counts.
- In a real run (the example MoE on pp=2 × ep=2, gloo processes) every pair's forward and
  backward run at the same time (their measured intervals intersect), the side thread's
  all-to-alls go over its own copies of the expert group (counted from outside by a
  `CommCounter`), and the loss, gradients and parameters equal the same plan with its pairs run
  one after the other (`overlap=False`) to the bit. Equality with one device, and the ledger
  against the bytes counted, are `tests/test_moe.py`'s (`pp2_ep2_dualpipev`, `pp4_dualpipev`).
- Prices: where the ranks run pairs side by side (CPU ranks: `schedules.SIDE_BY_SIDE_BACKENDS`)
  a pair takes the longer of its two computations and its two communications
  (`step_cost.pair_seconds`), so a plan whose all-to-alls block less than the other half
  computes gains exactly their time on every pair; on accelerator ranks (one after the other)
  nothing; the bubble ledger, which prices compute only, gains nothing.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD,
                                                    OVERLAP_F_B, ScheduleDualPipeV)

import autopar
from autopar.compiler.ledger.bubble import build_bubble_ledger
from autopar.core import schedules
from autopar.cost.cluster import Cluster
from autopar.cost.step_cost import estimate, pair_seconds
from autopar.measure.comm_counter import CommCounter
from autopar.planner import composed_cost
from autopar.runtime.launch import launch
from examples.gpt import example_batch
from examples.moe import MoEConfig, MoEGPT

MOE = MoEConfig(vocab_size=128, seq_len=16, n_layer=4, n_head=4, d_model=32, d_ff=64)


def _pytorchs(p: int, m: int) -> tuple[list[list[schedules.Action]], list[frozenset[int]]]:
    """`ScheduleDualPipeV`'s lists in our terms: a full backward as B then its W, an overlapped
    pair as its forward (whose position is the pair's) then that full backward."""
    schedule = object.__new__(ScheduleDualPipeV)  # its list arithmetic only: no stages, no process group
    schedule.pp_group_size, schedule._n_microbatches = p, m
    orders, pairs = [], []
    for rank in range(p):
        order: list[schedules.Action] = []
        paired = set()

        def add(action) -> None:
            stage, k = action.stage_index, action.microbatch_index
            if action.computation_type == FORWARD:
                order.append(schedules.Action("F", stage, k))
            elif action.computation_type == FULL_BACKWARD:
                order.extend([schedules.Action("B", stage, k), schedules.Action("W", stage, k)])
            elif action.computation_type == BACKWARD_INPUT:
                order.append(schedules.Action("B", stage, k))
            elif action.computation_type == BACKWARD_WEIGHT:
                order.append(schedules.Action("W", stage, k))
            else:
                raise AssertionError(action)

        for action in schedule._calculate_single_rank_operations(rank):
            if action is None:
                continue
            if action.computation_type == OVERLAP_F_B:
                paired.add(len(order))
                for sub in action.sub_actions:
                    add(sub)
            else:
                add(action)
        orders.append(order)
        pairs.append(frozenset(paired))
    return orders, pairs


@pytest.mark.parametrize("p,m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 13)])
def test_the_pairs_are_pytorchs_overlapped_actions(p, m):
    orders, pairs = _pytorchs(p, m)
    assert schedules.actions("dualpipev", degree=p, virtual=2, microbatches=m) == orders
    assert schedules.overlapped("dualpipev", degree=p, virtual=2, microbatches=m) == pairs
    assert all(pairs), "every rank has pairs"
    assert schedules.overlapped("zb_h1", degree=p, virtual=1, microbatches=m) == [frozenset()] * p


def test_a_pair_takes_the_longer_of_its_computations_and_its_communications():
    """Simulated: F = 1 s compute + c s blocking, B = 2 + c; paired, F + B cost max(3, 2c)."""
    p, m = 2, 6
    orders = schedules.actions("dualpipev", degree=p, virtual=2, microbatches=m)
    pairs = schedules.overlapped("dualpipev", degree=p, virtual=2, microbatches=m)
    rank_of = lambda stage: schedules.stage_coordinate("dualpipev", p, stage)  # noqa: E731
    for c in (0.5, 1.0, 2.0):
        def cost(a):  # B and W each half the backward; a paired backward's W is done in its pair
            return 1 + c if a.kind == "F" else (2 + c) / 2

        plain = schedules.simulate(orders, cost, stages=2 * p, split_backward=True, rank_of=rank_of)
        overlapped = schedules.simulate(orders, cost, stages=2 * p, split_backward=True,
                                        rank_of=rank_of, pairs=pairs, pair_cost=lambda f, b: max(3, 2 * c))
        busy_plain = schedules.busy_seconds(plain, p)
        busy = schedules.busy_seconds(overlapped, p)
        for rank in range(p):
            hidden = len(pairs[rank]) * (3 + 2 * c - max(3, 2 * c))
            assert busy[rank] == pytest.approx(busy_plain[rank] - hidden)
        span = max(t.end for t in overlapped)
        assert span < max(t.end for t in plain)
        running = [t for t in overlapped if t.end > t.start]
        for t in running:  # a pair's two actions share one interval
            partner = [u for u in running if u.rank == t.rank and u is not t and u.start == t.start]
            assert bool(partner) == any(orders[t.rank].index(t.action) in (i, i + 1) for i in pairs[t.rank])
        assert all(0 <= f < 1 for f in schedules.bubble_fractions(overlapped, p))


def _moe_plan(overlap: bool) -> autopar.Plan:
    torch.manual_seed(0)
    return autopar.plan(MoEGPT(MOE), "pp=2,ep=2", strategies=[
        autopar.pipeline_parallel(schedule="dualpipev", microbatches=4, overlap=overlap), autopar.expert_parallel()],
        example_inputs=example_batch(MOE, batch=8))


# a node of 4 whose ranks run the pairs side by side (gloo's: `schedules.SIDE_BY_SIDE_BACKENDS`), and
# the same node on NCCL, where they run one after the other
SIDE_BY_SIDE = dataclasses.replace(Cluster.preset("h100x1"), gpus_per_node=4, backend="gloo", name="node of 4, gloo")
ONE_AFTER_THE_OTHER = dataclasses.replace(SIDE_BY_SIDE, backend="nccl", name="node of 4, nccl")


def test_the_step_price_hides_each_pairs_all_to_alls_and_the_bubble_ledger_does_not_move():
    """Where the ranks run the pairs side by side, the paired plan's step is cheaper than the same
    plan run pair by pair, by no more than its blocking communication; where they do not
    (accelerator ranks) the two price the same; the compute-only bubble ledger is the same."""
    paired, apart = _moe_plan(True), _moe_plan(False)
    fast, slow = estimate(paired, SIDE_BY_SIDE), estimate(apart, SIDE_BY_SIDE)
    assert fast.seconds < slow.seconds
    assert slow.seconds - fast.seconds <= slow.parts["communication"]
    assert fast.parts["compute"] == pytest.approx(slow.parts["compute"])
    assert estimate(paired, ONE_AFTER_THE_OTHER).seconds == estimate(apart, ONE_AFTER_THE_OTHER).seconds
    assert build_bubble_ledger(paired).fractions == pytest.approx(build_bubble_ledger(apart).fractions)


def test_a_pair_takes_no_less_than_either_half_alone():
    assert pair_seconds((1.0, 10.0), (1.0, 0.0)) == 11.0  # the forward's own compute, then its wait
    assert pair_seconds((1.0, 0.5), (2.0, 0.5)) == 3.0  # each wait behind the other's compute
    assert pair_seconds((1.0, 2.0), (1.0, 2.0)) == 4.0  # the waits outlast the computes


def test_overlap_is_refused_for_a_schedule_that_runs_one_action_at_a_time():
    with pytest.raises(autopar.PlanError, match="1f1b.*runs one action at a time"):
        autopar.pipeline_parallel(schedule="1f1b", overlap=True)


def _run_both(rank: int, world: int) -> tuple[dict, dict]:
    return _run(rank, world, True), _run(rank, world, False)


def _run(rank: int, world: int, overlap: bool) -> dict:
    batches = [example_batch(MOE, batch=8, seed=s) for s in range(2)]
    torch.manual_seed(0)
    module = autopar.parallelize(MoEGPT(MOE), "pp=2,ep=2", strategies=[
        autopar.pipeline_parallel(schedule="dualpipev", microbatches=4, overlap=overlap), autopar.expert_parallel()],
        example_inputs=batches[0])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses, counter = [], CommCounter()
    for batch in batches:
        optimizer.zero_grad()
        with counter:
            losses.append(module.train_step(*module.local_batch(*batch)))
        optimizer.step()
    keys = module.group_keys()
    lanes = module.pipeline.lanes
    copies = set() if lanes is None else set(lanes.names.values()) | set(lanes.gradients.values())
    on_copies = sorted({(c.kind, keys[c.group]) for c in counter.calls if c.group in copies})
    return {"losses": losses, "state": module.full_state_dict(), "timeline": module.pipeline.timeline,
            "pairs": module.pipeline.pairs, "on_copies": on_copies,
            "all_to_alls": sum(c.kind == "all_to_all" for c in counter.calls)}


@pytest.mark.timeout(300)
def test_the_pairs_run_side_by_side_on_their_own_groups_and_change_no_number():
    for rank, (a, b) in enumerate(launch(_run_both, 4, timeout_s=250)):
        assert a["pairs"] and not b["pairs"]
        timeline = a["timeline"]
        order = [(t.kind, t.stage, t.microbatch) for t in timeline]
        for i in a["pairs"]:  # the executor records a pair's forward, then its backward
            f, bwd = timeline[i], timeline[i + 1]
            assert (f.kind, bwd.kind) == ("F", "B"), order
            assert f.start < bwd.end and bwd.start < f.end, f"rank {rank}: {f} and {bwd} did not overlap"
        # the side thread's forwards exchange their rows over the copy of the expert group; the
        # backwards' gradients go over the copy of the pipeline group
        assert ("all_to_all", "ep") in a["on_copies"] and ("send", "pp") in a["on_copies"], a["on_copies"]
        assert b["on_copies"] == []
        assert a["all_to_alls"] == b["all_to_alls"]
        assert [float(x) for x in a["losses"]] == [float(x) for x in b["losses"]]
        for name, value in b["state"].items():
            assert torch.equal(a["state"][name], value), name


def test_the_planner_prices_dualpipev_with_its_pairs():
    """`composed_cost._split_span` returns the busiest rank's running time below its work when the
    pairs hide communication (the composed candidates' agreement with the planned ones is
    tests/test_composed_cost.py's)."""
    stage = dataclasses.make_dataclass("S", ["index", "compute_f", "compute_b", "blocking_f", "blocking_b", "sends"])
    stages = [stage(i, 1.0, 2.0, 0.5, 0.5, []) for i in range(4)]
    candidate = dataclasses.make_dataclass("C", ["schedule", "virtual"])("dualpipev", 2)
    span, running = composed_cost._split_span(stages, candidate, SIDE_BY_SIDE, 8, 0.0, 2)
    work = 8 * 2 * (1.0 + 2.0 + 0.5 + 0.5)  # per rank: two stages, F + B each, per micro-batch
    pairs = schedules.overlapped("dualpipev", degree=2, virtual=2, microbatches=8)
    for rank in range(2):  # each pair hides its 0.5 + 0.5 behind 3 s of compute
        assert running[rank] == pytest.approx(work - len(pairs[rank]) * 1.0)
    assert span >= max(running)
    _, apart = composed_cost._split_span(stages, candidate, ONE_AFTER_THE_OTHER, 8, 0.0, 2)
    assert apart == pytest.approx([work, work])
