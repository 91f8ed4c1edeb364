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

from autopar.compiler.flops import node_flops
from autopar.compiler.ledger.bubble import build_bubble_ledger
from autopar.compiler.ledger.comm import CommEntry, CommLedger
from autopar.compiler.ledger.memory import MemoryEntry, MemoryLedger, build_memory_ledger
from autopar.compiler.passes.insert_grad_reductions import GRAD_SYNC
from autopar.compiler.passes.lower_moe import expert_parameters
from autopar.compiler.passes.recompute import recomputed_flops
from autopar.compiler.passes.schedule_collectives import overlaps
from autopar.compiler.passes.shard_parameters import ZERO_SHARD
from autopar.compiler.passes.split_pipeline import PIPELINE_STAGE
from autopar.core.comm_kinds import comm_step
from autopar.core.errors import PlanError
from autopar.core.ir import ARG_SPECS as ARG_SPECS_KEY
from autopar.core.ir import ORIGIN, RULE, SPEC, describe, local_shape, module_path, source_line
from autopar.core.mesh import Mesh
from autopar.core.ops import moe

if TYPE_CHECKING:
    from autopar.compiler.ledger.memory import MemoryLedger

SCHEMA = "autopar.plan/2"  # 2: pipeline stages, per-entry stage and calls per step


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
        "stage": list(node.meta.get(PIPELINE_STAGE, ())),
    }
    return entry


def _boundary_entries(plan: Any) -> list[dict[str, Any]]:
    """The send/recv steps of each stage graph (only a pipelined plan has them)."""
    entries = []
    for stage in plan.stages if plan.pipeline is not None else []:
        for node in stage.graph_module.graph.nodes:
            step = comm_step(node.target) if node.op == "call_function" else None
            if step is None or step.forward not in ("send", "recv"):
                continue
            source = node.args[0] if step.forward == "send" else node
            spec = _first_spec(source) or _first_spec(node)
            shape = [int(d) for d in spec.tensor_meta.shape] if spec is not None else []
            entries.append({
                "name": f"stage{stage.index}.{node.name}", "kind": "collective", "target": step.name,
                "module": module_path(node), "source": source_line(node), "shape": shape,
                "local_shape": local_shape(shape, spec.placements, plan.mesh.shape) if spec is not None else [],
                "placements": describe(spec.placements).split(",") if spec is not None else [],
                "inputs": [n.name for n in node.all_input_nodes if n.op != "placeholder"],
                "rule": None, "grad_sync": [], "origin": "", "stored": None, "stage": [stage.index],
                "collective": {"group": node.kwargs["group"], "peer_offset": node.kwargs["peer"][1],
                               "value": node.kwargs["value"]}})
    return entries


def _stored(node: torch.fx.Node, plan: Any) -> str | None:
    """How a ZeRO-sharded parameter is kept between uses (its placement is its gathered compute form)."""
    copies = [n for stage in plan.stages for n in stage.graph_module.graph.nodes
              if n.op == "placeholder" and n.name == node.name and ZERO_SHARD in n.meta] if node.op == "placeholder" else []
    if not copies:
        return None
    index, shape = copies[0].meta[ZERO_SHARD]
    unit = plan.units[index]
    return (f"ZeRO-{unit.stage} unit {index} ({unit.name or 'root'}): dim-0 shard {'x'.join(map(str, shape))} "
            f"per rank on {unit.axis}, gathered before use")


def _entry_data(entry: CommEntry, ledger: CommLedger) -> dict[str, Any]:
    return {"phase": entry.phase, "kind": entry.kind, "axis": entry.axis, "link": entry.link,
            "group_size": entry.group_size, "module": entry.module, "tensor": entry.tensor, "why": entry.why,
            "dtype": str(entry.dtype).replace("torch.", ""), "bytes": str(entry.logical_bytes),
            "bytes_value": ledger.number(entry.logical_bytes), "wire_bytes_value": ledger.number(entry.wire_bytes),
            "stage": entry.stage, "times": entry.times, **({"behind": entry.behind} if entry.behind else {})}


