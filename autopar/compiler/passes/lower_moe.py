"""Pass 0b: find each mixture-of-experts block and lower its token routing to autopar's kernels.

An experts block is found by its structure, not by its class: the grouped matmuls of one module
(`aten._grouped_mm`, or transformers' `grouped_mm_fallback`, what Hugging Face's default experts
implementation exports) read rows gathered from the tokens `x` [T, d] by a permutation sorting the
chosen experts `top_k_index` [T, k], and offsets counting rows per expert. `_find_block` reads:
- the gather `x_perm = x[perm // k]` feeding the first grouped matmul, `perm` from a sort of the
  flattened `top_k_index`, the offsets (third argument of every grouped matmul);
- the experts' computation: what the grouped matmuls compute from those rows, up to the last
  row-wise result `y_perm` before the router weights are applied;
- the combine: the rest of the block downstream of `top_k_index`, which must end in one value of
  shape [T, d] (the block's output) reading one [T, k] (or flat [T·k]) float tensor of router weights.

The bookkeeping (sort, gather, histc, cumsum; weighting, inverse permutation, sum over k) is
replaced by `runtime.moe.moe_permute` / `moe_unpermute`, which compute sizes from the tensors they
get and so run on any rank's tokens; the experts' computation stays as traced (its ops take any
number of rows). With an expert-parallel axis declared (`autopar/compiler/strategies/expert.py`) the rows go
through `moe_dispatch` before the experts and `moe_combine` after.

The replacement is checked, not assumed: the original block and its lowering are evaluated on
the same random tokens, choices, weights and parameters at the example's sizes (on CPU, when the
block is small enough to evaluate: `_CHECK_LIMIT` elements) and must agree to fp32 rounding.
Anything that does not match — a block whose pieces are not found, an experts computation that
reads other routing values, a combine that is not the weighted sum — is a PlanError naming the
block, so an MoE autopar cannot recognise is refused at plan time, never run wrong.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from autopar.compiler.context import CompileContext
from autopar.compiler.rules.expert_rules import is_grouped_mm
from autopar.core.errors import PlanError
from autopar.core.ir import hint, module_path
from autopar.core.ops import moe
from autopar.core.program import Program

aten = torch.ops.aten
_CHECK_LIMIT = 1 << 22  # elements in the block's values above which the evaluation check is skipped
_PASS_THROUGH = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.clone.default, aten.alias.default}
_FLATTEN = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.flatten.using_ints}
_NOT_FOUND = ("write the block as Hugging Face's grouped experts do (sort the flattened top-k expert ids, gather "
              "x[perm // k], grouped matmuls with cumulative offsets, weight, unpermute, sum over k), or keep it "
              "out of a sharded plan")


@dataclass
class ExpertBlock:
    path: str  # module path of the experts
    grouped: list[torch.fx.Node]
    x: torch.fx.Node
    top_k_index: torch.fx.Node
    weights: torch.fx.Node
    x_perm: torch.fx.Node
    offsets: torch.fx.Node
    perm: torch.fx.Node
    ids_sorted: torch.fx.Node | None
    y_perm: torch.fx.Node
    output: torch.fx.Node
    experts: list[torch.fx.Node]  # the experts' computation, kept
    removed: list[torch.fx.Node]  # bookkeeping and combine, replaced
    num_experts: int
    top_k: int


def expert_parameters(graph: torch.fx.Graph) -> dict[str, list[torch.fx.Node]]:
    """Experts module path -> the placeholders (parameters) its grouped matmuls read as weights,
    through views; every one's first dimension is the expert."""
    found: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and is_grouped_mm(node.target):
            for source in _placeholders_above(node.args[1]):
                found.setdefault(module_path(node), [])
                if source not in found[module_path(node)]:
                    found[module_path(node)].append(source)
    return found


def _placeholders_above(node: torch.fx.Node) -> list[torch.fx.Node]:
    seen, stack, found = set(), [node], []
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            found.append(current)
        stack.extend(current.all_input_nodes)
    return found


