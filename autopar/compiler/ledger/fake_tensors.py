"""Fake tensors for running a rank graph at plan time: one per placeholder at its local shape
(`fake_inputs`), the device whose kernels decide what is saved (`kernel_device`), the graph's
factory calls moved there and its pipeline sends and receives replaced by planning stand-ins
(`on_device`), and the plan's own fake mode (`traced_mode`). Read by the fake runs of the ledgers
(`ledger/fake_run.py`) and by the plan-time check (`compiler/check_rank_graphs.py`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from autopar.compiler.passes.recompute import is_region_call
from autopar.core.ir import SPEC, hint, local_shape
from autopar.core.ops.float8_matmul import float8_matmul
from autopar.core.ops.p2p import PLANNING_STAND_INS

if TYPE_CHECKING:
    from autopar.compiler.plan import Plan


def fake_inputs(plan: "Plan", graph: torch.fx.Graph, mode: Any, device: torch.device) -> list[torch.Tensor | Any]:
    """One fake tensor per placeholder of a stage graph: local shape at the hints; trainable
    parameters (and a receiving stage's gradient token) require grad."""
    inputs = []
    with mode:
        for node in graph.nodes:
            if node.op != "placeholder":
                continue
            value, info = node.meta.get("val"), plan.context.placeholders[node.name]
            if info.kind == "token":
                inputs.append(torch.zeros((), device=device, requires_grad=True))
                continue
            if not isinstance(value, torch.Tensor):
                inputs.append(hint(value))
                continue
            shape = local_shape(hint(tuple(value.shape)), node.meta[SPEC].placements, plan.mesh.shape)
            tensor = torch.empty(shape, dtype=value.dtype, device=device)
            inputs.append(tensor.requires_grad_(info.kind == "parameter" and info.requires_grad))
    return inputs


def kernel_device(plan: "Plan", device: "str | torch.device | None") -> torch.device:
    """The device whose kernels decide what is saved: given, else the traced one (cpu for meta)."""
    if device is not None:
        return torch.device(device)
    for node in plan.graph_module.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            return torch.device("cpu") if value.device.type == "meta" else value.device
    return torch.device("cpu")


def on_device(gm: torch.fx.GraphModule, device: torch.device, *, accelerator_kernels: bool = False
              ) -> torch.fx.GraphModule:
    """Factory calls (arange, scalar_tensor, ...) of the rank graph moved to `device`; pipeline
    sends and receives replaced by their planning stand-ins (nothing moves); with
    `accelerator_kernels` (`Plan.fused_attention`), the kernels an accelerator runs where the CPU
    runs others: attention whose value heads are narrower than its query heads as
    `padded_attention`, FP8 linear products as `torch._scaled_mm` of 8-bit operands (priced at the
    cluster's FP8 rate, `Cluster.matmul_tflops`) instead of the emulation's fp32 product."""
    for node in gm.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = dict(node.kwargs, device=device)
        if node.op == "call_function" and node.target in PLANNING_STAND_INS:
            node.target = PLANNING_STAND_INS[node.target]
        if accelerator_kernels and node.op == "call_function" and node.target is _SDPA and _narrower_values(node):
            node.target = padded_attention
        if accelerator_kernels and node.op == "call_function" and node.target is float8_matmul:
            node.kwargs = dict(node.kwargs, scaled_kernel=True)
        if is_region_call(node):  # a recomputed region's own graph (autopar/compiler/passes/recompute.py)
            on_device(node.target.__self__.graph_module, device, accelerator_kernels=accelerator_kernels)
    gm.recompile()
    return gm


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _narrower_values(node: torch.fx.Node) -> bool:
    query, _, value = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:3])
    return isinstance(query, torch.Tensor) and isinstance(value, torch.Tensor) and value.shape[-1] < query.shape[-1]


def padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
                     ) -> torch.Tensor:
    """Attention whose value heads are narrower than its query and key heads (multi-head latent
    attention: 192 against 128) as an accelerator runs it, for the ledgers' fake runs only: the
    values zero-padded to the query's head size, so that PyTorch's fused CPU kernel runs it (its
    flash attention needs equal head sizes; otherwise the math path keeps every query-key
    probability for backward, 4.3 GB per DeepSeek-V3 block and 4K-token sequence), and the output
    cut back. What it saves and computes is a fused kernel's, with the padding FlashAttention-2's
    callers add (transformers pads so for it); the memory-efficient kernel would save the
    unpadded values and output."""
    width = value.shape[-1]
    padded = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    return _SDPA(query, key, padded, *args, **kwargs)[..., :width]


def traced_mode(plan: "Plan") -> Any:
    values = [n.meta["val"] for n in plan.graph_module.graph.nodes if n.op == "placeholder"]
    return torch._guards.detect_fake_mode(values) or torch._subclasses.FakeTensorMode()
