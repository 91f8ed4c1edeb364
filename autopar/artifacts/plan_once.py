"""Plan once: one process plans, every other rank runs the plan it made.

`obtain_plan` (called by `autopar.parallelize`) decides where this rank's plan comes from:

- **from rank 0** (the default): rank 0 traces and plans (`autopar.plan`); every other rank
  writes its fingerprint into the process group's key-value store and waits for rank 0's plan,
  encoded by `autopar/artifacts/plan_codec.py` (the whole plan as rank 0 made it, without weights). Before
  publishing, rank 0 compares every rank's fingerprint with its own; a mismatch is published
  instead of the plan, so every rank raises the same `PlanError` naming the rank and the field,
  and an error while planning is published the same way (no rank is left waiting). Each
  receiving rank compares rank 0's fingerprint with its own again before using the plan.
- **from a file** (`parallelize(model, plan="gpt.plan")`): every rank reads a runnable plan
  file (`save_runnable_plan`, format below) and checks it against its own model; nothing is
  traced or planned.
- **planned locally** on every rank: a plan traced with `dynamic_dims`. Its sizes are SymInts of
  the planner's ShapeEnv, which `plan_codec` does not carry yet (see there), so each rank traces
  and plans the same model itself, as autopar did before plan-once.
In the last two ways the ranks first compare their fingerprints through the store (`agree`):
every rank raises the same PlanError naming the first rank and field that differ from rank 0's.

Why the store and not a broadcast on the process group: the plan is control data exchanged
once, before training; the store moves bytes without a collective, so it needs no device
tensors under NCCL, and setup still moves nothing over the process groups (the communication
ledger, which the numerics tests compare with counted collectives, has no setup traffic).

The fingerprint (`fingerprint`) is computed without tracing: world size, mesh, strategies, the
model's parameters and buffers (name, shape, dtype, requires_grad; tied names included), the
example inputs' structure, shapes and dtypes, the planning options, torch's and autopar's versions. Weights
never cross: each rank cuts its shards from its own model (`state_from_model`), as before.

A runnable plan file is one line of JSON — `{"schema": "autopar.runnable/1", "torch": ...,
"fingerprint": {...}}` — then the encoded plan (a pickle: load only files you trust, as with
`torch.load(weights_only=False)`). It is a different file from the plan document (`autopar plan
--save plan.json`, `autopar/compiler/plan_file.py`), which is for reading and diffing and cannot run.
"""
from __future__ import annotations

import itertools
import json
import pickle
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.artifacts.plan_codec import decode_plan, encode_plan
from autopar.core.errors import PlanError

SCHEMA = "autopar.runnable/1"
_CALLS = itertools.count()  # the n-th parallelize of a rank pairs with the n-th of every other rank
_FIX = ("build the same model (same config, dtype and parameter names), mesh, strategies and example inputs on "
        "every rank")


@dataclass(frozen=True)
class PlanTiming:
    """How this rank obtained its plan: `source` is 'planned' (rank 0, or a lone process),
    'received' (from rank 0), 'file' or 'local' (every rank plans: dynamic sizes). `seconds` and
    `cpu_seconds` are this rank's own work (planning; or reading, decoding and checking), `waited`
    the time spent waiting for rank 0, `payload_bytes` the encoded plan's size."""

    source: str
    seconds: float
    cpu_seconds: float
    waited: float = 0.0
    payload_bytes: int = 0


def _lines(named: Sequence[tuple[str, torch.Tensor]], *, grad: bool) -> str:
    return "\n".join(f"{name} {tuple(t.shape)} {t.dtype}" + (f" requires_grad={t.requires_grad}" if grad else "")
                     for name, t in named)