def _up_through(node: Any, ops: set) -> Any:
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in ops:
        node = node.args[0]
    return node


def _descendants(sources: list[torch.fx.Node], within: set[torch.fx.Node]) -> set[torch.fx.Node]:
    found, stack = set(), [u for s in sources for u in s.users]
    while stack:
        node = stack.pop()
        if node in found or node not in within:
            continue
        found.add(node)
        stack.extend(node.users)
    return found


def _ancestors(node: torch.fx.Node, within: set[torch.fx.Node]) -> set[torch.fx.Node]:
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in found or current not in within:
            continue
        found.add(current)
        stack.extend(current.all_input_nodes)
    return found


def _refusal(path: str, default: torch.fx.Node) -> Any:
    def refuse(message: str, node: torch.fx.Node = default) -> PlanError:
        return PlanError.at(node, f"mixture-of-experts block {path!r}: {message}; autopar cannot recognise it",
                            fix=_NOT_FOUND)

    return refuse


def _find_routing(grouped: list[torch.fx.Node], refuse: Any) -> tuple:
    """(offsets, x_perm, x, top_k, perm, sort, top_k_index) of an experts block (module docstring)."""
    first = grouped[0]
    offsets = first.args[2] if len(first.args) > 2 else first.kwargs.get("offs")
    if not isinstance(offsets, torch.fx.Node) or any(
            (g.args[2] if len(g.args) > 2 else g.kwargs.get("offs")) is not offsets for g in grouped):
        raise refuse("its grouped matmuls do not share one offsets tensor")
    x_perm = _up_through(first.args[0], _PASS_THROUGH)
    if not (isinstance(x_perm, torch.fx.Node) and x_perm.target is aten.index.Tensor and len(x_perm.args[1]) == 1):
        raise refuse("the rows of its first grouped matmul are not gathered from the tokens (x[perm // k])")
    x, rows = x_perm.args[0], x_perm.args[1][0]
    floor = rows.target is aten.floor_divide.default or (
        rows.target in (aten.div.Tensor_mode, aten.div.Scalar_mode) and rows.kwargs.get("rounding_mode") == "floor")
    if not (floor and isinstance(rows.args[1], int)):
        raise refuse("the gathered rows are not x[perm // k]", x_perm)
    top_k, perm = rows.args[1], rows.args[0]
    sort = perm.args[0] if perm.target is operator.getitem and perm.args[1] == 1 else None
    if sort is None or sort.target not in (aten.sort.default, aten.sort.stable):
        raise refuse("the permutation is not a sort of the chosen experts", rows)
    top_k_index = _up_through(sort.args[0], _FLATTEN)
    tokens = x.meta["val"].shape[0]
    if tuple(top_k_index.meta["val"].shape) != (tokens, top_k) or top_k_index.meta["val"].dtype.is_floating_point:
        raise refuse(f"the sorted expert ids are not a [{tokens}, {top_k}] integer tensor", sort)
    return offsets, x_perm, x, top_k, perm, sort, top_k_index


