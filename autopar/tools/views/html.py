"""One self-contained HTML page of a plan document (`autopar.compiler.plan_file.plan_document`).

`render_html(document)` returns a page with inline CSS and JS only (no network, no server):

- header: mesh axes, sizes and links, strategies, traced symbol values, passes (`_header`);
- graph: an SVG drawn here, one row per node in the document's (topological) order, indented by
  module depth, filled with one colour per placement tuple (`_placement_colors`, legend in
  `_legend`), collectives with a thick red border and labelled with their op and mesh axis
  (`_node_label`), edges from each node's `inputs` bowing into a left gutter (`_edge_path`); the
  tooltip of a node is its SVG <title> (`_tooltip`); hovering a node highlights its edges (`_SCRIPT`);
- pipeline (a pipelined plan only): its stages and the predicted timeline of one step
  (`_pipeline_section`, drawn by autopar/tools/views/timeline.py);
- ledger: the communication entries grouped per layer (`layer_of`), then per (phase, kind, axis),
  with counts, byte sums and formulas (`ledger_rows`, `_ledger_table`), and totals per mesh axis
  (`_totals_table`);
- overlap: the collectives the scheduling pass leaves in flight over compute, with how many
  nodes and which run meanwhile (`_overlap_section`).

All text from the document is escaped with `html.escape`. The page is plain SVG and tables, drawn
in one pass, so graphs of a few thousand nodes open without freezing the browser.
"""
from __future__ import annotations

import html
import math
import re
from collections import Counter
from typing import Any

from autopar.core.schedules import Action, Timed
from autopar.tools.views.timeline import render_timeline

ROW_HEIGHT = 20
BOX_HEIGHT = 16
GUTTER = 130
INDENT = 14
CHAR_WIDTH = 6.7
LABEL_CHARS = 46
PHASE_ORDER = {"forward": 0, "backward": 1, "grad_sync": 2}
LAYER_PATTERN = re.compile(r"layers?\.(\d+)\.|\.h\.(\d+)\.")
PALETTE = ["#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7", "#fccde5", "#d9d9d9",
           "#bebada", "#80b1d3", "#ccebc5", "#ffed6f", "#fb9a99", "#e5c494"]
LEAF_KINDS = ("parameter", "input", "buffer", "constant")

_CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 0; color: #222; background: #fff; }
header { padding: 10px 16px; background: #f3f5f8; border-bottom: 1px solid #d8dde5; }
header h1 { font-size: 18px; margin: 0 0 4px; }
header p { margin: 2px 0; }
.tag { display: inline-block; padding: 0 6px; margin-right: 4px; border-radius: 3px; background: #e1e7f0; }
main { display: flex; flex-wrap: wrap; gap: 12px; padding: 8px 16px; align-items: flex-start; }
section { flex: 1 1 720px; min-width: 0; }
#ledger-panel { flex: 0 1 600px; }
section h2 { font-size: 15px; margin: 6px 0; }
#graph-panel { overflow: auto; max-height: calc(100vh - 150px); border: 1px solid #d8dde5; }
#ledger-panel { overflow: auto; max-height: calc(100vh - 110px); }
.legend span { display: inline-block; margin: 0 10px 4px 0; white-space: nowrap; font-family: monospace; }
.swatch { display: inline-block; width: 14px; height: 12px; vertical-align: middle; margin-right: 3px;
          border: 1px solid #777; }
.swatch.collective { border: 3px solid #d0021b; width: 10px; height: 8px; }
svg text { font: 11px monospace; dominant-baseline: middle; }
.node rect { stroke: #666; stroke-width: 1; }
.node.collective rect { stroke: #d0021b; stroke-width: 3; }
.node.collective text.label { font-weight: bold; fill: #8b0000; }
.node:hover rect { stroke: #000; stroke-width: 2; }
.module { fill: #666; font-style: italic; }
.band { fill: #f6f7f9; }
.edge { fill: none; stroke: #8a94a6; stroke-opacity: 0.35; stroke-width: 1; }
.edge.hot { stroke: #0b63ce; stroke-opacity: 1; stroke-width: 2; }
table { border-collapse: collapse; font-size: 12px; margin-bottom: 12px; }
th, td { border: 1px solid #d8dde5; padding: 2px 6px; text-align: left; }
th { background: #eef1f5; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.formula { font-family: monospace; }
tr.layer-start td { border-top: 2px solid #8a94a6; }
"""

_SCRIPT = """
(function () {
  var edges = {};
  document.querySelectorAll('#graph .edge').forEach(function (e) {
    [e.getAttribute('data-from'), e.getAttribute('data-to')].forEach(function (n) {
      (edges[n] = edges[n] || []).push(e);
    });
  });
  function mark(node, on) {
    (edges[node.getAttribute('data-name')] || []).forEach(function (e) { e.classList.toggle('hot', on); });
  }
  document.querySelectorAll('#graph .node').forEach(function (node) {
    node.addEventListener('mouseenter', function () { mark(node, true); });
    node.addEventListener('mouseleave', function () { mark(node, false); });
  });
})();
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def layer_of(module: str) -> str:
    """The layer number of a module path (`layers.3.mlp` -> "3", `h.0.attn` -> "0"), else "other"."""
    match = LAYER_PATTERN.search(module + ".")
    if match is None:
        return "other"
    return match.group(1) if match.group(1) is not None else match.group(2)


def _placement_key(node: dict[str, Any]) -> str:
    return ",".join(node["placements"])


def _placement_colors(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """One fill colour per distinct placement tuple, in order of first appearance."""
    colors: dict[str, str] = {}
    for node in nodes:
        key = _placement_key(node)
        if key not in colors:
            index = len(colors)
            colors[key] = (PALETTE[index] if index < len(PALETTE)
                           else f"hsl({(index * 137.5) % 360:.0f}, 65%, 80%)")
    return colors


def _header(document: dict[str, Any], *, title: str) -> str:
    mesh = document.get("mesh", {})
    links = mesh.get("links", {})
    axes = " × ".join(f"{_e(name)}={_e(size)} <small>({_e(links.get(name, '?'))})</small>"
                      for name, size in mesh.get("axes", []))
    world = math.prod(size for _, size in mesh.get("axes", [])) if mesh.get("axes") else 1
    per_node = mesh.get("ranks_per_node")
    strategies = "".join(f"<span class=\"tag\">{_e(s['name'])} on {_e(s['axis'])}</span>"
                         for s in document.get("strategies", []))
    symbols = ", ".join(f"{_e(k)}={_e(v)}" for k, v in document.get("symbols", {}).items()) or "none"
    passes = " → ".join(f"{_e(p['name'])} ({_e(p['nodes_in'])}→{_e(p['nodes_out'])})"
                        for p in document.get("passes", []))
    return (f"<header><h1>{_e(title)}</h1>"
            f"<p><b>mesh</b> {axes} &nbsp; {world} ranks"
            f"{f', {_e(per_node)} per node' if per_node else ''}</p>"
            f"<p><b>strategies</b> {strategies}</p>"
            f"<p><b>traced symbols</b> {symbols} &nbsp; <b>passes</b> {passes or 'none'}</p></header>")


def _legend(nodes: list[dict[str, Any]], colors: dict[str, str], *, axes: str) -> str:
    counts = Counter(_placement_key(node) for node in nodes)
    items = "".join(f"<span><i class=\"swatch\" style=\"background:{color}\"></i>{_e(key)} ({counts[key]})</span>"
                    for key, color in colors.items())
    collectives = sum(1 for node in nodes if node.get("kind") == "collective")
    return (f"<div class=\"legend\"><b>placement ({_e(axes)})</b>: {items}"
            f"<span><i class=\"swatch collective\"></i>collective ({collectives})</span></div>")


def _collective_label(node: dict[str, Any]) -> str:
    info = node.get("collective") or {}
    parts = [str(node["target"])]
    if "group" in info:
        parts.append(f"on {info['group']}")
    if "dim" in info:
        parts.append(f"dim {info['dim']}")
    if info.get("reduce_op"):
        parts.append(str(info["reduce_op"]))
    if info.get("grad_partial"):
        parts.append("(grad partial)")
    return " ".join(parts)


def _node_label(node: dict[str, Any]) -> str:
    kind = node.get("kind")
    if kind == "collective":
        text = "⇄ " + _collective_label(node)
    elif kind == "input":
        text = f"input {node['name']}"
    elif kind in LEAF_KINDS:
        text = f"{kind[:5]} {node['target']}"
    else:
        text = f"{node['name']} {node['target']}"
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"


def _tooltip(node: dict[str, Any]) -> str:
    lines = [f"{node['name']} ({node.get('kind')}): {node.get('target')}",
             f"module: {node.get('module') or '(top)'}",
             f"source: {node.get('source') or '-'}",
             f"global shape: {node.get('shape')}  local shape: {node.get('local_shape')}",
             f"placements: {_placement_key(node)}"]
    if node.get("collective"):
        lines.append(f"collective: {_collective_label(node)}")
    for key in ("rule", "origin"):
        if node.get(key):
            lines.append(f"{key}: {node[key]}")
    if node.get("grad_sync"):
        lines.append("grad sync over: " + ", ".join(node["grad_sync"]))
    return "\n".join(lines)


def _depth(node: dict[str, Any]) -> int:
    module = node.get("module") or ""
    return len(module.split(".")) if module else 0


def _edge_path(*, x_from: float, y_from: float, x_to: float, y_to: float) -> str:
    bow = min(GUTTER - 8, 12 + 5 * math.sqrt(abs(y_to - y_from) / ROW_HEIGHT))
    return (f"M{x_from:.0f},{y_from:.0f} C{x_from - bow:.0f},{y_from:.0f} "
            f"{x_to - bow:.0f},{y_to:.0f} {x_to:.0f},{y_to:.0f}")


def _bands(nodes: list[dict[str, Any]], *, width: float) -> list[str]:
    """Shade alternate runs of consecutive nodes of the same layer, so layers read as blocks."""
    layers = [layer_of(node.get("module") or "") for node in nodes]
    shapes, start, shade = [], 0, False
    for index in range(1, len(nodes) + 1):
        if index == len(nodes) or layers[index] != layers[start]:
            if shade:
                shapes.append(f"<rect class=\"band\" x=\"0\" y=\"{start * ROW_HEIGHT}\" width=\"{width:.0f}\" "
                              f"height=\"{(index - start) * ROW_HEIGHT}\"/>")
            start, shade = index, not shade
    return shapes


def _graph_svg(nodes: list[dict[str, Any]], colors: dict[str, str]) -> str:
    labels = [_node_label(node) for node in nodes]
    label_width = max((len(text) for text in labels), default=10) * CHAR_WIDTH
    place_width = max((len(_placement_key(node)) for node in nodes), default=3) * CHAR_WIDTH
    box_width = label_width + place_width + 24
    x_of = [GUTTER + _depth(node) * INDENT for node in nodes]
    module_x = max(x_of, default=GUTTER) + box_width + 12
    width = module_x + 260
    row_of = {node["name"]: index for index, node in enumerate(nodes)}
    parts = _bands(nodes, width=width)
    for index, node in enumerate(nodes):
        y_to = index * ROW_HEIGHT + ROW_HEIGHT / 2
        for name in node.get("inputs", []):
            source = row_of.get(name)
            if source is None or source == index:
                continue
            path = _edge_path(x_from=x_of[source], y_from=source * ROW_HEIGHT + ROW_HEIGHT / 2,
                              x_to=x_of[index], y_to=y_to)
            parts.append(f"<path class=\"edge\" data-from=\"{_e(name)}\" data-to=\"{_e(node['name'])}\" "
                         f"d=\"{path}\"/>")
    previous_module = None
    for index, node in enumerate(nodes):
        parts.append(_node_svg(node, label=labels[index], color=colors[_placement_key(node)], x=x_of[index],
                               y=index * ROW_HEIGHT, box_width=box_width, place_width=place_width))
        module = node.get("module") or ""
        if module and module != previous_module:
            parts.append(f"<text class=\"module\" x=\"{module_x:.0f}\" y=\"{index * ROW_HEIGHT + ROW_HEIGHT / 2:.0f}\">"
                         f"{_e(module)}</text>")
        previous_module = module
    height = max(len(nodes), 1) * ROW_HEIGHT
    return (f"<svg id=\"graph\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0f}\" height=\"{height}\" "
            f"viewBox=\"0 0 {width:.0f} {height}\">" + "\n".join(parts) + "</svg>")


def _node_svg(node: dict[str, Any], *, label: str, color: str, x: float, y: float, box_width: float,
              place_width: float) -> str:
    css = "node collective" if node.get("kind") == "collective" else "node"
    top = y + (ROW_HEIGHT - BOX_HEIGHT) / 2
    middle = y + ROW_HEIGHT / 2
    name = _e(node["name"])
    return (f"<g class=\"{css}\" id=\"node-{name}\" data-name=\"{name}\"><title>{_e(_tooltip(node))}</title>"
            f"<rect x=\"{x:.0f}\" y=\"{top:.0f}\" width=\"{box_width:.0f}\" height=\"{BOX_HEIGHT}\" rx=\"3\" "
            f"fill=\"{color}\"/>"
            f"<text class=\"label\" x=\"{x + 5:.0f}\" y=\"{middle:.0f}\">{_e(label)}</text>"
            f"<text x=\"{x + box_width - place_width - 6:.0f}\" y=\"{middle:.0f}\">"
            f"{_e(_placement_key(node))}</text></g>")


def _formula(entries: list[dict[str, Any]]) -> str:
    """The byte formulas of a group of entries: `3 × 64*b*s`, or distinct formulas joined with ` + `."""
    counts: Counter = Counter()
    for entry in entries:
        counts[entry["bytes"]] += entry.get("times", 1)
    return " + ".join(formula if count == 1 else f"{count} × {formula}" for formula, count in counts.items())


def _layer_sort_key(layer: str) -> tuple[int, int]:
    return (0, int(layer)) if layer.isdigit() else (1, 0)


def ledger_rows(collectives: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ledger entries summed per (layer, phase, kind, axis); layers in numeric order, "other" last."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for entry in collectives:
        key = (layer_of(entry.get("module") or ""), entry["phase"], entry["kind"], entry["axis"])
        groups.setdefault(key, []).append(entry)
    ordered = sorted(groups.items(), key=lambda item: (_layer_sort_key(item[0][0]), PHASE_ORDER.get(item[0][1], 9)))
    return [{"layer": layer, "phase": phase, "kind": kind, "axis": axis, "link": entries[0].get("link", ""),
             "count": sum(e.get("times", 1) for e in entries),
             "bytes_value": sum(e.get("times", 1) * e["bytes_value"] for e in entries),
             "wire_bytes_value": sum(e.get("times", 1) * e["wire_bytes_value"] for e in entries),
             "formula": _formula(entries),
             "modules": sorted({e.get("module") or "" for e in entries})}
            for (layer, phase, kind, axis), entries in ordered]


def _ledger_table(rows: list[dict[str, Any]]) -> str:
    body, previous = [], None
    for row in rows:
        css = " class=\"layer-start\"" if row["layer"] != previous else ""
        layer = _e(row["layer"]) if row["layer"] != previous else ""
        previous = row["layer"]
        body.append(f"<tr{css} title=\"{_e(', '.join(row['modules']))}\"><td>{layer}</td><td>{_e(row['phase'])}</td>"
                    f"<td>{_e(row['kind'])}</td><td>{_e(row['axis'])}</td><td>{_e(row['link'])}</td>"
                    f"<td class=\"num\">{row['count']}</td><td class=\"formula\">{_e(row['formula'])}</td>"
                    f"<td class=\"num\">{row['bytes_value']:,}</td>"
                    f"<td class=\"num\">{row['wire_bytes_value']:,}</td></tr>")
    head = ("<tr><th>layer</th><th>phase</th><th>collective</th><th>axis</th><th>link</th><th>count</th>"
            "<th>bytes (formula)</th><th>bytes</th><th>wire bytes</th></tr>")
    return f"<table id=\"ledger\"><thead>{head}</thead><tbody>{''.join(body)}</tbody></table>"


def _totals_table(collectives: list[dict[str, Any]]) -> str:
    totals: dict[str, list[int]] = {}
    for entry in collectives:
        total = totals.setdefault(entry["axis"], [0, 0, 0])
        times = entry.get("times", 1)
        total[0] += times
        total[1] += times * entry["bytes_value"]
        total[2] += times * entry["wire_bytes_value"]
    rows = [(_e(axis), *values) for axis, values in totals.items()]
    rows.append(("<b>all</b>", *(sum(values[i] for values in totals.values()) for i in range(3))))
    body = "".join(f"<tr><td>{axis}</td><td class=\"num\">{count}</td><td class=\"num\">{logical:,}</td>"
                   f"<td class=\"num\">{wire:,}</td></tr>" for axis, count, logical, wire in rows)
    return ("<table id=\"ledger-totals\"><thead><tr><th>axis</th><th>collectives</th><th>bytes</th>"
            f"<th>wire bytes</th></tr></thead><tbody>{body}</tbody></table>")


def render_html(document: dict[str, Any], *, title: str = "autopar plan") -> str:
    """One self-contained HTML page showing the plan `document` (see module docstring)."""
    nodes = document.get("nodes", [])
    collectives = document.get("collectives", [])
    colors = _placement_colors(nodes)
    axes = ",".join(name for name, _ in document.get("mesh", {}).get("axes", []))
    graph = (f"<section><h2>Graph — {len(nodes)} nodes, topological order, indented by module depth</h2>"
             f"{_legend(nodes, colors, axes=axes)}<div id=\"graph-panel\">{_graph_svg(nodes, colors)}</div></section>")
    ledger = (f"<section id=\"ledger-panel\"><h2>Communication per step, per rank — by layer</h2>"
              f"{_ledger_table(ledger_rows(collectives))}<h2>Totals per mesh axis</h2>"
              f"{_totals_table(collectives)}</section>")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_e(title)}</title>"
            f"<style>{_CSS}</style></head><body>{_header(document, title=title)}"
            f"<main>{_pipeline_section(document)}{graph}{ledger}{_overlap_section(document)}</main>"
            f"<script>{_SCRIPT}</script></body></html>\n")


def _overlap_section(document: dict[str, Any]) -> str:
    """The collectives the scheduling pass left in flight over compute (autopar/compiler/passes/schedule_collectives.py)."""
    overlaps = [o for o in document.get("overlaps", []) if o["between"]]
    if not overlaps:
        return ""
    rows = "".join(f"<tr><td class=\"num\">{o['stage']}</td><td>{_e(o['start'])}</td><td>{_e(o['kind'])}</td>"
                   f"<td>{_e(o['axis'])}</td><td>{_e(o['module'])}</td><td class=\"num\">{o['between']}</td>"
                   f"<td>{_e(' … '.join(f'{n} ({m})' for n, m in o['over']))}</td></tr>" for o in overlaps)
    return (f"<section id=\"overlap-panel\"><h2>Collectives in flight over compute — {len(overlaps)} "
            f"steps</h2><table><thead><tr><th>stage</th><th>start</th><th>kind</th>"
            f"<th>axis</th><th>module</th><th>nodes over</th><th>first … last node over</th></tr></thead>"
            f"<tbody>{rows}</tbody></table></section>")


def _pipeline_section(document: dict[str, Any]) -> str:
    """A pipelined plan's stages and the predicted timeline of one step (autopar/tools/views/timeline.py)."""
    pipeline = document.get("pipeline")
    if not pipeline:
        return ""

    timed = [Timed(Action(kind, stage, micro), rank, start, end) for rank, kind, stage, micro, start, end
             in pipeline["timeline"]]
    rows = "".join(f"<tr><td class=\"num\">{s['index']}</td><td class=\"num\">{s['coordinate']}</td>"
                   f"<td class=\"num\">{s['forward_flops']:,}</td><td>{_e(', '.join(n for n, *_ in s['sends']))}</td></tr>"
                   for s in pipeline["stages"])
    return (f"<section id=\"pipeline-panel\" style=\"flex-basis:100%\"><h2>Pipeline on {_e(pipeline['axis'])}: "
            f"{_e(pipeline['schedule'])}, p={pipeline['degree']}, v={pipeline['virtual']}, "
            f"m={pipeline['microbatches']}</h2><table id=\"pipeline-stages\"><thead><tr><th>stage</th><th>pp rank</th>"
            f"<th>forward FLOPs</th><th>sends</th></tr></thead><tbody>{rows}</tbody></table>"
            f"{render_timeline(predicted=timed, title=pipeline['schedule'])}</section>")
