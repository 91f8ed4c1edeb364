"""Tracing: a model and example inputs -> an aten-level graph with shapes, via torch.export.

`trace_model` runs `torch.export.export(strict=False)` (which also works on meta-device models
and under FakeTensorMode, so models far larger than the planning host's memory can be planned), then
decomposes to core ATen with DTensor-friendly ops, keeping `scaled_dot_product_attention`, the
loss and SiLU as one node each (`autopar/compiler/decompositions.py`). `dynamic_dims={"b": 0, "s": 1}` marks those dimensions of every user input dynamic; the
resulting export symbols are renamed to the user's names so ledgers come out in `b` and `s`.
A list of equal blocks (a transformer's layers) is exported three blocks deep and the third
block's graph copied for the others (`autopar/compiler/repeated_blocks.py`): tracing costs what the
distinct blocks cost, not the layer count. Parameters, buffers and constants are lifted to placeholders, described by `PlaceholderInfo`;
the model's `state_dict()` names and the other names of tied parameters are kept, so that a
gathered state dict loads back into the original model strictly. Any other exception raised while
tracing becomes a `PlanError` in autopar's words (`autopar/compiler/planning_errors.py`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import sympy
import torch
import torch.fx
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from autopar.compiler.context import PlaceholderInfo
from autopar.compiler.decompositions import decomposition_table
from autopar.compiler.export_errors import untraceable
from autopar.compiler.planning_errors import planning_error
from autopar.compiler.repeated_blocks import TRACED, drop_last_block, find_repeated_blocks, replicate_blocks, truncated
from autopar.core.errors import PlanError
from autopar.core.ir import lazy_graph_module, sym_size


@dataclass
class TracedProgram:
    graph_module: torch.fx.GraphModule
    placeholders: dict[str, PlaceholderInfo]
    state: dict[str, torch.Tensor]
    user_input_count: int
    out_spec: Any
    symbols: dict[sympy.Symbol, sympy.Symbol]
    symbol_values: dict[sympy.Symbol, int]
    original_code: str = ""  # the traced single-device graph, before any pass changed it
    seconds: dict[str, float] = field(default_factory=dict)  # "export", "decompose": wall seconds of each
    copied_blocks: str = ""  # which blocks were copied rather than traced (autopar/compiler/repeated_blocks.py)
    # the model's state_dict() names, and each name of a tied parameter -> the name the graph reads
    state_keys: tuple[str, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    shortened: bool = False  # a longer model's trace less its last block (`reuse_shortened`), not exported


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_dims: dict[str, int]) -> Any:
    """export's dict form: forward's argument name -> {dim: Dim.AUTO} for every listed dim a tensor has."""
    def one(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return None
        return {dim: Dim.AUTO for dim in dynamic_dims.values() if dim < value.dim()} or None

    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {name: pytree.tree_map(one, value, is_leaf=lambda v: isinstance(v, torch.Tensor))
            for name, value in bound.items()}


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_dims: dict[str, int] | None,
            seconds: dict[str, float]) -> ExportedProgram:
    dynamic = _dynamic_shapes(model, args, kwargs, dynamic_dims) if dynamic_dims else None
    start = time.perf_counter()
    try:
        program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as error:
        raise untraceable(model, error) from error
    seconds["export"] = seconds.get("export", 0.0) + time.perf_counter() - start
    start = time.perf_counter()
    program = program.run_decompositions(decomposition_table())
    seconds["decompose"] = seconds.get("decompose", 0.0) + time.perf_counter() - start
    return program


def _symbols(program: ExportedProgram, placeholders: dict[str, PlaceholderInfo],
             dynamic_dims: dict[str, int] | None) -> tuple[dict, dict]:
    names: dict[sympy.Symbol, sympy.Symbol] = {}
    values: dict[sympy.Symbol, int] = {}
    for node in program.graph.nodes:
        info = placeholders.get(node.name)
        value = node.meta.get("val")
        if node.op != "placeholder" or info is None or info.kind != "input" or not isinstance(value, torch.Tensor):
            continue
        for name, dim in (dynamic_dims or {}).items():
            if dim < value.dim() and isinstance(value.shape[dim], torch.SymInt):
                expr = sym_size(value.shape[dim])
                if isinstance(expr, sympy.Symbol) and expr not in names:
                    names[expr] = sympy.Symbol(name, positive=True, integer=True)
                    values[names[expr]] = int(value.shape[dim].node.hint)
    return names, values


_REUSED: "dict[Any, TracedProgram] | None" = None


@contextlib.contextmanager
def reusing_traces() -> Iterator[None]:
    """Within it, tracing a model again (the same object, with the same modules, on inputs of the
    same shapes) gives a copy of the first trace instead of exporting it again: the planner at
    scale plans one model under many layouts (`autopar/planner/block_ledgers.py`), and the passes rewrite
    a graph in place, so each plan gets its own copy of the graph (nodes and their metadata
    dicts), sharing the traced values and state tensors, which no pass changes."""
    global _REUSED
    outer, _REUSED = _REUSED, {} if _REUSED is None else _REUSED
    try:
        yield
    finally:
        _REUSED = outer


def _reuse_key(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_dims: Any, reuse_blocks: bool) -> Any:
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return tuple(value.shape), value.dtype, value.device.type
        return repr(value)

    # a module list by its length: `repeated_blocks.truncated` stands a new list in for the old one
    modules = tuple((name, len(module)) if isinstance(module, torch.nn.ModuleList) else (name, id(module))
                    for name, module in model.named_modules())
    dtypes = tuple(p.dtype for p in model.parameters())
    return (id(model), modules, dtypes, tuple(pytree.tree_map(describe, pytree.tree_leaves((args, kwargs)))),
            repr(sorted((dynamic_dims or {}).items())), reuse_blocks)


def _copy_of(traced: TracedProgram) -> TracedProgram:
    graph = copy.deepcopy(traced.graph_module.graph)  # fx copies nodes iteratively, metadata dicts shallowly
    return dataclasses.replace(traced, graph_module=lazy_graph_module(traced.graph_module, graph),
                               placeholders=dict(traced.placeholders), state=dict(traced.state),
                               seconds={"export (reused)": 0.0})


def reused_trace(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                 dynamic_dims: dict[str, int] | None = None, reuse_blocks: bool = True) -> "TracedProgram | None":
    """Under `reusing_traces()`, the trace of `model` (as it is now) made before, if any."""
    if _REUSED is None:
        return None
    return _REUSED.get(_reuse_key(model, tuple(args), kwargs or {}, dynamic_dims, reuse_blocks))


def reuse_shortened(model: torch.nn.Module, args: tuple, kwargs: dict | None, longer: TracedProgram, *, path: str,
                    count: int, dynamic_dims: dict[str, int] | None = None, reuse_blocks: bool = True) -> bool:
    """Under `reusing_traces()`, with `model`'s list at `path` now holding `count - 1` blocks:
    `longer`, its trace with `count` blocks, less its last block (`repeated_blocks.drop_last_block`),
    is this model's trace from now on — the planner at scale's one-block plans cost no export of
    their own. False where the blocks are not the same graph (the model is then exported): a block
    reads something other than the block before, or something other than the next block reads a
    block (an auxiliary loss summed over the blocks)."""
    if _REUSED is None:
        return False
    key = _reuse_key(model, tuple(args), kwargs or {}, dynamic_dims, reuse_blocks)
    if key in _REUSED:
        return _REUSED[key].shortened
    gm = lazy_graph_module(longer.graph_module, copy.deepcopy(longer.graph_module.graph))
    placeholders, state = dict(longer.placeholders), dict(longer.state)
    if not drop_last_block(gm, placeholders, state, path, count):
        return False
    _REUSED[key] = dataclasses.replace(longer, graph_module=gm, placeholders=placeholders, state=state,
                                       original_code=gm.code, seconds={"export (last block dropped)": 0.0},
                                       state_keys=tuple(model.state_dict(keep_vars=True)),
                                       aliases=_tied_aliases(model, gm, placeholders), copied_blocks="",
                                       shortened=True)
    return True


def trace_model(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                dynamic_dims: dict[str, int] | None = None, reuse_blocks: bool = True) -> TracedProgram:
    """`reuse_blocks`: export the first blocks of a list of equal blocks and copy the last of them
    for the rest (`autopar/compiler/repeated_blocks.py`); the whole model where they are not the same graph.
    Under `reusing_traces()` a trace made before is copied instead."""
    if _REUSED is None:
        return _trace_or_refuse(model, args, kwargs, dynamic_dims=dynamic_dims, reuse_blocks=reuse_blocks)
    key = _reuse_key(model, tuple(args), kwargs or {}, dynamic_dims, reuse_blocks)
    if key not in _REUSED:
        _REUSED[key] = _trace_or_refuse(model, args, kwargs, dynamic_dims=dynamic_dims, reuse_blocks=reuse_blocks)
    return _copy_of(_REUSED[key])


def _trace_or_refuse(model: torch.nn.Module, args: tuple, kwargs: dict | None, *,
                     dynamic_dims: dict[str, int] | None, reuse_blocks: bool) -> TracedProgram:
    """`_trace_model`, its exceptions that are not autopar's own made a `PlanError`."""
    try:
        return _trace_model(model, args, kwargs, dynamic_dims=dynamic_dims, reuse_blocks=reuse_blocks)
    except PlanError:
        raise
    except Exception as error:
        raise planning_error(error, phase="tracing", module=type(model).__name__) from error


