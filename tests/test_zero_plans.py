"""ZeRO / FSDP / HSDP plans without processes: the communication and memory ledgers against the
lecture's figures (slide 28; 2Psi for ZeRO-1/2, 3Psi for ZeRO-3), and bad input refused clearly."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar import PlanError
from autopar.compiler.ledger.memory import build_memory_ledger, largest_model
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)


def plan_gpt(mesh: str, strategies: list, config: GPTConfig = CONFIG, **kwargs):
    torch.manual_seed(0)
    return autopar.plan(GPT(config), mesh, strategies=strategies, example_inputs=example_batch(config), **kwargs)


def test_slide_28_largest_model_per_stage():
    """8 x 80 GB, 12 bytes/param (2 + 2 + 8), activations ignored: 6.66 B, 16 B, 24.62 B, 53.33 B."""
    fits = [largest_model(devices=8, memory_bytes=80e9, stage=s, bytes_per_param=(2, 2, 8)) for s in range(4)]
    assert [round(f / 1e9, 2) for f in fits] == [6.67, 16.0, 24.62, 53.33]
    assert fits[0] == pytest.approx(80e9 / 12) and fits[3] == pytest.approx(80e9 / 1.5)


def _grad_and_param_wire_bytes(plan) -> int:
    """Wire bytes of the data-parallel state traffic: everything but the loss's (sum, count) all-reduce."""
    return sum(plan.comm.number(e.wire_bytes) for e in plan.comm.entries if e.module != "")


def test_zero3_moves_one_and_a_half_times_ddp_and_zero12_the_same():
    ddp = _grad_and_param_wire_bytes(plan_gpt("dp=4", [autopar.data_parallel()]))
    by_stage = {s: _grad_and_param_wire_bytes(plan_gpt("dp=4", [autopar.zero(stage=s)])) for s in (1, 2, 3)}
    padded = sum(u.gathered_numel * 4 for u in plan_gpt("dp=4", [autopar.zero(stage=3)]).units)
    parameters = sum(p.numel() for p in GPT(CONFIG).parameters()) * 4
    assert ddp == 2 * 3 * parameters // 4  # one all-reduce: 2 (N-1)/N Psi
    assert by_stage[1] == by_stage[2] == 2 * 3 * padded // 4  # reduce-scatter + all-gather of the padded units
    # root unit kept for backward (like FSDP2's root): its parameters are gathered once, blocks twice
    root = plan_gpt("dp=4", [autopar.zero(stage=3)]).units[0]
    assert by_stage[3] == 3 * 3 * padded // 4 - 3 * root.gathered_numel * 4 // 4
    keep_all = _grad_and_param_wire_bytes(plan_gpt("dp=4", [autopar.zero(stage=3, reshard_after_forward=False)]))
    assert keep_all == by_stage[1]
    for everything_resharded in (autopar.zero(stage=3, reshard_root=True), autopar.zero(stage=3, units=("*",))):
        ratio = _grad_and_param_wire_bytes(plan_gpt("dp=4", [everything_resharded])) / ddp
        assert ratio == pytest.approx(1.5, rel=(padded - parameters) / parameters + 1e-12)


def test_hsdp_splits_traffic_by_axis_and_link():
    plan = plan_gpt("dp_rep=2,dp_shard=2", [autopar.hsdp()], ranks_per_node=2)
    kinds = {(e.kind, e.axis, e.link) for e in plan.comm.entries if e.module.startswith("unit")}
    assert kinds == {("all_gather", "dp_shard", "intra"), ("reduce_scatter", "dp_shard", "intra"),
                     ("all_reduce", "dp_rep", "inter")}
    for unit in plan.units:
        rep = [e for e in plan.comm.entries if e.module.startswith(f"unit {unit.index} ") and e.axis == "dp_rep"]
        assert [plan.comm.number(e.logical_bytes) for e in rep] == [unit.shard_numel * 4]


def test_memory_ledger_shards_what_each_stage_says():
    ledgers = {s: build_memory_ledger(plan_gpt("dp=4", [autopar.zero(stage=s)] if s else [autopar.data_parallel()]),
                                      activations=False).by_category() for s in range(4)}
    psi = sum(p.numel() for p in GPT(CONFIG).parameters()) * 4
    assert ledgers[0]["parameters"] == ledgers[0]["gradients"] == psi
    assert ledgers[0]["optimizer state"] == 2 * psi + 4 * 37  # exp_avg, exp_avg_sq; a 4-byte step per tensor
    for stage in (1, 2, 3):
        assert ledgers[stage]["optimizer state"] < ledgers[0]["optimizer state"] / 3.5
    assert ledgers[1]["gradients"] > psi and ledgers[2]["gradients"] < psi / 3.5  # ZeRO-1 keeps full gradients
    assert ledgers[2]["parameters"] > psi and ledgers[3]["parameters"] < psi / 3.5


def test_report_shows_memory_next_to_communication():
    report = plan_gpt("dp=4", [autopar.zero(stage=3)]).report()
    assert "Memory per rank" in report and "optimizer state" in report and "reduce_scatter" in report


def test_unknown_stage():
    with pytest.raises(PlanError, match=r"unknown ZeRO stage 4: choose 1 .* 2 .* or 3"):
        autopar.zero(stage=4)


