"""The fake runs of a rank graph that the ledgers read, each made once per plan.

Both run the rank's emitted graph of one stage — what the runtime runs, recomputed regions
included — on fake tensors of the rank's local shapes at the traced hint sizes
(`fake_tensors.fake_inputs`, the kernels of `fake_tensors.kernel_device`):

- `saving_run(plan, rank, stage=)`: forward only, node by node (`_Recorder`, an fx Interpreter),
  under `saved_tensors_hooks`: every storage autograd saves, with the graph node that first
  produced it — the activation ledger (`autopar/compiler/ledger/activations.py`). The forward's values are kept
  until it ends, so storage identities stay unique; what the ledger needs of them is copied out
  (`SavedStorage`: sizes, dtypes, nodes). `recompute=False` runs the recomputed regions inline
  (what a region saves when it runs again, `activations.recomputed_region_bytes`).
- `ops_run(plan, rank, stage=)`: forward and backward without any hook, as the runtime runs them:
  every ATen call with its FLOPs and bytes (`ledger/op_cost._OpRecorder`) and the most bytes
  backward allocates beyond what is alive when it starts (`ledger/working_memory.LiveFakeStorages`);
  with `block=` (a module path) also which calls are that module's (`_BlockCalls`: the planner at
  scale reads a block's calls off a one-block plan's run, `autopar/planner/block_ledgers.py`) and, where
  no recomputed region saves through hooks, the bytes autograd saved, the rank's, the
  block's, the block's attention cores' and the block's made from received expert rows
  (`received_rows`) (`RankOps.saved`): read off the autograd graph the forward left (`_autograd_saved`, no hook), each storage labelled by the graph node that
  allocated it — what the saving run counts, without running the forward again
  (`tests/test_composed_cost.py` compares).

Two runs, not one: a pack hook changes what autograd does — it keeps the saved tensor itself
instead of its data, so backward unpacks it through a `detach` and accumulates gradients in
place where it would not (the example GPT at dp=4: 1462 backward calls under the hook against
1368, forward 576 against 581) — and the op ledger is to count what the runtime calls. Each run
is kept on the plan (`Plan._fake_runs`, never encoded), per (rank, stage, device, recompute): a
plan's graphs do not change once planned, and the memory ledger, the peak's moments, the step
estimate and the planner at scale all ask for them.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from autopar.compiler.ledger.fake_tensors import fake_inputs, kernel_device, on_device, traced_mode
from autopar.compiler.ledger.op_cost import RankOps, _OpRecorder
from autopar.compiler.ledger.working_memory import LiveFakeStorages, gather_free_runner, taking_weight_gradients
from autopar.compiler.passes.recompute import attention_cores, is_region_call
from autopar.core.ir import module_stack
from autopar.core.ops import moe
from autopar.core.ops.collectives import regathered_source

if TYPE_CHECKING:
    from autopar.compiler.ledger.working_memory import Working
    from autopar.compiler.plan import Plan


@dataclass(frozen=True)
class Produced:
    """A graph node's output that a storage first came from."""
    node: torch.fx.Node
    output: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class SavedStorage:
    """A storage autograd saved: its bytes, its producer (None: allocated inside a kernel), the
    node that was running when it was saved, the saved tensor's shape and dtype, and every node
    whose forward saved it."""
    nbytes: int
    producer: Produced | None
    running: torch.fx.Node
    shape: tuple[int, ...]
    dtype: torch.dtype
    savers: tuple[torch.fx.Node, ...]


@dataclass
class FakeRun:
    graph_module: torch.fx.GraphModule  # the rank graph that ran (factory calls on the kernels' device)
    saved: list[SavedStorage] = field(default_factory=list)  # in first-saved order


@dataclass
class _Saving:
    storage: torch.UntypedStorage
    tensor: torch.Tensor
    running: torch.fx.Node
    savers: list[torch.fx.Node]


