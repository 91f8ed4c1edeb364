"""Sharded checkpoints in torch.distributed.checkpoint (DCP) format that load on another mesh.

`save(path, module, optimizer=None, extra=None)` writes, from every rank in parallel, the pieces
of every parameter and optimizer-state tensor the rank holds, each as a rectangular box of the
whole tensor (its global offsets and sizes): DCP's metadata records the boxes, writes a piece
held by several ranks (replicated on some axis) once, and `load` reads, for every box the loading
rank holds under its own plan, exactly the bytes that cover it, from whichever saved boxes
overlap it. So a checkpoint written under dp=2×tp=2 FSDP loads under tp=4, under dp=4 ZeRO-1 or
into one process without a process group (`load_into_model`: a plain `nn.Module` and optimizer).

Why boxes rather than DTensors: a rank's piece of an autopar parameter is cut axis after axis in
the plan's order, and a ZeRO unit then cuts the tensor-parallel shard's rows (FSDP2's order);
as DTensor placements the second cut would be a `_StridedShard` and a padded ZeRO shard would be
uneven. The box of every cut is computed directly (`_boxes`: contiguous chunks, DTensor's strided
blocks, the load-balanced sequence pairs, ZeRO's padded rows without their padding) and handed to
DCP through its checkpointable-object protocol (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`), the same one DTensor implements, with planners that look a box's bytes up
in it (`_SavePlanner`, `_LoadPlanner`: DCP's default planners find pieces only inside tensors).

Contents: `model.<fqn>` per parameter, `model.<buffer>` per buffer, `optim.<fqn>.<key>` per
optimizer state entry (tensors shaped like the parameter as boxes, scalars such as AdamW's `step`
as plain tensors), `optim.param_groups` (hyper-parameters, parameters by name), and `extra` (a
learning-rate scheduler's `state_dict()`, RNG states, anything picklable or tensors). After
loading, ZeRO-1/2's replicated compute copies are refreshed from the loaded shards.
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from autopar.core.ir import shard_dim
from autopar.core.sequence_chunks import chunk_ids, chunks_total

Interval = tuple[int, int, int]  # (global offset, length, offset in the local tensor)


def _select(intervals: list[Interval], ranges: list[tuple[int, int]]) -> list[Interval]:
    """The parts of the current (concatenated) dimension at `ranges` of its own coordinates, in order."""
    chosen, local = [], 0
    for start, stop in ranges:
        position = 0
        for offset, length, _ in intervals:
            lo, hi = max(start, position), min(stop, position + length)
            if lo < hi:
                chosen.append((offset + lo - position, hi - lo, local))
                local += hi - lo
            position += length
    return chosen


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    size = math.ceil(length / parts)  # torch.chunk's sizes (DTensor's Shard)
    return min(index * size, length), min((index + 1) * size, length)


def _cut(intervals: list[Interval], placement: Any, parts: int, index: int, layout: str) -> list[Interval]:
    """`sequence_chunks.take`'s cut (the layout's chunks of each strided block) as ranges."""
    blocks = getattr(placement, "split_factor", 1)
    block = sum(i[1] for i in intervals) // blocks
    total = chunks_total(parts, layout)
    ranges = [(b * block + lo, b * block + hi) for b in range(blocks)
              for lo, hi in (_chunk(block, total, c) for c in chunk_ids(index, parts, layout))]
    return _select(intervals, ranges)


def _boxes(shape: tuple[int, ...], placements: tuple, mesh: Any, rank: int, layouts: dict[str, str],
           zero: tuple[str, int] | None) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(global offsets, sizes, local offsets) of every box of the whole tensor `rank` holds."""
    dims: list[list[Interval]] = [[(0, n, 0)] for n in shape]
    for axis, placement in zip(mesh.names, placements):
        if shard_dim(placement) is not None:
            dims[placement.dim] = _cut(dims[placement.dim], placement, mesh.size(axis), mesh.coordinate(rank, axis),
                                       layouts.get(axis, "contiguous"))
    if zero is not None and shape:
        axis, rows = zero
        start = mesh.coordinate(rank, axis) * rows
        dims[0] = _select(dims[0], [(start, start + rows)])
    boxes = []
    for parts in itertools.product(*dims):
        if all(length > 0 for _, length, _ in parts):
            boxes.append((tuple(p[0] for p in parts), tuple(p[1] for p in parts), tuple(p[2] for p in parts)))
    return boxes