def _describe_inputs(args: Sequence[Any], kwargs: dict | None) -> str:
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs or {}))
    described = [f"tensor {tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else repr(v) for v in leaves]
    return f"{spec}\n" + "\n".join(described)


def _autopar_version() -> str:
    try:
        return version("autopar")
    except PackageNotFoundError:
        return "not installed"


def fingerprint(model: torch.nn.Module, *, world_size: int, mesh: Any = None, strategies: Sequence[Any] | None = None,
                example_inputs: Sequence[Any] | None = None, example_kwargs: dict | None = None,
                options: dict | None = None) -> dict[str, str]:
    """What identifies the plan a rank needs, without tracing (module docstring); fields not
    given (a plan file run without a mesh, say) are left out and not compared."""
    fields = {"world size": str(world_size),
              "parameters": _lines(list(model.named_parameters(remove_duplicate=False)), grad=True),
              "buffers": _lines(list(model.named_buffers(remove_duplicate=False)), grad=False),
              "torch version": torch.__version__, "autopar version": _autopar_version()}
    if mesh is not None:
        fields["mesh"] = str(mesh)
    if strategies is not None:
        fields["strategies"] = "\n".join(repr(s) for s in strategies)
    if example_inputs is not None:
        fields["example inputs"] = _describe_inputs(example_inputs, example_kwargs)
    if options is not None:
        fields["options"] = repr(sorted(options.items()))
    return fields


def mismatch(planned: dict[str, str], local: dict[str, str], *, rank: int, planner: str = "rank 0") -> str | None:
    """The first field of `local` that differs from the planner's, as an error message (or None)."""
    for field, value in local.items():
        if field in planned and planned[field] != value:
            ours, theirs = planned[field].splitlines(), value.splitlines()
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            at = lambda lines: lines[first] if first < len(lines) else "<nothing>"  # noqa: E731
            return (f"rank {rank} is not running the model {planner} planned; {field}: {planner} has "
                    f"{at(ours)!r}, rank {rank} has {at(theirs)!r}\n  fix: {_FIX}")
    return None


def state_from_model(plan: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The traced state `autopar.plan` would have kept, taken from this rank's own model: its
    parameters and buffers by name (a frozen parameter in a mixed-precision plan cast to the
    traced compute dtype, as planning traced it; trainable ones stay the master weights) and the
    constants the plan carries."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    state = dict(plan.traced.state)
    for node in plan.graph_module.graph.nodes:
        info = plan.context.placeholders.get(node.name)
        if node.op != "placeholder" or info is None or info.kind not in ("parameter", "buffer"):
            continue
        if info.target not in named:
            raise PlanError(f"rank {_rank()}'s model has no {info.kind} {info.target!r}, which the plan reads\n"
                            f"  fix: {_FIX}")
        tensor, traced = named[info.target], node.meta.get("val")
        if (info.kind == "parameter" and info.target not in plan.context.master_dtypes
                and isinstance(traced, torch.Tensor) and tensor.dtype != traced.dtype):
            tensor = tensor.detach().to(traced.dtype)
        state[info.target] = tensor
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    now = _clock()
    return now[0] - start[0], now[1] - start[1]


def obtain_plan(make_plan: Callable[[], Any], local: dict[str, str], *, dynamic: bool) -> tuple[Any, PlanTiming]:
    """This rank's plan (module docstring): made here on rank 0 (or on every rank when `dynamic`),
    received from rank 0 elsewhere. Collective over the default process group's store."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        start = _clock()
        return make_plan(), PlanTiming("planned", *_since(start))
    store = dist.distributed_c10d._get_default_store()  # private in torch 2.13; every backend has one
    key = f"autopar/plan/{next(_CALLS)}"
    if dynamic:
        agree(local, store, key, world, rank)
        start = _clock()
        return make_plan(), PlanTiming("local", *_since(start))
    if rank == 0:
        return _plan_and_publish(make_plan, local, store, key, world)
    return _receive(local, store, key, world, rank)


def agree(local: dict[str, str], store: Any, key: str, world: int, rank: int) -> None:
    """Every rank's fingerprint against rank 0's, on every rank (no rank waits for a rank that
    fails): the same PlanError everywhere naming the first rank and field that differ. For the
    ways of obtaining a plan that do not go through rank 0 (a plan file, planning on every rank)."""
    store.set(f"{key}/agree/{rank}", pickle.dumps(local))
    names = [f"{key}/agree/{r}" for r in range(world)]
    store.wait(names)
    first = pickle.loads(store.get(names[0]))
    problems = [mismatch(first, pickle.loads(store.get(names[r])), rank=r) for r in range(1, world)]
    if store.add(f"{key}/agree/read", 1) == world:  # the last reader clears the exchange
        for name in names + [f"{key}/agree/read"]:
            store.delete_key(name)
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise PlanError(problem)


def agree_on_plan_file(local: dict[str, str]) -> None:
    """`agree` for ranks that each read a plan file (each also checks the file against itself)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        agree(local, dist.distributed_c10d._get_default_store(), f"autopar/plan/{next(_CALLS)}",
              dist.get_world_size(), dist.get_rank())


def _plan_and_publish(make_plan: Callable[[], Any], local: dict[str, str], store: Any, key: str,
                      world: int) -> tuple[Any, PlanTiming]:
    start = _clock()
    try:
        made = make_plan()
    except Exception as error:
        store.set(f"{key}/plan", pickle.dumps(("error", f"rank 0 could not plan: {type(error).__name__}: {error}")))
        raise
    seconds, cpu = _since(start)
    problems = [mismatch(local, pickle.loads(store.get(f"{key}/fingerprint/{r}")), rank=r) for r in range(1, world)]
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        store.set(f"{key}/plan", pickle.dumps(("error", problem)))
        raise PlanError(problem)
    payload = encode_plan(made)
    store.set(f"{key}/plan", pickle.dumps(("plan", local, payload)))
    return made, PlanTiming("planned", seconds, cpu, payload_bytes=len(payload))


def _receive(local: dict[str, str], store: Any, key: str, world: int, rank: int) -> tuple[Any, PlanTiming]:
    store.set(f"{key}/fingerprint/{rank}", pickle.dumps(local))
    waiting = time.perf_counter()
    store.wait([f"{key}/plan"])  # rank 0 is planning (the store's timeout is the process group's)
    waited = time.perf_counter() - waiting
    start = _clock()
    message = pickle.loads(store.get(f"{key}/plan"))
    if store.add(f"{key}/read", 1) == world - 1:  # the last reader clears the exchange
        for name in [f"{key}/plan", f"{key}/read"] + [f"{key}/fingerprint/{r}" for r in range(1, world)]:
            store.delete_key(name)
    if message[0] == "error":
        raise PlanError(message[1])
    _, planned, payload = message
    problem = mismatch(planned, local, rank=rank)
    if problem is not None:
        raise PlanError(problem)
    received = decode_plan(payload)
    return received, PlanTiming("received", *_since(start), waited=waited, payload_bytes=len(payload))


def save_runnable_plan(plan: Any, path: "str | Path", *, model: torch.nn.Module, example_inputs: Sequence[Any],
                       example_kwargs: dict | None = None, strategies: Sequence[Any] | None = None) -> None:
    """Write `plan` as a runnable plan file (module docstring) that `parallelize(model, plan=path)`
    runs without planning; `model` and the inputs give the fingerprint checked when it is run."""
    local = fingerprint(model, world_size=plan.mesh.world_size, mesh=plan.mesh, strategies=strategies,
                        example_inputs=example_inputs, example_kwargs=example_kwargs)
    header = json.dumps({"schema": SCHEMA, "torch": torch.__version__, "fingerprint": local}, sort_keys=True)
    Path(path).write_bytes(header.encode() + b"\n" + encode_plan(plan))


def load_runnable_plan(path: "str | Path", local: dict[str, str]) -> tuple[Any, PlanTiming]:
    """The plan in a runnable plan file, after checking its fingerprint against this rank's."""
    start = _clock()
    data = Path(path).read_bytes()
    line, _, payload = data.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        header = {}
    if header.get("schema") != SCHEMA:
        raise PlanError(f"{path} is not a runnable plan file (schema {header.get('schema')!r}, this autopar reads "
                        f"{SCHEMA!r})\n  fix: write one with autopar.save_runnable_plan(plan, path, model=..., "
                        f"example_inputs=...); a plan document (autopar plan --save) cannot run")
    problem = mismatch(header["fingerprint"], local, rank=_rank(), planner=f"the plan file {path}")
    if problem is not None:
        raise PlanError(problem)
    loaded = decode_plan(payload)
    return loaded, PlanTiming("file", *_since(start), payload_bytes=len(payload))
