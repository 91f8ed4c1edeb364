"""Pass 4: emit the executable graph of one rank.

Copies the planned graph and binds it to a rank: communication steps get their keyword arguments
bound as the registry (`autopar.core.comm_kinds`) says — the rank's process-group name, its coordinate
on the axis, the global rank of a pipeline peer; nodes an autopar rule lowered call their local
kernel (`autopar.core.ops.local_ops`) with arguments bound the same way; shape arguments DTensor
rewrote to local sizes replace the global ones; `view`s become `reshape`s (a shard's strides
may differ from the traced tensor's); dead nodes (unused outputs of multi-output ops)
are removed; last, each region `autopar/compiler/passes/recompute.py` marked becomes one checkpointed call.

Symbolic sizes (a plan traced with `dynamic_dims`) stay symbolic, so one rank graph runs at any
size of a dynamic dimension. The planned graph is a global program: every size in it is a global
size. A rank's tensors are its shards, so `_globalize_sizes` multiplies each size read off a
tensor (`aten.sym_size.int`, `aten.sym_numel`) by the shard degree of that dimension under the
tensor's placements; every size computed from them is then global, as planned. Where DTensor
rewrote a symbolic shape argument to a local size (at the example's sizes), `_localize_args`
divides the global size by the same ratio (`g // (g_example / l_example)`, the shard degree); a
ratio that is not a whole number cannot be a shard degree and is refused naming the node. A view's
-1 or an expand's -1, which DTensor resolves at the example's sizes, stays -1 where the shape is symbolic. The
result is an ordinary `torch.fx.GraphModule` over local tensors, whose code (`gm.code`,
generated when first read or run) reads like the hand-written per-rank program.

A rank graph holds no device: the trace ran on CPU (or meta), and its factory ops (`arange`,
`full`, `scalar_tensor`, ...) and metadata asserts carry that device as a constant.
`_devices_from_inputs` makes each take the device of the graph's first parameter (else buffer,
constant or input), on the rank's device at run time (CUDA under NCCL, CPU under gloo); a copy
(`_to_copy`) to a device other than its tensor's traced one is a host transfer and is refused.
For the same reason a grouped expert matmul traced as a CPU op (transformers' fallback loop, a
registered custom op) is called through `autopar/core/ops/grouped_matmul.py`, which runs
`torch._grouped_mm` where the rank's tensors allow it and the traced op elsewhere.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx
from torch.utils import _pytree as pytree

from autopar.compiler.context import CompileContext
from autopar.compiler.passes.recompute import wrap_recomputed_regions
from autopar.compiler.rules.expert_rules import is_grouped_mm
from autopar.core.comm_kinds import bind, comm_step
from autopar.core.errors import PlanError
from autopar.core.ops.grouped_matmul import grouped_matmul
from autopar.core.ir import LOCAL_ARGS, RULE, SPEC, hint, lazy_graph_module, shard_dim

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_SIZE_READS = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default)


def _local_size(node: torch.fx.Node, size: torch.fx.Node, local: int) -> "torch.fx.Node | int":
    """A global symbolic size `size` as the local size DTensor computed at the example's values."""
    example = hint(size.meta["val"])
    if local == example:
        return size
    if local <= 0 or example % local:
        raise PlanError.at(node, f"DTensor rewrote the symbolic size {size.name} (= {example} in the example) to "
                                 f"{local}, which is not the size divided by a shard degree",
                           fix="declare this dimension static (leave it out of dynamic_dims)")
    with node.graph.inserting_before(node):
        local_size = node.graph.call_function(operator.floordiv, (size, example // local))
    _same_origin(local_size, node)
    return local_size


def _same_origin(inserted: torch.fx.Node, node: torch.fx.Node) -> None:
    """A node inserted for `node` is placed in its module and source line (error messages; the
    plan-time check maps a copied block's nodes by module, autopar/compiler/check_rank_graphs.py)."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in node.meta:
            inserted.meta[key] = node.meta[key]


def _localize_args(node: torch.fx.Node) -> None:
    local_args, local_kwargs = node.meta[LOCAL_ARGS]
    leaves, tree = pytree.tree_flatten((node.args, dict(node.kwargs)))
    local_leaves = pytree.tree_leaves((local_args, local_kwargs))
    if len(local_leaves) != len(leaves):
        raise AssertionError(f"local arguments of {node.format_node()} do not line up with its arguments")
    merged = []
    symbolic = _has_symbolic_shape(node)
    for leaf, local in zip(leaves, local_leaves):
        value = leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else None
        if isinstance(value, torch.Tensor):
            merged.append(leaf)
        elif isinstance(value, torch.SymInt) and isinstance(local, int):
            merged.append(_local_size(node, leaf, local))
        elif symbolic and leaf == -1 and type(leaf) is int and node.target in _SHAPED:
            # DTensor resolved the inferred size at the example's values; the local shard infers its own
            merged.append(-1)
        else:
            merged.append(local)
    node.args, node.kwargs = pytree.tree_unflatten(merged, tree)


_SHAPED = (*_VIEWS, torch.ops.aten.reshape.default, torch.ops.aten.expand.default)  # -1: inferred, or kept


def _has_symbolic_shape(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape)


def _shard_degree(spec: object, dims: "set[int]", mesh_shape: tuple[int, ...]) -> int:
    placements = getattr(spec, "placements", ())
    return math.prod(parts for placement, parts in zip(placements, mesh_shape) if shard_dim(placement) in dims)


def _globalize_sizes(graph: torch.fx.Graph, ctx: CompileContext) -> None:
    """Sizes read off a rank's shards, multiplied back to the global sizes the plan computes with."""
    for node in list(graph.nodes):
        if node.target not in _SIZE_READS:
            continue
        tensor = node.args[0]
        rank = len(tensor.meta["val"].shape)
        dims = {node.args[1] % rank} if node.target is torch.ops.aten.sym_size.int else set(range(rank))
        degree = _shard_degree(tensor.meta.get(SPEC), dims, ctx.mesh.shape)
        if degree == 1:
            continue
        with graph.inserting_after(node):
            scaled = graph.call_function(operator.mul, (node, degree))
        scaled.meta["val"] = node.meta.get("val")
        _same_origin(scaled, node)
        node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)


_COPIES = (torch.ops.aten._to_copy.default,)


def _traced_device(node: torch.fx.Node) -> "torch.device | None":
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.device if isinstance(value, torch.Tensor) else None


_SOURCE_KINDS = ("parameter", "buffer", "constant", "input")  # preferred first: the module's own state


def _device_source(graph: torch.fx.Graph, ctx: CompileContext) -> "torch.fx.Node | None":
    """A `rank_device = placeholder.device` node after the placeholders: the device of the rank
    graph's first parameter (else buffer, constant, input); None where it is given no tensor."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    kinds = {node.name: getattr(ctx.placeholders.get(node.name), "kind", None) for node in placeholders}
    # read by the graph: an unread placeholder (a tied weight's second name) is given None at run time
    tensors = [node for node in placeholders if node.users and _traced_device(node) is not None
               and kinds[node.name] in _SOURCE_KINDS]
    if not tensors:
        return None
    source = min(tensors, key=lambda node: _SOURCE_KINDS.index(kinds[node.name]))
    with graph.inserting_after(placeholders[-1]):
        device = graph.create_node("call_function", getattr, (source, "device"), name="rank_device")
    device.meta["val"] = _traced_device(source)
    return device


def _devices_from_inputs(graph: torch.fx.Graph, ctx: CompileContext) -> None:
    """No device constant left in the rank graph (see the module docstring)."""
    device = None
    for node in list(graph.nodes):
        constant = node.kwargs.get("device") if node.op == "call_function" else None
        if not isinstance(constant, torch.device):
            continue
        if node.target in _COPIES and _traced_device(node.args[0]) not in (None, constant):
            raise PlanError.at(node, f"the model copies a tensor to the constant device {constant}, a host "
                                     "transfer no rank graph may hold",
                               fix="keep the tensor where it is, or move it with .to(other_tensor.device)")
        device = device or _device_source(graph, ctx)
        if device is not None:
            node.kwargs = {**node.kwargs, "device": device}


def _grouped_matmuls_on_the_rank_device(graph: torch.fx.Graph) -> None:
    """Every grouped matmul but `aten._grouped_mm` itself through `grouped_matmul` (module docstring)."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not is_grouped_mm(target) or target is torch.ops.aten._grouped_mm.default:
            continue
        schema = getattr(target, "_schema", None)
        if schema is None or len(schema.arguments) != 3:
            continue
        values = [node.args[i] if i < len(node.args) else node.kwargs[arg.name]
                  for i, arg in enumerate(schema.arguments)]
        node.target, node.args, node.kwargs = grouped_matmul, tuple(values), {"traced": target}


class _KeysAsNames(dict):
    """Process-group names while planning: every group key names itself."""

    def __missing__(self, key: str) -> str:
        return key


def emit_rank_graph(gm: torch.fx.GraphModule, ctx: CompileContext, *, rank: int,
                    groups: dict[str, str] | None = None, recompute: bool = True) -> torch.fx.GraphModule:
    """The graph rank `rank` runs. `groups` maps group key (an axis, `ep+tp`) -> process-group name
    (the keys themselves when planning). `recompute=False` leaves the recomputed regions inline
    (what they save once their forward runs again: the memory ledger's transient)."""
    groups = groups or _KeysAsNames()
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    _globalize_sizes(graph, ctx)
    _devices_from_inputs(graph, ctx)
    _grouped_matmuls_on_the_rank_device(graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        step = comm_step(node.target)
        if step is not None:
            node.kwargs = bind(dict(node.kwargs), step.binds, ctx.mesh, rank, groups)
            continue
        rule = node.meta.get(RULE)
        if rule is not None and rule.local_kernel is not None:
            node.target = rule.local_kernel
            unbound = {name: axis for name, (_, axis) in rule.kernel_kwargs.items()}
            binds = {name: how for name, (how, _) in rule.kernel_kwargs.items()}
            node.kwargs = dict(node.kwargs, **bind(unbound, binds, ctx.mesh, rank, groups))
            if getattr(rule, "unread_args", ()):  # their producers become dead code below (plans saved before: none)
                node.args = tuple(None if i in rule.unread_args else a for i, a in enumerate(node.args))
        if LOCAL_ARGS in node.meta:
            _localize_args(node)
        if node.target in _VIEWS:
            # a local shard need not have the strides the global tensor had (a gathered or sliced
            # input is contiguous where the traced one was a transposed view): reshape copies only then
            node.target = torch.ops.aten.reshape.default
    graph.eliminate_dead_code()
    if recompute:
        wrap_recomputed_regions(graph)
    graph.lint()
    return lazy_graph_module(gm, graph, class_name=f"Rank{rank}")
