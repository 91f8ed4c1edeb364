"""The HTML view of a plan opens in a real browser: headless Chromium renders the graph (one element
per node, collectives marked) and the per-layer ledger, and a screenshot of it is not blank; the
pipeline timeline (SVG, and the page's pipeline panel) renders one block per scheduled action."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import autopar
from autopar.compiler.plan_file import plan_document
from autopar.tools.views.html import layer_of, ledger_rows, render_html
from examples.gpt import example

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def document() -> dict:
    model, batch = example()
    plan = autopar.plan(model, "dp=2,tp=2", strategies=[autopar.data_parallel(), autopar.sequence_parallel()],
                        example_inputs=batch, dynamic_dims={"b": 0, "s": 1})
    return plan_document(plan)


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found; install the Debian package `chromium` to run the browser check")
    result = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_layer_of_reads_layer_numbers():
    assert [layer_of(m) for m in ("layers.3.mlp", "layer.12", "transformer.h.0.attn", "embed_tokens", "bucket 0")] \
        == ["3", "12", "0", "other", "other"]


def test_ledger_rows_sum_per_layer(document):
    rows = ledger_rows(document["collectives"])
    assert sum(row["count"] for row in rows) == len(document["collectives"])
    assert sum(row["bytes_value"] for row in rows) == sum(e["bytes_value"] for e in document["collectives"])
    assert [row["layer"] for row in rows][-1] == "other" and {"0", "1"} <= {row["layer"] for row in rows}


def test_page_is_self_contained_and_escaped(document):
    hostile = dict(document, nodes=[dict(document["nodes"][0], name="<script>x</script>")] + document["nodes"][1:])
    page = render_html(hostile, title="a <b> & c")
    assert "<script>x</script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    assert "a &lt;b&gt; &amp; c" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "page must not load anything external"


def test_chromium_renders_graph_and_ledger(document, tmp_path):
    page = tmp_path / "plan.html"
    page.write_text(render_html(document, title="example GPT dp=2,tp=2 sp"))
    dom = chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile-dom").stdout
    assert 'id="graph"' in dom and 'id="ledger"' in dom
    assert len(re.findall(r'class="node[ "]', dom)) == len(document["nodes"])
    collectives = sum(node["kind"] == "collective" for node in document["nodes"])
    assert len(re.findall(r'class="node collective"', dom)) == collectives > 0
    ledger = dom[dom.index('id="ledger"'):]
    ledger = ledger[:ledger.index("</table>")]
    assert "<td>all_gather</td>" in ledger and "<td>reduce_scatter</td>" in ledger and "<td>tp</td>" in ledger

    shot = tmp_path / "plan.png"
    chromium(f"--screenshot={shot}", "--window-size=1400,1000", page.as_uri(), profile=tmp_path / "profile-shot")
    assert shot.exists() and shot.stat().st_size > 10_000


@pytest.fixture(scope="module")
def pipeline_plan() -> autopar.Plan:
    model, batch = example()
    return autopar.plan(model, "pp=2", strategies=[autopar.pipeline_parallel(schedule="zb_h1", microbatches=4)],
                        example_inputs=batch)


def test_chromium_renders_the_pipeline_timeline(pipeline_plan, tmp_path):
    """The timeline SVG (`autopar plan --timeline`) and the HTML view's pipeline panel open in the
    browser with one block per action of the schedule: F, B and W of 2 stages x 4 micro-batches."""
    from autopar.compiler.ledger.bubble import build_bubble_ledger
    from autopar.tools.views.timeline import render_timeline

    timeline = build_bubble_ledger(pipeline_plan).timeline
    assert len(timeline) == 3 * 2 * 4
    svg = tmp_path / "step.svg"
    svg.write_text(render_timeline(predicted=timeline, title="zb_h1"))
    dom = chromium("--dump-dom", svg.as_uri(), profile=tmp_path / "profile-svg").stdout
    assert len(re.findall(r'class="action"', dom)) == len(timeline)
    assert "pp rank 0" in dom and "pp rank 1" in dom and "idle per rank" in dom

    page = tmp_path / "pipeline.html"
    page.write_text(render_html(plan_document(pipeline_plan), title="example GPT pp=2 zb_h1"))
    dom = chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile-page").stdout
    panel = dom[dom.index('id="pipeline-panel"'):]
    assert len(re.findall(r'class="action"', panel)) == len(timeline)
    assert len(re.findall(r"<tr><td", panel[:panel.index("</table>")])) == 2  # the two stages
    shot = tmp_path / "step.png"
    chromium(f"--screenshot={shot}", "--window-size=1300,200", svg.as_uri(), profile=tmp_path / "profile-shot")
    assert shot.exists() and shot.stat().st_size > 3_000
