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

Safety (`checkpoint_files.py`): a save writes beside `path` and commits by a rename once every
rank's files, the metadata and a manifest (save id, size and CRC-32 of every file) are written;
`load` and `load_into_model` read only a committed checkpoint whose files all belong to its save
and pass their CRC-32, and, strict by default, only into a model whose parameters (names and whole
shapes; for `load`, the plan's) are the checkpoint's. Every failure is a `CheckpointError` naming
the file or directory and the cause.

`async_save` is `save` in the background (`checkpoint_async.py`): it returns once the state is
copied to host memory; the write and the same commit run on a thread and a process group of
their own, and `.result()` on the handle it returns waits for the commit.
"""
from __future__ import annotations

import itertools
import json
import math
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from autopar.artifacts import checkpoint_async as background
from autopar.artifacts import checkpoint_files as files
from autopar.core.errors import CheckpointError
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

    def host_copy(self) -> "Boxes":
        """The same boxes over a copy of the local tensor in host memory (an async save's snapshot)."""
        return Boxes(background.host_tensor(self.local), self.shape, self.boxes)

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
                raise CheckpointError("the optimizer holds a tensor that is not one of the module's parameters; "
                                      "build it over module.parameters()")
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


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _from_rank0(make: Callable[[], Any], group: Any = None) -> Any:
    """Rank 0's `make()`, on every rank (of `group`: every rank, the default group or the
    checkpoint group of background saves)."""
    value = [make() if _rank_and_world()[0] == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(value, src=0, group=group)
    return value[0]


def _raise_any(problem: str | None, collective: bool) -> None:
    """Every rank raises the first rank's problem (no rank is left waiting in a collective)."""
    problems = [problem]
    if collective and dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise CheckpointError(first)


def _new_save(path: Path) -> str:
    """A save id drawn by rank 0, on every rank; CheckpointError on every rank if `path` must not
    be replaced. Collective (default group)."""
    save_id, problem = _from_rank0(lambda: (files.new_save_id(), files.replace_problem(path)))
    _raise_any(problem, collective=False)
    return save_id


def save(path: "str | Path", module: Any, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None, *, on_phase: Callable[[str], None] | None = None) -> None:
    """Write the module's (and optimizer's) state as a sharded DCP checkpoint at `path`, atomically
    (`checkpoint_files.py`): a crash at any point leaves the checkpoint that was at `path`, if any,
    loadable. Collective. `on_phase(phase)` is called on each rank as it reaches a phase of the save
    ("write", "shards", "metadata", "manifest"; rank 0 also "commit", "swap", "cleanup"): the fault
    tests stop a rank there. A background save still in flight (`async_save`) is waited for first."""
    path, hook = Path(path), on_phase or (lambda phase: None)
    background.wait_for_pending()
    _write_and_commit(path, _new_save(path), state_dict(module, optimizer, extra), hook, group=None)


def async_save(path: "str | Path", module: Any, optimizer: torch.optim.Optimizer | None = None,
               extra: dict | None = None, *, on_phase: Callable[[str], None] | None = None
               ) -> background.AsyncSave:
    """`save` in the background (`checkpoint_async.py`): returns once the state is copied to host
    memory, so the training steps that follow may change parameters and optimizer state in place
    without changing what is saved; the write and the commit (the same as `save`'s: only when every
    rank's files are written) run on a thread of their own, their collectives on a process group of
    their own. Collective: every rank calls it, in the same order as its other collectives.

    What the caller must do: call `.result()` on the returned handle, on every rank, before
    destroying the process group or exiting. Until the save commits, `path` holds the previous
    checkpoint (or nothing); a process that ends first leaves it so, with the partial save beside
    it, refused by name. `.result()` raises the save's `CheckpointError`; the next `save`,
    `async_save`, `load` or `load_into_model` in the process waits for the save first and raises
    its failure if `.result()` was not called. The snapshot holds a second copy of the rank's
    state in host memory until the save ends. `on_phase` as in `save`, called from the save's
    thread."""
    path, hook = Path(path), on_phase or (lambda phase: None)
    background.wait_for_pending()
    save_id = _new_save(path)
    group = background.checkpoint_group()
    snapshot = background.host_snapshot(state_dict(module, optimizer, extra))
    return background.start(path, save_id, lambda: _write_and_commit(path, save_id, snapshot, hook, group))


def _write_and_commit(path: Path, save_id: str, state: dict, hook: Callable[[str], None], group: Any) -> None:
    """Every rank's files into the staging directory, then rank 0's manifest and commit; collective
    over `group` (None: the default group)."""
    staging = files.staging_path(path, save_id)
    hook("write")
    writer = files.Writer(staging, save_id, hook)
    with files.as_checkpoint_error(f"saving checkpoint {path} failed (in {staging})"):
        dcp.save(state, storage_writer=writer, planner=_SavePlanner(), process_group=group)
    hook("manifest")
    gathered = _gather_digests(path, staging, writer.written, group)
    _raise_any(_from_rank0(lambda: _commit(path, staging, save_id, gathered, hook), group), collective=False)


def _gather_digests(path: Path, staging: Path, written: list[str], group: Any) -> list[dict | str] | None:
    """On rank 0, every rank's {file: size and CRC-32} of the files it wrote (or why it could not
    read them back: sent like the digests, so that no rank is left waiting)."""
    try:
        digests: dict | str = {name: files.digest(staging / name) for name in written}
    except OSError as error:
        digests = f"saving checkpoint {path} failed: rank {_rank_and_world()[0]} cannot read back {staging}: {error}"
    if not dist.is_initialized():
        return [digests]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(digests, gathered, dst=0, group=group)
    return gathered


def _commit(path: Path, staging: Path, save_id: str, gathered: list[dict | str],
            hook: Callable[[str], None]) -> str | None:
    """Rank 0: the manifest, then the commit and the clean-up; why not, as a message for every rank."""
    problem = next((entry for entry in gathered if isinstance(entry, str)), None)
    if problem is not None:
        return problem
    try:
        files.write_manifest(staging, save_id, {k: v for rank_files in gathered for k, v in rank_files.items()})
        files.commit(path, staging, save_id, hook)
        files.remove_leftovers(path)
    except Exception as error:
        return f"saving checkpoint {path} failed while committing {staging}: {type(error).__name__}: {error}"
    return None


def _open(path: "str | Path", *, verify: bool, collective: bool) -> tuple[Path, Any]:
    """The committed checkpoint directory for `path` and its DCP metadata, verified against the
    manifest (`checkpoint_files.verify`); the ranks share out the CRC-32s and all raise the same error."""
    rank, world = _rank_and_world() if collective else (0, 1)
    opened, problem = None, None
    try:
        directory = files.resolve(path)
        manifest = files.read_manifest(directory)
        metadata = files.read_metadata(directory)
        share = files.verification_share(manifest, rank, world) if verify else [files.METADATA]
        files.verify(directory, manifest, metadata, share)
        opened = directory, metadata
    except CheckpointError as error:
        problem = str(error)
    _raise_any(problem, collective)
    if collective and dist.is_initialized():  # one save for all: a rank must not find another directory
        found = [None] * world
        dist.all_gather_object(found, str(opened[0]))
        if len(set(found)) > 1:
            raise CheckpointError(f"the ranks found different checkpoints for {path}: {sorted(set(found))} (a save "
                                  f"committed while loading, or ranks that see different file systems)")
    return opened


def _check_model(directory: Path, saved: dict[str, Any], required: dict[str, tuple], accepted: set[str],
                 strict: bool) -> set[str]:
    """The model entries to load; CheckpointError naming every missing, unexpected and mismatched
    entry (only mismatched shapes when not `strict`). `required`: key -> shape the model needs;
    `accepted`: keys it can take (non-persistent buffers too)."""
    stored = {k: tuple(m.size) for k, m in saved.items() if k.startswith("model.") and hasattr(m, "size")}
    missing = sorted(required.keys() - stored.keys())
    unexpected = sorted(stored.keys() - accepted - required.keys())
    mismatched = [f"{k.removeprefix('model.')} (checkpoint {list(stored[k])}, model {list(required[k])})"
                  for k in sorted(required.keys() & stored.keys()) if stored[k] != required[k]]
    if mismatched or strict and (missing or unexpected):
        parts = [f"{what}: {', '.join(k.removeprefix('model.') for k in keys[:8])}"
                 + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
                 for what, keys in (("missing from the checkpoint", missing), ("not in the model", unexpected),
                                    ("shapes differ", mismatched)) if keys]
        raise CheckpointError(f"checkpoint {directory} does not fit the model: {'; '.join(parts)}. Load it into "
                              f"the model it was saved from; strict=False loads only the entries that match "
                              f"(shapes must still agree)")
    return required.keys() & stored.keys()


def _check_optimizer(directory: Path, saved: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is not None and "optim.param_groups" not in saved:
        raise CheckpointError(f"checkpoint {directory} holds no optimizer state (it was saved without an "
                              f"optimizer); load without one")


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
         extra: dict | None = None, *, strict: bool = True, verify: bool = True) -> dict:
    """Fill the module's shards (and the optimizer's state, created where missing) from a
    checkpoint written under any plan; `extra` names what to read back (its values are templates:
    a tensor of the saved shape, or any object). Returns the extra entries read. Collective.

    Refuses (CheckpointError, on every rank) an incomplete checkpoint, one whose files are not all
    of one save or fail their CRC-32 (`verify=False`: sizes only), and one whose parameters do not
    match the plan's (`strict=False`: load the entries that match). A background save still in
    flight (`async_save`) is waited for first."""
    background.wait_for_pending()
    directory, metadata = _open(path, verify=verify, collective=True)
    saved = metadata.state_dict_metadata
    _check_optimizer(directory, saved, optimizer)
    target = state_dict(module, None)
    shapes = {key: tuple(value.shape) for key, value in target.items()}
    kept = _check_model(directory, saved, shapes, set(shapes), strict)
    target = {key: value for key, value in target.items() if key in kept}
    if optimizer is not None:
        fqn_of, global_shapes = _optimizer_names(module, optimizer), _global_shapes(module)

        def place(fqn: str, param: torch.Tensor, name: str, meta: Any) -> Any:
            state = optimizer.state[param]
            if len(meta.size) and tuple(meta.size) == global_shapes[fqn]:  # shaped like the parameter: its boxes
                state.setdefault(name, torch.zeros_like(param))
                return _param_boxes(module, fqn, state[name])
            state.setdefault(name, torch.zeros(tuple(meta.size), dtype=meta.properties.dtype))
            return state[name]

        target.update(_optimizer_targets(saved, optimizer, fqn_of, place))
    target.update({f"extra.{key}": value for key, value in (extra or {}).items()})
    with files.as_checkpoint_error(f"loading checkpoint {directory} failed"):
        dcp.load(target, storage_reader=files.Reader(directory), planner=_LoadPlanner())
        if optimizer is not None:
            _restore_optimizer(optimizer, fqn_of, target)
    with torch.no_grad():
        for runner in module.stages:
            if runner.sharded is not None:
                runner.sharded.refresh()
    return {key: target[f"extra.{key}"] for key in (extra or {})}


def load_into_model(path: "str | Path", model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None, *, strict: bool = True, verify: bool = True) -> dict:
    """Load a checkpoint into a plain single-device model (and its optimizer) in this process
    alone, whether or not a process group is initialised: every tensor whole. Names are the traced
    parameter names (a tied weight under the name the trace kept). Refuses what `load` refuses;
    `strict` compares the model's parameters and persistent buffers with the checkpoint's."""
    background.wait_for_pending()
    directory, metadata = _open(path, verify=verify, collective=False)
    saved = metadata.state_dict_metadata
    _check_optimizer(directory, saved, optimizer)
    params = dict(model.named_parameters())
    persistent = model.state_dict(keep_vars=True).keys()
    tensors = {f"model.{fqn}": t for fqn, t in [*params.items(), *model.named_buffers()]}
    required = {key: tuple(t.shape) for key, t in tensors.items()
                if key.removeprefix("model.") in params or key.removeprefix("model.") in persistent}
    _check_model(directory, saved, required, set(tensors), strict)
    target: dict[str, Any] = {key: t.detach() for key, t in tensors.items() if key in saved}
    if optimizer is not None:
        fqn_of = {id(p): fqn for fqn, p in params.items()}

        def place(fqn: str, param: torch.Tensor, name: str, meta: Any) -> torch.Tensor:
            state = optimizer.state[param]
            state.setdefault(name, torch.zeros(tuple(meta.size), dtype=meta.properties.dtype))
            return state[name]

        target.update(_optimizer_targets(saved, optimizer, fqn_of, place))
    target.update({f"extra.{key}": value for key, value in (extra or {}).items()})
    with files.as_checkpoint_error(f"loading checkpoint {directory} failed"):
        with warnings.catch_warnings():  # DCP's notice that it loads in one process: what was asked
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(target, storage_reader=files.Reader(directory), no_dist=True)
        if optimizer is not None:
            _restore_optimizer(optimizer, fqn_of, target)
    return {key: target[f"extra.{key}"] for key in (extra or {})}
