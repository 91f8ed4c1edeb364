"""The activation ledger: what autograd keeps for backward on one rank, per step.

`saved_activations(plan, rank=r)` reads a fake forward of rank r's emitted graph (`Plan.rank_graph`;
`ledger/fake_run.saving_run`: fake tensors of the rank's local shapes at the traced hint sizes, node by
node, under `torch.autograd.graph.saved_tensors_hooks`). Every tensor a node outputs registers
its storage with the first node that produced it (a view shares its base's storage, so views map
back to the op that allocated); the pack hook records every storage autograd saves. The ledger is
the set of unique saved storages (`_saved_storages`), minus parameters, buffers and constants and
the gathered ZeRO-3 parameters (nodes with `node.meta["autopar_zero_unit"]`). Saved user inputs
(token ids an embedding keeps) are activations.

Bytes per storage (`_entry`): the producing node's local element count, from the planned graph's
symbolic global shape and placements (`autopar.core.ir.local_numel`), times the item size of the
tensor the kernel produced, as a sympy expression in the user's symbols (b, s), checked against
the fake storage's size at the hints.
A saved storage that no graph node produced, or that is larger than its producer's output, was
allocated inside a kernel (e.g. SDPA's logsumexp, the masked ids of the vocabulary-parallel
embedding): its entry is marked `internal` and carries the concrete byte count at the hint sizes.

`recompute="attention"` models Korthikanti et al.'s selective recomputation (`attention_core`):
storages produced strictly inside an explicit attention core are dropped — from the score
matmul (q·kᵀ, both operands activations) up to, not including, the probabilities·v matmul that
consumes it; q, k and v stay saved. Fused attention (`scaled_dot_product_attention`, lowered to
`_scaled_dot_product_flash_attention_for_cpu` / `_efficient_attention`) already keeps only q, k,
v, its output and logsumexp; it has no such core and nothing is dropped.

The kernels that decide what is saved are those of the fake tensors' device (`device=`; by
default the traced placeholders' device, and cpu for a model traced on the meta device, whose
SDPA would take the math path and save the attention matrix; the rank graph's factory calls are
moved there too). CUDA's fused attention saves other internals (e.g. RNG state) than the CPU one.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy
import torch
import torch.fx
from tabulate import tabulate

from autopar.compiler.ledger.fake_run import saving_run
from autopar.compiler.ledger.fake_tensors import kernel_device
from autopar.compiler.passes.recompute import ATTENTION_OPS, RECOMPUTE, attention_cores
from autopar.core.ir import PLANNED_NAME, SPEC, local_numel, module_path
from autopar.core.ops import in_flight

if TYPE_CHECKING:
    from autopar.compiler.ledger.fake_run import SavedStorage
    from autopar.compiler.plan import Plan

# gathered ZeRO-3 parameters (autopar/compiler/passes/shard_parameters.py); its `unit_boundary` nodes carry the key too,
# but return a view, so the storages they pass on keep the block's own node as first producer
ZERO_UNIT = "autopar_zero_unit"


@dataclass(frozen=True)
class ActivationEntry:
    """One storage autograd saves: its producing node (and which of its outputs), the local shape
    at the hints, and bytes."""

    node: str
    output: int
    op: str
    module: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: sympy.Expr
    number: int
    internal: bool = False
    saved_by: tuple[str, ...] = ()  # the nodes whose backward keeps it (a split backward frees some early)


@dataclass
class ActivationLedger:
    entries: list[ActivationEntry]
    symbol_values: dict[sympy.Symbol, int]
    rank: int
    recompute: str | None = None

    @property
    def total(self) -> sympy.Expr:
        return sympy.expand(sum((e.bytes for e in self.entries), sympy.Integer(0)))

    def number(self, expr: sympy.Expr | None = None) -> int:
        """`expr` (default: the total) at the traced sizes."""
        value = sympy.sympify(self.total if expr is None else expr).subs(self.symbol_values)
        return int(value)

    def by_module(self, *, depth: int | None = None) -> dict[str, sympy.Expr]:
        """Bytes per module path ('' is the root); `depth=2` groups by e.g. 'layers.3'."""
        totals: dict[str, sympy.Expr] = defaultdict(lambda: sympy.Integer(0))
        for entry in self.entries:
            key = ".".join(entry.module.split(".")[:depth]) if depth else entry.module
            totals[key] += entry.bytes
        return {key: sympy.expand(value) for key, value in totals.items()}

    def table(self) -> str:
        rows = [[e.module, e.node, e.op, "x".join(map(str, e.shape)), str(e.dtype).replace("torch.", ""),
                 str(e.bytes), e.number, "internal" if e.internal else ""] for e in self.entries]
        rows.append(["total", "", "", "", "", str(self.total), self.number(), ""])
        return tabulate(rows, headers=["module", "node", "op", "local shape", "dtype", "bytes", "S", ""])


def _saved_storages(plan: "Plan", rank: int, device: torch.device, stage: int | None, *,
                    recompute: bool = True) -> tuple[torch.fx.GraphModule, list["SavedStorage"]]:
    run = saving_run(plan, rank, stage=stage, device=device, recompute=recompute)
    return run.graph_module, run.saved


def _is_state(node: torch.fx.Node, plan: "Plan", planned: dict[str, torch.fx.Node]) -> bool:
    """Parameters, buffers, constants and gathered ZeRO-3 parameters: not activations."""
    if node.op == "placeholder":
        return plan.context.placeholders[node.name].kind != "input"
    return planned.get(node.name, node).meta.get(ZERO_UNIT) is not None


def _symbolic_bytes(plan: "Plan", planned: torch.fx.Node | None, index: int, itemsize: int) -> sympy.Expr | None:
    """Local bytes of output `index` of a planned node, from its global symbolic shape and placements.

    The item size is the executed tensor's: kernels may pick another dtype than the trace's (CPU
    LayerNorm keeps a bf16 input's mean and rstd in bf16; the meta and CUDA kernels use fp32)."""
    if planned is None or planned.meta.get(SPEC) is None:
        return None
    value, spec = planned.meta.get("val"), planned.meta[SPEC]
    if isinstance(value, (tuple, list)):
        if not isinstance(spec, (tuple, list)) or index >= len(value):
            return None
        value, spec = value[index], spec[index]
    if not isinstance(value, torch.Tensor) or spec is None:
        return None
    numel = local_numel(tuple(value.shape), spec.placements, plan.mesh.shape)
    return sympy.expand(numel.subs(plan.traced.symbols) * itemsize)


def _op_name(node: torch.fx.Node) -> str:
    """The op that made a value; a deferred step's finish names its step (`autopar/core/ops/in_flight.py`)."""
    if node.target is in_flight.finish:
        return _op_name(node.args[0])
    target = node.target
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _entry(plan: "Plan", saved: "SavedStorage", planned: dict[str, torch.fx.Node]) -> ActivationEntry:
    produced = saved.producer
    node, output = (produced.node, produced.output) if produced is not None else (saved.running, 0)
    shape, dtype = (produced.shape, produced.dtype) if produced is not None else (saved.shape, saved.dtype)
    expr = None
    name = node.meta.get(PLANNED_NAME, node.name)  # a recomputed region's item stands for a planned node
    if produced is not None:
        expr = _symbolic_bytes(plan, planned.get(name), output, dtype.itemsize)
    internal = expr is None or sympy.sympify(expr.subs(plan.traced.symbol_values)) != saved.nbytes
    if internal:  # allocated inside a kernel: what was saved, at its concrete size
        shape, dtype, expr = saved.shape, saved.dtype, sympy.Integer(saved.nbytes)
    return ActivationEntry(node=name, output=output, op=_op_name(node), module=module_path(node),
                           shape=shape, dtype=dtype, bytes=expr, number=saved.nbytes, internal=internal,
                           saved_by=tuple(n.name for n in saved.savers))


def attention_core(gm: torch.fx.GraphModule, placeholder_kinds: dict[str, str]) -> set[str]:
    """Names of the nodes strictly inside explicit attention cores (see the module docstring): the
    cores `passes/recompute.attention_cores` finds (score matmul … probabilities·v), without their
    last node (the probabilities·v matmul) and without fused attention, which has no such core."""
    return {n.name for core in attention_cores(gm.graph, placeholder_kinds) if core[0].target not in ATTENTION_OPS
            for n in core[:-1]}


def saved_activations(plan: "Plan", *, rank: int = 0, recompute: str | None = None,
                      device: "str | torch.device | None" = None, stage: int | None = None) -> ActivationLedger:
    """The storages autograd keeps for backward on `rank` for one forward of `stage` (default: the
    rank's first stage; without a pipeline the whole step, with one a micro-batch).

    `recompute=None` keeps everything the graph saves; `"attention"` drops what selective
    recomputation of the attention core would recompute (module docstring). `device` names whose
    kernels decide what is saved (default: the traced device; cpu for a model traced on meta)."""
    if recompute not in (None, "attention"):
        raise ValueError(f"recompute={recompute!r}: expected None or 'attention'")
    gm, saved = _saved_storages(plan, rank, kernel_device(plan, device), stage)
    kinds = {name: info.kind for name, info in plan.context.placeholders.items()}
    dropped = attention_core(gm, kinds) if recompute == "attention" else set()
    chosen = plan.stages[stage] if stage is not None else plan.stages_of_rank(rank)[0]
    planned = {node.name: node for node in plan.graph_module.graph.nodes}
    planned.update({node.name: node for node in chosen.graph_module.graph.nodes})
    entries = []
    for item in saved:
        producer = item.producer.node if item.producer is not None else None
        if producer is not None and (_is_state(producer, plan, planned) or producer.name in dropped):
            continue
        entries.append(_entry(plan, item, planned))
    return ActivationLedger(entries=entries, symbol_values=dict(plan.traced.symbol_values or {}), rank=rank,
                            recompute=recompute)


def recomputed_region_bytes(plan: "Plan", *, rank: int = 0, device: "str | torch.device | None" = None,
                            stage: int | None = None, producers: "set[str] | None" = None) -> int:
    """What the largest recomputed region (`autopar/compiler/passes/recompute.py`) saves inside itself when its
    forward runs again in backward, alive until its backward has used it (bytes at the hints; 0
    without recomputation): the rank graph run with the regions inline, its saved storages summed
    per region of the node that produced them. With `producers` (node names): of the largest
    region's bytes, those these nodes produced."""
    if plan.strategy.recompute is None:
        return 0

    _, saved = _saved_storages(plan, rank, kernel_device(plan, device), stage, recompute=False)
    chosen = plan.stages[stage] if stage is not None else plan.stages_of_rank(rank)[0]
    planned = {node.name: node for node in chosen.graph_module.graph.nodes}
    per_region: dict[str, int] = defaultdict(int)
    theirs: dict[str, int] = defaultdict(int)
    for item in saved:
        producer = planned.get(item.producer.node.name) if item.producer is not None else planned.get(item.running.name)
        region = producer.meta.get(RECOMPUTE) if producer is not None else None
        if region is not None:
            per_region[region] += item.nbytes
            theirs[region] += item.nbytes if producers is not None and producer.name in producers else 0
    if not per_region:
        return 0
    largest = max(per_region, key=per_region.__getitem__)
    return per_region[largest] if producers is None else theirs[largest]
