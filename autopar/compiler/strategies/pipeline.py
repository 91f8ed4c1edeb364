"""Pipeline parallelism as data: stages along a mesh axis, a schedule and a micro-batch count.

`pipeline_parallel(axis="pp", schedule="1f1b", microbatches=m, stages=None, layout=None, virtual_stages=1)`
declares that the model is cut by depth into `p * virtual_stages` stages (p = the axis size),
dealt round-robin to the ranks of the axis, and that every global batch is split into `m`
micro-batches along `batch_dim`. `stages` lists the blocks where each stage after the first
starts (module paths of repeated blocks, e.g. `["layers.4", "layers.8"]`, matched as path
suffixes); `layout` says the same as a string of blocks per stage, Megatron-Core's way
(`"Et|(tt|)*3t|tL"`: `pipeline_layout.py`), its block count checked against the model's; `None`
for both lets `autopar/compiler/passes/split_pipeline.py` balance the stages by the compute each
block costs, with the first stage carrying the embedding and the last the head and loss.

Schedules (`autopar.core.schedules`): `gpipe` (all forwards, then all backwards; with virtual stages,
breadth-first), `1f1b`, `interleaved_1f1b` (Megatron's, virtual_stages >= 2, m a multiple of p)
`zb_h1` (zero bubble: backward split into input-gradient B and weight-gradient W, the Ws
filling the bubbles at 1F1B's activation memory) and `dualpipev` (DeepSeek-V3's DualPipe folded
into a V: two stages per rank, rank c holding stages c and 2p-1-c, so the first rank holds the
embedding's stage and the loss's; a forward beside another micro-batch's backward in the steady
state; at least 2p micro-batches; `virtual_stages` 1 or 2 both mean its two).

`overlap` (DualPipeV only; default on): the forward and the backward the schedule pairs run side by
side, one's collectives waiting while the other computes (`autopar/runtime/overlap.py`);
`overlap=False` runs them one after the other.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.compiler.strategies import Strategy
from autopar.compiler.strategies.pipeline_layout import cut_points, parse_layout
from autopar.core.errors import PlanError
from autopar.core.schedules import OVERLAPPING

SCHEDULES = {
    "gpipe": "all forwards, then all backwards (GPipe; breadth-first over virtual stages)",
    "1f1b": "one forward, one backward (PipeDream-flush / Megatron 1F1B)",
    "interleaved_1f1b": "1F1B over virtual stages dealt round-robin (Megatron interleaved)",
    "zb_h1": "zero bubble H1: input- and weight-gradient backwards split, Ws fill the bubbles",
    "dualpipev": "DualPipeV: two stages per rank in a V, forwards beside other micro-batches' backwards",
}


@dataclass(frozen=True)
class PipelineDeclaration:
    """What `pipeline_parallel()` declares; read by autopar/compiler/passes/split_pipeline.py and the runtime."""

    schedule: str
    microbatches: int
    stages: tuple[str, ...] | None
    virtual_stages: int
    batch_dim: int
    layout: str | None = None  # the layout string `stages` came from
    layout_blocks: int | None = None  # the blocks it lists: the model must have as many
    overlap: bool = False  # paired forwards and backwards run side by side (DualPipeV)


def pipeline_parallel(*, axis: str = "pp", schedule: str = "1f1b", microbatches: int = 4,
                      stages: "list[str] | tuple[str, ...] | None" = None, layout: str | None = None,
                      virtual_stages: int = 1, batch_dim: int = 0, overlap: bool | None = None) -> Strategy:
    """Pipeline parallelism over `axis` (see the module docstring)."""
    if overlap and schedule not in OVERLAPPING:
        raise PlanError(f"overlap=True: schedule {schedule!r} runs one action at a time; only "
                        f"{', '.join(sorted(OVERLAPPING))} pairs a forward with another micro-batch's backward")
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {schedule!r}; choose one of: "
                        + "; ".join(f"{name} ({what})" for name, what in SCHEDULES.items()))
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches={microbatches!r}: a pipeline needs a positive number of micro-batches")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise PlanError(f"virtual_stages={virtual_stages!r}: each rank runs at least one stage")
    if schedule == "interleaved_1f1b" and virtual_stages < 2:
        raise PlanError("schedule 'interleaved_1f1b' interleaves virtual stages: set virtual_stages >= 2 "
                        "(or use schedule='1f1b' for one stage per rank)")
    if schedule == "dualpipev":
        if virtual_stages not in (1, 2):
            raise PlanError(f"schedule 'dualpipev' runs two stages per rank in a V; virtual_stages={virtual_stages} "
                            f"cannot be (leave it out)")
        virtual_stages = 2
    if schedule in ("1f1b", "zb_h1") and virtual_stages != 1:
        raise PlanError(f"schedule {schedule!r} runs one stage per rank; with virtual_stages={virtual_stages} use "
                        f"schedule='interleaved_1f1b' (or 'gpipe', breadth-first)")
    if stages is not None and (isinstance(stages, str) or not all(isinstance(s, str) for s in stages)):
        raise PlanError(f"stages={stages!r}: give a list of module paths where stages start, e.g. ['layers.4']")
    layout_blocks = None
    if layout is not None:
        if stages is not None:
            raise PlanError(f"pipeline_parallel: give stages= or layout=, not both (layout={layout!r} already "
                            f"says where stages start)")
        counts = parse_layout(layout)
        stages, layout_blocks = cut_points(counts), sum(counts)
    declaration = PipelineDeclaration(schedule=schedule, microbatches=microbatches,
                                      stages=tuple(stages) if stages is not None else None,
                                      virtual_stages=virtual_stages, batch_dim=batch_dim, layout=layout,
                                      layout_blocks=layout_blocks,
                                      overlap=schedule in OVERLAPPING if overlap is None else overlap)
    return Strategy(name=f"pipeline[{schedule}, m={microbatches}" + (f", v={virtual_stages}]" if virtual_stages > 1
                                                                     else "]"),
                    axis=axis, pipeline=declaration)