@pytest.mark.parametrize("rows,group_size", [(8, 4), (7, 4), (5, 4), (4, 3), (1, 4)])
def test_gradients_lay_out_as_each_owner_reads_its_shard(rows, group_size):
    """`grad_layout` puts rank r's rows of every parameter side by side in row r of the flat buffer,
    padding rows and a missing gradient zero, whatever the buffer held before; `copy_gathered`
    reads it back into the full parameters."""
    from autopar.core.zero_units import ShardUnit, UnitParam, copy_gathered, grad_layout, rows_per_rank, shard_of

    shapes = [(rows, 3), (rows + 1,), (2, 2)]
    params = tuple(UnitParam(f"p{i}", f"p{i}", shape, rows_per_rank(shape[0], group_size))
                   for i, shape in enumerate(shapes))
    unit = ShardUnit(index=0, name="block", axis="dp", group_size=group_size, stage=2, dtype=torch.float32,
                     params=params, extra_axes=(), reshard=False, prefetch=False)
    grads = [torch.randn(shapes[0]), torch.randn(shapes[1]), None]
    garbage = torch.full((group_size, unit.shard_numel), float("nan"))
    del garbage  # the allocator hands these bytes to the buffer next: every element must be written
    flat = grad_layout(unit, list(grads), torch.float32).view(group_size, unit.shard_numel)
    for rank in range(group_size):
        expected = [shard_of(g if g is not None else torch.zeros(p.shape), p.rows, rank).reshape(-1)
                    for p, g in zip(params, grads)]
        assert torch.equal(flat[rank], torch.cat(expected)), rank
    fulls = [torch.empty(shape) for shape in shapes]
    copy_gathered(unit, flat.view(-1), fulls)
    assert torch.equal(fulls[0], grads[0]) and torch.equal(fulls[1], grads[1])
    assert not fulls[2].any()


def test_sharding_axis_missing_from_mesh():
    with pytest.raises(PlanError, match=r"unknown mesh axis 'dp_shard' \(named by strategy 'zero3'"):
        plan_gpt("dp=4", [autopar.hsdp()])


def test_two_sharded_state_axes_are_refused():
    with pytest.raises(PlanError, match="each shard the training state"):
        plan_gpt("dp=2,tp=2", [autopar.zero(stage=3), autopar.zero(stage=1, axis="tp")])


def _step_with(rank: int, world: int, optimizer_name: str) -> str:
    torch.manual_seed(0)
    module = autopar.parallelize(GPT(CONFIG), "dp=2", strategies=[autopar.zero(stage=2)],
                                 example_inputs=example_batch(CONFIG))
    optimizer = getattr(torch.optim, optimizer_name)(module.parameters())
    module(*module.local_batch(*example_batch(CONFIG))).backward()
    try:
        optimizer.step(lambda: 0.0) if optimizer_name == "LBFGS" else optimizer.step()
    except PlanError as error:
        return str(error)
    return "stepped"


@pytest.mark.timeout(120)
def test_optimizer_that_cannot_run_on_shards_is_refused_before_its_step():
    assert launch(_step_with, 2, "LBFGS", timeout_s=90)[0].startswith("LBFGS cannot run on ZeRO shards")
    assert launch(_step_with, 2, "Adafactor", timeout_s=90)[0].startswith("Adafactor cannot run on ZeRO shards")
    assert launch(_step_with, 2, "SGD", timeout_s=90) == ["stepped", "stepped"]


def test_cli_compares_stages_side_by_side(capsys):
    from autopar.tools.cli import main

    assert main(["plan", "examples/gpt.py", "--mesh", "dp=4", "--compare-stages"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in
            ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")}
    assert list(rows) == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    held = {name: int(row[7].replace(",", "")) for name, row in rows.items()}
    assert held["DDP"] > held["ZeRO-1"] > held["ZeRO-2"] > held["ZeRO-3"]
    assert rows["DDP"][9] == rows["ZeRO-1"][9] == rows["ZeRO-2"][9]  # same wire bytes: 2(N-1)/N Psi


def test_comparing_stages_under_context_parallelism_counts_the_flattened_gradient_reduction():
    """Under dp × cp plain data parallelism reduces its gradients over the flattened dp+cp group,
    ZeRO over dp (then its shards over cp): a per-axis question about dp counts the dp+cp
    reduction with it, or DDP's row would show no gradient bytes at all."""
    from autopar.tools.stage_compare import compare_stages

    config = GPTConfig(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=32, d_ff=64)
    strategies = [autopar.data_parallel(), autopar.context_parallel()]
    ddp = plan_gpt("dp=2,cp=2", strategies, config)
    gradients = sum(b.numel * b.dtype.itemsize for b in ddp.buckets)
    assert {b.axes for b in ddp.buckets} == {("dp+cp",)}
    assert ddp.comm.total(axis="dp", phase="grad_sync") == 0
    assert ddp.comm.total(axis="dp", phase="grad_sync", joined=True) == gradients
    assert ddp.comm.total(axis="cp", phase="grad_sync", joined=True) == gradients
    rows = compare_stages(GPT(config), "dp=2,cp=2", strategies=strategies, example_inputs=example_batch(config),
                          stages=(0, 2))
    assert rows[0]["comm bytes"] >= gradients  # DDP: its gradients, over dp+cp
    assert rows[1]["comm bytes"] >= 2 * gradients  # ZeRO-2: reduce-scatter and all-gather over dp