def _find_block(path: str, grouped: list[torch.fx.Node], graph: torch.fx.Graph) -> ExpertBlock:
    last = grouped[-1]
    refuse = _refusal(path, grouped[0])
    offsets, x_perm, x, top_k, perm, sort, top_k_index = _find_routing(grouped, refuse)
    tokens = x.meta["val"].shape[0]
    ids_sorted = next((u for u in sort.users if u.args[1] == 0), None)
    region = {n for n in graph.nodes if module_path(n) == path or module_path(n).startswith(path + ".")}
    downstream = _descendants([top_k_index], region)
    sources = [s for s in (x_perm, offsets, ids_sorted) if s is not None]
    closure = _descendants(sources, region) | set(sources)
    y_perm = last
    while True:  # row-wise steps after the last grouped matmul that read nothing of the combine (a bias)
        users = [u for u in y_perm.users if u in region]
        if len(users) != 1 or users[0].target not in _PASS_THROUGH | {aten.add.Tensor, aten.masked_fill.Scalar}:
            break
        if any(a in downstream and a not in closure for a in users[0].all_input_nodes if a is not y_perm):
            break
        y_perm = users[0]
    feeding_sources = set().union(*(_ancestors(s, region) for s in sources))
    experts = (_descendants(sources, region) & _ancestors(y_perm, region)) - feeding_sources
    removed = downstream - experts
    outputs = [n for n in removed if any(u not in removed and u not in experts for u in n.users)]
    if len(outputs) != 1 or tuple(outputs[0].meta["val"].shape) != tuple(x.meta["val"].shape):
        raise refuse(f"its routing does not end in one [T, d] output (found "
                     f"{[(n.name, [u.name for u in n.users if u not in removed]) for n in outputs]})", last)
    output = outputs[0]
    for node in experts:
        for read in node.all_input_nodes:
            if read in removed and read not in sources:
                raise refuse(f"its experts' computation reads {read.name}, a routing value autopar does not "
                             f"reproduce (only the gathered rows, the offsets and the sorted expert ids)", node)
    weights = _router_weights(removed, experts, tokens, top_k, refuse, output)
    return ExpertBlock(path=path, grouped=grouped, x=x, top_k_index=top_k_index, weights=weights, x_perm=x_perm,
                       offsets=offsets, perm=perm, ids_sorted=ids_sorted, y_perm=y_perm, output=output,
                       experts=sorted(experts, key=_order(graph)), removed=sorted(removed, key=_order(graph)),
                       num_experts=int(hint(offsets.meta["val"].shape[0])), top_k=top_k)


def _router_weights(removed: set, experts: set, tokens: Any, top_k: int, refuse: Any, output: torch.fx.Node
                    ) -> torch.fx.Node:
    reads = {a for n in removed for a in n.all_input_nodes if a not in removed and a not in experts}
    wanted = {(tokens, top_k), (tokens * top_k,)}
    found = [a for a in reads if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype.is_floating_point
             and tuple(a.meta["val"].shape) in wanted]
    if len(found) != 1:
        raise refuse(f"its combine does not read exactly one [T, k] float tensor of router weights "
                     f"(found {sorted(a.name for a in found)})", output)
    return found[0]


def _order(graph: torch.fx.Graph):
    position = {n: i for i, n in enumerate(graph.nodes)}
    return lambda node: position[node]


def lower_moe(program: Program, ctx: CompileContext) -> Program:
    gm = program.graph_module
    graph = gm.graph
    by_path: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and is_grouped_mm(node.target):
            by_path.setdefault(module_path(node), []).append(node)
    expert_axes = ctx.strategy.expert_axes()
    for path, grouped in by_path.items():
        block = _find_block(path, grouped, graph)
        _check_experts_divide(block, expert_axes, ctx)
        _check_lowering(block, graph)
        _rewrite(block, graph, expert_axes, ctx)
    if by_path:
        graph.lint()
        gm.recompile()
    return program


