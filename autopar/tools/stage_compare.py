"""Compare ZeRO stages side by side for one model and mesh: the question a user picks a stage by.

`compare_stages` plans the model once per stage with the data-parallel axis' strategy replaced
(stage 0 = `data_parallel`, 1-3 = `zero(stage=k)`, other axes' strategies kept) and tabulates,
per rank, the memory ledger's categories and the bytes moved per step on that axis (logical S
and NCCL bus-bandwidth wire bytes; a reduction over a flattened group that includes the axis,
`dp+cp`, counted with it). `autopar plan ... --compare-stages` prints it.
"""
from __future__ import annotations

from typing import Any, Sequence

from tabulate import tabulate

from autopar.compiler.ledger.memory import CATEGORIES, build_memory_ledger
from autopar.compiler.plan import plan
from autopar.compiler.strategies.data_parallel import data_parallel
from autopar.compiler.strategies.zero import zero

_REPLACEABLE = {"data_parallel", "zero1", "zero2", "zero3"}


def _with_stage(strategies: Sequence[Any], axis: str, stage: int) -> list[Any]:
    replaced = [s for s in strategies if getattr(s, "axis", None) == axis and getattr(s, "name", "") in _REPLACEABLE]
    kept = [s for s in strategies if not any(s is r for r in replaced)]
    declared = next((s.sharded_state for s in replaced if getattr(s, "sharded_state", None) is not None), None)
    options = {} if declared is None else {"param_dtype": declared.param_dtype, "reduce_dtype": declared.reduce_dtype,
                                           "reduce": declared.reduce, "gather": declared.gather}  # the user's, kept
    if stage == 0:
        return kept + [data_parallel(axis=axis)]
    return kept + [zero(stage=stage, axis=axis, **options)]


def compare_stages(model: Any, mesh: Any, *, strategies: Sequence[Any], example_inputs: Sequence[Any],
                   axis: str = "dp", stages: Sequence[int] = (0, 1, 2, 3), **plan_options: Any) -> list[dict[str, Any]]:
    """One row per stage: memory bytes per category (rank 0) and communication on `axis` per step."""
    rows = []
    for stage in stages:
        the_plan = plan(model, mesh, strategies=_with_stage(strategies, axis, stage), example_inputs=example_inputs,
                        **plan_options)
        memory = build_memory_ledger(the_plan).by_category()
        comm = the_plan.comm
        rows.append({"stage": stage, **memory,
                     "held": sum(v for k, v in memory.items() if k != "transient"),
                     "comm bytes": comm.number(comm.total(axis=axis, joined=True)),
                     "comm wire bytes": comm.number(comm.total(axis=axis, wire=True, joined=True))})
    return rows


def stage_table(rows: list[dict[str, Any]]) -> str:
    headers = ["stage", *CATEGORIES, "held", "comm bytes", "comm wire bytes"]
    names = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    body = [[names[r["stage"]], *(f"{r[h]:,}" for h in headers[1:])] for r in rows]
    return tabulate(body, headers=headers, tablefmt="simple")
