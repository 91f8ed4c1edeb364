"""Plan-time check that an accepted plan runs: each rank graph, forward and backward, on fake tensors.

A plan can be accepted by every rule and still hold a rank graph that fails when it runs (a
slice along a dimension a tensor does not have, a kernel given an argument it does not take).
`check_rank_graphs(plan)` finds that before any process group exists: it emits, for every
pipeline stage (the whole graph without a pipeline), the rank graphs (`Plan.rank_graph`) of the
first and the last rank holding it — ranks differ only in their coordinates (shard indices,
group names, peers), which change no shape, and the two ends hold the extreme indices —
and runs each on fake tensors of the rank's local shapes, built as the activation ledger builds
them (`autopar.ledger.activations`: same inputs, factory calls moved to the kernels' device,
the traced program's fake mode; a caller's own FakeTensorMode is set aside meanwhile). The collectives in a rank
graph are PyTorch's functional collectives, whose fake kernels only compute shapes: the group
names need not exist. Forward runs node by node (`_CheckedRun`); a node that raises becomes a
`PlanError` naming it, its op, module and source line. Backward then runs from the outputs
(`_check_backward`); each node's output gradient registers a hook, so an error in backward names
the node whose gradient was being computed last. Plans with symbolic sizes (`dynamic_dims`) run
too, at the example's sizes: their rank graphs compute every size from the local inputs
(`passes/emit_rank_graph.py`), so the fake inputs of the example's local shapes exercise the same
code the run does at other sizes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils import _pytree as pytree

from autopar.errors import PlanError
from autopar.ledger.activations import fake_inputs, kernel_device, on_device

if TYPE_CHECKING:
    from autopar.plan import Plan

_FIX = ("this is a bug in the rule or lowering that placed the node (autopar.op_rules / autopar.runtime.local_ops); "
        "keep the tensors it touches replicated (declare a layout without them) until it is fixed")


class _CheckedRun(torch.fx.Interpreter):
    """Runs a rank graph node by node; a failing node is a PlanError; output gradients are watched."""

    def __init__(self, gm: torch.fx.GraphModule, rank: int) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # the PlanError names the node already
        self.rank = rank
        self.last_backward: torch.fx.Node | None = None

    def run_node(self, node: torch.fx.Node) -> Any:
        try:
            result = super().run_node(node)
        except PlanError:
            raise
        except Exception as error:
            raise PlanError.at(node, f"rank {self.rank}'s graph fails on fake tensors of its local shapes (forward): "
                                     f"{type(error).__name__}: {_first_line(error)}", fix=_FIX) from error
        for value in pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(lambda grad, node=node: self._arrived(node))
        return result

    def _arrived(self, node: torch.fx.Node) -> None:
        self.last_backward = node


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _check_backward(run: _CheckedRun, outputs: Any) -> None:
    roots = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not roots:
        return
    try:
        torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
    except Exception as error:
        node = run.last_backward
        message = (f"rank {run.rank}'s graph fails on fake tensors of its local shapes (backward): "
                   f"{type(error).__name__}: {_first_line(error)}")
        if node is None:
            raise PlanError(f"{message}\n  fix: {_FIX}") from error
        raise PlanError.at(node, message + " (in the backward of this node or the next one back)", fix=_FIX) from error


def check_rank_graph(plan: "Plan", rank: int, *, stage: int | None = None) -> None:
    """Run `rank`'s graph of `stage` (default: its first) forward and backward on fake tensors;
    PlanError naming the failing node."""
    chosen = plan.stages[stage] if stage is not None else plan.stages_of_rank(rank)[0]
    device = kernel_device(plan, None)
    gm = on_device(plan.rank_graph(rank, stage=chosen.index), device)
    mode = _traced_mode(plan)
    inputs = fake_inputs(plan, chosen.graph_module.graph, mode, device)
    run = _CheckedRun(gm, rank)
    with mode, torch.enable_grad():
        outputs = run.run(*inputs)
        _check_backward(run, outputs)


def _traced_mode(plan: "Plan") -> Any:
    values = [n.meta["val"] for n in plan.graph_module.graph.nodes if n.op == "placeholder"]
    return torch._guards.detect_fake_mode(values) or torch._subclasses.FakeTensorMode()


def check_rank_graphs(plan: "Plan") -> None:
    """`check_rank_graph` on the first and the last rank (module docstring)."""
    with unset_fake_temporarily():  # planning may run under the caller's FakeTensorMode
        for stage in plan.stages:
            holders = [r for r in range(plan.mesh.world_size) if stage in plan.stages_of_rank(r)]
            for rank in sorted({holders[0], holders[-1]}):
                check_rank_graph(plan, rank, stage=stage.index)