def _trace_model(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                 dynamic_dims: dict[str, int] | None = None, reuse_blocks: bool = True) -> TracedProgram:
    kwargs = kwargs or {}
    if any(p.device.type == "meta" for p in model.parameters()):  # planning a model built on the meta device
        args, kwargs = pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, (tuple(args), kwargs))
    seconds: dict[str, float] = {}
    repeated = find_repeated_blocks(model) if reuse_blocks else None
    if repeated is not None:
        with truncated(model, repeated[0]):
            program = _export(model, tuple(args), kwargs, dynamic_dims, seconds)
        placeholders, state, user_count = _lift(program, model)
        start = time.perf_counter()
        reused = replicate_blocks(program.graph_module, placeholders, state, model, *repeated)
        seconds["replicate_blocks"] = time.perf_counter() - start
        copied = f"{repeated[0]}.{TRACED}-{repeated[1] - 1}" if reused else ""
    if repeated is None or not reused:
        copied = ""
        program = _export(model, tuple(args), kwargs, dynamic_dims, seconds)
        placeholders, state, user_count = _lift(program, model)
    for spec in program.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise PlanError(f"the model's forward mutates state ({spec.kind.name} {spec.target}); autopar plans "
                            f"pure training steps. fix: avoid in-place buffer updates (e.g. BatchNorm running stats) "
                            f"in forward")
    names, values = _symbols(program, placeholders, dynamic_dims)
    # the exported module's code, or where blocks were copied into its graph (not recompiled), the graph's
    original_code = program.graph_module.graph.python_code(root_module="self").src if copied else \
        program.graph_module.code
    # the passes recompile it after each rewrite: its code is generated only when read
    return TracedProgram(graph_module=lazy_graph_module(program.graph_module, program.graph_module.graph), placeholders=placeholders, state=state,
                         user_input_count=user_count, out_spec=program.call_spec.out_spec,
                         symbols=names, symbol_values=values, original_code=original_code,
                         state_keys=tuple(model.state_dict(keep_vars=True)),
                         aliases=_tied_aliases(model, program.graph_module, placeholders), seconds=seconds,
                         copied_blocks=copied)


