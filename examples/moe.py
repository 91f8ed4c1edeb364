"""A small mixture-of-experts decoder: the example GPT's blocks with a routed experts FFN.

Each block's `moe` routes every token to `top_k` of `n_experts` SwiGLU experts (softmax router
in fp32, top-k probabilities renormalised, as Qwen3-MoE and Mixtral do) and adds two auxiliary
losses to the language-model loss: the Switch load-balancing loss (E · Σ_e f_e · P_e: the
fraction of routed rows each expert gets times its mean router probability) and the router
z-loss (mean squared log-sum-exp of the router logits). Both are means over every token of the
batch: sharded over ranks, they need global statistics, which is what makes them a test.

The experts run as grouped matmuls over rows sorted by expert, the way Hugging Face's default
experts implementation does. `torch._grouped_mm` has no fp32 backward on CPU in PyTorch 2.13
(and fp32 strides it refuses), so `grouped_mm` here is a custom op looping over the experts
(`examples::grouped_mm`), registered with autopar as a grouped matmul
(`autopar.register_grouped_matmul`); on a GPU `torch._grouped_mm` takes its place.
`forward(idx, targets)` returns the scalar loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import register_flop_formula

import autopar
from examples.gpt import Attention, GPTConfig, example_batch


@torch.library.custom_op("examples::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [N, K] sorted by expert, weight [E, K, M], offsets [E] cumulative rows -> [N, M]."""
    out = rows.new_zeros(rows.shape[0], weight.shape[2])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = rows[start:end] @ weight[expert]
        start = end
    return out


@grouped_mm.register_fake
def _(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[2])


@torch.library.custom_op("examples::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(rows: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    """The gradient of each expert's weight: rows of the expert transposed times their output gradients."""
    out = rows.new_zeros(experts, rows.shape[1], grad.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            out[expert] = rows[start:end].t() @ grad[start:end]
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _(rows: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, experts: int) -> torch.Tensor:
    return rows.new_empty(experts, rows.shape[1], grad.shape[1])


def _grouped_mm_backward(ctx, grad: torch.Tensor):
    rows, weight, offsets = ctx.saved_tensors
    grad_rows = grouped_mm(grad, weight.transpose(1, 2).contiguous(), offsets)
    return grad_rows, grouped_mm_weight_grad(rows, grad, offsets, weight.shape[0]), None


def _grouped_mm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)
autopar.register_grouped_matmul(torch.ops.examples.grouped_mm.default)


# FLOPs for PyTorch's counter (torch.utils.flop_counter; autopar's op ledger reads the same
# registry): every routed row meets one expert's [K, M] weight, forward and for both gradients
@register_flop_formula(torch.ops.examples.grouped_mm)
def _grouped_mm_flops(rows_shape, weight_shape, offsets_shape, out_shape=None, **kwargs) -> int:
    return 2 * rows_shape[0] * weight_shape[1] * weight_shape[2]


@register_flop_formula(torch.ops.examples.grouped_mm_weight_grad)
def _grouped_mm_weight_grad_flops(rows_shape, grad_shape, offsets_shape, experts, out_shape=None, **kwargs) -> int:
    return 2 * rows_shape[0] * rows_shape[1] * grad_shape[1]


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    n_experts: int = 4
    top_k: int = 2
    d_expert: int = 32
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001


class Experts(nn.Module):
    """`n_experts` SwiGLU FFNs stacked: gate|up [E, d, 2·d_expert], down [E, d_expert, d]."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_experts = config.n_experts
        self.gate_up = nn.Parameter(torch.randn(config.n_experts, config.d_model, 2 * config.d_expert) * 0.1)
        self.down = nn.Parameter(torch.randn(config.n_experts, config.d_expert, config.d_model) * 0.1)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        rows = x[perm // top_k]
        counts = torch.histc(expert_ids.float(), bins=self.n_experts, min=0, max=self.n_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = grouped_mm(rows, self.gate_up, offsets).chunk(2, dim=-1)
        out = grouped_mm(F.silu(gate) * up, self.down, offsets)
        weighted = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return weighted[inverse].view(tokens, top_k, -1).sum(dim=1)


class MoE(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.n_experts = config.top_k, config.n_experts
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, load-balancing loss, z-loss) of the flattened tokens."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        probs = torch.softmax(logits, dim=-1)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_i, top_p.to(x.dtype))
        routed = F.one_hot(top_i, self.n_experts).to(probs.dtype).sum(dim=1)  # [T, E]: 1 where routed
        balance = self.n_experts * (routed.mean(dim=0) / self.top_k * probs.mean(dim=0)).sum()
        z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return out.view(shape), balance, z_loss


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = Attention(config)
        self.moe_norm = nn.LayerNorm(config.d_model)
        self.moe = MoE(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x))
        out, balance, z_loss = self.moe(self.moe_norm(x))
        return x + out, balance, z_loss


class MoEGPT(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(config.seq_len, config.d_model)
        self.layers = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed_tokens(idx) + self.embed_positions(positions)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, balance, z_loss = layer(x)
            aux = aux + self.config.aux_loss_coef * balance + self.config.z_loss_coef * z_loss
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux


def example(*, batch: int = 8, config: MoEConfig | None = None) -> tuple[MoEGPT, tuple[torch.Tensor, torch.Tensor]]:
    """The CLI's entry point (`autopar plan examples/moe.py:example ...`): a model and a global batch."""
    config = config or MoEConfig()
    torch.manual_seed(0)
    return MoEGPT(config), example_batch(config, batch=batch)
