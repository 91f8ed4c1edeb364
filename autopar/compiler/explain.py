"""Why a tensor got its placement: the alternatives DTensor weighed, and the `explain` report.

`dtensor_alternatives(schema)` re-asks DTensor's registry for every strategy it considers for an
op (the same expansion `propagate_op_sharding` minimises over) and lists each one's output
placements, required input placements and redistribution cost, cheapest first. `explain(document,
name)` renders, for a node, parameter or module of a plan file: its placement, the seed rule or
module layouts behind it, who decided (DTensor or an autopar rule), the alternatives, and the
collectives the plan inserted around it.
"""
from __future__ import annotations

from itertools import chain
from typing import Any

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy
from torch.distributed.tensor._sharding_prop import _expand_single_dim_strategy_to_mesh

from autopar.core.ir import describe

MAX_ALTERNATIVES = 6


def _op_strategy(schema: OpSchema) -> OpStrategy | None:
    propagator = DTensor._op_dispatcher.sharding_propagator
    wrapped = propagator._wrap_with_op_strategy(schema)
    single = propagator.op_single_dim_strategy_funcs.get(schema.op)
    if single is not None:
        mesh = schema.args_spec[0].mesh
        meta = propagator._propagate_tensor_meta_non_cached(schema)
        return _expand_single_dim_strategy_to_mesh(mesh, wrapped, single, meta)(schema.op, wrapped.args_meta,
                                                                                 wrapped.kwargs_meta)
    function = propagator.op_strategy_funcs.get(schema.op)
    return function(wrapped) if function is not None else None


def dtensor_alternatives(schema: OpSchema) -> list[dict[str, Any]]:
    """The strategies DTensor weighs for this op and these input placements, cheapest first."""
    try:
        strategy = _op_strategy(schema)
    except Exception as error:  # explanation only: never fail a plan for it
        return [{"error": f"{type(error).__name__}: {error}"}]
    if not isinstance(strategy, OpStrategy):
        return []
    options = []
    for spec in strategy.strategies:
        cost = float(sum(chain.from_iterable(spec.redistribute_cost or [])))
        output = spec.output_specs
        outputs = [describe(o.placements) for o in (output if isinstance(output, (tuple, list)) else [output]) if o is not None]
        inputs = [describe(s.placements) for s in (spec.input_specs or [])]
        options.append({"output": outputs, "inputs": inputs, "cost": round(cost, 3)})
    options.sort(key=lambda o: o["cost"])
    return options[:MAX_ALTERNATIVES]


def explain(document: Any, name: str) -> str:
    """Text explanation of node/parameter/module `name` in a PlanDocument."""
    nodes = document.node(name)
    if not nodes:
        raise KeyError(f"no node, parameter or module named {name!r} in this plan")
    lines = []
    by_name = {n["name"]: n for n in document.data["nodes"]}
    for node in nodes[:12]:
        origin = node.get("origin") or {}
        lines.append(f"{node['name']}  ({node['kind']} {node['target']}, module {node['module'] or '<top>'})")
        lines.append(f"  placement: {','.join(node['placements'])}   global {node['shape']} -> local {node['local_shape']}")
        if node.get("stored"):
            lines.append(f"  stored: {node['stored']}")
        if node.get("stage"):
            lines.append(f"  pipeline: {_stage_line(document, node['stage'], leaf=node['kind'] != 'op')}")
        if node.get("source"):
            lines.append(f"  source: {node['source']}")
        if "seed" in origin:
            lines.append(f"  seeded: {origin['seed']}")
        for edge in origin.get("edges", []):
            lines.append(f"  input layout: {edge}")
        if "decided_by" in origin:
            lines.append(f"  decided by: {origin['decided_by']}")
        for option in origin.get("alternatives", []):
            if "error" in option:
                lines.append(f"  alternatives unavailable: {option['error']}")
                continue
            lines.append(f"  alternative: out {' | '.join(option['output'])} from inputs {' | '.join(option['inputs'])}"
                         f"  redistribution cost {option['cost']}")
        if node["grad_sync"]:
            lines.append(f"  gradient: synchronised over {', '.join(node['grad_sync'])} after backward (bucketed)")
        around = [by_name[i] for i in node["inputs"] if i in by_name and by_name[i]["kind"] == "collective"]
        for inserted in around:
            lines.append(f"  input arrives through {inserted['target']} {inserted['collective']}")
    if len(nodes) > 12:
        lines.append(f"... and {len(nodes) - 12} more nodes in {name}")
    return "\n".join(lines)


def _stage_line(document: Any, stages: list[int], *, leaf: bool) -> str:
    pipeline = document.data.get("pipeline") or {}
    where = {s["index"]: s["coordinate"] for s in pipeline.get("stages", [])}
    held = ", ".join(f"stage {s} (pp rank {where.get(s, '?')})" for s in stages)
    if len(stages) == 1:
        return f"{'held by' if leaf else 'computed in'} {held}"
    return (f"held by {held}: its gradient is summed over them" if leaf else
            f"computed in {held}: recomputed where needed, not sent")
