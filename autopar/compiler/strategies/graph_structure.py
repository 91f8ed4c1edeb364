"""The structure the tensor-parallel layout finder reads in a traced graph (`find_layout.py`).

- `find_projections`: every `mm`/`addmm` with a 2-D parameter operand, seen through transposes
  and casts (nn.Linear's `permute`, a Conv1D's [in, out] weight): its data operand, the weight
  dimension of the output features and an `addmm` bias (`Projection`).
- `classify`: every node is `const` (no trainable input: masks, positions, rotary tables,
  labels), `param` (parameters and constants only, no user data), `port` (a projection's
  output), `derived` (computed from projection outputs, not from the stream) or `stream`.
- `components`: union-find over derived nodes, each projection's output side (the derived
  nodes it feeds: it is a column there) and input side (its data operand is derived: a row);
  per component its columns, rows, nodes, and the edges by which it leaks into the stream.
- `fused_blocks`: k when a projection's output features are taken apart into k equal parts.
- `common_module`: the innermost module enclosing nodes (a block's boundary).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from autopar.compiler.context import PlaceholderInfo
from autopar.core.ir import module_stack

aten = torch.ops.aten
_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}  # op -> (data operand, weight operand)
PASS_THROUGH = {aten._to_copy.default, aten.alias.default, aten.clone.default, aten.detach.default}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


@dataclass(frozen=True)
class Projection:
    """A matmul against a 2-D parameter: `out_dim` is the weight dimension of its output features."""

    node: torch.fx.Node
    weight: str
    out_dim: int
    data: torch.fx.Node
    bias: str | None

    @property
    def name(self) -> str:
        return self.weight.removesuffix(".weight").rsplit(".", 1)[-1]


def param_of(node: torch.fx.Node, placeholders: dict[str, PlaceholderInfo]) -> torch.fx.Node | None:
    info = placeholders.get(node.name) if node.op == "placeholder" else None
    return node if info is not None and info.kind == "parameter" else None


def _weight_source(node: torch.fx.Node, placeholders: dict[str, PlaceholderInfo]) -> tuple[torch.fx.Node, bool] | None:
    """The 2-D parameter behind a matmul operand and whether it arrives transposed."""
    transposed = False
    while node.op == "call_function":
        if node.target is aten.permute.default and list(node.args[1]) == [1, 0]:
            transposed = not transposed
        elif node.target is aten.t.default or (node.target is aten.transpose.int and node.args[1] != node.args[2]):
            transposed = not transposed
        elif node.target not in PASS_THROUGH:
            return None
        node = node.args[0]
    param = param_of(node, placeholders)
    if param is None or param.meta["val"].dim() != 2:
        return None
    return param, transposed


def find_projections(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo]) -> dict[torch.fx.Node, Projection]:
    projections = {}
    for node in gm.graph.nodes:
        operands = _MATMULS.get(node.target) if node.op == "call_function" else None
        if operands is None:
            continue
        source = _weight_source(node.args[operands[1]], placeholders)
        if source is None or _weight_source(node.args[operands[0]], placeholders) is not None:
            continue
        param, transposed = source
        bias = None
        if node.target is aten.addmm.default:
            bias_node = node.args[0]
            while bias_node.op == "call_function" and bias_node.target in PASS_THROUGH:
                bias_node = bias_node.args[0]
            bias = placeholders[bias_node.name].target if param_of(bias_node, placeholders) is not None else None
        projections[node] = Projection(node=node, weight=placeholders[param.name].target, out_dim=0 if transposed else 1,
                                       data=node.args[operands[0]], bias=bias)
    return projections


def classify(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo],
              ports: dict[torch.fx.Node, Projection]) -> dict[torch.fx.Node, str]:
    kinds: dict[torch.fx.Node, str] = {}
    from_input: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            info = placeholders[node.name]
            kinds[node] = "param" if info.kind == "parameter" else "const"
            if info.kind == "input":
                from_input.add(node)
            continue
        inputs = node.all_input_nodes
        if any(i in from_input for i in inputs):
            from_input.add(node)
        found = {kinds.get(i, "const") for i in inputs}
        if node in ports:
            kinds[node] = "port"
        elif node.op != "call_function" or "stream" in found:
            kinds[node] = "stream" if found - {"const"} else "const"
        elif found & {"port", "derived"}:
            kinds[node] = "derived"
        elif "param" in found:
            kinds[node] = "stream" if node in from_input else "param"
        else:
            kinds[node] = "const"
    return kinds


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, key):
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a, b) -> None:
        self.parent[self.find(a)] = self.find(b)


def components(gm: torch.fx.GraphModule, kinds: dict, ports: dict[torch.fx.Node, Projection]) -> list[dict]:
    """Derived nodes with the projections around them; each: columns, rows, nodes, escapes."""
    sets = _UnionFind()
    for node in gm.graph.nodes:
        if kinds[node] == "derived":
            sets.find(node)
            for source in node.all_input_nodes:
                if kinds[source] == "derived":
                    sets.union(node, source)
                elif kinds[source] == "port":
                    sets.union(node, ("out", source))
        elif kinds[node] == "port" and kinds[ports[node].data] in ("derived", "port"):
            data = ports[node].data
            sets.union(("in", node), data if kinds[data] == "derived" else ("out", data))
    groups: dict = {}
    for key in list(sets.parent):
        group = groups.setdefault(sets.find(key), {"columns": [], "rows": [], "nodes": set(), "escapes": []})
        if isinstance(key, tuple):
            group["columns" if key[0] == "out" else "rows"].append(ports[key[1]])
        else:
            group["nodes"].add(key)
    for group in groups.values():
        members = list(group["nodes"]) + [p.node for p in group["columns"]]
        for member in members:
            for user in member.users:
                leaks = user.op == "output" or kinds.get(user) == "stream"
                leaks = leaks or (kinds.get(user) == "port" and ports[user].data is not member)
                if leaks:
                    group["escapes"].append((member, user))
    return [g for g in groups.values() if g["columns"]]


def fused_blocks(projection: Projection) -> int:
    """k when the output features are taken apart into k equal parts (split or slices), else 1."""
    node, features = projection.node, projection.node.meta["val"].shape[-1]
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target not in VIEWS or user.meta["val"].shape[-1] != features:
            break
        node = user
    last = node.meta["val"].dim() - 1
    users = list(node.users)
    if len(users) == 1 and users[0].target is aten.split_with_sizes.default:
        sizes, dim = users[0].args[1], users[0].args[2] if len(users[0].args) > 2 else 0
        return len(sizes) if dim % (last + 1) == last and len(set(sizes)) == 1 and len(sizes) > 1 else 1
    if users and all(u.target is aten.slice.Tensor and u.args[1] % (last + 1) == last for u in users):
        bounds = sorted((u.args[2] or 0, min(u.args[3], features) if len(u.args) > 3 else features) for u in users)
        widths = {end - start for start, end in bounds}
        tiles = all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])) and bounds[0][0] == 0 and bounds[-1][1] == features
        return len(bounds) if tiles and len(widths) == 1 and len(bounds) > 1 else 1
    return 1


def common_module(nodes: list[torch.fx.Node]) -> str:
    """The innermost module that encloses every node ('' when only the root does)."""
    common: list[str] | None = None
    for node in nodes:
        stack = module_stack(node)
        if common is None:
            common = stack
            continue
        depth = 0
        while depth < min(len(common), len(stack)) and common[depth] == stack[depth]:
            depth += 1
        common = common[:depth]
    return common[-1] if common else ""
