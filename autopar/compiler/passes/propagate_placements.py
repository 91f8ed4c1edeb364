"""Pass 1: give every tensor in the graph a DTensor placement per mesh axis.

Seeds: parameters and user inputs get the placements the strategies declare (`ResolvedStrategy`),
buffers and constants are replicated, ops without tensor inputs (arange, zeros) produce
replicated tensors. Every other node, in topological order:
1. each tensor argument's spec is adjusted for the module boundaries the edge crosses
   (`ResolvedStrategy.edge_placements`: a module's declared input / output layouts);
2. autopar's own rule for the op (`autopar.compiler.rules.op_rules`) decides if there is one, otherwise DTensor's
   sharding propagator (`propagate_op_sharding_non_cached`, the rules DTensor registers) picks the
   output placement and the placements the arguments must be redistributed to, and rewrites
   shape arguments (view, reshape, expand, new_*) to local sizes; DTensor's answer is a pure
   function of the op and its argument specs and values, so it is asked once per distinct
   question and remembered in `CompileContext.sharding_decisions` (`_dtensor_decision`: the
   layers of a deep model ask the same questions; inputs that already match one of the op's
   single-mesh-dimension strategies on every axis are answered without DTensor's full expansion,
   `autopar/compiler/dtensor_matching.py`);
3. the node records `SPEC` (its output), `ARG_SPECS` (what each tensor argument must be),
   `LOCAL_ARGS` (arguments with local shapes), `RULE` (an autopar rule's result, if any) and
   `ORIGIN` (why: the seed rule, the module layouts its inputs crossed, who decided, and with
   `CompileContext.explain` the alternatives DTensor weighed with their costs).
An op with no rule whose inputs are all replicated runs whole on every rank (`_held_whole`); a
random op DTensor placed on shards gets the kernel that draws one device's values, or is refused
(`_draw_as_one_device`, `autopar/compiler/rules/random_rules.py`). A
sharded dimension that its axis does not divide, or an op with no rule on sharded inputs, is a
`PlanError` naming the node, module and source line. `propagate_node` places one node (the
tensor-parallel layout finder, `autopar/compiler/strategies/find_layout.py`, checks its candidates with it).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils import _pytree as pytree

from autopar.compiler import rules
from autopar.compiler.argument_trees import (
    argument_leaves,
    flatten_arguments,
    map_arguments,
)
from autopar.compiler.context import CompileContext
from autopar.compiler.dtensor_matching import exact_matches_first
from autopar.compiler.explain import dtensor_alternatives
from autopar.compiler.planning_errors import data_dependent, planning_error
from autopar.core.errors import PlanError
from autopar.core.ir import (
    ARG_SPECS,
    LOCAL_ARGS,
    ORIGIN,
    RULE,
    SPEC,
    describe,
    hint,
    module_stack,
    shard_dim,
    tensor_meta,
)
from autopar.core.program import Program


def _replicated(ctx: CompileContext, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return DTensorSpec(ctx.device_mesh, (Replicate(),) * len(ctx.mesh.names), tensor_meta(value))
    if isinstance(value, (tuple, list)):
        return tuple(_replicated(ctx, v) for v in value)
    return None


def _seed(node: torch.fx.Node, ctx: CompileContext) -> DTensorSpec | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    info = ctx.placeholders[node.name]
    if info.kind == "parameter":
        placements = ctx.strategy.param_placements(info.target)
        node.meta[ORIGIN] = {"seed": ctx.strategy.param_origin(info.target)}
    elif info.kind == "input":
        placements = ctx.strategy.input_placements(info.index)
        placements = tuple(p if shard_dim(p) is None or p.dim < value.dim() else Replicate() for p in placements)
        node.meta[ORIGIN] = {"seed": f"user input {info.index}: input rules of the strategies give {describe(placements)}"}
    else:
        placements = (Replicate(),) * len(ctx.mesh.names)
        node.meta[ORIGIN] = {"seed": f"{info.kind}: replicated"}
    return DTensorSpec(ctx.device_mesh, placements, tensor_meta(value))


def _check_divisible(node: torch.fx.Node, spec: Any, ctx: CompileContext) -> None:
    for one in spec if isinstance(spec, (tuple, list)) else (spec,):
        if not isinstance(one, DTensorSpec) or one.tensor_meta is None:
            continue
        shape = one.tensor_meta.shape
        for axis_index, placement in enumerate(one.placements):
            blocks = getattr(placement, "split_factor", 1)
            if shard_dim(placement) is not None and shape[placement.dim] % (ctx.axis_size(axis_index) * blocks):
                axis = ctx.mesh.names[axis_index]
                raise PlanError.at(
                    node, f"dimension {placement.dim} of size {shape[placement.dim]} cannot be split evenly over "
                          f"mesh axis {axis!r} of size {ctx.axis_size(axis_index)} (placement {describe(one.placements)}, "
                          f"global shape {tuple(shape)})",
                    fix=f"choose a {axis} size that divides {shape[placement.dim]} (e.g. heads % tp == 0, "
                        f"batch % dp == 0), or change the model's sizes")


def _edge_spec(producer: torch.fx.Node, consumer: torch.fx.Node, ctx: CompileContext) -> DTensorSpec:
    spec = producer.meta[SPEC]
    if producer.op == "placeholder" and ctx.placeholders[producer.name].kind != "input":
        return spec
    reasons: list[str] = []
    value = producer.meta.get("val")  # its sizes, symbolic where dynamic (the spec holds their hints)
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    placements = ctx.strategy.edge_placements(module_stack(producer), module_stack(consumer), spec.placements, reasons,
                                              shape=shape)
    if placements == spec.placements:
        return spec
    edges = consumer.meta.setdefault(ORIGIN, {}).setdefault("edges", [])
    edges.append(f"{producer.name} {describe(spec.placements)} -> {describe(placements)}: " + "; ".join(reasons))
    return DTensorSpec(spec.mesh, placements, spec.tensor_meta)


def _to_schema_arg(value: Any, consumer: torch.fx.Node, ctx: CompileContext) -> Any:
    if isinstance(value, torch.fx.Node):
        spec = value.meta.get(SPEC)
        if isinstance(spec, DTensorSpec):
            return _edge_spec(value, consumer, ctx)
        return hint(value.meta.get("val"))
    return hint(value)


# Matmuls whose operand's rows map one-to-one onto the output's rows (argument index of that
# operand): which rows a rank holds does not matter to them. Rows of a flattened [batch, seq]
# sharded on seq (context parallelism) are a _StridedShard(0), which DTensor's matmul strategies
# do not offer beside another axis' shard; such an operand is decided as Shard(0) and the strided
# placement put back on the output's rows and on what the operand must arrive as.
_ROW_OPERAND = {torch.ops.aten.mm.default: 0, torch.ops.aten.addmm.default: 1}


def _strided_rows(node: torch.fx.Node, args: tuple) -> tuple[tuple, dict[int, Placement]]:
    """`args` with the row operand's _StridedShard(0) placements as Shard(0), and which axes changed."""
    position = _ROW_OPERAND.get(node.target)
    spec = args[position] if position is not None and position < len(args) else None
    if not isinstance(spec, DTensorSpec):
        return args, {}
    strided = {i: p for i, p in enumerate(spec.placements) if isinstance(p, _StridedShard) and p.dim == 0}
    if not strided:
        return args, {}
    plain = tuple(Shard(0) if i in strided else p for i, p in enumerate(spec.placements))
    changed = list(args)
    changed[position] = DTensorSpec(spec.mesh, plain, spec.tensor_meta)
    return tuple(changed), strided


