"""Live tensor storages of this process, seen by a dispatch mode: what a program holds, without asking it.

`LiveStorages` is a `TorchDispatchMode`. Every real (not fake, not meta) tensor that an op
returns while it is active has its untyped storage recorded with a weak reference; the storage
counts as live until PyTorch frees it (a storage's Python object lives exactly as long as the
storage: PyTorch preserves it). Storages resized in place are followed both ways: through the
dispatched `resize_` / `set_` ops (their outputs are re-read) and through
`torch.UntypedStorage.resize_`, which does not dispatch and is wrapped while the mode is active
(FSDP2 frees its unsharded parameters that way), as PyTorch's own `MemTracker` does.

It knows nothing of who holds a storage: the numbers are what the process holds, full stop. The
ledgers' categories are recovered from public PyTorch interfaces by `autopar.measure.memory`.

- `live_bytes(exclude=...)`: bytes of the live recorded storages now, without those behind the
  tensors in `exclude` (the caller's own inputs and outputs);
- `peak_bytes` / `reset_peak()`: the most live bytes after any op since the last reset, and
  `peak_by_epoch`: those bytes by the epoch they were allocated in; `watch(mark)` follows
  `watched_peak`, the most live bytes allocated since a mark;
- `mark()` starts an epoch; `live_since(mark)`: storages allocated since that are still alive,
  the basis of `autopar.measure.activations`. An op's output counts as allocated by it unless it
  shares the storage of one of the op's inputs (views, in-place and out= ops); a storage first
  seen as a view of something older counts as allocated before every mark;
- `track(*tensors)`: record storages made outside the mode (e.g. before it was entered);
- with `producers=True`, `at_peak()`: the storages live at the peak, each with the op that
  allocated it, its first tensor's shape and dtype, and its bytes, largest first — where a
  measured peak and a predicted one part, the storage the prediction missed is named (each
  new peak copies the live list: a diagnostic, not for timing);
- `settle()`: wait until tensors held by finished collectives' worker threads are let go.
DTensor is let through first (`NotImplemented`) so that its local ops, which allocate, are the
ones seen; other subclasses (fake and functional tensors while a model is traced) run untracked.
"""
from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import defaultdict
from typing import Any, Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage while it is alive (the StorageImpl's address)."""
    return tensor.untyped_storage()._cdata


def distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _is_real(value: Any) -> bool:
    return type(value) in _PLAIN and value.device.type != "meta"


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    """The tensors in `values` (tensors, lists, tuples, dicts, nested): a lean pytree walk for every op."""
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, (list, tuple)):
        for value in values:
            yield from _tensors(value)
    elif isinstance(values, dict):
        for value in values.values():
            yield from _tensors(value)


class _Record:
    __slots__ = ("nbytes", "epoch", "ref", "made")

    def __init__(self, nbytes: int, epoch: int, ref: weakref.ref, made: "tuple | None" = None) -> None:
        self.nbytes, self.epoch, self.ref, self.made = nbytes, epoch, ref, made


