"""The machine a plan runs on: nodes, accelerators per node, memory, links and compute.

`Cluster(nodes=64, gpus_per_node=8, memory_gb=80, intra_gbps=..., inter_gbps=..., peak_tflops=...)`
describes it; `Cluster.preset(name)` gives the named ones (`PRESETS`); `autopar.calibrate()`
(`autopar/cost/calibration.py`) measures the machine at hand. Every figure is per accelerator (rank):

- `memory_gb`: its memory, in GB (10^9 bytes);
- `intra_gbps` / `inter_gbps`: the bus bandwidth β of a collective whose group stays inside one
  node / crosses nodes, in GB/s, NCCL's busbw convention — the wire bytes the registry gives
  (`autopar.core.comm_kinds.wire_bytes`: all-reduce 2(n-1)/n S, all-gather (n-1)/n S, ...) divided by
  the time, so one β serves every kind and group size;
- `intra_latency_us` / `inter_latency_us`: α, the time of one step of a ring (a collective of n
  ranks takes `CommKind.latency_steps(n)` of them: all-reduce 2(n-1), all-gather n-1, a send 1);
- `p2p_latency_us`: α of one point-to-point message between two ranks while the node's other
  ranks are not in a collective with them — a pipeline's hand-over between stages, whose
  peers compute or wait (`handover_seconds`). None: the link's α. On CPU ranks sharing cores the
  two differ by much: a collective's every step waits for all of its peers to be scheduled, a
  lone message for one that is waiting for it (`calibrate` measures both; they can differ
  twentyfold);
- `peak_tflops`: dense matrix-product throughput, 10^12 floating-point operations per second —
  the headline figure: 16-bit operands on the GPU presets, fp32 on a calibrated CPU;
- `matmul_tflops`: (dtype name, TFLOP/s) rows for operand dtypes whose products run at another
  rate: on an H100, fp32 (PyTorch's default float32 matmul precision, "highest", multiplies fp32
  15× slower than bf16; a job that allows TF32 gives ("float32", 495)) and fp8 (twice bf16's);
  on a CPU without bf16 matrix units, bf16 (`calibrate` measures it: over a hundred times slower
  than fp32). A call's FLOPs are priced at its operands' dtype's figure (`peak_flops_for`),
  `peak_tflops` where no row names it;
- `memory_gbps`: the accelerator memory's bandwidth, GB/s (what an elementwise op is bound by);
- `memory_curve`: measured (bytes an op touches, GB/s) where the bandwidth depends on the size —
  a CPU's caches serve a call on small tensors several times faster than its memory serves a
  large copy (`calibrate` times copies from 64 KiB to 32 MiB); `bandwidth_for(nbytes)` reads it,
  interpolated in log size; empty (the presets): `memory_gbps` for every size;
- `op_overhead_us`: the fixed cost of one operator call (kernel launch, eager dispatch), µs;
- `overlap`: the share of communication the runtime issues asynchronously (gradient buckets
  during backward, ZeRO-3's prefetched gathers) that actually hides behind compute: 1 where the
  links have their own engines (NCCL on GPUs), less where communication takes the same cores as
  compute (gloo on a CPU; `autopar.calibrate` measures it);
- `processors`: where a node's ranks share fewer processors than there are ranks (CPU ranks of
  one thread on a machine with fewer cores), how many; the compute figures are then per rank
  with every rank busy, and a rank whose peers idle (a pipeline's bubble) runs faster, as
  processor sharing gives it (`schedules.simulate(cores=)`). None: one processor per rank;
- `group_links`: measured (group size, α µs, β GB/s) of collectives inside one node, for
  machines where they depend on the group size (CPU ranks sharing cores wait longer for a peer
  the more of them there are); `calibrate` fills it, and a group of a listed size uses its row;
- `kind_factors`: measured (kind, factor) multiplying the α-β time of a collective kind whose
  implementation is slower than the all-reduce's figures predict (gloo's reduce-scatter and
  all-gather); none on the presets: NCCL's bus bandwidth serves every kind;
- `backend`: the process-group backend the cluster's jobs run on, "nccl" (the presets) or "gloo"
  (`calibrate`): the planner's ZeRO candidates exchange gradients by all-to-all on gloo, in their
  plans and their composed estimates (`comm_kinds.gradient_exchange_kind`).

A collective then takes `latency_steps(n) · α + wire_bytes / β` on its link (`collective_seconds`,
the α-β model of the lecture and of NCCL's tuning model). A description that contradicts itself
is refused (`PlanError`): sizes that are not positive, inter-node links faster or quicker to
answer than intra-node ones, a mesh that does not fill the cluster (`Cluster.mesh`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import sympy
import torch

from autopar.compiler.ledger.op_cost import Peaks, bandwidth_at
from autopar.core.comm_kinds import KINDS, wire_bytes, wire_factor
from autopar.core.errors import PlanError
from autopar.core.mesh import Mesh

GB = 10 ** 9


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    memory_gb: float
    intra_gbps: float
    inter_gbps: float
    peak_tflops: float
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    memory_gbps: float = 2000.0
    op_overhead_us: float = 5.0
    overlap: float = 1.0
    processors: int | None = None
    group_links: tuple[tuple[int, float, float], ...] = ()
    kind_factors: tuple[tuple[str, float], ...] = ()
    name: str = ""
    # the process-group backend its jobs run on ("gloo" for a calibrated CPU machine): it decides
    # how the planner's ZeRO candidates exchange gradients (`comm_kinds.gradient_exchange_kind`)
    backend: str = "nccl"
    p2p_latency_us: float | None = None
    memory_curve: tuple[tuple[int, float], ...] = ()
    matmul_tflops: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"cluster {self.label}: {name}={value!r}; it must be a positive integer")
        for name in ("memory_gb", "intra_gbps", "inter_gbps", "peak_tflops", "memory_gbps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise PlanError(f"cluster {self.label}: {name}={value!r}; it must be a positive number")
        for name in ("intra_latency_us", "inter_latency_us", "op_overhead_us", "p2p_latency_us"):
            value = getattr(self, name)
            if value is None and name == "p2p_latency_us":  # the link's α
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise PlanError(f"cluster {self.label}: {name}={value!r}; a latency is a number >= 0")
        if not isinstance(self.overlap, (int, float)) or not 0 <= self.overlap <= 1:
            raise PlanError(f"cluster {self.label}: overlap={self.overlap!r}; it is the share of asynchronous "
                            f"communication hidden behind compute, between 0 and 1")
        if self.processors is not None and (not isinstance(self.processors, int) or self.processors < 1):
            raise PlanError(f"cluster {self.label}: processors={self.processors!r}; a positive integer or None")
        for row in self.matmul_tflops:
            if (len(row) != 2 or not isinstance(row[0], str) or not isinstance(getattr(torch, row[0], None), torch.dtype)
                    or not isinstance(row[1], (int, float)) or not row[1] > 0):
                raise PlanError(f"cluster {self.label}: matmul_tflops row {row!r}; each is (a torch dtype's name such as "
                                f"'float32' or 'float8_e4m3fn', TFLOP/s > 0)")
        for row in self.memory_curve:
            if len(row) != 2 or row[0] <= 0 or row[1] <= 0:
                raise PlanError(f"cluster {self.label}: memory_curve row {row!r}; each is (bytes > 0, GB/s > 0)")
        for row in self.group_links:
            if len(row) != 3 or row[0] < 2 or row[1] < 0 or row[2] <= 0:
                raise PlanError(f"cluster {self.label}: group_links row {row!r}; each is (group size >= 2, "
                                f"α µs >= 0, β GB/s > 0)")
        if self.inter_gbps > self.intra_gbps:
            raise PlanError(f"cluster {self.label}: inter_gbps={self.inter_gbps} is above intra_gbps="
                            f"{self.intra_gbps}: links between nodes cannot be faster than links inside one "
                            f"(swapped?); with one node give both the node's figure")
        if self.inter_latency_us < self.intra_latency_us:
            raise PlanError(f"cluster {self.label}: inter_latency_us={self.inter_latency_us} is below "
                            f"intra_latency_us={self.intra_latency_us}: a message between nodes cannot arrive "
                            f"sooner than one inside a node (swapped?)")

    @property
    def fuses_attention(self) -> bool:
        """Whether its devices run attention as one fused kernel whatever the head sizes (an
        accelerator's flash or memory-efficient attention; the plans it prices say so,
        `Plan.fused_attention`), or as PyTorch's CPU kernels do (a gloo cluster: unequal query and
        value head sizes on the math path)."""
        return self.backend != "gloo"

    @property
    def label(self) -> str:
        return self.name or f"{self.nodes}x{self.gpus_per_node}"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GB)

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def peak_flops_for(self, dtype: "torch.dtype | str") -> float:
        """Matrix-product FLOP/s of operands of `dtype` (`matmul_tflops`, else `peak_tflops`)."""
        return self.peaks.flops(str(dtype).removeprefix("torch."))

    @cached_property
    def peaks(self) -> Peaks:
        """Every matmul figure in FLOP/s, made once: the op ledger prices each call against it."""
        return Peaks(self.peak_flops, tuple((name, tflops * 1e12) for name, tflops in self.matmul_tflops))

    @property
    def memory_bandwidth(self) -> float:
        """Bytes per second of the accelerator's memory."""
        return self.memory_gbps * GB

    def bandwidth_for(self, nbytes: float) -> float:
        """Bytes per second for an op touching `nbytes` (`memory_curve`, else `memory_bandwidth`)."""
        return bandwidth_at(self.memory_curve, self.memory_bandwidth, nbytes)

    @property
    def op_overhead(self) -> float:
        """Seconds of one operator call's fixed cost."""
        return self.op_overhead_us * 1e-6

    def _group_link(self, link: str, group_size: int | None) -> tuple[float, float] | None:
        if link != "intra" or group_size is None:
            return None
        return next(((alpha, beta) for size, alpha, beta in self.group_links if size == group_size), None)

    def bandwidth(self, link: str, group_size: int | None = None) -> float:
        """β of a link class ('intra' or 'inter'), bytes per second (of that group size where measured)."""
        measured = self._group_link(link, group_size)
        return (measured[1] if measured else _per_link(self.intra_gbps, self.inter_gbps, link)) * GB

    def latency(self, link: str, group_size: int | None = None) -> float:
        """α of a link class, seconds per ring step (of that group size where measured)."""
        measured = self._group_link(link, group_size)
        return (measured[0] if measured else _per_link(self.intra_latency_us, self.inter_latency_us, link)) * 1e-6

    def handover_seconds(self, logical_bytes: int, link: str) -> float:
        """One point-to-point message of a pipeline's hand-over between stages: `p2p_latency_us`
        plus its bytes over the link's β where the cluster states it, a send's α-β time otherwise."""
        if self.p2p_latency_us is None:
            return self.collective_seconds("send", 2, logical_bytes, link)
        return self.p2p_latency_us * 1e-6 + logical_bytes / self.bandwidth(link, 2)

    @property
    def alone_speedup(self) -> float:
        """How much faster a rank computes alone than with all of its node's ranks busy."""
        if self.processors is None or self.processors >= self.gpus_per_node:
            return 1.0
        return self.gpus_per_node / self.processors

    def collective_seconds(self, kind: str, group_size: int, logical_bytes: "int | sympy.Expr", link: str) -> float:
        """One call of a collective (`comm_kinds.KINDS`) of `logical_bytes` over `group_size` ranks."""
        if group_size <= 1 and not KINDS[kind].peer:
            return 0.0
        if isinstance(logical_bytes, int):  # the planner's bytes at the hints: no symbolic form to keep
            wire = wire_factor(kind, group_size) * logical_bytes
        else:
            wire = float(wire_bytes(kind, group_size, sympy.sympify(logical_bytes)))
        size = 2 if KINDS[kind].peer else group_size
        factor = dict(self.kind_factors).get(kind, 1.0)
        return factor * (KINDS[kind].latency_steps(group_size) * self.latency(link, size)
                         + wire / self.bandwidth(link, size))

    def mesh(self, spec: "str | dict[str, int] | Mesh") -> Mesh:
        """The mesh `spec` laid on this cluster: its node size is the cluster's, its world the cluster's."""
        axes = Mesh.parse(spec).axes if not isinstance(spec, Mesh) else spec.axes
        mesh = Mesh(dict(axes), ranks_per_node=self.gpus_per_node if self.world_size > self.gpus_per_node else None)
        if mesh.world_size != self.world_size:
            raise PlanError(f"mesh {mesh} has {mesh.world_size} ranks; cluster {self.label} has "
                            f"{self.nodes} x {self.gpus_per_node} = {self.world_size}")
        return mesh

    @classmethod
    def preset(cls, name: str) -> "Cluster":
        if name not in PRESETS:
            raise PlanError(f"unknown cluster preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return PRESETS[name]


def _per_link(intra: float, inter: float, link: str) -> float:
    if link == "intra":
        return intra
    if link == "inter":
        return inter
    raise PlanError(f"unknown link class {link!r}; a mesh axis is 'intra' or 'inter' node")


def _h100_node(nodes: int) -> Cluster:
    # DGX/HGX H100 SXM: NVLink 4 + NVSwitch, nccl-tests all-reduce busbw ~450 GB/s in a node; one
    # 400 Gb/s InfiniBand NIC per GPU (50 GB/s, busbw ~45 GB/s across nodes); 989 dense BF16 TFLOP/s,
    # 1,979 FP8, 67 FP32 (PyTorch's default float32 matmul precision keeps TF32 off);
    # HBM3 3.35 TB/s; ~4 µs per kernel launch
    return Cluster(nodes=nodes, gpus_per_node=8, memory_gb=80, intra_gbps=450, inter_gbps=45, peak_tflops=989,
                   intra_latency_us=5, inter_latency_us=10, memory_gbps=3350, op_overhead_us=4,
                   matmul_tflops=(("float32", 67), ("float8_e4m3fn", 1979), ("float8_e5m2", 1979)),
                   name=f"h100x{nodes}")


def _a100_node(nodes: int) -> Cluster:
    # DGX A100 80 GB: NVLink 3 busbw ~230 GB/s; one 200 Gb/s HDR NIC per GPU (25 GB/s, busbw ~23);
    # 312 dense BF16 TFLOP/s, 19.5 FP32 (TF32 off, PyTorch's default; no FP8); HBM2e 2.04 TB/s
    return Cluster(nodes=nodes, gpus_per_node=8, memory_gb=80, intra_gbps=230, inter_gbps=23, peak_tflops=312,
                   intra_latency_us=6, inter_latency_us=12, memory_gbps=2039, op_overhead_us=5,
                   matmul_tflops=(("float32", 19.5),), name=f"a100x{nodes}")


# A CPU host whose 4 gloo ranks of one thread each share 2 cores, as `python benchmarks/calibrate.py
# --world 4` measures one (the readings behind these figures: benchmarks/RESULTS.md). α is large
# because each ring step waits for a peer to be scheduled. Its cores have no bf16 matrix units: its
# bf16 row is the fp32 figure over the ratio measured there (benchmarks/RESULTS.md, "Calibration").
CPU2X4 = Cluster(nodes=1, gpus_per_node=4, memory_gb=6.3, intra_gbps=1.4, inter_gbps=1.4, peak_tflops=0.05,
                 intra_latency_us=950, inter_latency_us=950, p2p_latency_us=60, name="cpu2x4",
                 backend="gloo", matmul_tflops=(("bfloat16", 0.05 / 148),))

PRESETS: dict[str, Cluster] = {
    **{f"h100x{n}": _h100_node(n) for n in (1, 8, 64, 1024)},
    **{f"a100x{n}": _a100_node(n) for n in (1, 8, 64)},
    "cpu2x4": CPU2X4,
}