class Boxes:
    """A rank's pieces of one whole tensor, as DCP's checkpointable object (module docstring)."""

    def __init__(self, local: torch.Tensor, shape: tuple[int, ...], boxes: list) -> None:
        self.local, self.shape, self.boxes = local, torch.Size(shape), boxes

    def _piece(self, sizes: tuple[int, ...], local_offsets: tuple[int, ...]) -> torch.Tensor:
        piece = self.local
        for dim, (start, length) in enumerate(zip(local_offsets, sizes)):
            piece = piece.narrow(dim, start, length)
        return piece

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                                 sizes=torch.Size(sizes)),
                                                      properties=properties, size=self.shape))
                for offsets, sizes, _ in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, sizes, local_offsets in self.boxes:
            if torch.Size(offsets) == index.offset:
                return self._piece(sizes, local_offsets)
        raise ValueError(f"{index.fqn}: this rank holds no box at offset {tuple(index.offset)}")


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        found = self.state_dict.get(index.fqn)
        return found.__get_tensor_shard__(index) if isinstance(found, Boxes) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up replaces, in place, every value it does not know (our Boxes) by None while
        # it materialises meta tensors; put them back in both dictionaries it keeps
        boxes = {key: value for key, value in state_dict.items() if isinstance(value, Boxes)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(boxes)
        self.state_dict.update(boxes)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = self.state_dict.get(index.fqn)
        return found.__get_tensor_shard__(index) if isinstance(found, Boxes) else super().lookup_tensor(index)


def _layouts(module: Any) -> dict[str, str]:
    return {axis: module.plan.context.strategy.sequence_layout(axis) for axis in module.plan.mesh.names}


def _param_boxes(module: Any, fqn: str, local: torch.Tensor) -> Boxes:
    plan = module.plan
    shape = _global_shapes(module)[fqn]
    unit = module._unit_of.get(fqn)
    zero = (unit[0].axis, unit[1].rows) if unit is not None else None
    return Boxes(local, shape, _boxes(shape, module._placements[fqn], plan.mesh, module.rank, _layouts(module), zero))


def _global_shapes(module: Any) -> dict[str, tuple[int, ...]]:
    if not hasattr(module, "_checkpoint_shapes"):
        shapes = {}
        for node in module.plan.graph_module.graph.nodes:
            info = module.plan.context.placeholders.get(node.name)
            if node.op == "placeholder" and info is not None and info.kind == "parameter":
                shapes[info.target] = tuple(int(s) for s in node.meta["val"].shape)
        module._checkpoint_shapes = shapes
    return module._checkpoint_shapes


def _optimizer_names(module: Any, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    by_id = {id(p): fqn for fqn, p in module.named_parameters()}
    names = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise ValueError("the optimizer holds a tensor that is not one of the module's parameters; build "
                                 "it over module.parameters()")
            names[id(param)] = by_id[id(param)]
    return names


def state_dict(module: Any, optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None) -> dict:
    """What `save` writes: Boxes for sharded tensors, plain tensors and objects for the rest."""
    params = dict(module.named_parameters())
    result: dict[str, Any] = {f"model.{fqn}": _param_boxes(module, fqn, p.detach()) for fqn, p in params.items()}
    for fqn, buffer in module.named_buffers():
        result[f"model.{fqn.removeprefix('_state.')}"] = buffer.detach()
    if optimizer is not None:
        names = _optimizer_names(module, optimizer)
        for param, entries in optimizer.state.items():
            fqn = names[id(param)]
            for key, value in entries.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                    result[f"optim.{fqn}.{key}"] = _param_boxes(module, fqn, value)
                else:
                    result[f"optim.{fqn}.{key}"] = value
        # one JSON string: DCP would flatten a list of dicts into keys of its own
        result["optim.param_groups"] = json.dumps([{**{k: v for k, v in g.items() if k != "params"},
                                                    "params": [names[id(p)] for p in g["params"]]}
                                                   for g in optimizer.param_groups])
    if extra:
        result.update({f"extra.{k}": v for k, v in extra.items()})
    return result


def save(path: "str | Path", module: Any, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None) -> None:
    """Write the module's (and optimizer's) state as a sharded DCP checkpoint; collective."""
    dcp.save(state_dict(module, optimizer, extra), checkpoint_id=str(path), planner=_SavePlanner())


def _saved(path: "str | Path") -> dict[str, Any]:
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def _saved_optimizer_state(saved: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The saved optimizer entries by parameter: fqn -> state name -> DCP metadata."""
    grouped: dict[str, dict[str, Any]] = {}
    for key, meta in saved.items():
        if key.startswith("optim.") and key != "optim.param_groups":
            fqn, name = key[len("optim."):].rsplit(".", 1)
            grouped.setdefault(fqn, {})[name] = meta
    return grouped


def _optimizer_targets(saved: dict[str, Any], optimizer: torch.optim.Optimizer, fqn_of: dict[int, str],
                       place: Any) -> dict[str, Any]:
    """DCP load targets for every saved optimizer entry of the optimizer's parameters: a tensor entry
    is created where missing and `place(fqn, param, name, meta)` gives what DCP fills; objects
    (read whole) get None."""
    grouped = _saved_optimizer_state(saved)
    targets: dict[str, Any] = {"optim.param_groups": ""}
    for group in optimizer.param_groups:
        for param in group["params"]:
            fqn = fqn_of[id(param)]
            for name, meta in grouped.get(fqn, {}).items():
                targets[f"optim.{fqn}.{name}"] = place(fqn, param, name, meta) if hasattr(meta, "size") else None
    return targets


def _restore_optimizer(optimizer: torch.optim.Optimizer, fqn_of: dict[int, str], loaded: dict[str, Any]) -> None:
    """Hyper-parameters, and the state entries DCP read as objects, into the optimizer."""
    for group, saved in zip(optimizer.param_groups, json.loads(loaded["optim.param_groups"])):
        group.update({k: v for k, v in saved.items() if k != "params"})
    param_of = {fqn: param for group in optimizer.param_groups for param in group["params"]
                for fqn in [fqn_of[id(param)]]}
    for key, value in loaded.items():
        if key.startswith("optim.") and key != "optim.param_groups" and value is not None \
                and not isinstance(value, (Boxes, torch.Tensor)):
            fqn, name = key[len("optim."):].rsplit(".", 1)
            optimizer.state[param_of[fqn]][name] = value


def load(path: "str | Path", module: Any, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None) -> dict:
    """Fill the module's shards (and the optimizer's state, created where missing) from a
    checkpoint written under any plan; `extra` names what to read back (its values are templates:
    a tensor of the saved shape, or any object). Returns the extra entries read. Collective."""
    saved = _saved(path)
    target = state_dict(module, None)
    missing = next((key for key in target if key not in saved), None)
    if missing is not None:
        raise KeyError(f"{path} holds no {missing!r}: it was written from another model")
    if optimizer is not None:
        fqn_of, shapes = _optimizer_names(module, optimizer), _global_shapes(module)

        def place(fqn: str, param: torch.Tensor, name: str, meta: Any) -> Any:
            state = optimizer.state[param]
            if len(meta.size) and tuple(meta.size) == shapes[fqn]:  # shaped like the parameter: its boxes
                state.setdefault(name, torch.zeros_like(param))
                return _param_boxes(module, fqn, state[name])
            state.setdefault(name, torch.zeros(tuple(meta.size), dtype=meta.properties.dtype))
            return state[name]

        target.update(_optimizer_targets(saved, optimizer, fqn_of, place))
    target.update({f"extra.{key}": value for key, value in (extra or {}).items()})
    dcp.load(target, checkpoint_id=str(path), planner=_LoadPlanner())
    if optimizer is not None:
        _restore_optimizer(optimizer, fqn_of, target)
    with torch.no_grad():
        for runner in module.stages:
            if runner.sharded is not None:
                runner.sharded.refresh()
    return {key: target[f"extra.{key}"] for key in (extra or {})}


def load_into_model(path: "str | Path", model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None) -> dict:
    """Load a checkpoint into a plain single-device model (and its optimizer), no process group
    needed: every tensor whole. Names are the traced parameter names (a tied weight under the
    name the trace kept)."""
    saved = _saved(path)
    params = dict(model.named_parameters())
    target: dict[str, Any] = {f"model.{fqn}": p.detach() for fqn, p in params.items() if f"model.{fqn}" in saved}
    target.update({f"model.{fqn}": b for fqn, b in model.named_buffers() if f"model.{fqn}" in saved})
    if optimizer is not None:
        fqn_of = {id(p): fqn for fqn, p in params.items()}

        def place(fqn: str, param: torch.Tensor, name: str, meta: Any) -> torch.Tensor:
            state = optimizer.state[param]
            state.setdefault(name, torch.zeros(tuple(meta.size), dtype=meta.properties.dtype))
            return state[name]

        target.update(_optimizer_targets(saved, optimizer, fqn_of, place))
    target.update({f"extra.{key}": value for key, value in (extra or {}).items()})
    dcp.load(target, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    if optimizer is not None:
        _restore_optimizer(optimizer, fqn_of, target)
    return {key: target[f"extra.{key}"] for key in (extra or {})}