def plan_document(plan: Any) -> dict[str, Any]:
    """Plain, JSON-ready data of a plan (see module docstring)."""
    nodes = [entry for node in plan.graph_module.graph.nodes if (entry := _node_entry(node, plan)) is not None]
    nodes += _boundary_entries(plan)
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
                     "numel": b.numel, "stage": stage.index} for stage in plan.stages
                    for b in stage.buckets],
        "units": [{"index": u.index, "name": u.name, "axis": u.axis, "stage": u.stage, "reshard": u.reshard,
                   "extra_axes": list(u.extra_axes), "shard_numel": u.shard_numel, "pipeline_stage": u.pipeline_stage,
                   "reduce_kind": u.reduce_kind, "reduce_dtype": str(u.reduce_dtype).replace("torch.", ""),
                   "gather_kind": u.gather_kind,
                   "params": [[p.fqn, list(p.shape), p.rows] for p in u.params]} for u in plan.units],
        "memory": _memory_data(plan),
        "pipeline": _pipeline_data(plan),
        "experts": _experts_data(plan),
        "recompute": _recompute_data(plan),
        "overlaps": _overlap_data(plan),
    }


def _in_flight_kind(step: Any) -> str:
    """What is in flight: the step's forward collective, or its conjugate where it has none (f)."""
    return step.forward or f"{step.backward} (backward)"


def _overlap_data(plan: Any) -> list[dict[str, Any]]:
    """Each deferred collective of each stage graph (`autopar/compiler/passes/schedule_collectives.py`): the compute
    the rank runs while it is in flight (how many call nodes, the first and last of them and their
    modules)."""
    found = []
    for stage in plan.stages:
        graph = stage.graph_module.graph
        by_name = {node.name: node for node in graph.nodes}
        for over in overlaps(graph):
            start = by_name[over.start]
            found.append({"stage": stage.index, "start": over.start, "finish": over.finish,
                          "kind": _in_flight_kind(comm_step(start.target)), "axis": start.kwargs.get("group"),
                          "module": module_path(start), "between": len(over.between),
                          "over": [[n, module_path(by_name[n])] for n in over.between[:1] + over.between[-1:]]})
    return found


def _recompute_data(plan: Any) -> dict[str, Any] | None:
    """The declared recomputation (`autopar/compiler/passes/recompute.py`): each region, its forward FLOPs run again
    in backward (global, at the traced sizes) and the share of the whole forward they are."""
    declared = plan.strategy.recompute
    if declared is None:
        return None
    regions = {}
    for stage in plan.stages:
        regions.update(recomputed_flops(stage.graph_module.graph))
    forward = sum(node_flops(n) for stage in plan.stages for n in stage.graph_module.graph.nodes)
    again = sum(1 for e in plan.comm.entries if e.why.endswith(tuple(f"recomputation of {r}" for r in regions)))
    return {"policy": declared.describe(), "regions": [[name, flops] for name, flops in regions.items()],
            "forward_flops": forward, "collectives_again": again}


def _experts_data(plan: Any) -> list[dict[str, Any]]:
    """Each mixture-of-experts block (`autopar/compiler/passes/lower_moe.py`): its experts, the axes its tokens are
    sharded over, the expert-parallel axis splitting them, what its weights and the rest of the
    model synchronise gradients over, and its all-to-all bytes per step under uniform routing."""
    graph = plan.graph_module.graph
    weights = expert_parameters(graph)
    sync = plan.grad_sync_axes()
    expert_fqns = {plan.context.placeholders[p.name].target for params in weights.values() for p in params}
    others = sorted({axis for fqn, axes in sync.items() if fqn not in expert_fqns for axis in axes})
    blocks = []
    for node in graph.nodes:
        if node.target is not moe.moe_permute:
            continue
        path = module_path(node)
        tokens = node.meta[ARG_SPECS_KEY][0].placements
        dispatch = next((u for u in graph.nodes if u.target is moe.moe_dispatch and module_path(u) == path), None)
        axis = dispatch.kwargs["group"] if dispatch is not None else None
        fqns = [plan.context.placeholders[p.name].target for p in weights.get(path, [])]
        experts = node.kwargs["num_experts"]
        blocks.append({
            "module": path, "experts": experts, "top_k": _top_k(node),
            "tokens_over": [a for a, p in zip(plan.mesh.names, tokens) if p.is_shard()],
            "expert_axis": axis, "experts_per_rank": experts // plan.mesh.size(axis) if axis else experts,
            "weights": fqns, "weights_sync": sorted({a for f in fqns for a in sync.get(f, ())}), "others_sync": others,
            "all_to_all_bytes": sum(plan.comm.number(e.logical_bytes) * e.times for e in plan.comm.entries
                                    if e.kind == "all_to_all" and e.module == path)})
    return blocks


