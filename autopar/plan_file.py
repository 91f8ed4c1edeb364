"""Plan files: a versioned JSON document of a plan, and the reports rendered from it.

`plan_document(plan)` turns a `Plan` into plain data: mesh (axes, node size, links), strategies,
one entry per tensor node (kind, op or FQN, module path, source line, global and local shape,
placement per axis, arguments, the collective an inserted node performs, gradient-sync axes of
parameters, where its placement came from), every ledger entry (formula as a string and its
number for the traced shapes), the gradient buckets, ZeRO/FSDP units and the memory ledger. Keys and lists keep a fixed order so two
plan files diff readably. `PlanDocument` wraps such data (from a plan or a file) and renders the
placement table and the communication ledger; a live `Plan` renders its reports through it, so a
saved and reloaded plan reports exactly the same. A file of another schema version is refused.
"""
from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sympy
import torch
from tabulate import tabulate
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from autopar.errors import PlanError
from autopar.ir import ORIGIN, RULE, SPEC, describe, local_shape, module_path, source_line
from autopar.ledger.comm import CommEntry, CommLedger
from autopar.mesh import Mesh

if TYPE_CHECKING:
    from autopar.ledger.memory import MemoryLedger

SCHEMA = "autopar.plan/1"


def _first_spec(node: torch.fx.Node) -> DTensorSpec | None:
    spec = node.meta.get(SPEC)
    if isinstance(spec, (tuple, list)):
        spec = next((s for s in spec if isinstance(s, DTensorSpec)), None)
    return spec if isinstance(spec, DTensorSpec) else None


def _producer(node: torch.fx.Node) -> torch.fx.Node:
    """Multi-output ops appear once in a plan file: an input read through getitem names the op."""
    return node.args[0] if node.target is operator.getitem else node


def _op_name(target: Any) -> str:
    if hasattr(target, "_schema"):
        return str(target).replace("aten.", "")
    return getattr(target, "__name__", str(target))


def _node_entry(node: torch.fx.Node, plan: Any) -> dict[str, Any] | None:
    spec = _first_spec(node)
    if spec is None or node.target is operator.getitem:
        return None
    from autopar.comm_kinds import comm_step
    from autopar.passes.insert_grad_reductions import GRAD_SYNC

    info = plan.context.placeholders.get(node.name)
    shape = [int(d) for d in spec.tensor_meta.shape] if spec.tensor_meta else []
    local = local_shape(shape, spec.placements, plan.mesh.shape)
    if info is not None:
        kind, what = info.kind, info.target
    elif comm_step(node.target) is not None:
        kind, what = "collective", _op_name(node.target)
    else:
        kind, what = "op", _op_name(node.target)
    rule = node.meta.get(RULE)
    entry = {
        "name": node.name, "kind": kind, "target": what, "module": module_path(node), "source": source_line(node),
        "shape": shape, "local_shape": local, "placements": describe(spec.placements).split(","),
        "inputs": [_producer(n).name for n in node.all_input_nodes],
        "rule": rule.local_kernel.__name__ if rule is not None and rule.local_kernel is not None else None,
        "collective": ({k: v for k, v in node.kwargs.items() if k in ("group", "dim", "reduce_op", "grad_partial")}
                       if comm_step(node.target) is not None else None),
        "grad_sync": list(node.meta.get(GRAD_SYNC, [])),
        "origin": node.meta.get(ORIGIN, ""),
        "stored": _stored(node, plan),
    }
    return entry


def _stored(node: torch.fx.Node, plan: Any) -> str | None:
    """How a ZeRO-sharded parameter is kept between uses (its placement is its gathered compute form)."""
    from autopar.passes.shard_parameters import ZERO_SHARD

    if ZERO_SHARD not in node.meta:
        return None
    index, shape = node.meta[ZERO_SHARD]
    unit = plan.units[index]
    return (f"ZeRO-{unit.stage} unit {index} ({unit.name or 'root'}): dim-0 shard {'x'.join(map(str, shape))} "
            f"per rank on {unit.axis}, gathered before use")


def _entry_data(entry: CommEntry, ledger: CommLedger) -> dict[str, Any]:
    return {"phase": entry.phase, "kind": entry.kind, "axis": entry.axis, "link": entry.link,
            "group_size": entry.group_size, "module": entry.module, "tensor": entry.tensor, "why": entry.why,
            "dtype": str(entry.dtype).replace("torch.", ""), "bytes": str(entry.logical_bytes),
            "bytes_value": ledger.number(entry.logical_bytes), "wire_bytes_value": ledger.number(entry.wire_bytes)}