def _check_experts_divide(block: ExpertBlock, expert_axes: tuple[str, ...], ctx: CompileContext) -> None:
    for axis in expert_axes:
        declared = ctx.strategy.expert_declaration(axis)
        factor = declared.capacity_factor
        if factor is not None and factor < block.num_experts and not declared.drop_tokens:
            raise PlanError.at(block.grouped[0], f"mixture-of-experts block {block.path!r}: capacity factor {factor} "
                                                 f"lets each of its {block.num_experts} experts take at most "
                                                 f"ceil({factor} · rows / {block.num_experts}) of a rank's rows, so "
                                                 f"tokens routed beyond it would be dropped (one device drops none)",
                               fix="pass expert_parallel(..., drop_tokens=True) to accept dropped tokens, or leave "
                                   "capacity_factor out (dropless)")
        group = ctx.strategy.expert_group(axis)
        size = ctx.mesh.group_size(group)
        if block.num_experts % size:
            over = (f"expert-parallel axis {axis!r} of size {size}" if group == axis else
                    f"the {size} ranks of expert-parallel axes {group!r} (folded)")
            raise PlanError.at(block.grouped[0], f"mixture-of-experts block {block.path!r}: {block.num_experts} "
                                                 f"experts do not divide over {over}",
                               fix=f"choose an {axis} size dividing {block.num_experts}" if group == axis else
                               f"choose {group.replace('+', ' × ')} sizes whose product divides {block.num_experts}")
        if block.ids_sorted is not None and block.ids_sorted in {a for n in block.experts for a in n.all_input_nodes}:
            raise PlanError.at(block.grouped[0], f"mixture-of-experts block {block.path!r}: its experts read the "
                                                 f"sorted expert ids (per-expert biases), which expert parallelism "
                                                 f"does not move yet",
                               fix="leave expert_parallel out for this model, or use experts without biases")


def _random_like(value: torch.Tensor, generator: torch.Generator, high: int | None = None) -> torch.Tensor:
    shape = tuple(hint(s) for s in value.shape)
    if not value.dtype.is_floating_point:
        return torch.randint(0, high or 2, shape, generator=generator, dtype=value.dtype)
    return (torch.randn(shape, generator=generator) * 0.5).to(value.dtype)


def _evaluate(nodes: list[torch.fx.Node], values: dict) -> None:
    def concrete(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return values[value]
        return torch.device("cpu") if isinstance(value, torch.device) else hint(value)

    for node in nodes:
        if node not in values and node.op == "call_function":
            args, kwargs = pytree.tree_map(concrete, (node.args, dict(node.kwargs)))
            values[node] = node.target(*args, **kwargs)


def _check_lowering(block: ExpertBlock, graph: torch.fx.Graph) -> None:
    """The original block and its lowering agree on random inputs (module docstring)."""
    involved = set(block.removed) | set(block.experts)
    frontier = {a for n in involved for a in n.all_input_nodes if a not in involved}
    made = {a for a in frontier if a.op == "call_function" and not a.all_input_nodes}  # arange, empty: evaluated
    involved |= made
    frontier = sorted(frontier - made, key=_order(graph))
    sizes = [hint(v.numel()) for n in frontier + block.removed + block.experts
             if isinstance(v := n.meta.get("val"), torch.Tensor)]
    if sum(sizes) > _CHECK_LIMIT or any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "meta"
                                        for n in frontier):
        return
    generator = torch.Generator().manual_seed(0)
    inputs = {n: _random_like(n.meta["val"], generator, block.num_experts) for n in frontier}
    original = dict(inputs)
    _evaluate(sorted(involved, key=_order(graph)), original)
    lowered = dict(inputs)
    x_perm, offsets, order, ids = moe.moe_permute(inputs[block.x], inputs[block.top_k_index],
                                                  num_experts=block.num_experts)
    lowered.update({block.x_perm: x_perm, block.offsets: offsets.to(block.offsets.meta["val"].dtype), block.perm: order})
    if block.ids_sorted is not None:
        lowered[block.ids_sorted] = ids
    _evaluate(block.experts, lowered)
    out = moe.moe_unpermute(lowered[block.y_perm], order, inputs[block.weights], top_k=block.top_k,
                            dtype=block.output.meta["val"].dtype)
    expected = original[block.output]
    if out.shape != expected.shape or not torch.allclose(out, expected, rtol=1e-4, atol=1e-5):
        error = (out - expected).abs().max().item() if out.shape == expected.shape else "shape"
        raise PlanError.at(block.output, f"mixture-of-experts block {block.path!r}: its routing is not the weighted "
                                         f"sum over its top-{block.top_k} experts autopar lowers it to (max "
                                         f"difference {error} on random inputs); autopar cannot recognise it",
                           fix=_NOT_FOUND)