def _top_k(permute: torch.fx.Node) -> int:
    unpermute = next((u for u in permute.graph.nodes if u.op == "call_function"
                      and getattr(u.target, "__name__", "") == "moe_unpermute" and u.args[1].args[0] is permute), None)
    return unpermute.kwargs["top_k"] if unpermute is not None else 0


def _memory_ranks(plan: Any) -> list[int]:
    """Rank 0, and under a pipeline one rank per pipeline coordinate (the others' coordinates 0)."""
    if plan.pipeline is None:
        return [0]
    return [plan.mesh.neighbour(0, plan.pipeline.axis, c) for c in range(plan.pipeline.degree)]


def _memory_data(plan: Any) -> list[dict[str, Any]]:
    """The memory ledger (AdamW) of rank 0 and, under a pipeline, of one rank per pipeline coordinate.
    Ranks of one coordinate differ only where uneven tensor-parallel shards would."""
    rows = []
    for rank in _memory_ranks(plan):
        ledger = build_memory_ledger(plan, rank=rank)
        rows += [{"rank": rank, "category": e.category, "what": e.what, "bytes": str(e.bytes),
                  "bytes_value": ledger.number(e.bytes)} for e in ledger.entries]
    return rows


def _pipeline_data(plan: Any) -> dict[str, Any] | None:
    if plan.pipeline is None:
        return None

    layout, bubble = plan.pipeline, build_bubble_ledger(plan)
    return {"axis": layout.axis, "degree": layout.degree, "virtual": layout.virtual,
            "microbatches": layout.microbatches, "schedule": layout.schedule, "starts": list(layout.starts),
            "balance": layout.balance, "ties": {k: list(v) for k, v in plan.program.ties.items()},
            "stages": [{"index": s.index, "coordinate": layout.coordinate(s.index), "forward_flops":
                        bubble.stage_flops[s.index],
                        "sends": [[b.name, b.target, b.requires_grad] for b in s.sends],
                        "receives": [[b.name, b.source, b.requires_grad] for b in s.receives]} for s in plan.stages],
            "bubble": {"formula": bubble.formula, "predicted": bubble.fractions},
            "timeline": [[t.rank, t.action.kind, t.action.stage, t.action.microbatch, t.start, t.end]
                         for t in bubble.timeline]}


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
                             dtype=getattr(torch, e["dtype"]), logical_bytes=sympy.sympify(e["bytes"], locals=locals_),
                             stage=e["stage"], times=e["times"], behind=e.get("behind", ""))
                   for e in self.data["collectives"]]
        pipeline = self.data.get("pipeline")
        coordinates = {s["index"]: s["coordinate"] for s in pipeline["stages"]} if pipeline else None
        return CommLedger(entries=entries, symbol_values=symbols, stage_coordinates=coordinates,
                          pipeline_axis=pipeline["axis"] if pipeline else None, mesh=self.mesh)

    @property
    def memory(self) -> "MemoryLedger":
        """Rank 0's memory ledger."""
        return self.memory_of(0)

    def memory_ranks(self) -> list[int]:
        return sorted({e["rank"] for e in self.data.get("memory", [])})

    def memory_of(self, rank: int) -> "MemoryLedger":
        symbols = self.comm.symbol_values
        locals_ = {str(s): s for s in symbols}
        return MemoryLedger(entries=[MemoryEntry(e["category"], e["what"], sympy.sympify(e["bytes"], locals=locals_))
                                     for e in self.data.get("memory", []) if e["rank"] == rank],
                            symbol_values=symbols)

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
        summary = self.data.get("strategy_summary")
        passes = tabulate([[p["name"], p["nodes_in"], p["nodes_out"]] for p in self.data["passes"]],
                          headers=["pass", "nodes in", "nodes out"])
        return ((f"Strategies\n{summary}\n\n" if summary else "") + f"mesh {mesh}  ({mesh.world_size} ranks; "
                + ", ".join(f"{a}: {link}" for a, link in self.data["mesh"]["links"].items()) + ")\n"
                + "strategies: " + ", ".join(f"{s['name']} on {s['axis']}" for s in self.data["strategies"]) + "\n\n"
                + passes + "\n\n" + self.placement_table(activations=activations)
                + "\n\nCommunication per step, per rank\n" + self.comm.table()
                + "".join(f"\n\nMemory per rank (rank {rank}, AdamW)\n" + self.memory_of(rank).table()
                          for rank in self.memory_ranks())
                + self.pipeline_report() + self.experts_report() + self.recompute_report() + self.overlap_report())

    def overlap_report(self) -> str:
        overlaps = self.data.get("overlaps")
        if not overlaps:
            return ""
        rows = [[o["stage"], o["start"], o["kind"], o["axis"], o["module"] or "-", o["between"],
                 " … ".join(f"{name} ({module or '-'})" for name, module in o["over"])]
                for o in overlaps if o["between"]]
        return (f"\n\nCollectives in flight (scheduling pass): {len(rows)} steps have nodes between their start and "
                f"their finish — a forward collective runs while the rank computes them, a conjugate while it "
                f"computes their backward (a tap: the linear's weight gradient); every other step lands where it "
                f"is issued\n"
                + tabulate(rows, headers=["stage", "start", "kind", "axis", "module", "nodes in flight over",
                                          "first … last node in flight over (module)"]))

    def recompute_report(self) -> str:
        declared = self.data.get("recompute")
        if not declared:
            return ""
        forward = max(declared["forward_flops"], 1)
        rows = [[name, f"{flops:,}", f"{flops / forward:.1%}"] for name, flops in declared["regions"]]
        total = sum(flops for _, flops in declared["regions"])
        rows.append(["all", f"{total:,}", f"{total / forward:.1%}"])
        return (f"\n\nRecomputation ({declared['policy']}): regions run again in backward; "
                f"{declared['collectives_again']} forward collectives run again (in the backward rows above)\n"
                + tabulate(rows, headers=["region", "forward FLOPs again (global)", "of the forward"]))

    def experts_report(self) -> str:
        blocks = self.data.get("experts")
        if not blocks:
            return ""
        rows = [[b["module"], b["experts"], b["top_k"], ",".join(b["tokens_over"]) or "-", b["expert_axis"] or "-",
                 b["experts_per_rank"], ",".join(b["weights_sync"]) or "-", ",".join(b["others_sync"]) or "-",
                 f"{b['all_to_all_bytes']:,}"] for b in blocks]
        return ("\n\nMixture-of-experts blocks (all-to-all bytes per step per rank under uniform routing; a run's "
                "exact bytes follow its routing)\n"
                + tabulate(rows, headers=["experts module", "E", "top-k", "tokens over", "experts split over",
                                          "experts/rank", "expert grads sync over", "other grads sync over",
                                          "all-to-all bytes"]))

    def pipeline_report(self) -> str:
        pipeline = self.data.get("pipeline")
        if not pipeline:
            return ""
        rows = [[s["index"], s["coordinate"], f"{s['forward_flops']:,}", ", ".join(f"{n}->{t}" for n, t, _ in s["sends"])]
                for s in pipeline["stages"]]
        bubble = pipeline["bubble"]
        return (f"\n\nPipeline on {pipeline['axis']}: {pipeline['schedule']}, p={pipeline['degree']}, "
                f"v={pipeline['virtual']}, m={pipeline['microbatches']}; stages start at "
                f"{', '.join(pipeline['starts'])} ({pipeline['balance']})\n"
                + tabulate(rows, headers=["stage", "pp rank", "forward FLOPs/micro-batch", "sends (value->stage)"])
                + "\n\nBubble (idle fraction of the step): predicted per pp rank "
                + ", ".join(f"{f:.1%}" for f in bubble["predicted"])
                + f"; balanced-stage formula {bubble['formula']:.1%}")


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
    _refuse_shared_memory(data, path)
    return PlanDocument(data)


def _refuse_shared_memory(data: dict[str, Any], path: "str | Path") -> None:
    """A file written while autopar had a shared-memory transport carries `"transport": "shared_memory"`
    on what moved through it; every collective now goes through the process group, so its ledger
    would not describe what a run of it does."""
    items = [*data.get("collectives", []), *data.get("buckets", []), *data.get("units", [])]
    if any(isinstance(item, dict) and item.get("transport", "process_group") != "process_group" for item in items):
        raise PlanError(f"plan file {path} moves collectives through the shared-memory transport, which autopar no "
                        f"longer has (every collective goes through the process group); fix: regenerate it with "
                        f"`autopar plan ... --save {path}`")
