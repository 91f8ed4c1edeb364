"""A forward beside another micro-batch's backward on one pipeline rank: DualPipeV's overlapped
pairs (`autopar.core.schedules.overlapped`), run by `runtime/pipeline.py` on CPU ranks
(`schedules.SIDE_BY_SIDE_DEVICES`: on an accelerator each half would need a stream of its own).

Why a thread: an autograd backward cannot be paused at its all-to-all to run another micro-batch's
forward up to its own (DualPipe interleaves hand-cut chunks of both; autopar's stages are whole
graphs), so the pair runs on two threads of the rank: the backward on the caller's thread, the
forward on a side thread (`SideThread`). Each blocks in its own collectives while the other
computes; gloo's and NCCL's collectives progress on their own threads and streams.

What the side thread needs to be the caller's twin:
- its collectives on copies of the groups (`Lanes`): two threads issue collectives in no fixed
  order, and a group must receive them in the same order on all its ranks
  (`autopar.core.ops.collective_calls`: lanes);
- the point-to-point messages of forwards and of backwards on two copies of the pipeline axis's
  group (`Lanes.gradients`): a pair's forward only sends and receives activations, its backward
  only gradients, so each copy is driven by one thread at a time;
- what torch keeps per thread and a forward reads: the caller's dispatch modes (a communication
  counter, a memory tracker), grad mode, CPU autocast, and the innermost saved-tensor hooks (a
  caller's `save_on_cpu`, say; the stage installs its own inside).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from autopar.core.mesh import JOIN
from autopar.core.ops.collective_calls import lane


class Lanes:
    """The side thread's copies of a rank's process groups, and the pipeline axis's copy for gradients."""

    def __init__(self, plan: Any, groups: dict[str, str], axis: str) -> None:
        """Collective: every rank creates the same groups in the same order (`new_group`)."""
        self.names: dict[str, str] = {}  # group name -> the side thread's copy
        self.gradients: dict[str, str] = {}  # the pipeline axis's group -> its copy for gradient messages
        rank = dist.get_rank()
        for key in sorted(groups):
            axis_part, _ = plan.mesh.split_group(key)
            on_pipeline = axis in axis_part.split(JOIN)
            if on_pipeline and key != axis:  # a tied parameter's sum over stages: never beside another
                continue
            for ranks in plan.mesh.group_slices(key):
                copy = dist.new_group(list(ranks))
                if rank in ranks:
                    (self.gradients if on_pipeline else self.names)[groups[key]] = copy.group_name

    def axes(self, groups: dict[str, str]) -> dict[str, str]:
        """copy's name -> the key of the group it copies (for a counter that names groups by axis)."""
        key_of = {name: key for key, name in groups.items()}
        return {copy: key_of[name] for name, copy in {**self.names, **self.gradients}.items()}


class SideThread:
    """Runs one function at a time on a side thread as the caller's twin (module docstring)."""

    def __init__(self, lanes: Lanes) -> None:
        self.lanes = lanes

    def start(self, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """Start `fn(*args)` on the side thread; the returned `join()` waits for it and gives its
        result (or raises what it raised); `join(timeout, raise_error=False)` waits at most that
        long and raises nothing (the thread is a daemon: a process can end while it waits)."""
        modes = [m for m in _get_current_dispatch_mode_stack() if getattr(m, "_dispatch_key", None) is None]
        grad = torch.is_grad_enabled()
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)  # noqa: SLF001 (no public reader)
        outcome: dict[str, Any] = {}

        def body() -> None:
            for mode in modes:
                _push_mode(mode)
            try:
                with contextlib.ExitStack() as inherited:
                    inherited.enter_context(torch.set_grad_enabled(grad))
                    if autocast is not None:
                        inherited.enter_context(torch.autocast("cpu", dtype=autocast))
                    if hooks is not None:
                        inherited.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
                    inherited.enter_context(lane(self.lanes.names))
                    outcome["value"] = fn(*args)
            except BaseException as error:  # handed to the caller's join
                outcome["error"] = error
            finally:
                for _ in modes:
                    _pop_mode()

        thread = threading.Thread(target=body, name="autopar-pipeline-side", daemon=True)
        thread.start()

        def join(timeout: float | None = None, raise_error: bool = True) -> Any:
            thread.join(timeout)
            if "error" in outcome and raise_error:
                raise outcome["error"]
            return outcome.get("value")
        return join
