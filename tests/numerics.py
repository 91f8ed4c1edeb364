"""Shared harness of the numerics tests: train the single-device model and the autopar program side
by side for a few AdamW steps; on every rank, measure from outside what each step moves and holds.

Per rank (`distributed_rank`), `Instruments` — a collective counter and a live-storage tracker from
`autopar.measure` — are active over every phase of the rank's work: `setup` (build the seeded
model, `parallelize`, the optimizer), then per step `zero_grad`, `local_batch`, the step body
(`forward`, then `backward`), optional `clip`, and `optimizer`. Only the harness's own work runs
between phases: reassembling whole gradients and parameters (`autopar.measure.reassemble`:
all-gather and DTensor, never autopar's slicing code) and reading the measurements.

The step body is one replaceable function, `step(module, local) -> loss` (`train_step`: forward
and backward; a pipeline module's would be `lambda module, local: module.train_step(*local)`,
as a module-level function so that it pickles). It receives the module behind `Probed`: calling
it runs the forward in phase `forward` and measures what the forward leaves alive
(`measure_saved_activations`); whatever follows in the body is phase `backward`. A body that
never calls the module runs in phase `step`, compared with the ledger's forward + backward
together, and measures no activations (`assert_memory_equals_ledger(..., activations=False)`).

Whole tensors are reassembled per parameter the rank holds (`module.named_parameters()`, in
order) over the axes that shard it, so ranks that hold different parameters (pipeline stages)
take part only in their own groups; `assert_matches` checks that the union over ranks covers
every single-device parameter. `parameter_layout` is where the plan's claim is read.

The checks (`tests/numerics_checks.py`) compare whole tensors, the ledger with the counted
collectives, and the memory ledger with the measured bytes.
"""
from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any, Callable, Iterator

import torch

import autopar
from autopar.compiler.ledger.memory import build_memory_ledger
from autopar.compiler.ledger.peak import moments, peak_terms
from autopar.compiler.passes.recompute import RECOMPUTE
from autopar.core.ops import moe as moe_ops
from autopar.measure.activations import measure_saved_activations
from autopar.measure.comm_counter import CommCounter
from autopar.measure.memory import held_bytes
from autopar.measure.reassemble import Dim0Shard, check_mesh, full_tensors
from autopar.measure.storages import LiveStorages, distinct_storage_bytes, storage_key

STEPS = 3
LR = 1e-2
# AdamW's first steps move every entry by ~lr*g/(|g|+eps): an entry with |g| ~ 1e-7 (cancellation) whose
# last bits differ between summation orders (1e-9 absolute, measured) then moves differently by ~1e-6, a
# relative parameter error above 1e-5 that says nothing about parallelisation. eps=1e-3 keeps such entries
# in Adam's linear regime; gradients themselves are compared at 1e-5 before the optimizer sees them.
EPS = 1e-3