def _restrided(spec: Any, strided: dict[int, Placement]) -> Any:
    if not isinstance(spec, DTensorSpec):
        return spec
    placements = tuple(strided[i] if i in strided and p == Shard(0) else p for i, p in enumerate(spec.placements))
    return DTensorSpec(spec.mesh, placements, spec.tensor_meta)


def _propagate_with_dtensor(node: torch.fx.Node, args: tuple, kwargs: dict, ctx: CompileContext) -> None:
    original_args = args
    args, strided = _strided_rows(node, args)
    _propagate_with_dtensor_decided(node, args, kwargs, ctx)
    if strided:
        node.meta[SPEC] = _restrided(node.meta[SPEC], strided)
        position = _ROW_OPERAND[node.target]
        index = sum(len(pytree.tree_leaves(a)) for a in original_args[:position])
        wanted = list(node.meta[ARG_SPECS])
        wanted[index] = _restrided(wanted[index], strided)
        node.meta[ARG_SPECS] = wanted


def _propagate_with_dtensor_decided(node: torch.fx.Node, args: tuple, kwargs: dict, ctx: CompileContext) -> None:
    propagator = DTensor._op_dispatcher.sharding_propagator
    try:
        result, schema = _dtensor_decision(propagator, args, kwargs, node, ctx)
    except NotImplementedError as error:
        if _held_whole(node, args, kwargs, ctx):
            return
        if rules.draws(node):
            raise rules.refuse_draw(node, ", ".join(describe(a.placements) for a in pytree.tree_leaves(args)
                                                    if isinstance(a, DTensorSpec)),
                                    "autopar has no rule drawing one device's values for it on a shard") from None
        raise PlanError.at(node, f"no sharding rule for {node.target} with inputs "
                                 f"{[describe(a.placements) for a in pytree.tree_leaves(args) if isinstance(a, DTensorSpec)]}: {error}",
                           fix="register one with @autopar.compiler.rules.registry.register(<op>) returning a RuleResult, "
                               "or declare a layout that keeps this op's inputs replicated") from None
    except Exception as error:  # DTensor raises assorted types for impossible shardings
        if data_dependent(error, node):  # nonzero, masked_select: said in autopar's words, the text below
            raise planning_error(error, phase="placement propagation", node=node) from error
        uneven = "uneven" in str(error)
        message = "a sharded dimension does not split evenly over its mesh axis" if uneven else "DTensor could not shard"
        fix = ("make the sharded size divisible by the axis size (e.g. heads % tp == 0, hidden % tp == 0)" if uneven
               else "declare module layouts that give this op inputs it can shard, or keep them replicated")
        raise PlanError.at(node, f"{message}: {node.target}: {type(error).__name__}: {error}", fix=fix) from None
    node.meta[SPEC] = result.output_spec
    origin = node.meta.setdefault(ORIGIN, {})
    origin["decided_by"] = f"DTensor's sharding rule for {node.target}"
    if ctx.explain:
        origin["alternatives"] = dtensor_alternatives(schema or _schema(propagator, node, args, kwargs))
    arg_leaves = argument_leaves((args, kwargs))
    if result.needs_redistribute and result.redistribute_schema is not None:
        suggested = result.redistribute_schema
        wanted_leaves = argument_leaves((suggested.args_schema, suggested.kwargs_schema))
        if len(wanted_leaves) != len(arg_leaves):
            wanted_leaves = arg_leaves
        if result.use_val_from_redistribute_schema:
            node.meta[LOCAL_ARGS] = (pytree.tree_map(lambda a: None if isinstance(a, DTensorSpec) else a,
                                                     (tuple(suggested.args_schema), dict(suggested.kwargs_schema))))
    else:
        wanted_leaves = arg_leaves
    node.meta[ARG_SPECS] = [w if isinstance(a, DTensorSpec) else None for a, w in zip(arg_leaves, wanted_leaves)]


