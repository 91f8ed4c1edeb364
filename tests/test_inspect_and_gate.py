"""Plan files, plan diffs, the communication gate and explain: round trips, exit codes, and a
gate that fails when a strategy change adds communication and names the axis and kind."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import autopar
from autopar import PlanError
from autopar.tools.plan_diff import diff_plans
from autopar.compiler.plan_file import load_plan, save_plan
from autopar.compiler.strategies.layouts import EXAMPLE_GPT
from autopar.tools.comm_gate import comm_summary, compare, load_baseline, save_baseline
from autopar.tools.testing import assert_comm_within_baseline, rewrite_reference
from examples.gpt import example
from tests.cli_in_process import run_cli

BASELINES = Path(__file__).parent.parent / "baselines"
EXAMPLES = {
    "example_gpt_dp2": ("dp=2", [autopar.data_parallel]),
    "example_gpt_tp2": ("tp=2", [autopar.tensor_parallel]),
    "example_gpt_tp2_sp": ("tp=2", [autopar.sequence_parallel]),
    "example_gpt_dp2_tp2_sp": ("dp=2,tp=2", [autopar.data_parallel, autopar.sequence_parallel]),
    "example_gpt_pp2_dp2": ("pp=2,dp=2", [autopar.pipeline_parallel, autopar.data_parallel]),
}
# a "regression": the MLP's down projection no longer row-parallel; autopar then slices its weight
# locally and must all-reduce the weight's gradient over tp every step
NO_ROW_PARALLEL_MLP = dataclasses.replace(EXAMPLE_GPT, row=("*layers.*.attn.o_proj",))


def plan_example(mesh: str, strategies: list, **options) -> autopar.Plan:
    model, batch = example()
    return autopar.plan(model, mesh, strategies=strategies, example_inputs=batch, **options)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_examples_stay_within_their_committed_baselines(name):
    mesh, makers = EXAMPLES[name]
    assert_comm_within_baseline(plan_example(mesh, [m() for m in makers]), BASELINES / f"{name}.json")


def test_gate_fails_naming_axis_and_kind_when_a_strategy_adds_communication():
    regressed = plan_example("tp=2", [autopar.tensor_parallel(layout=NO_ROW_PARALLEL_MLP)])
    with pytest.raises(AssertionError) as failure:
        assert_comm_within_baseline(regressed, BASELINES / "example_gpt_tp2.json")
    grew = [line.split() for line in str(failure.value).splitlines() if line.rstrip().endswith(("GREW", "NEW"))]
    assert [(row[0], row[2], row[-1]) for row in grew] == [("tp", "all_reduce", "GREW")]


def test_gate_fails_when_communication_shrinks_unexplained(tmp_path):
    """A ledger that drops bytes (an entry lost, a reduction skipped) reads as an improvement: the gate
    fails on it as on growth, until the smaller baseline is accepted on purpose."""
    baseline = tmp_path / "baseline.json"
    save_baseline(comm_summary(plan_example("tp=2", [autopar.tensor_parallel(layout=NO_ROW_PARALLEL_MLP)])), baseline)
    with pytest.raises(AssertionError) as failure:
        assert_comm_within_baseline(plan_example("tp=2", [autopar.tensor_parallel()]), baseline)
    assert "all_reduce on tp (SHRANK)" in str(failure.value)
    before = comm_summary(plan_example("tp=2", [autopar.tensor_parallel()]))
    gone = dict(before, volumes=before["volumes"] + [{"axis": "tp", "link": "intra", "kind": "all_to_all",
                                                      "dtype": "float32",
                                                      "calls": 1, "bytes": 8}])
    result = compare(gone, before)
    assert not result.passed and [row[-1] for row in result.shrank] == ["GONE"]


def test_gate_fails_when_a_collective_widens_even_within_tolerance():
    """FSDP planned to gather bf16 parameters (and reduce bf16 gradients) against the same plan
    gathering fp32: the bytes double, inside a 150% tolerance, and the gate still fails on the
    dtype (torchtitan's issue 3123: bf16 gathered where fp8 was configured, no warning)."""
    narrow = comm_summary(plan_example("dp=2", [autopar.fsdp(param_dtype=torch.bfloat16)]))
    wide = comm_summary(plan_example("dp=2", [autopar.fsdp()]))
    assert {v["dtype"] for v in narrow["volumes"]} == {"bfloat16"}
    result = compare(narrow, wide, tolerance_pct=150)
    assert not result.passed
    assert {(row[2], row[3], row[-1]) for row in result.grew} == {
        ("all_gather", "float32", "WIDENED"), ("reduce_scatter", "float32", "WIDENED"),
        ("all_reduce", "float32", "WIDENED")}
    assert "all_gather on dp (WIDENED)" in result.failures()
    back = compare(wide, narrow, tolerance_pct=150)
    assert not back.passed and {row[-1] for row in back.shrank} == {"NARROWED", "GONE"}


def test_update_modes_print_the_change_and_fail_unless_accepted(tmp_path, monkeypatch, capsys):
    """AUTOPAR_UPDATE_BASELINES / AUTOPAR_UPDATE_GOLDEN print what a rewrite would change and fail,
    writing nothing; only AUTOPAR_ACCEPT=1 rewrites the file and passes. An unchanged file passes
    quietly."""
    plan = plan_example("tp=2", [autopar.tensor_parallel()])
    baseline = tmp_path / "baseline.json"
    baseline.write_text((BASELINES / "example_gpt_tp2.json").read_text())
    monkeypatch.setenv("AUTOPAR_UPDATE_BASELINES", "1")
    assert_comm_within_baseline(plan, baseline)
    regressed = plan_example("tp=2", [autopar.tensor_parallel(layout=NO_ROW_PARALLEL_MLP)])
    with pytest.raises(AssertionError, match="AUTOPAR_ACCEPT=1") as failure:
        assert_comm_within_baseline(regressed, baseline)
    assert "GREW" in str(failure.value) and "GREW" in capsys.readouterr().out
    assert load_baseline(baseline) == comm_summary(plan)  # nothing written until accepted
    golden = tmp_path / "golden.txt"
    golden.write_text("a\nb\n")
    with pytest.raises(AssertionError, match=r"(?s)-b\n\+c\n.*AUTOPAR_ACCEPT=1"):
        rewrite_reference(golden, "a\nc\n")
    assert golden.read_text() == "a\nb\n"
    monkeypatch.setenv("AUTOPAR_ACCEPT", "1")
    rewrite_reference(golden, "a\nd\n")
    assert_comm_within_baseline(regressed, baseline)
    assert golden.read_text() == "a\nd\n" and load_baseline(baseline) == comm_summary(regressed)


def test_plan_file_round_trip_gives_identical_reports(tmp_path):
    plan = plan_example("dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()],
                        dynamic_dims={"b": 0, "s": 1}, explain=True)
    save_plan(plan, tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.report() == plan.report()
    assert str(loaded.comm.total(axis="tp")) == str(plan.comm.total(axis="tp"))
    save_plan(loaded, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == (tmp_path / "plan.json").read_text()


def test_plan_file_of_another_schema_is_refused(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": "autopar.plan/0", "nodes": []}))
    with pytest.raises(PlanError, match=r"schema 'autopar.plan/0', this autopar reads 'autopar.plan/2'.*--save"):
        load_plan(path)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(PlanError, match="cannot read plan file"):
        load_plan(tmp_path / "broken.json")


def test_diff_names_changed_placements_new_collectives_and_growth(tmp_path):
    save_plan(plan_example("tp=2", [autopar.tensor_parallel()]), tmp_path / "a.json")
    save_plan(plan_example("tp=2", [autopar.tensor_parallel(layout=NO_ROW_PARALLEL_MLP)]), tmp_path / "b.json")
    result = diff_plans(load_plan(tmp_path / "a.json"), load_plan(tmp_path / "b.json"))
    assert result.grew
    assert ["layers.0.mlp.down_proj.weight", "S(1)", "R"] in [row[1:] for row in result.placements]
    assert any(row[0] == "grad_sync" and row[2] == "tp" and row[4] == 0 for row in result.collectives)
    cli = run_cli("diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert cli.returncode == 1 and "communication grew" in cli.stdout
    same = run_cli("diff", str(tmp_path / "a.json"), str(tmp_path / "a.json"))
    assert same.returncode == 0 and "no communication grew" in same.stdout


def test_check_cli_exit_codes(tmp_path):
    args = ["check", "examples/gpt.py", "--mesh", "tp=2", "--strategy", "tp"]
    assert run_cli(*args, "--baseline", str(BASELINES / "example_gpt_tp2.json")).returncode == 0
    tight = json.loads((BASELINES / "example_gpt_tp2.json").read_text())
    tight["volumes"][0]["bytes"] -= 4
    (tmp_path / "tight.json").write_text(json.dumps(tight))
    failed = run_cli(*args, "--baseline", str(tmp_path / "tight.json"))
    assert failed.returncode == 1 and "GREW" in failed.stdout and "FAILED" in failed.stdout
    assert run_cli(*args, "--baseline", str(tmp_path / "tight.json"), "--tolerance", "1").returncode == 0
    missing = run_cli(*args, "--baseline", str(tmp_path / "missing.json"))
    assert missing.returncode == 2 and "--update" in missing.stderr
    loose = json.loads((BASELINES / "example_gpt_tp2.json").read_text())
    loose["volumes"][0]["bytes"] += 4
    (tmp_path / "loose.json").write_text(json.dumps(loose))
    shrank = run_cli(*args, "--baseline", str(tmp_path / "loose.json"))
    assert shrank.returncode == 1 and "SHRANK" in shrank.stdout and "FAILED" in shrank.stdout
    # --update says what a rewrite would change and writes nothing; --update --accept rewrites
    shown = run_cli(*args, "--baseline", str(tmp_path / "tight.json"), "--update")
    assert shown.returncode == 1 and "would change" in shown.stdout and "GREW" in shown.stdout
    assert json.loads((tmp_path / "tight.json").read_text()) == tight
    updated = run_cli(*args, "--baseline", str(tmp_path / "tight.json"), "--update", "--accept")
    assert updated.returncode == 0 and "rewritten; what changed" in updated.stdout and "GREW" in updated.stdout
    assert f"total bytes {tight['total_bytes']} ->" in updated.stdout
    assert run_cli(*args, "--baseline", str(tmp_path / "tight.json")).returncode == 0
    again = run_cli(*args, "--baseline", str(tmp_path / "tight.json"), "--update")
    assert again.returncode == 0 and "unchanged" in again.stdout


def test_explain_says_which_rule_and_which_alternatives(tmp_path):
    assert run_cli("plan", "examples/gpt.py", "--mesh", "dp=2,tp=2", "--strategy", "dp,sp",
                   "--save", str(tmp_path / "plan.json")).returncode == 0
    param = run_cli("explain", str(tmp_path / "plan.json"), "layers.0.attn.q_proj.weight")
    assert param.returncode == 0 and "column of attention pattern in layers.0.attn" in param.stdout
    assert "synchronised over dp" in param.stdout
    op = run_cli("explain", str(tmp_path / "plan.json"), "layers.0.attn.q_proj")
    assert "entering layers.0.attn" in op.stdout and "alternative:" in op.stdout and "redistribution cost" in op.stdout
    unknown = run_cli("explain", str(tmp_path / "plan.json"), "no.such.module")
    assert unknown.returncode == 2 and "no node, parameter or module" in unknown.stderr


def test_graph_views_annotate_and_diff():
    annotated = run_cli("graph", "examples/gpt.py", "--mesh", "dp=2,tp=2", "--strategy", "dp,sp", "--rank", "1")
    assert annotated.returncode == 0
    assert any("all_gather" in line and "# S(0),R  <- all_gather over tp" in line for line in annotated.stdout.splitlines())
    diff = run_cli("graph", "examples/gpt.py", "--mesh", "tp=2", "--rank", "1", "--diff")
    assert diff.returncode == 0 and "+++ rank 1" in diff.stdout and "+    all_reduce" in diff.stdout
