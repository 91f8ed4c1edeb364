"""Why a tensor got its placement: the alternatives DTensor weighed, and the `explain` report.

`dtensor_alternatives(schema)` re-asks DTensor's registry for every strategy it considers for an
op (the same expansion `propagate_op_sharding` minimises over) and lists each one's output
placements, required input placements and redistribution cost, cheapest first. `explain(document,
name)` renders, for a node, parameter or module of a plan file: its placement, the seed rule or
module layouts behind it, who decided (DTensor or an autopar rule), the alternatives, and the
collectives the plan inserted around it. `strategy_summary(plan)` gives one line per strategy:
the parameters it shards out of all (counts and bytes), and each module it left replicated with
the reason (the strategy's own note, or what autopar knows of that kind of module).
"""
from __future__ import annotations

import math
import re
from itertools import chain
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy
from torch.distributed.tensor._sharding_prop import _expand_single_dim_strategy_to_mesh

from autopar.core.ir import SPEC, describe

if TYPE_CHECKING:
    from autopar.compiler.plan import Plan

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


MAX_REPLICATED = 6  # modules listed per strategy; the rest counted
# why tensor parallelism leaves a module of this class replicated, where no note of its own says
KNOWN_REPLICATED = {"MultiheadAttention": "fused in_proj (q|k|v in one weight, applied inside "
                                          "F.multi_head_attention_forward) not split by TP",
                    "Embedding": "not the token embedding (only the vocabulary is split)"}


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _module_classes(plan: "Plan") -> dict[str, str]:
    """Module path -> class name, from the traced graph's module stacks."""
    classes = {}
    for node in plan.traced.graph_module.graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            name = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
            classes.setdefault(path, name)
    return classes


def _replicated_modules(plan: "Plan", strategy: Any, axis_index: int, params: dict[str, Any]) -> list[str]:
    """Modules with a matrix parameter the tensor-parallel `strategy` left replicated, and why;
    repeated blocks folded into one pattern (`layers.*.attn`)."""
    left = {fqn.rsplit(".", 1)[0] if "." in fqn else "" for fqn, node in params.items()
            if len(node.meta[SPEC].tensor_meta.shape) >= 2 and node.meta[SPEC].placements[axis_index].is_replicate()}
    outermost = sorted(m for m in left if not any(m.startswith(f"{o}.") for o in left if o != m))
    classes, reasons = _module_classes(plan), {}
    for module in outermost:
        kind = classes.get(module, "")
        note = next((n for n in strategy.notes if re.search(rf"\b{re.escape(module)}\b", n)), None)
        why = note or KNOWN_REPLICATED.get(kind, "no column / row pattern found in it")
        reasons.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", module) or "<top level>", f"{kind}: {why}" if kind else why)
    shown = [f"{module} ({why})" for module, why in list(reasons.items())[:MAX_REPLICATED]]
    if len(reasons) > MAX_REPLICATED:
        shown.append(f"... and {len(reasons) - MAX_REPLICATED} more")
    return shown


def _stage_counts(plan: "Plan") -> str:
    counts = [sum(1 for n in stage.graph_module.graph.nodes if n.op == "placeholder" and
                  plan.context.placeholders[n.name].kind == "parameter") for stage in plan.stages]
    return f"{len(counts)} stages holding " + " / ".join(map(str, counts)) + " parameters"


def strategy_summary(plan: "Plan") -> str:
    """One line per strategy on an axis of size > 1: parameters sharded / total (counts, bytes), then
    the modules it left replicated, one per line, with the reason."""
    params = {plan.context.placeholders[n.name].target: n for n in plan.placeholder_nodes("parameter")}
    size = {fqn: math.prod(n.meta[SPEC].tensor_meta.shape) * n.meta[SPEC].tensor_meta.dtype.itemsize
            for fqn, n in params.items()}
    lines = []
    for strategy in plan.strategy.strategies:
        if plan.mesh.size(strategy.axis) == 1:
            continue
        index = plan.mesh.names.index(strategy.axis)
        if strategy.sharded_state is not None:
            units = {p.fqn for u in plan.units if u.axis == strategy.axis for p in u.params}
            chosen = [f for f in params if f in units]
            what = f"parameters' ZeRO-{strategy.sharded_state.stage} state sharded"
        else:
            chosen = [f for f, n in params.items() if not n.meta[SPEC].placements[index].is_replicate()]
            what = "parameters sharded"
        line = (f"{strategy.name} on {strategy.axis} ({plan.mesh.size(strategy.axis)}): {len(chosen)} / {len(params)} "
                f"{what} ({_bytes(sum(size[f] for f in chosen))} / {_bytes(sum(size.values()))})")
        if strategy.pipeline is not None:
            line += f"; {_stage_counts(plan)}"
        elif not chosen and strategy.name == "replicated":
            line += f"; every rank of {strategy.axis} computes the same step (declared replicated)"
        elif not chosen:
            line += f"; replicated, gradients summed over {strategy.axis}"
        lines.append(line)
        if strategy.name.startswith("tensor_parallel"):
            lines += [f"  left replicated: {entry}" for entry in _replicated_modules(plan, strategy, index, params)]
    return "\n".join(lines)
