"""The placement IR: what the passes write into `node.meta` and how to read it back.

Every tensor-valued node of the traced graph carries, under `SPEC`, a DTensorSpec (or a tuple
of them for multi-output ops) with one placement per mesh axis and the global tensor meta.
Consumers record under `ARG_SPECS` the spec each tensor argument must have when it arrives
(the collective-insertion pass makes that true), and under `LOCAL_ARGS` the argument list with
shape arguments rewritten to local sizes. Redistribution and gradient nodes inserted later carry
a `CollectiveInfo` under `COLLECTIVE` that the ledgers read.

Helpers here also answer "where did this node come from": `module_path`, `module_stack`,
`source_line`, and shape helpers that keep symbolic (sympy) and concrete sizes side by side.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.fx._lazy_graph_module import _LazyGraphModule

SPEC = "autopar_spec"
ARG_SPECS = "autopar_arg_specs"
LOCAL_ARGS = "autopar_local_args"
RULE = "autopar_rule"
COLLECTIVE = "autopar_collective"
ORIGIN = "autopar_origin"
PLANNED_NAME = "autopar_planned_name"  # a rank-graph node standing for a planned node of another name


@dataclass(frozen=True)
class CollectiveInfo:
    """One collective (or local redistribution) that a graph node performs, per step.

    `phase` is "forward", "backward" or "grad_sync"; `kind` one of all_reduce, all_gather,
    reduce_scatter, all_to_all, or a local (no-communication) step such as "slice".
    `logical_bytes` is the NCCL-benchmark size S (all-reduce input, all-gather output,
    reduce-scatter input, all-to-all input) as a sympy expression in the traced symbols.
    """

    kind: str
    axis: str
    phase: str
    logical_bytes: sympy.Expr
    dtype: torch.dtype
    tensor: str
    module: str
    why: str


def module_stack(node: torch.fx.Node) -> list[str]:
    """Module paths enclosing `node`, outermost first ('' for the root is dropped)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values() if isinstance(path, str) and path and "hook" not in path]


def reachable(node: "torch.fx.Node | list[torch.fx.Node]", *, forward: bool,
              within: "Any | None" = None) -> set[torch.fx.Node]:
    """Nodes reachable from `node` (or any of a list) through users (forward) or inputs (backward),
    passing only through nodes for which `within(node)` holds (all, by default)."""
    seen, stack = set(), list(node) if isinstance(node, list) else [node]
    while stack:
        current = stack.pop()
        for neighbour in (current.users if forward else current.all_input_nodes):
            if neighbour not in seen and (within is None or within(neighbour)):
                seen.add(neighbour)
                stack.append(neighbour)
    return seen


def module_path(node: torch.fx.Node) -> str:
    stack = module_stack(node)
    return stack[-1] if stack else ""


def source_line(node: torch.fx.Node) -> str:
    """The user's source line ('file, line N, in fn: code') that produced `node`, if recorded.

    The innermost frame outside torch itself: a user's `F.embedding(...)` call, not nn.functional."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    frames = [(lines[i].replace("File ", "").replace('"', ""), lines[i + 1] if i + 1 < len(lines) else "")
              for i in range(len(lines)) if lines[i].startswith("File ")]
    for location, code in reversed(frames):
        if "/site-packages/torch/" not in location and not location.startswith("torch/"):
            return f"{location}: {code}"
    return f"{frames[-1][0]}: {frames[-1][1]}" if frames else ""


def output_specs(node: torch.fx.Node) -> Any:
    return node.meta.get(SPEC)


def tensor_spec(node: torch.fx.Node) -> DTensorSpec | None:
    spec = node.meta.get(SPEC)
    return spec if isinstance(spec, DTensorSpec) else None


def shard_dim(placement: Placement) -> int | None:
    """The tensor dimension a placement splits: Shard(d), or _StridedShard(d, sf) (block-sharded:
    the dimension is sf equal blocks, each split over the axis, e.g. a fused q|k|v projection)."""
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


def describe(placements: tuple[Placement, ...]) -> str:
    """Short form: S(1), R, P(sum) joined per axis."""
    def one(p: Placement) -> str:
        if isinstance(p, _StridedShard):
            return f"S({p.dim})x{p.split_factor}"
        if isinstance(p, Shard):
            return f"S({p.dim})"
        if isinstance(p, Replicate):
            return "R"
        if isinstance(p, Partial):
            return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
        return str(p)

    return ",".join(one(p) for p in placements)


def sym_size(value: Any) -> sympy.Expr:
    """A size as a sympy expression (SymInt -> its expression, int -> Integer)."""
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    return sympy.Integer(int(value))


def hint(value: Any) -> Any:
    """A concrete Python value for anything that may be a SymInt (or contain some)."""
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    if isinstance(value, (list, tuple)):
        return type(value)(hint(v) for v in value)
    return value


def tensor_meta(value: torch.Tensor) -> TensorMeta:
    """DTensor's TensorMeta of a traced value, with concrete (hint) sizes."""
    return TensorMeta(torch.Size(hint(tuple(value.shape))), hint(tuple(value.stride())), value.dtype)