def _call(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: dict, like: torch.fx.Node, val: Any
          ) -> torch.fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = val
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def _outputs(graph: torch.fx.Graph, node: torch.fx.Node, vals: list, like: torch.fx.Node) -> list[torch.fx.Node]:
    items = []
    anchor = node
    for i, val in enumerate(vals):
        with graph.inserting_after(anchor):
            anchor = _call(graph, operator.getitem, (node, i), {}, like, val)
        items.append(anchor)
    return items


def _rewrite(block: ExpertBlock, graph: torch.fx.Graph, expert_axes: tuple[str, ...], ctx: CompileContext) -> None:
    ids_val = block.ids_sorted.meta["val"] if block.ids_sorted is not None else block.perm.meta["val"]
    vals = [block.x_perm.meta["val"], block.offsets.meta["val"], block.perm.meta["val"], ids_val]
    with graph.inserting_before(block.x_perm):
        permute = _call(graph, moe.moe_permute, (block.x, block.top_k_index), {"num_experts": block.num_experts},
                        block.x_perm, tuple(vals))
    rows, offsets, order, ids = _outputs(graph, permute, vals, block.x_perm)
    feeds = {block.x_perm: rows, block.offsets: offsets}
    if block.ids_sorted is not None:
        feeds[block.ids_sorted] = ids
    exchange = None
    if expert_axes:
        (declared,) = expert_axes
        axis = ctx.strategy.expert_group(declared)  # the group key: the axis, and the axes folded into it
        size = ctx.mesh.group_size(axis)
        factor = ctx.strategy.expert_declaration(declared).capacity_factor or 0.0
        received_val = block.offsets.meta["val"].new_zeros((size, block.num_experts // size), dtype=torch.long)
        dispatch_vals = [block.x_perm.meta["val"], block.offsets.meta["val"], received_val]
        with graph.inserting_after(ids):
            dispatch = _call(graph, moe.moe_dispatch, (rows, offsets),
                             {"group": axis, "size": axis, "index": axis, "block": block.path,
                              "capacity_factor": factor}, block.x_perm,
                             tuple(dispatch_vals))
        local_rows, local_offsets, received = _outputs(graph, dispatch, dispatch_vals, block.x_perm)
        feeds.update({block.x_perm: local_rows, block.offsets: local_offsets})
        exchange = (axis, received, offsets, factor)
    for node in block.experts:
        for old, new in feeds.items():
            node.replace_input_with(old, new)
    result = block.y_perm
    if exchange is not None:
        axis, received, global_offsets, factor = exchange
        with graph.inserting_after(block.y_perm):
            result = _call(graph, moe.moe_combine, (block.y_perm, received, global_offsets),
                           {"group": axis, "size": axis, "capacity_factor": factor}, block.output,
                           block.y_perm.meta["val"])
    with graph.inserting_before(block.output):
        out = _call(graph, moe.moe_unpermute, (result, order, block.weights),
                    {"top_k": block.top_k, "dtype": block.output.meta["val"].dtype}, block.output,
                    block.output.meta["val"])
    if exchange is not None:
        with graph.inserting_after(out):
            out = _call(graph, moe.moe_rejoin, (out,), {}, block.output, block.output.meta["val"])
    removed = set(block.removed)
    block.output.replace_all_uses_with(out, delete_user_cb=lambda user: user not in removed)
    for node in reversed(block.removed):
        for user in list(node.users):
            if user not in removed:
                raise PlanError.at(user, f"mixture-of-experts block {block.path!r}: {user.name} outside the "
                                         f"block reads its routing value {node.name}", fix=_NOT_FOUND)
        graph.erase_node(node)
    _erase_dead(graph)


def _erase_dead(graph: torch.fx.Graph) -> None:
    """Pure nodes left without users by the rewrite (e.g. the flattened router weights' old copies)."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op == "call_function" and not node.users and not node.is_impure() \
                    and node.target is not aten._assert_tensor_metadata.default:
                graph.erase_node(node)
                changed = True
