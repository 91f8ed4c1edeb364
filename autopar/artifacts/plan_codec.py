"""A `Plan` as bytes: what crosses from the rank that planned to the ranks that did not (plan
once, `autopar/artifacts/plan_once.py`) and what a runnable plan file holds.

A rank that did not plan needs the whole plan, not only its rank graphs: `ParallelModule` emits
its rank graphs from the stage graphs and the compile context (`Plan.rank_graph`), cuts its
shards by the parameters' placements, binds ZeRO units and gradient buckets, and the ledgers
(`plan.comm`, `plan.memory(rank=...)`, the activation ledger's fake execution) read the planned
graph's node meta. So everything in the Plan crosses as rank 0 made it — except the weights:
`traced.state` is reduced to the constants the trace lifted (an empty KV cache, a tensor created
in forward), which are part of the program; each rank takes its parameters and buffers from its
own model (`plan_once.state_from_model`). A plan the planner chose keeps its ranking
(`Plan.search`), which crosses without the candidates' plans: the winner's is the plan itself.

How the parts that plain pickling cannot carry cross (`encode_plan` / `decode_plan`):

- fx `GraphModule`s (the traced graph, the planned graph, each stage graph): node by node —
  name, op, target, arguments (other nodes by name), type, and the node meta autopar reads
  (`KEPT_META`: autopar's own `autopar_*` keys, `val`, `nn_module_stack`, `stack_trace`).
  GraphModule's own pickling regenerates the graph from its code and loses every node's meta;
  torch's provenance bookkeeping (`from_node`, `seq_nr`, `desc`, `torch_fn`, `original_aten`,
  `tensor_meta`) is left out: nothing in autopar reads it, and part of it (references to
  decomposition functions) does not pickle.
- FakeTensors (`meta["val"]`): shape, stride, storage offset, dtype, device, requires_grad;
  rebuilt in one fresh `FakeTensorMode` per decoded plan (the mode the rank-graph check and the
  activation ledger then run in).
- The planning `DeviceMesh` every DTensorSpec refers to: rebuilt on the receiving rank as
  planning builds it (`Mesh.device_mesh(plan_rank=...)`, no backend).
- Symbolic sizes (a plan traced with `dynamic_dims`): not encoded. Their SymInts belong to the
  planner's ShapeEnv, whose guards and replacements the plan's shapes depend on; rebuilding one
  faithfully is not done yet, so `encode_plan` raises `NotEncodable` and the caller plans on every
  rank (`autopar/artifacts/plan_once.py` says so where it falls back).

Everything else (placements, sympy expressions of the ledgers, strategies, op rules with their
local kernels, ZeRO units, buckets) pickles as it is, by reference for functions and classes.
"""
from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.fx.node import map_aggregate

from autopar.core.mesh import Mesh

KEPT_META = ("val", "nn_module_stack", "stack_trace")
_OWN_META = "autopar_"


class NotEncodable(Exception):
    """The plan holds something this codec does not carry (symbolic sizes); plan locally instead."""


@dataclasses.dataclass(frozen=True)
class _NodeRef:
    name: str


def _graph_record(gm: torch.fx.GraphModule) -> dict[str, Any]:
    nodes = []
    attributes = {}
    for node in gm.graph.nodes:
        args = map_aggregate((node.args, dict(node.kwargs)),
                             lambda a: _NodeRef(a.name) if isinstance(a, torch.fx.Node) else a)
        meta = {k: v for k, v in node.meta.items() if k in KEPT_META or k.startswith(_OWN_META)}
        nodes.append((node.name, node.op, node.target, args, meta, node.type))
        if node.op in ("get_attr", "call_module"):
            attributes[node.target] = gm.get_submodule(node.target) if node.op == "call_module" else \
                _get_attr(gm, node.target)
    return {"class_name": type(gm).__name__, "nodes": nodes, "attributes": attributes}


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _graph_module(record: dict[str, Any]) -> torch.fx.GraphModule:
    """Rebuild a GraphModule from `_graph_record` (called by the unpickler)."""
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for name, op, target, args, meta, type_expr in record["nodes"]:
        node_args, node_kwargs = map_aggregate(args, lambda a: env[a.name] if isinstance(a, _NodeRef) else a)
        node = graph.create_node(op, target, tuple(node_args), dict(node_kwargs), name=name, type_expr=type_expr)
        if node.name != name:
            raise AssertionError(f"decoded node {name} was renamed {node.name}")
        node.meta.update(meta)
        env[name] = node
    return torch.fx.GraphModule(record["attributes"], graph, class_name=record["class_name"])


