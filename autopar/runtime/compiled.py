"""`parallelize(compile=...)`: the rank graphs through `torch.compile`.

`compile_options` turns the argument into torch.compile's options (None: eager graphs);
`refuse_uncompilable` refuses, before anything runs, the plans whose compiled graphs would not
run as planned; `compiled` is what a `StageRunner` calls instead of its GraphModule, and
`warn_if_watched` what it checks before each call.

What is captured: dynamo traces a rank graph's generated code. The redistribution steps
(`autopar/core/ops/collectives.py`) are autograd functions that call functional collectives, so they are
traced into the graph, and AOT autograd derives the backward from their conjugates: a dp×tp+SP
rank graph is one compiled graph, collectives included. What keeps run-time state in Python
runs eagerly between compiled pieces: ZeRO's unit calls (`autopar/core/ops/sharded_state.py`), the
re-gathering all-gather of `regather_in_backward` (`collectives._regathering_all_gather`).
Measuring from outside with a dispatch mode (`autopar.measure`) disables compilation (dynamo
runs frames eagerly under a non-infra dispatch mode), so the ledgers are checked on eager runs.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from autopar.core.errors import PlanError
from autopar.core.ir import module_path, source_line
from autopar.core import schedules
from autopar.core.ops import moe


def compile_options(compile: Any, *, dynamic: bool) -> dict | None:
    """torch.compile's options for `parallelize(compile=...)`, None for eager rank graphs. A static
    plan's inputs keep the example's shapes (checked before each run), so its graphs are compiled
    for those shapes; a plan with dynamic_dims lets dynamo mark the sizes that change."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {"backend": "inductor", "dynamic": None if dynamic else False}
    if not isinstance(compile, dict):
        raise PlanError(f"compile={compile!r}: give True (inductor) or a dict of torch.compile options, e.g. "
                        f"compile={{'backend': 'aot_eager'}}")
    return {"dynamic": None if dynamic else False, **compile}


def compiled(graph: torch.fx.GraphModule, options: dict) -> Any:
    """The rank graph through `torch.compile(**options)`. The planned graph is a lazily generated
    GraphModule: its code is generated now, so that dynamo traces the graph's code and not the
    stub that would generate it."""
    graph.real_recompile()
    return torch.compile(graph, **options)


def refuse_uncompilable(plan: Any) -> None:
    """A PlanError for plans whose rank graphs `compiled` cannot run as planned."""
    if plan.pipeline is not None and plan.pipeline.schedule in schedules.SPLIT_BACKWARD:
        name = plan.pipeline.schedule
        raise PlanError(f"compile=True with the {name} pipeline schedule: {name} splits each stage's backward into an "
                        f"input-gradient and a weight-gradient pass through autograd, and a compiled stage's backward "
                        f"is one function (both passes would run all of it)\n  fix: schedule='1f1b' or "
                        f"'interleaved_1f1b' with compile=True, or {name} without compile")
    for stage in plan.stages:
        for node in stage.graph_module.graph.nodes:
            if node.op == "call_function" and node.target is moe.moe_permute:
                raise PlanError(f"compile=True with a mixture-of-experts block: node {node.name} "
                                f"(module {module_path(node) or '?'}, {source_line(node) or 'no source line'}) "
                                f"routes tokens whose count per expert changes every step, and dynamo recompiles "
                                f"its graph for every new count\n  fix: leave compile out for this model")


_warned = False


def warn_if_watched() -> None:
    """Warn once when a compiled rank graph is called under a (non-infra) dispatch mode — a memory
    tracker, a collective counter: dynamo then runs the frame eagerly, and keeps running it eagerly
    afterwards (found in `benchmarks/compare_step_time.py`, whose counted first step left both
    programs uncompiled), so the user trains an eager program without being told."""
    global _warned
    if not _warned and is_in_torch_dispatch_mode(include_infra_modes=False):
        _warned = True
        warnings.warn("parallelize(compile=True): a rank graph is called under a TorchDispatchMode; dynamo runs it "
                      "eagerly now and from then on. Measure with a dispatch mode only after the compiled steps "
                      "you want, or measure without one (torch.profiler)", stacklevel=3)
