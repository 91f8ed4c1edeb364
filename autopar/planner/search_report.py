"""The search's report: its result as plain data, and the two texts read off that data.

`search_data(result)` turns a `SearchResult` (`autopar/planner/search.py`) into JSON-ready data: the
cluster (name and figures), the model facts the search used (batch, sequence), the axes searched
and the search method, the chosen candidate, every candidate in rank order (`candidate_row`:
layout, strategies, the estimate — peak memory per rank, bytes, predicted step and its parts,
binding constraint — or the compiler's refusal, and why it was not chosen), the candidates passed
over unplanned with their reasons, and the search's time.

Two renderings take only that data, so a live search and a search file (`search_file.py`) print
the same text: `answer(data)` — the chosen layout, its memory and step, the binding constraint, the
step's parts, and a short paragraph on why (the runner-up's margin, what did not fit, what was
refused or pruned) — and `ranking_table(data, top=)` — one row per candidate, its step's parts
named (`step_parts`). `report(data, top=)` is the answer, a blank line, then the table.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from autopar.compiler.strategies import Strategy
from autopar.cost.cluster import GB

if TYPE_CHECKING:
    from autopar.planner.search import SearchResult
    from autopar.planner.search_space import Outcome

MIB = 2 ** 20
PART_NAMES = {"compute": "compute", "communication": "comm", "bubble": "bubble", "optimizer": "optimizer"}


def search_data(result: "SearchResult") -> dict[str, Any]:
    """The search as plain data (module docstring); `report` and the search file read it."""
    facts = result.facts
    rows = [candidate_row(result, outcome) for outcome in result.outcomes]
    return {
        "cluster": {"name": result.cluster.label, "figures": _plain(dataclasses.asdict(result.cluster))},
        "batch": None if facts is None else facts.batch,
        "sequence": None if facts is None else facts.sequence,
        "axes": None if result.space is None else list(result.space.axes),
        "method": result.method,
        "seconds": result.seconds,
        "chosen": rows[0],
        "candidates": rows,
        "pruned": [{"candidate": p.candidate.label, "mesh": p.candidate.mesh_spec, "reason": p.reason,
                    "recompute": p.candidate.recompute, "regather": p.candidate.regather,
                    "peak_at_least": p.peak_at_least} for p in result.pruned],
    }


def candidate_row(result: "SearchResult", outcome: "Outcome") -> dict[str, Any]:
    """One ranked candidate: what it is, what it costs (or why the compiler refused it), why it lost."""
    candidate, priced = outcome.candidate, outcome.estimate
    return {
        "candidate": candidate.label,
        "mesh": candidate.mesh_spec,
        "layout": {"degrees": [[axis, size] for axis, size in candidate.degrees], "zero": candidate.zero,
                   "sequence_parallel": candidate.sequence_parallel, "schedule": candidate.schedule,
                   "microbatches": candidate.microbatches, "virtual_stages": candidate.virtual,
                   "recompute": candidate.recompute, "regather": candidate.regather,
                   "fold_experts": candidate.fold_experts},
        "strategies": [{"name": s.name, "axis": s.axis} for s in candidate.strategies(result.cluster.backend)
                       if isinstance(s, Strategy)],
        "estimate": None if priced is None else {
            "step_seconds": priced.seconds, "parts": dict(priced.parts), "peak_bytes": priced.peak_bytes,
            "wire_bytes": priced.wire_bytes, "comm_seconds": priced.comm_seconds, "held_bytes": priced.held_bytes,
            "memory": dict(priced.memory), "moments": dict(priced.moments), "comm_by_kind": dict(priced.comm_by_kind),
            "fits": priced.fits, "binding": priced.binding},
        "refused": outcome.refused,
        "why_not_chosen": result.why_lost(outcome),
    }


def _plain(value: Any) -> Any:
    """Tuples as lists, as JSON keeps them: data from a live search and from a file compare equal."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def step_parts(parts: dict[str, float]) -> str:
    """'compute 6.2 ms, comm 6.7 ms, bubble 2.6 ms, optimizer 1.1 ms' (comm: the exposed communication)."""
    return ", ".join(f"{PART_NAMES.get(name, name)} {seconds * 1e3:,.1f} ms" for name, seconds in parts.items()
                     if seconds)