def plan_document(plan: Any) -> dict[str, Any]:
    """Plain, JSON-ready data of a plan (see module docstring)."""
    nodes = [entry for node in plan.graph_module.graph.nodes if (entry := _node_entry(node, plan)) is not None]
    return {
        "schema": SCHEMA,
        "mesh": {"axes": [[name, size] for name, size in plan.mesh.axes], "ranks_per_node": plan.mesh.ranks_per_node,
                 "links": {axis: plan.mesh.link(axis) for axis in plan.mesh.names}},
        "strategies": [{"name": s.name, "axis": s.axis} for s in plan.strategy.strategies],
        "symbols": {str(k): v for k, v in sorted(plan.comm.symbol_values.items(), key=lambda kv: str(kv[0]))},
        "passes": [{"name": r.name, "nodes_in": r.nodes_before, "nodes_out": r.nodes_after} for r in plan.pass_records],
        "nodes": nodes,
        "collectives": [_entry_data(e, plan.comm) for e in plan.comm.entries],
        "buckets": [{"axes": list(b.axes), "dtype": str(b.dtype).replace("torch.", ""), "params": list(b.params),
                     "numel": b.numel} for b in plan.buckets],
        "units": [{"index": u.index, "name": u.name, "axis": u.axis, "stage": u.stage, "reshard": u.reshard,
                   "extra_axes": list(u.extra_axes), "shard_numel": u.shard_numel,
                   "params": [[p.fqn, list(p.shape), p.rows] for p in u.params]} for u in plan.units],
        "memory": _memory_data(plan),
    }


def _memory_data(plan: Any) -> list[dict[str, Any]]:
    """Rank 0's memory ledger (AdamW). Ranks differ only where uneven tensor-parallel shards would."""
    from autopar.ledger.memory import build_memory_ledger

    ledger = build_memory_ledger(plan, rank=0)
    return [{"category": e.category, "what": e.what, "bytes": str(e.bytes), "bytes_value": ledger.number(e.bytes)}
            for e in ledger.entries]


@dataclass
class PlanDocument:
    """A plan as data: from `plan_document(plan)` or a plan file. Renders the plan's reports."""

    data: dict[str, Any]

    @property
    def mesh(self) -> Mesh:
        mesh = self.data["mesh"]
        return Mesh({name: size for name, size in mesh["axes"]}, ranks_per_node=mesh["ranks_per_node"])

    @property
    def comm(self) -> CommLedger:
        symbols = {sympy.Symbol(name, positive=True, integer=True): value for name, value in self.data["symbols"].items()}
        locals_ = {str(s): s for s in symbols}
        entries = [CommEntry(phase=e["phase"], kind=e["kind"], axis=e["axis"], link=e["link"],
                             group_size=e["group_size"], module=e["module"], tensor=e["tensor"], why=e["why"],
                             dtype=getattr(torch, e["dtype"]), logical_bytes=sympy.sympify(e["bytes"], locals=locals_))
                   for e in self.data["collectives"]]
        return CommLedger(entries=entries, symbol_values=symbols)

    @property
    def memory(self) -> "MemoryLedger":
        from autopar.ledger.memory import MemoryEntry, MemoryLedger

        symbols = self.comm.symbol_values
        locals_ = {str(s): s for s in symbols}
        return MemoryLedger(entries=[MemoryEntry(e["category"], e["what"], sympy.sympify(e["bytes"], locals=locals_))
                                     for e in self.data.get("memory", [])], symbol_values=symbols)

    def node(self, name_or_module: str) -> list[dict[str, Any]]:
        """Nodes named so, or the nodes of a module (or a parameter FQN)."""
        exact = [n for n in self.data["nodes"] if name_or_module in (n["name"], n["target"])]
        return exact or [n for n in self.data["nodes"] if n["module"] == name_or_module]

    def placement_table(self, *, activations: bool = True) -> str:
        rows = [[n["name"], f"{n['kind']} {n['target']}" if n["kind"] in ("parameter", "input", "buffer", "constant")
                 else n["target"], n["module"], "x".join(map(str, n["shape"])), ",".join(n["placements"]),
                 "x".join(map(str, n["local_shape"]))]
                for n in self.data["nodes"] if activations or n["kind"] in ("parameter", "input", "buffer", "constant")]
        axes = ",".join(name for name, _ in self.data["mesh"]["axes"])
        return tabulate(rows, headers=["node", "op / tensor", "module", "global", f"placement ({axes})", "local"],
                        tablefmt="simple")

    def report(self, *, activations: bool = True) -> str:
        mesh = self.mesh
        passes = tabulate([[p["name"], p["nodes_in"], p["nodes_out"]] for p in self.data["passes"]],
                          headers=["pass", "nodes in", "nodes out"])
        return (f"mesh {mesh}  ({mesh.world_size} ranks; "
                + ", ".join(f"{a}: {link}" for a, link in self.data["mesh"]["links"].items()) + ")\n"
                + "strategies: " + ", ".join(f"{s['name']} on {s['axis']}" for s in self.data["strategies"]) + "\n\n"
                + passes + "\n\n" + self.placement_table(activations=activations)
                + "\n\nCommunication per step, per rank\n" + self.comm.table()
                + "\n\nMemory per rank (rank 0, AdamW)\n" + self.memory.table())


def save_plan(plan_or_document: Any, path: "str | Path") -> None:
    document = plan_or_document if isinstance(plan_or_document, PlanDocument) else plan_or_document.document()
    data = document.data
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")


def load_plan(path: "str | Path") -> PlanDocument:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PlanError(f"cannot read plan file {path}: {error}") from None
    found = data.get("schema") if isinstance(data, dict) else None
    if found != SCHEMA:
        raise PlanError(f"plan file {path} has schema {found!r}, this autopar reads {SCHEMA!r}; "
                        f"fix: regenerate it with `autopar plan ... --save {path}`")
    return PlanDocument(data)
