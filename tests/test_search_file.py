"""Search files: `autopar plan TARGET --cluster NAME --auto --save search.json` keeps the search, and
`autopar explain search.json` prints its answer and ranking again without tracing or searching.

The CLI runs in process (`tests/cli_in_process.py`), so the test can take the search away: with
`search`, `load_target` and `winner_plan` replaced by functions that raise, `explain search.json`
must still print exactly what the search printed. A live composed search saved and loaded back
renders as `SearchResult.table()` and `SearchResult.explain()` do. Refusals name the file: a search
file of another version, a plan file given where a search file is wanted, JSON that is neither.
"""
from __future__ import annotations

import json

import pytest
import torch

import autopar.tools.cli as cli
from autopar import Cluster, PlanError, SearchSpace, search
from autopar.compiler.plan_file import PlanDocument, save_plan
from autopar.planner.search_file import SCHEMA, load_search, save_search, search_document
from examples.gpt import GPT, GPTConfig, example_batch
from tests.cli_in_process import run_cli

TARGET = ("examples.gpt:example", "--cluster", "cpu2x4", "--axes", "dp", "--top", "3")
SAVED_LINE = "\n\nthe search saved to "


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, str]:
    """The search file and what `plan --auto --save` printed before its closing line."""
    path = str(tmp_path_factory.mktemp("search") / "search.json")
    result = run_cli("plan", *TARGET, "--auto", "--save", path)
    assert result.returncode == 0, result.stderr
    printed, _, closing = result.stdout.partition(SAVED_LINE)
    assert closing.startswith(path), result.stdout
    return path, printed


def _no_search(*_, **__):
    raise AssertionError("explain of a search file searched, traced or planned")


def test_the_file_holds_the_winner_the_ranking_and_what_was_searched(saved):
    path, _ = saved
    data = json.loads(open(path).read())
    assert data["schema"] == SCHEMA and data["autopar"] and data["target"] == "examples.gpt:example"
    assert data["cluster"]["name"] == "cpu2x4" and data["cluster"]["figures"]["memory_gb"] == 6.3
    assert (data["batch"], data["sequence"], data["axes"]) == (8, 16, ["dp"])
    labels = [row["candidate"] for row in data["candidates"]]
    assert sorted(labels) == ["dp4", "dp4 zero1", "dp4 zero2", "dp4 zero3"]  # every one, not only --top 3
    chosen = data["chosen"]
    assert chosen == data["candidates"][0] and chosen["mesh"] == "dp=4" and chosen["why_not_chosen"] == "chosen"
    assert chosen["strategies"] == [{"name": "data_parallel", "axis": "dp"}]
    priced = chosen["estimate"]
    assert priced["fits"] and priced["peak_bytes"] > 0 and priced["binding"].startswith("communication")
    assert priced["step_seconds"] == pytest.approx(sum(priced["parts"].values()))
    steps = [row["estimate"]["step_seconds"] for row in data["candidates"]]
    assert steps == sorted(steps)
    assert all(row["why_not_chosen"].startswith("+") for row in data["candidates"][1:])
    assert data["plan"]["schema"] == "autopar.plan/2"  # the chosen plan, for `explain search.json NODE`


def test_explain_prints_what_the_search_printed_without_searching(saved, monkeypatch):
    path, printed = saved
    for name in ("search", "load_target", "winner_plan", "plan"):
        monkeypatch.setattr(cli, name, _no_search)
    explained = run_cli("explain", path, "--top", "3")
    assert explained.returncode == 0, explained.stderr
    assert explained.stdout == printed + "\n"
    answer, _, table = explained.stdout.partition("\n\n")
    assert answer.startswith("chosen: dp4 (mesh dp=4) on cpu2x4: ") and "\nbinding constraint: communication" in answer
    assert "\nstep parts: compute " in answer and "\nwhy: the fastest of the 4 candidates" in answer
    rows = [line for line in table.splitlines() if line[:1].isdigit()]
    assert len(rows) == 3 and all(", comm " in row and " ms, optimizer " in row for row in rows)
    node = run_cli("explain", path, "layers.0.mlp")  # a node of the chosen plan, still nothing searched
    assert node.returncode == 0 and "module layers.0.mlp" in node.stdout, node.stderr


def test_explain_of_a_target_searches_and_prints_the_same(saved):
    path, printed = saved
    searched = run_cli("explain", *TARGET)
    assert searched.returncode == 0, searched.stderr

    def timeless(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("searched ")]
    assert timeless(searched.stdout) == timeless(printed)


def test_a_search_file_of_another_version_or_kind_is_refused_by_name(saved, tmp_path):
    path, _ = saved
    data = json.loads(open(path).read())
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**data, "schema": "autopar.search/0"}))
    refused = run_cli("explain", str(old))
    assert refused.returncode == 2
    assert f"search file {old} has schema 'autopar.search/0'" in refused.stderr and "search again" in refused.stderr
    plan_file = tmp_path / "plan.json"
    save_plan(PlanDocument(data["plan"]), plan_file)
    with pytest.raises(PlanError, match=f"{plan_file} is a plan file \\(autopar.plan/2\\), not a search file"):
        load_search(plan_file)
    as_plan = run_cli("explain", str(plan_file))  # a plan file is still a plan file: it wants a node
    assert as_plan.returncode == 2 and "needs a node name" in as_plan.stderr
    assert run_cli("explain", str(plan_file), "layers.0.mlp").returncode == 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    neither = run_cli("explain", str(other))
    assert neither.returncode == 2 and f"{other} is not an autopar search file" in neither.stderr
    same = run_cli("diff", path, str(plan_file))  # a search file's chosen plan diffs as a plan file
    assert same.returncode == 0, same.stderr
    with_cluster = run_cli("explain", path, "--cluster", "cpu2x4")
    assert with_cluster.returncode == 2 and "--cluster and --axes are for a TARGET" in with_cluster.stderr


def test_a_composed_search_saved_and_loaded_renders_as_the_live_result(tmp_path):
    """Memory between dp4's peak and dp4 zero3's: a candidate that does not fit and a selective
    variant passed over unmeasured are in the report too."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
    node = Cluster(nodes=1, gpus_per_node=4, memory_gb=0.35 * 2 ** 20 / 1e9, intra_gbps=100, inter_gbps=10,
                   peak_tflops=10, name="node")
    result = search(GPT(config), node, example_inputs=example_batch(config, batch=8),
                    space=SearchSpace(axes=("dp",), zero_stages=(0, 3), recompute=("selective",)), method="blocks")
    save_search(search_document(result), tmp_path / "search.json")
    loaded = load_search(tmp_path / "search.json")
    assert loaded.answer() == result.explain() and loaded.table() == result.table()
    assert "not fitting in memory: 1 candidate(s), e.g. dp4: memory:" in loaded.answer()
    assert "with recomputation, not priced: 1 candidate(s)" in loaded.answer()
    assert loaded.data["method"] == "blocks" and loaded.data["pruned"][0]["peak_at_least"] > 0
    assert loaded.report(top=1) == result.explain() + "\n\n" + result.table(top=1)
    with pytest.raises(PlanError, match="holds no plan of the chosen layout"):
        loaded.winner_plan()
