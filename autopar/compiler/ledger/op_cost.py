"""The op ledger: every operator call a rank graph makes in forward and backward, with its FLOPs and bytes.

`rank_ops(plan, rank, stage=)` reads the fake run of the rank's emitted graph of one stage
(`ledger/fake_run.ops_run`: what the runtime runs, recomputed regions included, forward and then
backward, on fake tensors of the rank's local shapes, no hook), in which `_OpRecorder`, a
dispatch mode, records each ATen call: its floating-point operations (PyTorch's own formulas,
`torch.utils.flop_counter.flop_registry`: 2·m·n·k per matrix product, attention's products) and
the bytes it touches (its tensor inputs and outputs). Views move no bytes; collectives are not
compute (the communication ledger has them, exactly); an op that returns no tensor (`prim.device`,
export's dtype checks) is no call at all. Backward is what autograd runs for the
graph's outputs, so a recomputed region's forward appears again in it. The same run follows the
storages backward allocates (`autopar/compiler/ledger/working_memory.py`): `RankOps.working`, the memory peak's
backward working memory. Parameter gradients are taken as soon as they are accumulated (as the
runtime takes them); ZeRO-3's gathered parameters are not followed. Backward's calls made inside
a weight-gradient tap (`autopar/core/ops/weight_gradients.py`, told by the autograd node running) are also
totalled apart (`RankOps.taps`): the compute a tensor-parallel input gradient's reduction is in
flight behind, which the cost model hides it behind (`autopar/cost/step_cost.py`).

`OpTotals.seconds(cluster)` prices the calls with a roofline per call — the larger of FLOPs /
peak and bytes / memory bandwidth (at the call's own size where the cluster measured a
`memory_curve`: a CPU's caches) — plus the cluster's fixed cost per call; that is the compute
part of the cost model (`autopar/cost/comm_cost.py`). The peak is the cluster's for the dtype the
call computes in (`Cluster.peak_flops_for`: its first tensor operand's; an H100 multiplies bf16 15×
faster than fp32 at PyTorch's default precision, fp8 twice as fast as bf16), so a mixed-precision
plan is priced at the 16-bit figure and an fp32 one at the fp32 figure. One micro-batch under a pipeline: the stage graph is
a micro-batch's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from autopar.compiler.ledger.working_memory import Working, tensors_in
from autopar.core.ops.weight_gradients import TAP_BACKWARD

if TYPE_CHECKING:
    from autopar.cost.cluster import Cluster

_NOT_COMPUTE = ("_c10d_functional", "c10d", "_dtensor")


@dataclass
class OpTotals:
    calls: int = 0
    flops: int = 0
    bytes: int = 0
    # per call: (flops, bytes, the dtype its FLOPs are computed in — "" where it has none), to
    # price each call on its own roofline
    per_call: list[tuple[int, int, str]] = field(default_factory=list, repr=False)
    _rooflines: dict = field(default_factory=dict, repr=False, compare=False)  # see `roofline`

    def add(self, flops: int, nbytes: int, dtype: str = "") -> None:
        self.calls += 1
        self.flops += flops
        self.bytes += nbytes
        self.per_call.append((flops, nbytes, dtype if flops else ""))

    def roofline(self, peaks: "Peaks", bandwidth: float, curve: tuple = (), scale: float = 1.0) -> float:
        """Seconds of the calls' own rooflines, without their fixed cost, each call's FLOPs (at
        `peaks`' figure for its dtype) and bytes times `scale` (the composed model's batch) and its
        bytes at the bandwidth of its own size where the cluster has a `memory_curve`
        (`bandwidth_at`): remembered per (peaks, bandwidth, calls), and per curve and scale where
        there is a curve — the planner prices every candidate of a layout on the same totals."""
        if not curve:  # one bandwidth: the sum scales with the batch as a whole
            key: tuple = (peaks, bandwidth, len(self.per_call))
            if key not in self._rooflines:
                self._rooflines[key] = sum(max(f / peaks.flops(d), b / bandwidth) for f, b, d in self.per_call)
            return scale * self._rooflines[key]
        key = (peaks, bandwidth, curve, scale, len(self.per_call))
        if key not in self._rooflines:
            self._rooflines[key] = scale * sum(max(f / peaks.flops(d), b / bandwidth_at(curve, bandwidth, scale * b))
                                               for f, b, d in self.per_call)
        return self._rooflines[key]

    def seconds(self, cluster: "Cluster", scale: float = 1.0) -> float:
        return (self.roofline(cluster.peaks, cluster.memory_bandwidth, cluster.memory_curve, scale)
                + len(self.per_call) * cluster.op_overhead)


@dataclass(frozen=True)
class Peaks:
    """Matrix-product FLOPs per second by the dtype a call computes in: `by_dtype` rows (dtype
    name, FLOP/s) where a dtype's differs from `default` (`Cluster.matmul_tflops`)."""

    default: float
    by_dtype: tuple[tuple[str, float], ...] = ()

    def flops(self, dtype: str) -> float:
        for name, value in self.by_dtype:
            if name == dtype:
                return value
        return self.default