def _decision_key(node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """The op, the arguments' structure and every leaf with its type (1, 1.0 and True differ)."""
    leaves, structure = flatten_arguments((args, kwargs))
    return node.target, structure, tuple((type(leaf), leaf) for leaf in leaves)


def _schema(propagator: Any, node: torch.fx.Node, args: tuple, kwargs: dict) -> OpSchema:
    info = propagator.op_to_schema_info.get(node.target) or \
        propagator.op_to_schema_info_for_single_dim_strategy.get(node.target)
    return OpSchema(node.target, args, kwargs, schema_info=info)


def _dtensor_decision(propagator: Any, args: tuple, kwargs: dict, node: torch.fx.Node, ctx: CompileContext
                      ) -> tuple[Any, OpSchema | None]:
    """DTensor's sharding decision for the op of `node` on `args` and `kwargs`, asked once per
    distinct key (failures are not kept), and the schema it was asked with (None where the
    decision was known: a schema costs as much to build as the lookup)."""
    key = _decision_key(node, args, kwargs)
    try:
        known = ctx.sharding_decisions.get(key)
    except TypeError:  # an unhashable argument value: ask every time
        schema = _schema(propagator, node, args, kwargs)
        with exact_matches_first():
            return propagator.propagate_op_sharding_non_cached(schema), schema
    if known is not None:
        return known, None
    schema = _schema(propagator, node, args, kwargs)
    with exact_matches_first():
        known = ctx.sharding_decisions[key] = propagator.propagate_op_sharding_non_cached(schema)
    return known, schema


def _held_whole(node: torch.fx.Node, args: tuple, kwargs: dict, ctx: CompileContext) -> bool:
    """An op without a sharding rule whose tensor inputs are all replicated runs whole on every rank
    (an opaque custom op, a random op on a replicated tensor): its outputs are replicated."""
    specs = [a for a in argument_leaves((args, kwargs)) if isinstance(a, DTensorSpec)]
    if not specs or any(not isinstance(p, Replicate) for s in specs for p in s.placements):
        return False
    node.meta[SPEC] = _replicated(ctx, node.meta.get("val"))
    node.meta[ARG_SPECS] = [a if isinstance(a, DTensorSpec) else None for a in argument_leaves((args, kwargs))]
    node.meta.setdefault(ORIGIN, {})["decided_by"] = f"no sharding rule for {node.target}; every input replicated: run whole"
    return True


def _rule_context(ctx: CompileContext) -> rules.RuleContext:
    return rules.RuleContext(ctx.mesh.names, ctx.mesh.shape, ctx.strategy.context_axes())


def _propagate_with_rule(node: torch.fx.Node, rule: Any, args: tuple, kwargs: dict, ctx: CompileContext) -> bool:
    """An autopar rule sees and constrains positional tensor arguments; list and keyword tensors pass as is."""
    positional = [a if isinstance(a, DTensorSpec) else None for a in args]
    result = rule(node, positional, _rule_context(ctx))
    if result is None:
        return False
    node.meta[SPEC] = result.output
    node.meta[RULE] = result
    node.meta.setdefault(ORIGIN, {})["decided_by"] = f"autopar rule {rule.__name__} ({rule.__module__})"
    required = list(result.required) + [None] * (len(args) - len(result.required))
    wanted: list[DTensorSpec | None] = []
    for arg, need in zip(args, required):
        leaves = argument_leaves(arg)
        wanted += [need] if isinstance(arg, DTensorSpec) else [None] * len(leaves)
    wanted += [None] * len(argument_leaves(kwargs))
    node.meta[ARG_SPECS] = wanted
    return True


def propagate_placements(program: Program, ctx: CompileContext) -> Program:
    for node in program.graph_module.graph.nodes:
        if node.op == "placeholder":
            node.meta[SPEC] = _seed(node, ctx)
            _check_divisible(node, node.meta[SPEC], ctx)
        elif node.op == "get_attr":
            node.meta[SPEC] = _replicated(ctx, node.meta.get("val"))
        elif node.op == "call_function":
            propagate_node(node, ctx)
        elif node.op == "output":
            outputs = pytree.tree_leaves(node.args)
            node.meta[ARG_SPECS] = [_replicated(ctx, o.meta.get("val")) if isinstance(o, torch.fx.Node) else None
                                    for o in outputs]
    return program


def propagate_node(node: torch.fx.Node, ctx: CompileContext) -> None:
    """Place one call_function node whose inputs are placed; refuse an uneven shard (PlanError)."""
    _propagate_node(node, ctx)
    _check_divisible(node, node.meta.get(SPEC), ctx)


def _propagate_node(node: torch.fx.Node, ctx: CompileContext) -> None:
    value = node.meta.get("val")
    if node.target is operator.getitem:
        parent = node.args[0].meta.get(SPEC)
        node.meta[SPEC] = parent[node.args[1]] if isinstance(parent, (tuple, list)) else None
        node.meta[ORIGIN] = {"decided_by": f"output {node.args[1]} of {node.args[0].name}"}
        return
    if not isinstance(value, (torch.Tensor, tuple, list)) or not any(
            isinstance(a, torch.fx.Node) and isinstance(a.meta.get(SPEC), DTensorSpec)
            for a in argument_leaves((node.args, node.kwargs))):
        node.meta[SPEC] = _replicated(ctx, value)
        node.meta[ORIGIN] = {"decided_by": "no sharded tensor inputs: replicated"}
        return
    args = map_arguments(lambda a: _to_schema_arg(a, node, ctx), node.args)
    kwargs = map_arguments(lambda a: _to_schema_arg(a, node, ctx), dict(node.kwargs))
    rule = rules.lookup(node.target)
    if rule is not None and _propagate_with_rule(node, rule, args, kwargs, ctx):
        return
    _propagate_with_dtensor(node, args, kwargs, ctx)
    _draw_as_one_device(node, ctx)


def _draw_as_one_device(node: torch.fx.Node, ctx: CompileContext) -> None:
    """A random op DTensor placed on shards runs the kernel drawing one device's values, or is
    refused (`autopar/compiler/rules/random_rules.py`)."""
    drawn = rules.one_device_draws(node, _rule_context(ctx))
    if drawn is not None:
        node.meta[RULE] = drawn
        origin = node.meta.setdefault(ORIGIN, {})
        origin["decided_by"] = (f"{origin.get('decided_by', 'DTensor')}; run as {drawn.local_kernel.__name__}: "
                                f"one device's values drawn whole, the rank's piece kept")