def reference_trainer(build: Callable[[], torch.nn.Module], *, eps: float = EPS
                      ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The single-device model (seeded like every rank) and its AdamW."""
    torch.manual_seed(0)
    model = build()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)


def parallel_trainer(build: Callable[[], torch.nn.Module], example_inputs: Any, mesh: str,
                     strategies: list, *, eps: float = EPS, options: dict | None = None
                     ) -> tuple[Any, torch.optim.Optimizer]:
    """This rank's ParallelModule of the same seeded model, and AdamW over its parameters (shards).
    `options`: more keyword arguments of `parallelize` (e.g. compile=True)."""
    torch.manual_seed(0)
    module = autopar.parallelize(build(), mesh, strategies=strategies, example_inputs=example_inputs,
                                 **(options or {}))
    return module, torch.optim.AdamW(module.parameters(), lr=LR, eps=eps)


def single_device(build: Callable[[], torch.nn.Module], batches: list[tuple], *, clip_norm: float | None = None,
                  param_dtype: torch.dtype | None = None, microbatches: int = 1, eps: float = EPS) -> dict[str, Any]:
    """Losses, gradients and parameters per step. `clip_norm`: gradients are clipped (and the norms
    recorded) before the step. `param_dtype`: FSDP-style mixed precision on one device, a copy in
    that dtype computes and the fp32 masters are updated. `microbatches`: each global batch is cut
    along dim 0 and the gradients of the micro-batches' losses / m accumulated, the loss being their
    mean (what a pipeline computes, in the same order). `backward_temporaries`: per step, the most
    bytes allocated after the forward that are alive at once (measured like a rank's)."""
    storages = LiveStorages()
    with storages:
        model, optimizer = reference_trainer(build, eps=eps)
        compute = copy.deepcopy(model) if param_dtype is not None else model
    result: dict[str, list] = {"losses": [], "grads": [], "params": [], "norms": [], "backward_temporaries": []}
    for batch in batches:
        storages.reset_peak()
        with storages:
            optimizer.zero_grad()
            if compute is not model:
                for low, high in zip(compute.parameters(), model.parameters()):
                    low.data, low.grad = high.detach().to(param_dtype), None
            losses = []
            for micro in zip(*(t.chunk(microbatches) for t in batch)):
                micro_loss = compute(*micro)
                storages.watch(storages.mark())
                (micro_loss / microbatches).backward()
                losses.append(micro_loss.detach())
            loss = torch.stack(losses).mean()
            if compute is not model:
                for low, high in zip(compute.parameters(), model.parameters()):
                    high.grad = low.grad.float()
            if clip_norm is not None:
                result["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm))
            optimizer.step()
        result["backward_temporaries"].append(storages.watched_peak)
        result["losses"].append(loss.detach().float())
        result["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        result["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return result


# ---- the step body (replaceable) and how the harness watches it
def train_step(module: Any, local: list[Any]) -> torch.Tensor:
    """One forward and backward; the default step body."""
    loss = module(*local)
    loss.backward()
    return loss


class Instruments:
    """The counter and the storage tracker, active inside `phase(...)` windows only."""

    def __init__(self) -> None:
        self.storages = LiveStorages()
        self.counter = CommCounter()
        self.activations: list[int] = []
        self.epochs: dict[str, int] = {}  # where the current step's storages were allocated
        self._active = False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._active:  # a phase inside a phase relabels; the modes are entered once
            with self.counter.phase(name):
                yield
            return
        self._active = True
        try:
            with self.storages, self.counter, self.counter.phase(name):
                yield
        finally:
            self._active = False

    def begin_step(self) -> None:
        """Free cyclic garbage, start the step's epoch of allocations and its peak."""
        gc.collect()
        self.epochs = {"step": self.storages.mark()}
        self.storages.reset_peak()

    def peak(self) -> dict[str, int]:
        """The step's peak live bytes, split by when they were allocated: before the step ("at
        rest"), before the forward, in the forward, after it (backward, optimizer)."""
        bounds = sorted(self.epochs.items(), key=lambda item: item[1])
        split = {"at rest": 0, **{name: 0 for name, _ in bounds}}
        for epoch, nbytes in self.storages.peak_by_epoch.items():
            name = next((n for n, start in reversed(bounds) if epoch >= start), "at rest")
            split[name] += nbytes
        return {"total": self.storages.peak_bytes, **split}

    def next_counter(self) -> CommCounter:
        """Start counting into a fresh counter (one per step); returns the finished one."""
        finished, self.counter = self.counter, CommCounter()
        return finished


class Probed:
    """The module as a step body sees it (see module docstring); other attributes pass through."""

    def __init__(self, module: Any, instruments: Instruments) -> None:
        self._module, self._instruments = module, instruments

    def __call__(self, *local: Any) -> Any:
        instruments = self._instruments
        instruments.epochs["forward"] = instruments.storages.mark()
        with instruments.phase("forward"), measure_saved_activations() as saved:
            outputs = saved.call(self._module, *local)
        instruments.epochs["backward"] = instruments.storages.mark()
        instruments.activations.append(saved.bytes)
        instruments.counter.relabel("backward")
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def device_mesh_keys() -> set[int]:
    """The storages of the rank maps of every live torch DeviceMesh, found by the garbage
    collector's object list (torch's own objects, not autopar's accounting); called after setup,
    before `settle_garbage` freezes the survivors out of that list."""
    from torch.distributed.device_mesh import DeviceMesh

    # the test is made once per type: isinstance on every object would run a Python-level
    # __instancecheck__ for torch's opaque types, ~1.5 s per rank over a process's ~10^6 objects
    objects = gc.get_objects()
    meshes = {kind for kind in {type(o) for o in objects} if issubclass(kind, DeviceMesh)}
    return {storage_key(o.mesh) for o in objects if type(o) in meshes}


def device_mesh_bytes(storages: LiveStorages, keys: set[int]) -> int:
    """Live tracked bytes of those rank maps."""
    return sum(nbytes for key, nbytes in storages.live().items() if key in keys)


def settle_garbage() -> set[int]:
    """Free what setup left in reference cycles (the original model, tracing state), then freeze
    the survivors out of the cyclic collector: the measurements' `gc.collect()` calls in each step
    then take milliseconds instead of ~0.4 s (a full collection over torch, sympy, transformers).
    Returns `device_mesh_keys()` of the survivors, read in between (frozen objects leave
    `gc.get_objects()`); one full collection, not two."""
    gc.collect()
    meshes = device_mesh_keys()
    gc.freeze()
    return meshes


# ---- what a rank reports
def parameter_layout(module: Any) -> dict[str, tuple[tuple, Dim0Shard | None]]:
    """The plan's claim per parameter the rank holds: placements per mesh axis, ZeRO dim-0 shard."""
    placements = module.plan.parameter_placements()
    zero = {p.fqn: Dim0Shard(axis=u.axis, rows=p.rows, length=p.shape[0]) for u in module.plan.units for p in u.params}
    return {fqn: (placements[fqn], zero.get(fqn)) for fqn, _ in module.named_parameters()}


def whole_tensors(module: Any, mesh: Any, *, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) this rank holds, reassembled whole, in `named_parameters()` order."""
    pieces = {}
    for fqn, param in module.named_parameters():
        pieces[fqn] = param.grad if grads else param
        if pieces[fqn] is None:
            raise AssertionError(f"{fqn} has no gradient on this rank")
    return full_tensors(pieces, mesh=mesh, layout=parameter_layout(module))


def comparison_mesh(module: Any) -> Any:
    return check_mesh(axes=module.plan.mesh.axes)


def memory_ledger(module: Any, rank: int) -> dict[str, Any]:
    ledger = build_memory_ledger(module.plan, rank=rank)
    entries: dict[tuple[str, str], int] = {}
    for entry in ledger.entries:
        entries[(entry.category, entry.what)] = entries.get((entry.category, entry.what), 0) + ledger.number(entry.bytes)
    terms = peak_terms(module.plan, ledger, rank=rank)
    graph = module.plan.graph_module.graph
    routed = any(getattr(node.target, "__module__", "") == moe_ops.__name__ for node in graph.nodes)
    recomputed = any(RECOMPUTE in node.meta for stage in module.plan.stages for node in stage.graph_module.graph.nodes)
    return {"by_category": ledger.by_category(), "entries": entries, "moments": moments(terms),
            "peak_at_its_moment": module.plan.pipeline is None and not routed and not recomputed
            and not module.plan.units}


def unit_bytes(plan: Any, *, keep: Callable[[Any], bool], padded: bool) -> int:
    """Gathered bytes of the ZeRO units `keep` selects: padded (the all-gather's size, as the
    ledger's transient entries count it) or each parameter's own rows (what the runtime keeps)."""
    total = 0
    for unit in plan.units:
        if keep(unit):
            rows = [unit.group_size * p.rows if padded else p.shape[0] for p in unit.params]
            total += sum(r * p.row_numel for r, p in zip(rows, unit.params)) * unit.dtype.itemsize
    return total


def regathered_shard_bound(plan: Any) -> int:
    """The largest shard a re-gathering (Megatron-style SP) all-gather keeps for backward."""
    return max((int(plan.comm.number(e.logical_bytes)) // plan.mesh.size(e.axis) for e in plan.comm.entries
                if e.why == "the shard saved for backward gathered again"), default=0)


def ledger_dtypes(plan: Any, rank: int) -> dict[tuple[str, str, str], int]:
    """(kind, axis, dtype) -> logical bytes per step of `rank`'s ledger entries."""
    result: dict[tuple[str, str, str], int] = {}
    for entry in plan.comm.for_rank(rank):
        key = (entry.kind, entry.axis, str(entry.dtype).removeprefix("torch."))
        result[key] = result.get(key, 0) + entry.times * int(plan.comm.number(entry.logical_bytes))
    return result


def rank_summary(module: Any, rank: int, world: int, setup: CommCounter, *, memory: bool = True) -> dict[str, Any]:
    """What a rank reports besides its steps: setup traffic, ledgers, layout, the named sizes.
    `memory=False` leaves the memory ledger out (its activation entries run the rank graph on
    fake tensors, ~0.5-1 s per rank) for callers that check no memory."""
    group_to_axis = module.group_keys()
    plan = module.plan
    kept = lambda unit: unit.stage == 3 and not unit.reshard  # noqa: E731
    return {"rank": rank, "world": world, "setup_comm": setup.by_key(group_to_axis),
            "ledger": plan.comm.by_key(rank=rank), "ledger_dtypes": ledger_dtypes(plan, rank),
            **({"memory_ledger": memory_ledger(module, rank)} if memory else {}),
            "layout": parameter_layout(module), "group_to_axis": group_to_axis,
            "kept_units": {"padded": unit_bytes(plan, keep=kept, padded=True),
                           "unpadded": unit_bytes(plan, keep=kept, padded=False)},
            "all_units_unpadded": unit_bytes(plan, keep=lambda unit: unit.stage == 3, padded=False),
            "regathered_shard_bound": regathered_shard_bound(plan),
            "sends_bound": sum(nbytes for (_, kind, _), (_, nbytes) in plan.comm.by_key(rank=rank).items()
                               if kind == "send")}


def distributed_rank(rank: int, world: int, build: Callable[[], torch.nn.Module], batches: list[tuple], mesh: str,
                     strategies: list, step: Callable[[Any, list], torch.Tensor] = train_step,
                     clip_norm: float | None = None, eps: float = EPS,
                     after: Callable[[Any, int], dict] | None = None, memory: bool = True,
                     options: dict | None = None) -> dict[str, Any]:
    """Train one step per batch; per step: loss, whole gradients and parameters, collectives by
    phase, bytes held after the step (by category), the step's peak, activations left by the
    forward. `after(module, rank)` (module-level, so that it pickles) adds its own entries once
    training is done (e.g. a state dict loaded into a fresh model). `memory=False`: no memory
    ledger in the result (`rank_summary`), for callers that check numerics and communication only.
    `options`: more keyword arguments of `parallelize`."""
    instruments = Instruments()
    with instruments.phase("setup"):
        module, optimizer = parallel_trainer(build, batches[0], mesh, strategies, eps=eps, options=options)
    setup = instruments.next_counter()
    meshes = settle_garbage()
    check = comparison_mesh(module)
    result = rank_summary(module, rank, world, setup, memory=memory)
    result.update(losses=[], grads=[], params=[], norms=[], comm=[], comm_dtypes=[], held=[], peak=[],
                  device_mesh_bytes=[])
    instruments.storages.track(batches)  # the harness's own: alive throughout, named in the peak's "at rest"
    result["batch_bytes"] = distinct_storage_bytes([t for batch in batches for t in batch])
    for batch in batches:
        instruments.begin_step()
        with instruments.phase("zero_grad"):
            optimizer.zero_grad()
        with instruments.phase("local_batch"):
            local = module.local_batch(*batch)
        instruments.epochs["forward"] = instruments.storages.mark()  # a body that never calls the module
        with instruments.phase("step"):
            loss = step(Probed(module, instruments), local)
        if clip_norm is not None:
            with instruments.phase("clip"):
                result["norms"].append(module.clip_grad_norm_(clip_norm))
        with instruments.phase("optimizer"):
            optimizer.step()
        result["peak"].append(instruments.peak())
        result["held"].append(held_bytes(instruments.storages, module=module, optimizer=optimizer,
                                         exclude=[batches, local, loss, result["norms"]]))
        result["device_mesh_bytes"].append(device_mesh_bytes(instruments.storages, meshes))
        counter = instruments.next_counter()
        result["comm"].append(counter.by_phase(result["group_to_axis"]))
        result["comm_dtypes"].append(counter.by_dtype(result["group_to_axis"]))
        result["losses"].append(loss.detach().clone())
        result["loss_bytes"] = loss.untyped_storage().nbytes()
        result["grads"].append(whole_tensors(module, check, grads=True))
        result["params"].append(whole_tensors(module, check, grads=False))
    result["activations"] = instruments.activations
    if after is not None:
        result.update(after(module, rank))
    return result