@dataclass(frozen=True)
class RankOps:
    rank: int
    stage: int
    forward: OpTotals
    backward: OpTotals
    working: "Working | None" = None  # what backward allocates beyond what was alive when it started
    # of which one block's calls (`fake_run.ops_run(..., block=)`): forward, backward
    block: "tuple[OpTotals, OpTotals] | None" = None
    # of backward's calls, those of the weight-gradient taps (`autopar/core/ops/weight_gradients.py`): what
    # runs while a tensor-parallel input gradient's reduction is in flight; the block's share of them
    taps: OpTotals = field(default_factory=OpTotals)
    block_taps: "OpTotals | None" = None
    # with a block and without recomputed regions: bytes autograd saved for backward (the rank's,
    # the block's, the attention cores', the block's attention cores', the block's made from the
    # expert rows the rank received), read off the autograd graph the forward left
    # (`fake_run._autograd_saved`)
    saved: "tuple[int, int, int, int, int] | None" = None


def _nbytes(values: Any) -> int:
    seen, total = set(), 0
    for value in tensors_in(values):
        if id(value) not in seen:
            seen.add(id(value))
            total += value.numel() * value.element_size()
    return total


def _kind(func: Any) -> "tuple[bool, bool, Any]":
    """(counted: a computation, not a collective; a view, which moves no bytes; its FLOP formula or
    None), once per op: the recorder asks for every call."""
    if func not in _KINDS:
        returns = func._schema.returns
        # an op that returns no tensor runs no kernel: a metadata query (`prim.device`, asked of
        # every tensor a collective's wrapper or DTensor looks at) or export's dtype check
        kernel = any("Tensor" in str(r.type) for r in returns)
        _KINDS[func] = (func.namespace not in _NOT_COMPUTE and kernel,
                        any(r.alias_info is not None and not r.alias_info.is_write for r in returns),
                        flop_registry.get(func.overloadpacket))
    return _KINDS[func]


_KINDS: dict = {}


def _operand_dtype(args: tuple) -> str:
    """The dtype a FLOP-counted call computes in: its first tensor operand's ("float32", "bfloat16",
    "float8_e4m3fn" for a scaled fp8 product)."""
    for value in tensors_in(args):
        return str(value.dtype).removeprefix("torch.")
    return ""


def _in_tap() -> bool:
    """Is autograd running a weight-gradient tap's backward (`weight_gradients._Tap`)?"""
    node = torch._C._current_autograd_node()
    return node is not None and node.name() == TAP_BACKWARD


class _OpRecorder(TorchDispatchMode):
    """Records every call; with `in_block` (a callable: is this call one block's?) also that
    block's calls apart (`block_totals`); backward's calls inside a weight-gradient tap also
    under "taps"."""

    def __init__(self, in_block: "Any | None" = None) -> None:
        super().__init__()
        self.totals = {"forward": OpTotals(), "backward": OpTotals(), "taps": OpTotals()}
        self.block_totals = {"forward": OpTotals(), "backward": OpTotals(), "taps": OpTotals()}
        self.phase = "forward"
        self.in_block = in_block

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counted, is_view, formula = _kind(func)
        if not counted:
            return out
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        nbytes = 0 if is_view else _nbytes((args, kwargs, out))
        dtype = _operand_dtype(args) if flops else ""
        tap = self.phase == "backward" and _in_tap()
        in_block = self.in_block is not None and self.in_block()
        for totals, counted in ((self.totals, True), (self.block_totals, in_block)):
            if counted:
                totals[self.phase].add(flops, nbytes, dtype)
                if tap:
                    totals["taps"].add(flops, nbytes, dtype)
        return out


GB = 10 ** 9  # a cluster's curves are in GB/s


def bandwidth_at(curve: tuple[tuple[int, float], ...], flat: float, nbytes: float) -> float:
    """Bytes per second of `curve` ((bytes, GB/s) rows, ascending sizes) at `nbytes`: linear in
    log size between two rows, the first row's below it, the last row's above; `flat` (bytes per
    second) where there is no curve."""
    if not curve:
        return flat
    if nbytes <= curve[0][0]:
        return curve[0][1] * GB
    for (low, low_gbps), (high, high_gbps) in zip(curve, curve[1:]):
        if nbytes <= high:
            share = math.log(nbytes / low) / math.log(high / low)
            return (low_gbps + share * (high_gbps - low_gbps)) * GB
    return curve[-1][1] * GB