def _op_overload(namespace: str, name: str, overload: str | None) -> Any:
    """`torch.ops.<namespace>.<name>[.<overload>]` (a custom op's library must be imported here too,
    as the model that uses it is)."""
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


class _Encoder(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, FakeTensor):
            return ("fake", tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(), obj.dtype, obj.device,
                    obj.requires_grad)
        if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NotEncodable(f"the plan has symbolic sizes ({obj}): they belong to the planner's ShapeEnv")
        if isinstance(obj, DeviceMesh):
            return ("device_mesh", obj.device_type, tuple(obj.mesh.shape), tuple(obj.mesh_dim_names or ()),
                    obj._rank)  # the rank planning built it for (plan_rank)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.fx.GraphModule):
            return _graph_module, (_graph_record(obj),)
        if isinstance(obj, torch._ops.OpOverload):  # not picklable itself: by its qualified name
            namespace, name = obj._schema.name.split("::")
            return _op_overload, (namespace, name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::")
            return _op_overload, (namespace, name, None)
        return NotImplemented


class _Decoder(pickle.Unpickler):
    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.meshes: dict[tuple, DeviceMesh] = {}

    def persistent_load(self, pid: Any) -> Any:
        kind, *fields = pid
        if kind == "fake":
            return self._fake(*fields)
        if kind == "device_mesh":
            key = tuple(fields)
            if key not in self.meshes:
                device_type, shape, names, rank = fields
                self.meshes[key] = Mesh(dict(zip(names, shape))).device_mesh(device_type=device_type, plan_rank=rank)
            return self.meshes[key]
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r} in a plan")

    def _fake(self, shape: tuple, stride: tuple, offset: int, dtype: torch.dtype, device: torch.device,
              requires_grad: bool) -> torch.Tensor:
        """A FakeTensor of this layout, built directly on a meta tensor (no fake dispatch: a plan
        holds hundreds of them, and decoding is what the receiving ranks wait on)."""
        extent = offset + sum((size - 1) * step for size, step in zip(shape, stride)) + 1 if all(shape) else offset
        element = torch.empty(extent, dtype=dtype, device="meta").as_strided(shape, stride, offset)
        tensor = FakeTensor(self.fake_mode, element, device)
        return tensor.requires_grad_(requires_grad) if requires_grad and tensor.is_floating_point() else tensor


def _without_weights(plan: Any) -> Any:
    """A shallow copy whose traced state holds only the lifted constants (no parameters or buffers),
    and whose planner's ranking (`plan.search`, a plan chosen by `plan(model, cluster=...)`) holds
    no plan: its winner's plan is the original `plan`, weights and all, and crossed with it — every
    receiving rank then held a whole copy of rank 0's parameters for as long as its plan lived
    (`tests/test_planner_moe_peak.py`: 0.96 MB over the predicted peak, on a 2.8 MB rank)."""
    constants = {info.target for info in plan.context.placeholders.values() if info.kind == "constant"}
    traced = dataclasses.replace(plan.traced, state={k: v for k, v in plan.traced.state.items() if k in constants})
    search = plan.search
    if search is not None:
        search = dataclasses.replace(search, outcomes=[dataclasses.replace(o, plan=None) for o in search.outcomes])
    return dataclasses.replace(plan, traced=traced, search=search, _document=None, _fake_runs={})


def encode_plan(plan: Any) -> bytes:
    """The plan as bytes, without its weights (module docstring). Raises `NotEncodable` for a
    plan with symbolic sizes."""
    buffer = io.BytesIO()
    with unset_fake_temporarily():
        _Encoder(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(_without_weights(plan))
    return buffer.getvalue()


def decode_plan(data: bytes) -> Any:
    """The Plan `encode_plan` wrote; `traced.state` holds the lifted constants only. A chosen plan's
    ranking has its winner's plan again: the decoded plan, as on the rank that searched."""
    with unset_fake_temporarily():
        plan = _Decoder(io.BytesIO(data)).load()
    if plan.search is not None and plan.search.outcomes:
        plan.search.best.plan = plan
    return plan