def _lift(program: ExportedProgram, model: torch.nn.Module) -> tuple[dict[str, PlaceholderInfo], dict, int]:
    """What each graph input is (`PlaceholderInfo`), the state tensors by name, the user input count."""
    # remove_duplicate=False: a tied weight is reachable under every name, and export may keep any of them
    trainable = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    placeholders: dict[str, PlaceholderInfo] = {}
    state: dict[str, torch.Tensor] = {}
    user_index = 0
    for position, spec in enumerate(program.graph_signature.input_specs):
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            placeholders[name] = PlaceholderInfo("input", str(user_index), user_index)
            user_index += 1
        elif spec.kind == InputKind.PARAMETER:
            placeholders[name] = PlaceholderInfo("parameter", spec.target, position, spec.target in trainable)
            state[spec.target] = program.state_dict[spec.target]
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kind = "buffer" if spec.kind == InputKind.BUFFER else "constant"
            placeholders[name] = PlaceholderInfo(kind, spec.target, position)
            source = program.state_dict if spec.target in program.state_dict else program.constants
            state[spec.target] = source[spec.target]
        else:
            raise PlanError(f"graph input {name} of kind {spec.kind.name} is not supported yet; "
                            f"fix: remove it from the model's forward")
    return placeholders, state, user_index


def _tied_aliases(model: torch.nn.Module, gm: torch.fx.GraphModule,
                  placeholders: dict[str, PlaceholderInfo]) -> dict[str, str]:
    """Every other name of a parameter or buffer reachable under several (tied embeddings) -> the
    name whose placeholder the traced graph reads (export lifts each name; one is used)."""
    read = {placeholders[n.name].target for n in gm.graph.nodes if n.op == "placeholder" and n.users}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in named:
        by_tensor.setdefault(id(tensor), []).append(name)
    aliases = {}
    for names in by_tensor.values():
        kept = next((name for name in names if name in read), None)
        aliases.update({name: kept for name in names if kept is not None and name != kept})
    return aliases