class _Recorder(torch.fx.Interpreter):
    """Runs a rank graph node by node, mapping each output storage to its first producer and
    recording every storage autograd saves."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)  # live values keep storage identities unique
        self.producers: dict[StorageWeakRef, tuple[torch.fx.Node, int, torch.Tensor]] = {}
        self.saving: dict[StorageWeakRef, _Saving] = {}
        self.running: torch.fx.Node | None = None
        self.position = {node: index for index, node in enumerate(gm.graph.nodes)}

    def run_node(self, node: torch.fx.Node) -> Any:
        self.running = node
        result = super().run_node(node)
        if is_region_call(node):  # its items register the storages, under the planned nodes' names
            return result
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for index, value in enumerate(outputs):
            if isinstance(value, torch.Tensor):
                self.producers.setdefault(StorageWeakRef(value.untyped_storage()), (node, index, value))
        return result

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # an op that saves its own output (softmax, dropout's mask, layer norm's statistics) does so
        # before run_node registers it: producers are looked up once the whole forward has run.
        # Megatron SP's re-gathered input counts as its shard (kept, gathered again in backward)
        source = regathered_source(tensor)
        counted = source if source is not None else tensor
        key = StorageWeakRef(counted.untyped_storage())
        if key not in self.saving:
            self.saving[key] = _Saving(counted.untyped_storage(), counted, self.running, [])
        if self.running not in self.saving[key].savers:
            self.saving[key].savers.append(self.running)
        return tensor

    def saved(self) -> list[SavedStorage]:
        """What was saved, as plain data; then every value this recorder held is let go."""
        result = []
        for key, item in self.saving.items():
            found = self.producers.get(key)
            producer = None
            # a node running after the save that outputs (a view of) the storage did not allocate it
            if found is not None and self.position[found[0]] <= self.position[item.running]:
                node, output, value = found
                producer = Produced(node, output, tuple(value.shape), value.dtype)
            result.append(SavedStorage(item.storage.nbytes(), producer, item.running, tuple(item.tensor.shape),
                                       item.tensor.dtype, tuple(item.savers)))
        self.producers.clear()
        self.saving.clear()
        self.env.clear()
        return result


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _prepared(plan: "Plan", rank: int, stage: int | None, device: torch.device | None, *,
              recompute: bool = True) -> tuple:
    """(stage, kernels' device, rank graph on that device, fake mode, fake inputs): what both runs
    start from. Call under `unset_fake_temporarily()` (planning may run under the caller's
    FakeTensorMode)."""
    chosen = plan.stages[stage] if stage is not None else plan.stages_of_rank(rank)[0]
    device = kernel_device(plan, device)
    gm = on_device(plan.rank_graph(rank, stage=chosen.index, recompute=recompute), device,
                   accelerator_kernels=plan.fused_attention)
    mode = traced_mode(plan)
    return chosen, device, gm, mode, fake_inputs(plan, chosen.graph_module.graph, mode, device)


def _key(plan: "Plan", what: str, rank: int, stage: int | None, device: torch.device | None, recompute: bool) -> tuple:
    chosen = plan.stages[stage] if stage is not None else plan.stages_of_rank(rank)[0]
    return what, rank, chosen.index, kernel_device(plan, device), recompute


def saving_run(plan: "Plan", rank: int, *, stage: int | None = None, device: torch.device | None = None,
               recompute: bool = True) -> FakeRun:
    """What `rank`'s graph of `stage` (default: its first) saves for backward in one forward, on
    `device`'s kernels (default: `fake_tensors.kernel_device`) (module docstring)."""
    key = _key(plan, "saved", rank, stage, device, recompute)
    if key not in plan._fake_runs:
        with unset_fake_temporarily():
            _, _, gm, mode, inputs = _prepared(plan, rank, stage, device, recompute=recompute)
            recorder = _Recorder(gm)
            with mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack):
                recorder.run(*inputs)
            plan._fake_runs[key] = FakeRun(gm, recorder.saved())
    return plan._fake_runs[key]