class LiveStorages(TorchDispatchMode):
    """Every storage allocated while active, until it is freed (see module docstring)."""

    def __init__(self, *, producers: bool = False) -> None:
        super().__init__()
        self._producers = producers
        self._at_peak: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
        self._records: dict[int, _Record] = {}
        self._epoch = 1  # storages seen before they were allocated under the mode belong to epoch 0
        self._by_epoch: dict[int, int] = defaultdict(int)
        self._live = 0
        self.peak_bytes = 0
        self.peak_by_epoch: dict[int, int] = {}
        self._watched: int | None = None
        self.watched_peak = 0
        self._depth = 0
        self._original_resize = torch.UntypedStorage.resize_
        # a storage may be freed on another thread (a c10d worker dropping a finished work's tensors)
        self._lock = threading.RLock()

    # ---- recording
    def track(self, *values: Any) -> None:
        """Record the storages of the tensors in `values` (nested lists/tuples/dicts), made before
        or outside the mode: they count as live, but as allocated before any `mark`."""
        self._record_all(values, fresh=False)

    def _record_all(self, values: Any, *, fresh: bool, inputs: set[int] = frozenset(), op: str = "(tracked)") -> None:
        with self._lock:
            for value in _tensors(values):
                if _is_real(value):
                    storage = value.untyped_storage()
                    made = (op, tuple(value.shape), value.dtype) if self._producers else None
                    self._record(storage, fresh=fresh and storage._cdata not in inputs, made=made)
            self._update_peak()

    def _record(self, storage: torch.UntypedStorage, *, fresh: bool, made: "tuple | None" = None) -> None:
        key = storage._cdata
        record = self._records.get(key)
        if record is not None:
            self._resized(record, storage.nbytes())
            return
        ref = weakref.ref(storage, functools.partial(self._freed, key))
        record = self._records[key] = _Record(storage.nbytes(), self._epoch if fresh else 0, ref, made)
        self._live += record.nbytes
        self._by_epoch[record.epoch] += record.nbytes

    def _resized(self, record: _Record, nbytes: int) -> None:
        self._live += nbytes - record.nbytes
        self._by_epoch[record.epoch] += nbytes - record.nbytes
        record.nbytes = nbytes

    def _freed(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            record = self._records.get(key)
            if record is not None and record.ref is ref:
                self._live -= record.nbytes
                self._by_epoch[record.epoch] -= record.nbytes
                del self._records[key]

    def _update_peak(self) -> None:
        if self._live > self.peak_bytes:
            self.peak_bytes = self._live
            self.peak_by_epoch = {epoch: n for epoch, n in self._by_epoch.items() if n}
            if self._producers:
                self._at_peak = [(*r.made, r.nbytes) for r in self._records.values() if r.made and r.nbytes]
        if self._watched is not None:
            since = sum(n for epoch, n in self._by_epoch.items() if epoch >= self._watched)
            self.watched_peak = max(self.watched_peak, since)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not all(t in _PLAIN for t in types):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            return func(*args, **kwargs)  # fake or functional tensors: nothing real is allocated
        out = func(*args, **kwargs)
        # an output sharing an input's storage (a view, an in-place or out= op) allocated nothing
        inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs)) if _is_real(t)}
        self._record_all(out, fresh=True, inputs=inputs, op=str(func.overloadpacket) if self._producers else "")
        return out

    def __enter__(self) -> "LiveStorages":
        if self._depth == 0:
            original, tracker = self._original_resize, self

            @functools.wraps(original)
            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                result = original(storage, size)
                with tracker._lock:
                    record = tracker._records.get(storage._cdata)
                    if record is not None:
                        tracker._resized(record, storage.nbytes())
                        tracker._update_peak()
                return result

            torch.UntypedStorage.resize_ = resize_
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            torch.UntypedStorage.resize_ = self._original_resize
        super().__exit__(*exc)

    # ---- reading
    def mark(self) -> int:
        """Start a new epoch and return it: storages allocated from now on belong to it."""
        self._epoch += 1
        return self._epoch

    def live(self) -> dict[int, int]:
        """storage key -> bytes of every live recorded storage."""
        with self._lock:
            return {key: record.nbytes for key, record in self._records.items()}

    def live_since(self, mark: int) -> dict[int, int]:
        """storage key -> bytes of the live storages allocated since `mark` (a `mark()` result)."""
        with self._lock:
            return {key: record.nbytes for key, record in self._records.items() if record.epoch >= mark}

    def at_peak(self) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
        """(op that allocated it, shape, dtype, bytes) of each storage live at `peak_bytes`, largest
        first (`producers=True`; "(tracked)" for storages made outside the mode)."""
        if not self._producers:
            raise ValueError("LiveStorages(producers=True) remembers what is live at the peak")
        return sorted(self._at_peak, key=lambda item: -item[3])

    def live_bytes(self, *, exclude: Iterable[torch.Tensor] = ()) -> int:
        excluded = {storage_key(t) for t in _tensors(list(exclude)) if _is_real(t)}
        with self._lock:
            return self._live - sum(self._records[k].nbytes for k in excluded if k in self._records)

    def settle(self, *, interval_s: float = 0.01, readings: int = 3, timeout_s: float = 2.0) -> None:
        """Wait until the live bytes stay unchanged over `readings` intervals (at most `timeout_s`).
        A c10d work is complete, and `wait()` returns, before its worker thread drops the work's
        input and output tensors: they may stay alive for a moment after the program let go."""
        deadline, last, same = time.monotonic() + timeout_s, None, 0
        while same < readings and time.monotonic() < deadline:
            time.sleep(interval_s)
            current = self._live
            same = same + 1 if current == last else 0
            last = current

    def watch(self, mark: int | None) -> None:
        """Follow `watched_peak`: the most live bytes allocated since `mark` (None: stop)."""
        self._watched, self.watched_peak = mark, 0

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        with self._lock:
            self.peak_bytes = -1
            self._update_peak()
