"""The pipeline timeline as a picture: one row per pipeline rank, one block per action.

`render_timeline(predicted=..., measured=...)` returns a self-contained SVG with up to two panels
side by side, each on its own time axis from the step's first start to its last end: the
timeline the bubble ledger predicts (`ledger.bubble`, in units of the heaviest stage's forward)
and one a run recorded (`PipelineExecutor.timeline` of every rank, seconds; time blocked in a
receive is drawn hatched at the action's start). Forwards are blue, backwards green (with a
split backward: input gradient green, weight gradient orange), each labelled stage.micro-batch;
a thin line joins an action to the one on the next rank that waited for its send; white is idle.
Two actions of one rank that run at once (DualPipeV's overlapped pairs) share the row: the
forward in its top half, the backward in its bottom half. Each panel's title gives its idle
fraction per rank.
"""
from __future__ import annotations

import html
from typing import Sequence

from autopar.core.schedules import Timed, bubble_fractions

COLORS = {"F": "#4e79a7", "B": "#59a14f", "W": "#f28e2b"}
ROW, PANEL, LEFT, TOP = 26, 620, 64, 44


def _panel(timed: Sequence[Timed], *, x0: float, title: str, unit: str, waited: dict | None) -> list[str]:
    ranks = 1 + max(t.rank for t in timed)
    begin, end = min(t.start for t in timed), max(t.end for t in timed)
    scale = (PANEL - LEFT - 10) / ((end - begin) or 1.0)
    fractions = bubble_fractions(list(timed), ranks)
    parts = [f'<text x="{x0 + 4}" y="16" class="title">{html.escape(title)}</text>',
             f'<text x="{x0 + 4}" y="32" class="sub">idle per rank: '
             + html.escape(", ".join(f"{f:.1%}" for f in fractions)) + f'; span {end - begin:.4g} {unit}</text>']
    for rank in range(ranks):
        y = TOP + rank * ROW
        parts.append(f'<rect x="{x0 + LEFT}" y="{y}" width="{PANEL - LEFT - 10}" height="{ROW - 6}" class="lane"/>')
        parts.append(f'<text x="{x0 + 4}" y="{y + ROW / 2}" class="rank">pp rank {rank}</text>')
    where = {}
    shared = _side_by_side(timed)
    for t in timed:
        x, width = x0 + LEFT + (t.start - begin) * scale, max((t.end - t.start) * scale, 0.6)
        y = TOP + t.rank * ROW
        height = (ROW - 6) / 2 if t in shared else ROW - 6
        top = y + height if t in shared and t.action.kind != "F" else y
        where[(t.action.kind, t.action.stage, t.action.microbatch)] = (x, width, y)
        label = f"{t.action.kind}{t.action.stage}.{t.action.microbatch}"
        parts.append(f'<rect x="{x:.2f}" y="{top:.1f}" width="{width:.2f}" height="{height:.1f}" '
                     f'fill="{COLORS[t.action.kind]}" class="action"><title>{label}: {t.start - begin:.4g} to '
                     f'{t.end - begin:.4g} {unit}</title></rect>')
        blocked = (waited or {}).get((t.rank, t.action.kind, t.action.stage, t.action.microbatch), 0.0)
        if blocked > 0:
            parts.append(f'<rect x="{x - blocked * scale:.2f}" y="{y}" width="{blocked * scale:.2f}" height="{ROW - 6}" '
                         f'class="waited"/>')
        if width > 7 * len(label):
            parts.append(f'<text x="{x + 2:.2f}" y="{y + ROW / 2 - 2}" class="label">{label}</text>')
    for (kind, stage, micro), (x, width, y) in where.items():  # sends: forward to the next stage, backward back
        peer = where.get((kind, stage + 1, micro)) if kind == "F" else where.get(("B", stage - 1, micro)) \
            if kind == "B" else None
        if peer is not None and peer[2] != y:
            parts.append(f'<line x1="{x + width:.2f}" y1="{y + ROW - 6}" x2="{peer[0]:.2f}" y2="{peer[2]}" class="p2p"/>')
    return parts


def _side_by_side(timed: Sequence[Timed]) -> set[Timed]:
    """The actions that run while another action of their rank runs."""
    by_rank: dict[int, list[Timed]] = {}
    for t in timed:
        if t.end > t.start:
            by_rank.setdefault(t.rank, []).append(t)
    shared = set()
    for actions in by_rank.values():
        actions.sort(key=lambda t: t.start)
        for first, second in zip(actions, actions[1:]):
            if second.start < first.end:
                shared |= {first, second}
    return shared


def render_timeline(*, predicted: Sequence[Timed] | None = None, measured: Sequence[Timed] | None = None,
                    waited: dict | None = None, title: str = "pipeline step") -> str:
    """An SVG of one pipeline step (see the module docstring); `waited` maps (rank, kind, stage,
    micro-batch) of measured actions to seconds blocked in receives before their compute."""
    panels = [(p, name, unit, w) for p, name, unit, w in (
        (predicted, "predicted (bubble ledger)", "forward units", None),
        (measured, "measured (this run)", "s", waited)) if p]
    if not panels:
        raise ValueError("render_timeline needs a predicted or a measured timeline")
    ranks = max(1 + max(t.rank for t in p) for p, *_ in panels)
    width, height = PANEL * len(panels), TOP + ranks * ROW + 24
    body = []
    for index, (timed, name, unit, blocked) in enumerate(panels):
        body += _panel(timed, x0=index * PANEL, title=f"{title}: {name}", unit=unit, waited=blocked)
    legend = " ".join(f'<tspan fill="{c}">■</tspan> {k}' for k, c in COLORS.items())
    style = ("text{font:11px monospace;dominant-baseline:middle}.title{font-weight:bold}.sub{fill:#444}"
             ".lane{fill:#f4f5f7}.action{stroke:#fff;stroke-width:0.5}.label{fill:#fff;font-size:9px}"
             ".waited{fill:url(#hatch)}.p2p{stroke:#999;stroke-width:0.6}.rank{fill:#333}")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}"><style>{style}</style><defs><pattern id="hatch" width="4" height="4" '
            f'patternUnits="userSpaceOnUse"><path d="M0,4 L4,0" stroke="#bbb"/></pattern></defs>'
            f'<rect width="{width}" height="{height}" fill="#fff"/>' + "".join(body)
            + f'<text x="4" y="{height - 10}">{legend}; white: idle; hatched: waiting for a receive</text></svg>')
