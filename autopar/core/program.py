"""The program the passes transform: the planned graph and, once split, its stage graphs.

A `Program` holds the whole planned graph (`graph_module`: every tensor's placements, the inserted
collectives; what the placement table and the views show) and its `stages`. Without pipeline
parallelism there is one stage whose graph is the whole graph; `autopar/compiler/passes/split_pipeline.py` cuts it
into `PipelineLayout.stages` stage graphs joined by send/recv steps (`autopar.core.ops.p2p`). A
rank runs the stages `PipelineLayout.stages_of(coordinate)` — one per virtual stage, dealt
round-robin or, under DualPipeV, in a V — each once per micro-batch, in the order its schedule
(`autopar.core.schedules`) gives.

A `Stage` knows what crosses its boundaries (`Boundary`: a value sent from one stage to a later
one, with the spec it travels with and its id, which tags its messages), the ZeRO units of its
parameters (filled by `autopar/compiler/passes/shard_parameters.py`) and its gradient buckets (filled by
`autopar.plan`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx

from autopar.core.schedules import V_SHAPED, stage_coordinate, v_stages

TOKEN = "pipeline_token"  # the placeholder of a receiving stage's gradient token (runtime/p2p.py)


@dataclass(frozen=True)
class PipelineLayout:
    """How the program is cut and scheduled along the pipeline axis (autopar/compiler/strategies/pipeline.py)."""

    axis: str
    degree: int  # p: ranks along the axis
    virtual: int  # v: stages per rank
    microbatches: int  # m
    schedule: str
    batch_dim: int
    starts: tuple[str, ...]  # the block each stage after the first starts with
    balance: str  # how the cut was chosen ("declared", or the cost it balanced)
    overlap: bool = False  # the schedule's paired forwards run beside their backwards (`schedules.overlapped`)

    @property
    def stages(self) -> int:
        return self.degree * self.virtual

    def coordinate(self, stage: int) -> int:
        """The pp coordinate that runs `stage`: stages are dealt round-robin (Megatron's
        interleaving), or in a V under a V-shaped schedule (`schedules.v_stages`: DualPipeV)."""
        return stage_coordinate(self.schedule, self.degree, stage)

    def stages_of(self, coordinate: int) -> list[int]:
        if self.schedule in V_SHAPED:
            return list(v_stages(self.degree, coordinate))
        return [coordinate + chunk * self.degree for chunk in range(self.virtual)]


@dataclass(frozen=True)
class Boundary:
    """A value computed in stage `source` and used in stage `target`: sent once per micro-batch."""

    value: int  # program-wide id: tags its messages
    name: str  # the producing node in the planned graph
    source: int
    target: int
    requires_grad: bool  # its gradient is sent back in backward


@dataclass
class Stage:
    index: int
    graph_module: torch.fx.GraphModule
    sends: list[Boundary] = field(default_factory=list)
    receives: list[Boundary] = field(default_factory=list)
    user_outputs: int = 0  # leading graph outputs that are the model's own (the last stage's loss)
    units: list[Any] = field(default_factory=list)  # ZeRO units (autopar.core.zero_units.ShardUnit)
    buckets: list[Any] = field(default_factory=list)  # gradient buckets (autopar.core.buckets.Bucket)


@dataclass
class Program:
    graph_module: torch.fx.GraphModule
    stages: list[Stage] = field(default_factory=list)
    pipeline: PipelineLayout | None = None
    ties: dict[str, tuple[int, ...]] = field(default_factory=dict)  # parameter -> pp coordinates holding a copy

    def stage_graphs(self) -> list[torch.fx.GraphModule]:
        """The graphs passes transform: the stages once split, else the whole graph."""
        return [stage.graph_module for stage in self.stages] or [self.graph_module]

    def stages_of_rank(self, coordinate: int | None) -> list[Stage]:
        """The stages a rank at this pipeline coordinate runs (all of them without a pipeline)."""
        if self.pipeline is None:
            return list(self.stages)
        return [self.stages[index] for index in self.pipeline.stages_of(coordinate)]

    def node_count(self) -> int:
        return sum(len(graph.graph.nodes) for graph in self.stage_graphs())