def retyped(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    """`spec` with its tensor's dtype changed (a cast: same placements, shape and stride)."""
    meta = spec.tensor_meta
    return DTensorSpec(spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))


def insert_cast(graph: torch.fx.Graph, source: torch.fx.Node, dtype: torch.dtype, *, before: torch.fx.Node,
                why: str) -> torch.fx.Node:
    """A placed `aten._to_copy(source, dtype=dtype)` before `before`: the source's placements, its
    traced value cast (a fake tensor's own mode runs it), `why` as its origin. The mixed-precision
    passes' casts of masters and of the model's outputs."""
    spec: DTensorSpec = source.meta[SPEC]
    with graph.inserting_before(before):
        cast = graph.call_function(torch.ops.aten._to_copy.default, (source,), {"dtype": dtype})
    value = source.meta.get("val")
    if isinstance(value, torch.Tensor):
        cast.meta["val"] = value.to(dtype)
    cast.meta[SPEC] = retyped(spec, dtype)
    cast.meta[ARG_SPECS] = [spec]
    cast.meta[ORIGIN] = {"decided_by": why}
    return cast


def local_shape(global_shape: tuple[int, ...], placements: tuple[Placement, ...], axis_sizes: tuple[int, ...]) -> list[int]:
    """One rank's shard shape for concrete sizes (divisible; the planner refuses the others)."""
    shape = [int(d) for d in global_shape]
    for placement, parts in zip(placements, axis_sizes):
        if shard_dim(placement) is not None:
            shape[placement.dim] //= parts
    return shape


def local_numel(global_shape: tuple[Any, ...], placements: tuple[Placement, ...], axis_sizes: tuple[int, ...]) -> sympy.Expr:
    """Elements of one rank's shard (divisible sizes; the planner refuses the others)."""
    sizes = [sym_size(d) for d in global_shape]
    for placement, parts in zip(placements, axis_sizes):
        if shard_dim(placement) is not None:
            sizes[placement.dim] = sizes[placement.dim] / parts
    numel = sympy.Integer(1)
    for size in sizes:
        numel *= size
    return simplified(numel)


@functools.lru_cache(maxsize=4096)
def simplified(expr: sympy.Expr) -> sympy.Expr:
    """`sympy.simplify(expr)`, once per distinct expression: it costs milliseconds, and every
    layer of a deep model asks for the same few sizes."""
    return sympy.simplify(expr)


def lazy_graph_module(root: "torch.nn.Module | dict", graph: torch.fx.Graph, *,
                      class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated when it is first read (`.code`) or run: the
    passes rewrite a graph and `recompile()` it several times, and the code of a 20,000-node graph
    takes seconds to generate (torch.fx's `_LazyGraphModule`, as inductor uses it)."""
    return _LazyGraphModule(root, graph, class_name=class_name)


def node_value(node: torch.fx.Node) -> Any:
    return node.meta.get("val")
