"""The machine a plan runs on: nodes, accelerators per node, memory, links and compute.

`Cluster(nodes=64, gpus_per_node=8, memory_gb=80, intra_gbps=..., inter_gbps=..., peak_tflops=...)`
describes it; `Cluster.preset(name)` gives the named ones (`PRESETS`); `autopar.calibrate()`
(`autopar/calibration.py`) measures the machine at hand. Every figure is per accelerator (rank):

- `memory_gb`: its memory, in GB (10^9 bytes);
- `intra_gbps` / `inter_gbps`: the bus bandwidth β of a collective whose group stays inside one
  node / crosses nodes, in GB/s, NCCL's busbw convention — the wire bytes the registry gives
  (`autopar.comm_kinds.wire_bytes`: all-reduce 2(n-1)/n S, all-gather (n-1)/n S, ...) divided by
  the time, so one β serves every kind and group size;
- `intra_latency_us` / `inter_latency_us`: α, the time of one step of a ring (a collective of n
  ranks takes `CommKind.latency_steps(n)` of them: all-reduce 2(n-1), all-gather n-1, a send 1);
- `peak_tflops`: dense matrix-product throughput, 10^12 floating-point operations per second.

A collective then takes `latency_steps(n) · α + wire_bytes / β` on its link (`collective_seconds`,
the α-β model of the lecture and of NCCL's tuning model). A description that contradicts itself
is refused (`PlanError`): sizes that are not positive, inter-node links faster or quicker to
answer than intra-node ones, a mesh that does not fill the cluster (`Cluster.mesh`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from autopar.comm_kinds import KINDS, wire_bytes
from autopar.errors import PlanError
from autopar.mesh import Mesh

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
    name: str = ""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"cluster {self.label}: {name}={value!r}; it must be a positive integer")
        for name in ("memory_gb", "intra_gbps", "inter_gbps", "peak_tflops"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise PlanError(f"cluster {self.label}: {name}={value!r}; it must be a positive number")
        for name in ("intra_latency_us", "inter_latency_us"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise PlanError(f"cluster {self.label}: {name}={value!r}; a latency is a number >= 0")
        if self.inter_gbps > self.intra_gbps:
            raise PlanError(f"cluster {self.label}: inter_gbps={self.inter_gbps} is above intra_gbps="
                            f"{self.intra_gbps}: links between nodes cannot be faster than links inside one "
                            f"(swapped?); with one node give both the node's figure")
        if self.inter_latency_us < self.intra_latency_us:
            raise PlanError(f"cluster {self.label}: inter_latency_us={self.inter_latency_us} is below "
                            f"intra_latency_us={self.intra_latency_us}: a message between nodes cannot arrive "
                            f"sooner than one inside a node (swapped?)")

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

    def bandwidth(self, link: str) -> float:
        """β of a link class ('intra' or 'inter'), bytes per second."""
        return _per_link(self.intra_gbps, self.inter_gbps, link) * GB

    def latency(self, link: str) -> float:
        """α of a link class, seconds per ring step."""
        return _per_link(self.intra_latency_us, self.inter_latency_us, link) * 1e-6

    def collective_seconds(self, kind: str, group_size: int, logical_bytes: "int | sympy.Expr", link: str) -> float:
        """One call of a collective (`comm_kinds.KINDS`) of `logical_bytes` over `group_size` ranks."""
        if group_size <= 1 and not KINDS[kind].peer:
            return 0.0
        wire = float(wire_bytes(kind, group_size, sympy.sympify(logical_bytes)))
        return KINDS[kind].latency_steps(group_size) * self.latency(link) + wire / self.bandwidth(link)

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
    # 400 Gb/s InfiniBand NIC per GPU (50 GB/s, busbw ~45 GB/s across nodes); 989 dense BF16 TFLOP/s
    return Cluster(nodes=nodes, gpus_per_node=8, memory_gb=80, intra_gbps=450, inter_gbps=45, peak_tflops=989,
                   intra_latency_us=5, inter_latency_us=10, name=f"h100x{nodes}")


def _a100_node(nodes: int) -> Cluster:
    # DGX A100 80 GB: NVLink 3 busbw ~230 GB/s; one 200 Gb/s HDR NIC per GPU (25 GB/s, busbw ~23);
    # 312 dense BF16 TFLOP/s
    return Cluster(nodes=nodes, gpus_per_node=8, memory_gb=80, intra_gbps=230, inter_gbps=23, peak_tflops=312,
                   intra_latency_us=6, inter_latency_us=12, name=f"a100x{nodes}")


# This 2-core CPU machine with 4 gloo ranks of one thread each, as `python benchmarks/calibrate.py
# --world 4` measured it (2026-12-02, two runs: α 0.86-1.05 ms per ring step — four ranks share two
# cores, so each step waits for a peer to be scheduled —, β 1.1-1.8 GB/s, 25-82 GFLOP/s per rank)
CPU2X4 = Cluster(nodes=1, gpus_per_node=4, memory_gb=6.3, intra_gbps=1.4, inter_gbps=1.4, peak_tflops=0.05,
                 intra_latency_us=950, inter_latency_us=950, name="cpu2x4")

PRESETS: dict[str, Cluster] = {
    **{f"h100x{n}": _h100_node(n) for n in (1, 8, 64, 1024)},
    **{f"a100x{n}": _a100_node(n) for n in (1, 8, 64)},
    "cpu2x4": CPU2X4,
}
