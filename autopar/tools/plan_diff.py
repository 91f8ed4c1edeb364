"""`autopar diff a.json b.json`: what changed between two plan files.

Three tables: placements that changed (parameters by FQN, activations by node name, grouped by
module), collectives that appeared or vanished (phase, kind, axis, module: count before and
after), bytes per rank per step by axis, link and kind before and after, and the memory ledger's
categories before and after (rank 0). `grew` is true when
any (axis, link, kind) moves more bytes in b than in a; the CLI's exit code says so.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from tabulate import tabulate

from autopar.compiler.plan_file import PlanDocument


@dataclass(frozen=True)
class PlanDiff:
    placements: list[list[str]]
    collectives: list[list[object]]
    volumes: list[list[object]]
    grew: bool
    memory: list[list[object]] = ()

    def report(self) -> str:
        parts = [
            "Placements that changed\n" + (tabulate(self.placements, headers=["module", "tensor", "before", "after"])
                                           if self.placements else "(none)"),
            "Collectives that appeared or vanished\n" + (tabulate(
                self.collectives, headers=["phase", "collective", "axis", "module", "before", "after"])
                if self.collectives else "(none)"),
            "Bytes per rank per step\n" + tabulate(
                self.volumes, headers=["axis", "link", "collective", "bytes before", "bytes after", "change"]),
            "Memory per rank (rank 0)\n" + (tabulate(self.memory, headers=["category", "bytes before", "bytes after",
                                                                            "change"]) if self.memory else "(none)"),
            "communication grew" if self.grew else "no communication grew",
        ]
        return "\n\n".join(parts)


def _placements(document: PlanDocument) -> dict[str, tuple[str, str]]:
    return {(n["target"] if n["kind"] == "parameter" else n["name"]): (n["module"], ",".join(n["placements"])
                                                                        + _stage_note(n))
            for n in document.data["nodes"] if n["kind"] != "collective"}


def _stage_note(node: dict) -> str:
    """A pipelined plan's node also says which stage(s) compute or hold it: moving is a change."""
    stages = node.get("stage") or []
    return f" @stage {','.join(map(str, stages))}" if stages else ""


def _volumes(document: PlanDocument) -> dict[tuple[str, str, str], int]:
    totals: dict[tuple[str, str, str], int] = defaultdict(int)
    for entry in document.data["collectives"]:
        totals[(entry["axis"], entry["link"], entry["kind"])] += entry.get("times", 1) * entry["bytes_value"]
    return totals


def _calls(document: PlanDocument) -> Counter:
    calls: Counter = Counter()
    for e in document.data["collectives"]:
        calls[(e["phase"], e["kind"], e["axis"], e["module"])] += e.get("times", 1)
    return calls


def diff_plans(before: PlanDocument, after: PlanDocument) -> PlanDiff:
    old, new = _placements(before), _placements(after)
    placements = [[new.get(k, old.get(k))[0] or "<top>", k, old[k][1] if k in old else "-", new[k][1] if k in new else "-"]
                  for k in sorted(set(old) | set(new)) if old.get(k, (None, None))[1] != new.get(k, (None, None))[1]]
    c_old, c_new = _calls(before), _calls(after)
    collectives = [[*key, c_old[key], c_new[key]] for key in sorted(set(c_old) | set(c_new)) if c_old[key] != c_new[key]]
    v_old, v_new = _volumes(before), _volumes(after)
    volumes, grew = [], False
    for key in sorted(set(v_old) | set(v_new)):
        a, b = v_old.get(key, 0), v_new.get(key, 0)
        grew = grew or b > a
        volumes.append([*key, a, b, f"{(b - a) / a:+.1%}" if a else "new"])
    m_old, m_new = before.memory.by_category(), after.memory.by_category()
    memory = [[c, m_old[c], m_new[c], f"{(m_new[c] - m_old[c]) / m_old[c]:+.1%}" if m_old[c] else "new" if m_new[c] else ""]
              for c in m_old if m_old[c] or m_new[c]] if before.data.get("memory") and after.data.get("memory") else []
    return PlanDiff(placements=placements, collectives=collectives, volumes=volumes, grew=grew, memory=memory)
