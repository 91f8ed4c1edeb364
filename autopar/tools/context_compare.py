"""Compare the lowerings of attention on sequence shards side by side: ring, all-gather K/V and
all-to-all (Ulysses), for one model and mesh.

`compare_context_methods` plans the model once per method with the context-parallel strategy's
method replaced (its axis and load balancing, and every other strategy, kept) and tabulates per
rank the bytes moved per step on the context axis by phase (logical S and NCCL bus-bandwidth wire
bytes), the calls, and the memory ledger's activations and held bytes. `autopar plan ...
--compare-cp` prints it. A method the model cannot take (all-to-all with heads that do not divide
the axis) is a row with the plan-time error's first line.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from tabulate import tabulate

from autopar.compiler.ledger.memory import build_memory_ledger
from autopar.compiler.plan import plan
from autopar.compiler.strategies.context import METHODS
from autopar.core.errors import PlanError


def _with_method(strategies: Sequence[Any], method: str) -> tuple[list[Any], str]:
    chosen = [s for s in strategies if getattr(s, "context", None) is not None]
    if not chosen:
        raise PlanError("--compare-cp compares context-parallel methods: declare context parallelism "
                        "(--strategy cp on a cp axis, or autopar.context_parallel())")
    declared = chosen[0]
    replaced = dataclasses.replace(declared, context=dataclasses.replace(declared.context, method=method))
    return [replaced if s is declared else s for s in strategies], declared.axis


def compare_context_methods(model: Any, mesh: Any, *, strategies: Sequence[Any], example_inputs: Sequence[Any],
                            **plan_options: Any) -> list[dict[str, Any]]:
    """One row per method: communication on the context axis per step (a flattened group's that
    includes it, `dp+cp`, counted with it) and memory of rank 0."""
    rows = []
    for method in METHODS:
        with_method, axis = _with_method(strategies, method)
        try:
            the_plan = plan(model, mesh, strategies=with_method, example_inputs=example_inputs, **plan_options)
        except PlanError as error:
            rows.append({"method": method, "refused": str(error).splitlines()[0]})
            continue
        comm, memory = the_plan.comm, build_memory_ledger(the_plan).by_category()
        rows.append({"method": method, "axis": axis,
                     "forward bytes": comm.number(comm.total(axis=axis, phase="forward", joined=True)),
                     "backward bytes": comm.number(comm.total(axis=axis, phase="backward", joined=True)),
                     "wire bytes": comm.number(comm.total(axis=axis, wire=True, joined=True)),
                     "calls": comm.count(axis=axis, joined=True),
                     "activations": memory["activations"],
                     "held": sum(v for k, v in memory.items() if k != "transient")})
    return rows


def context_table(rows: list[dict[str, Any]]) -> str:
    headers = ["method", "forward bytes", "backward bytes", "wire bytes", "calls", "activations", "held"]
    body = [[r["method"], *(f"{r[h]:,}" for h in headers[1:])] if "refused" not in r
            else [r["method"], f"refused: {r['refused']}", *[""] * (len(headers) - 2)] for r in rows]
    return tabulate(body, headers=headers, tablefmt="simple")