def _memory(count: int) -> str:
    return f"{count / GB:.3g} GB" if count >= GB / 10 else f"{count / MIB:,.1f} MiB"


def ranking_table(data: dict[str, Any], *, top: int | None = None) -> str:
    """Every candidate (the first `top`), best first: memory, bytes, predicted step, its parts, why it lost."""
    rows = []
    for rank, row in enumerate(data["candidates"][:top] if top else data["candidates"], start=1):
        priced = row["estimate"]
        rows.append([rank, row["candidate"], row["mesh"],
                     "-" if priced is None else f"{priced['peak_bytes'] / MIB:,.1f}",
                     "-" if priced is None else f"{priced['wire_bytes'] / MIB:,.2f}",
                     "-" if priced is None else f"{priced['step_seconds'] * 1e3:,.2f}",
                     "-" if priced is None else step_parts(priced["parts"]),
                     row["why_not_chosen"]])
    return tabulate(rows, headers=["#", "candidate", "mesh", "peak MiB/rank", "wire MiB/step", "step ms",
                                   "step parts (comm: exposed)", "why not chosen"], disable_numparse=True)


def answer(data: dict[str, Any]) -> str:
    """The chosen layout, its memory and step, the binding constraint and why (module docstring)."""
    rows, cluster, best = data["candidates"], data["cluster"], data["chosen"]
    memory_gb = cluster["figures"]["memory_gb"]
    chosen = best["estimate"]
    lines = [f"chosen: {best['candidate']} (mesh {best['mesh']}) on {cluster['name']}: "
             f"{chosen['step_seconds'] * 1e3:,.2f} ms per step predicted, peak {_memory(chosen['peak_bytes'])} "
             f"of {memory_gb:g} GB per rank",
             f"binding constraint: {chosen['binding']}",
             f"step parts: {step_parts(chosen['parts'])}"]
    fitting = [row for row in rows if row["estimate"] is not None and row["estimate"]["fits"]]
    runner = fitting[1] if len(fitting) > 1 else None
    lines.append(f"why: the fastest of the {len(fitting)} candidates that fit in {memory_gb:g} GB per rank; "
                 f"runner-up {runner['candidate']}: {runner['why_not_chosen']}" if runner is not None
                 else f"why: the only candidate that fits in {memory_gb:g} GB per rank")
    lines += _passed_over(data)
    searched = f" of {data['target']}" if data.get("target") else ""
    shape = ", ".join(f"{name} {data[name]}" for name in ("batch", "sequence") if data.get(name) is not None)
    lines.append(f"searched {len(rows)} candidates{searched}" + (f" ({shape})" if shape else "")
                 + f" in {data['seconds']:.1f} s")
    return "\n".join(lines)


def _passed_over(data: dict[str, Any]) -> list[str]:
    """The lines on what did not fit, what the compiler refused and what was never planned."""
    rows, lines = data["candidates"], []
    unfit = [row for row in rows if row["estimate"] is not None and not row["estimate"]["fits"]]
    if unfit:
        lines.append(f"not fitting in memory: {len(unfit)} candidate(s), e.g. {unfit[0]['candidate']}: "
                     f"{unfit[0]['estimate']['binding']}")
    refused = [row for row in rows if row["refused"] is not None]
    by_rules = [p for p in data["pruned"] if p["recompute"] is None and not p.get("regather")]
    if refused or by_rules:
        example = (f"{by_rules[0]['candidate']}: {by_rules[0]['reason']}" if by_rules
                   else f"{refused[0]['candidate']}: {refused[0]['refused']}")
        lines.append(f"refused by the compiler: {len(refused)}, pruned by the rules: {len(by_rules)} (e.g. {example})")
    regathering = [p for p in data["pruned"] if p.get("regather")]
    if regathering:
        lines.append(f"with the re-gather in backward, not priced: {len(regathering)} candidate(s), slower than the "
                     f"winner already without it")
    bounded = [p for p in data["pruned"] if p["recompute"] is not None]
    if bounded:
        lines.append(f"with recomputation, not priced: {len(bounded)} candidate(s), slower than the winner "
                     f"already without it")
    return lines


def report(data: dict[str, Any], *, top: int | None = None) -> str:
    """The answer first, then the ranking: what `autopar plan --auto` and `autopar explain` print."""
    return answer(data) + "\n\n" + ranking_table(data, top=top)