def ops_run(plan: "Plan", rank: int, *, stage: int | None = None, block: str | None = None) -> "RankOps":
    """The calls `rank`'s graph of `stage` (default: its first) makes, forward and backward, and
    backward's working memory (module docstring); with `block` (a module path) also which of the
    calls are that module's (`RankOps.block`, `_BlockCalls`)."""
    plain = _key(plan, "ops", rank, stage, None, True)
    key = plain + ((block,) if block else ())
    if key not in plan._fake_runs:
        with unset_fake_temporarily():
            chosen, _, gm, mode, inputs = _prepared(plan, rank, stage, None)
            labels = _BlockCalls(block) if block else None
            recorder, tracker = _OpRecorder(labels), LiveFakeStorages()
            reads_saved = labels is not None and _saved_readable(plan, gm)
            if reads_saved:
                kinds = {name: info.kind for name, info in plan.context.placeholders.items()}
                labels.cores = {node for core in attention_cores(gm.graph, kinds) for node in core}
                labels.received = received_rows(gm.graph)
                tracker.label = labels.label
            taking_weight_gradients(inputs, tracker)
            with mode, torch.enable_grad(), recorder, tracker:
                outputs = gather_free_runner(gm, tracker, labels.around if labels else None)(*inputs)
                roots = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
                saved = _autograd_saved(roots, tracker, _user_inputs(plan, chosen, inputs)) if reads_saved else None
                grads = [torch.ones_like(o) for o in roots]
                del outputs
                recorder.phase = "backward"
                if labels:
                    labels.backward = True
                tracker.backward_starts()
                if roots:
                    torch.autograd.backward(roots, grads)
            totals = recorder.block_totals
            plan._fake_runs[key] = RankOps(rank, chosen.index, recorder.totals["forward"], recorder.totals["backward"],
                                           tracker.working(), (totals["forward"], totals["backward"]) if labels else None,
                                           taps=recorder.totals["taps"], block_taps=totals["taps"] if labels else None,
                                           saved=saved)
            plan._fake_runs.setdefault(plain, plan._fake_runs[key])  # the same run, read without the split
    return plan._fake_runs[key]


def _saved_readable(plan: "Plan", gm: torch.fx.GraphModule) -> bool:
    """Whether what autograd saves can be read off its graph after the forward: not where a
    recomputed region saves through `saved_tensors_hooks` (reading a saved tensor would run the
    region again) or an all-gather keeps its input for backward (the saving run counts the shard)."""
    if any(is_region_call(node) for node in gm.graph.nodes):
        return False
    return not any(plan.strategy.regathers(axis) for axis in plan.mesh.names)


def _user_inputs(plan: "Plan", chosen: Any, inputs: list) -> set[int]:
    """Storage addresses of the stage's user inputs (tokens, labels: saved by the embedding and
    the loss, activations of the rest); the other placeholders are state."""
    placeholders = [n for n in chosen.graph_module.graph.nodes if n.op == "placeholder"]
    return {value.untyped_storage()._cdata for node, value in zip(placeholders, inputs)
            if isinstance(value, torch.Tensor) and getattr(plan.context.placeholders.get(node.name), "kind", None)
            == "input"}


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _autograd_saved(roots: list[torch.Tensor], tracker: LiveFakeStorages, user_inputs: set[int]
                    ) -> tuple[int, int, int, int, int]:
    """(bytes, the block's bytes, of the bytes the attention cores', of the block's its cores', of
    the block's those made from received expert rows) of
    the storages autograd saved for backward, read off the graph from `roots` (each node's
    `_saved_*` values, a custom function's `saved_tensors`): those the forward allocated (the
    block's where one of its nodes did, an attention core's where a node of one did:
    `tracker.labels`, `_BlockCalls.label`) and the user inputs; parameters and buffers are state. What the activation ledger's saving run counts
    (`saving_run`, `tests/test_composed_cost.py` compares), without running the forward again."""
    with _disable_current_modes():  # reading a saved output makes a view of it: not a call of the run
        storages = _saved_storages(roots)
    total = inside = cores = inside_cores = inside_received = 0
    for address, nbytes in storages.items():
        allocation = tracker.live_at.get(address)
        if allocation is not None:
            block, core, received = tracker.labels.get(allocation, (False, False, False))
            total += nbytes
            inside += nbytes if block else 0
            cores += nbytes if core else 0
            inside_cores += nbytes if block and core else 0
            inside_received += nbytes if block and received else 0
        elif address in user_inputs:
            total += nbytes
    return total, inside, cores, inside_cores, inside_received


