"""A checkpoint directory on disk: written aside, committed by a rename, found and verified at load.

`checkpoint.py` writes the tensors (DCP); this file makes a save atomic and a load refuse what
is not one complete save. The layout for a checkpoint at `path`:

- a save writes into `<path>.tmp-<save id>` (`staging_path`); DCP's `.metadata` there records the
  save id (its `storage_meta.save_id`) and every rank's shard file is named `__<save id>_<rank>_<n>.distcp`.
- when every rank's files and the metadata are written, every rank's file sizes and CRC-32s
  (`digest`) reach rank 0, which writes `autopar_manifest.json` last (`write_manifest`: the save id
  and the size and CRC-32 of every file, the metadata included), fsynced, by a rename.
- rank 0 commits (`commit`): an existing checkpoint is renamed aside to `<path>.old-<save id>`, the
  staged one renamed to `path`, the old one removed. The rename into `path` is the commit point:
  before it, `path` (or, after a crash between the two renames, the one set aside) is still the
  previous checkpoint; after it, the new one.
- `resolve` finds the committed directory for `path` (`path` itself, else the newest complete
  `<path>.old-*` a crash between the renames left) and refuses, by name, a directory without a
  manifest (an interrupted save) or a `path` whose save never committed. `verify` checks a
  manifest against the files: one save id in the manifest and the metadata, every file the
  metadata reads listed, every listed file of its recorded size and CRC-32 (a flipped byte, a
  truncated file, a shard of another save). The next successful save removes what an
  interrupted one left (`remove_leftovers`).

CRC-32 (zlib) reads each file once more from the page cache at save (each rank its own files)
and at load (the ranks share the files out); zlib's CRC-32 runs at over 1 GB/s per core, a small
share of the time a save spends writing the same bytes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import time
import uuid
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
from torch.futures import Future

from autopar.core.errors import CheckpointError

MANIFEST = "autopar_manifest.json"
METADATA = ".metadata"
SCHEMA = "autopar.checkpoint/1"
_BLOCK = 16 << 20


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


def staging_path(path: Path, save_id: str) -> Path:
    return path.with_name(f"{path.name}.tmp-{save_id}")


def aside_path(path: Path, save_id: str) -> Path:
    return path.with_name(f"{path.name}.old-{save_id}")


def digest(file: Path) -> dict[str, int]:
    """Size and CRC-32 of a file, read in blocks."""
    crc, size = 0, 0
    with open(file, "rb") as handle:
        while block := handle.read(_BLOCK):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"size": size, "crc32": crc}


def replace_problem(path: Path) -> str | None:
    """Why a save must not replace what is at `path` (None: nothing there, or a checkpoint)."""
    if not path.exists():
        return None
    if not path.is_dir():
        return f"cannot save a checkpoint to {path}: it is a file; choose a directory path"
    if any(path.iterdir()) and not (path / MANIFEST).exists() and not (path / METADATA).exists():
        return (f"cannot save a checkpoint to {path}: it is a directory that holds no checkpoint, and a save "
                f"replaces the directory whole; choose an empty or new directory")
    return None


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_manifest(staging: Path, save_id: str, files: dict[str, dict[str, int]]) -> None:
    """The commit marker of a staged save: written last, by a rename, after every file it lists."""
    manifest = {"schema": SCHEMA, "save_id": save_id, "saved_at": time.time(),
                "files": {**files, METADATA: digest(staging / METADATA)}}
    partial = staging / f"{MANIFEST}.tmp"
    with open(partial, "w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, staging / MANIFEST)
    _fsync_directory(staging)


def commit(path: Path, staging: Path, save_id: str, on_phase: Any) -> None:
    """Rank 0: put the staged save at `path`, replacing a checkpoint there (module docstring)."""
    on_phase("commit")
    if path.exists():
        aside = aside_path(path, save_id)
        os.rename(path, aside)
        on_phase("swap")
        os.rename(staging, path)
        _fsync_directory(path.parent)
        on_phase("cleanup")
        shutil.rmtree(aside)
    else:
        os.rename(staging, path)
        _fsync_directory(path.parent)


def remove_leftovers(path: Path) -> None:
    """Rank 0, after a commit: what interrupted saves into `path` left beside it."""
    for pattern in (f"{glob.escape(path.name)}.tmp-*", f"{glob.escape(path.name)}.old-*"):
        for leftover in path.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def read_manifest(directory: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {directory / MANIFEST} is corrupt: {error}") from error
    if manifest.get("schema") != SCHEMA:
        raise CheckpointError(f"checkpoint {directory / MANIFEST} is not an autopar checkpoint manifest "
                              f"(schema {manifest.get('schema')!r}, expected {SCHEMA!r})")
    return manifest


def _newest_aside(path: Path) -> Path | None:
    complete = [d for d in path.parent.glob(f"{glob.escape(path.name)}.old-*") if (d / MANIFEST).is_file()]
    return max(complete, key=lambda d: read_manifest(d)["saved_at"], default=None)


def resolve(path: "str | Path") -> Path:
    """The committed checkpoint directory for `path`, or CheckpointError saying why there is none."""
    path = Path(path)
    if path.is_dir():
        if (path / MANIFEST).is_file():
            return path
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {MANIFEST}, the file a save writes last (the save "
            f"into it was interrupted, or it was not written by autopar's checkpoint.save); load an earlier "
            f"checkpoint or save again")
    if path.exists():
        raise CheckpointError(f"checkpoint {path} is a file, not a checkpoint directory")
    aside = _newest_aside(path)
    if aside is not None:  # a crash between commit's two renames: this is the previous checkpoint
        return aside
    staged = sorted(path.parent.glob(f"{glob.escape(path.name)}.tmp-*"))
    if staged:
        complete = [s for s in staged if (s / MANIFEST).is_file()]
        detail = (f"{complete[0]} holds the complete save, interrupted before its commit: load it by that path "
                  f"or rename it to {path}" if complete else
                  f"{staged[0]} holds its partial write")
        raise CheckpointError(f"checkpoint {path} is incomplete: a save into it was interrupted before it was "
                              f"committed and no earlier checkpoint is there; {detail}")
    raise CheckpointError(f"no checkpoint at {path}: the path does not exist")


def verify(directory: Path, manifest: dict[str, Any], metadata: Metadata, crc_files: list[str]) -> None:
    """Raise CheckpointError unless `metadata` and every file belong to the manifest's save (module
    docstring): sizes of all files, CRC-32s of `crc_files` (this rank's share)."""
    save_id = manifest["save_id"]
    recorded = getattr(metadata.storage_meta, "save_id", None)
    if recorded != save_id:
        raise CheckpointError(f"checkpoint {directory / METADATA} belongs to save {recorded}, its manifest to "
                              f"save {save_id}: the directory mixes two saves; load an earlier checkpoint")
    read = {info.relative_path for info in metadata.storage_data.values()}
    unlisted = sorted(read - manifest["files"].keys())
    if unlisted:
        raise CheckpointError(f"checkpoint {directory / unlisted[0]} is not part of save {save_id} (its manifest "
                              f"does not list it): the directory mixes two saves; load an earlier checkpoint")
    for name in sorted(manifest["files"]):
        verify_file(directory, name, manifest, crc=name in crc_files)


def verify_file(directory: Path, name: str, manifest: dict[str, Any], *, crc: bool = True) -> None:
    expected, file = manifest["files"][name], directory / name
    if not file.is_file():
        raise CheckpointError(f"checkpoint {file} is missing: save {manifest['save_id']} wrote it; the checkpoint "
                              f"is incomplete, load an earlier one")
    size = file.stat().st_size
    found = f"it holds {size} bytes, the save wrote {expected['size']}" if size != expected["size"] else None
    if found is None and crc and (value := digest(file)["crc32"]) != expected["crc32"]:
        found = f"its CRC-32 is {value:08x}, the save wrote {expected['crc32']:08x}"
    if found is not None:
        raise CheckpointError(f"checkpoint {file} is corrupt: {found} (a changed or truncated file, or a file of "
                              f"another save); restore it from a copy or load an earlier checkpoint")


def verification_share(manifest: dict[str, Any], rank: int, world: int) -> list[str]:
    """The files whose digests `rank` recomputes at load (all of them for a single process)."""
    return sorted(manifest["files"])[rank::world]


# ---- DCP's file storage with the save id, per-file errors and the fault-test hook

@contextlib.contextmanager
def as_checkpoint_error(what: str) -> Iterator[None]:
    """Any failure inside, DCP's `CheckpointException` (a BaseException) included, as CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except CheckpointException as error:
        raise CheckpointError(_first_failure(what, error)) from error
    except Exception as error:
        raise CheckpointError(f"{what}: {type(error).__name__}: {error}") from error


def _first_failure(what: str, error: CheckpointException) -> str:
    """The first rank's failure in a DCP CheckpointException; our own CheckpointError's words as they are."""
    for rank, (cause, _) in sorted(error.failures.items()):
        if isinstance(cause, CheckpointError):
            return str(cause)
        return f"{what}: rank {rank}: {type(cause).__name__}: {cause}"
    return f"{what}: {error}"


class Writer(dcp.FileSystemWriter):
    """DCP's file writer with autopar's save id in the metadata and in every shard file's name;
    `on_phase("shards")` after this rank's files are written, `on_phase("metadata")` before the
    coordinator writes the metadata; `written`: this rank's file names."""

    def __init__(self, path: Path, save_id: str, on_phase: Callable[[str], None]) -> None:
        super().__init__(path)
        self.autopar_save_id, self.on_phase, self.written = save_id, on_phase, []

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        return [dataclasses.replace(plan, storage_data=dataclasses.replace(
            plan.storage_data, prefix=f"__{self.autopar_save_id}_{rank}_")) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: Any) -> Future:
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.wait()})
        self.on_phase("shards")
        return future

    def finish(self, metadata: Metadata, results: list) -> None:
        self.on_phase("metadata")
        super().finish(metadata, results)

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.autopar_save_id)


class Reader(dcp.FileSystemReader):
    """DCP's file reader that names the file a read fails in (a corrupt or truncated shard)."""

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as error:
                raise CheckpointError(f"checkpoint {Path(self.path) / name} is corrupt: {type(error).__name__}: "
                                      f"{error}; restore it from a copy or load an earlier checkpoint") from error
        future: Future = Future()
        future.set_result(None)
        return future


def read_metadata(directory: Path) -> Metadata:
    with as_checkpoint_error(f"checkpoint {directory / METADATA} is corrupt"):
        return Reader(directory).read_metadata()