def received_rows(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of an expert-parallel block that compute on the token rows its rank received:
    from each `moe_dispatch` (the rows it received, its offsets and counts) up to its `moe_combine`
    (not included: the rows sent back are the rank's own routed rows again). Under routing skew
    the busiest rank receives more of them (`autopar/planner/routing_skew.py`)."""
    found: set[torch.fx.Node] = set()
    pending = [node for node in graph.nodes if node.target is moe.moe_dispatch]
    while pending:
        node = pending.pop()
        if node in found or node.target in (moe.moe_combine, moe.moe_unpermute):
            continue
        found.add(node)
        pending.extend(node.users)
    return found


def _saved_storages(roots: list[torch.Tensor]) -> dict[int, int]:
    """Storage address -> bytes of every tensor the autograd graph from `roots` saved."""
    storages: dict[int, int] = {}
    seen: set = set()  # the nodes themselves, held: a freed node wrapper's id could be given to the next
    pending = [r.grad_fn for r in roots if r.grad_fn is not None]
    while pending:
        function = pending.pop()
        if function in seen:
            continue
        seen.add(function)
        kind = type(function)
        if kind not in _SAVED_NAMES:
            _SAVED_NAMES[kind] = tuple(name for name in dir(kind) if name.startswith("_saved_"))
        values = [getattr(function, name) for name in _SAVED_NAMES[kind]]
        if hasattr(function, "saved_tensors"):
            values.append(function.saved_tensors)
        for tensor in pytree.tree_leaves(values):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
        pending.extend(nxt for nxt, _ in function.next_functions if nxt is not None)
    return storages


class _BlockCalls:
    """Which calls of an ops run are one block's (the module `block`, e.g. `layers.1`): in forward,
    the calls of the graph nodes inside it (their module stack); in backward, the calls autograd
    makes for the autograd nodes those graph nodes created. Autograd numbers its nodes in the order
    they are made, so each graph node's run makes a range of numbers, and the node backward is
    running (`torch._C._current_autograd_node()`) names its range. Nodes numbered past the forward's
    (a recomputed region's forward run again inside its backward) and gradient accumulation (the
    largest number) keep the label of the call before them: they run inside the node that asked for
    them."""

    def __init__(self, block: str) -> None:
        self.block, self.prefix = block, block + "."
        self.cores: set[torch.fx.Node] = set()  # the attention cores' nodes, in the block or not (`label`)
        self.received: set[torch.fx.Node] = set()  # the nodes computing on received expert rows (`received_rows`)
        self.in_core = self.in_received = False
        self.ends: list[int] = []  # the last autograd number of each run of graph nodes with one label
        self.labels: list[bool] = []
        self.last = -1
        self.current = False
        self.backward = False

    def around(self, node: torch.fx.Node, run: Any) -> Any:
        inside = any(path == self.block or path.startswith(self.prefix) for path in module_stack(node))
        self.current, self.in_core, self.in_received = inside, node in self.cores, node in self.received
        result = run(node)
        newest = max((t.grad_fn._sequence_nr() for t in pytree.tree_leaves(result)
                      if isinstance(t, torch.Tensor) and t.grad_fn is not None), default=-1)
        if newest > self.last:
            if self.labels and self.labels[-1] == inside:
                self.ends[-1] = newest
            else:
                self.ends.append(newest)
                self.labels.append(inside)
            self.last = newest
        return result

    def label(self) -> tuple[bool, bool, bool]:
        """What a storage allocated now is: (the block's, an attention core's — what selective
        recomputation could free at most —, made from token rows the rank received for its experts
        — what routing skew grows on the busiest rank). The last two only in forward: a storage
        autograd saves was allocated by the forward."""
        return self(), self.in_core and not self.backward, self.in_received and not self.backward

    def __call__(self) -> bool:
        if self.backward:
            node = torch._C._current_autograd_node()
            number = node._sequence_nr() if node is not None else self.last + 1
            if number <= self.last:
                self.current = self.labels[bisect.bisect_left(self.ends, number)]
        return self.current


def backward_working(plan: "Plan", *, rank: int = 0, stage: int | None = None) -> Working:
    """Most bytes backward allocates beyond what is alive when it starts, on `rank` for one forward
    of `stage` (default: the rank's first stage), at the traced hint sizes (module docstring): the
    op ledger's fake run (`ops_run`) follows them."""
    return ops_run(plan, rank, stage=stage).working


def rank_ops(plan: "Plan", rank: int, *, stage: int | None = None) -> RankOps:
    """The calls `rank`'s graph of `stage` (default: its first) makes, forward and backward (module
    docstring), from the rank graph's fake run (`ops_run`)."""
    return ops_run(plan, rank, stage=stage)
