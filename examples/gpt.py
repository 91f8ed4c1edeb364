"""A small GPT-style decoder used by the examples, tests and benchmarks.

Module names follow the Llama convention (`attn.q_proj`, `mlp.up_proj`, ...) so that the
built-in layouts in `autopar.compiler.strategies.layouts` recognise it. `forward(idx, targets)`
returns the mean next-token cross-entropy, the scalar autopar trains on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 16
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 32
    d_ff: int = 128
    causal: bool = True  # False: every position attends to every other (an encoder's attention)
    dropout: float = 0.0  # GPT-2's places: after the embeddings, the attention and the MLP (none at 0)
    explicit_attention: bool = False  # softmax(q·kᵀ/√d)·v written out (as HF's "eager"), not the fused SDPA


def _dropout(config: GPTConfig) -> nn.Module:
    return nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.causal = config.causal
        self.explicit = config.explicit_attention
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.o_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = (batch, seq, -1, self.head_dim)
        q = self.q_proj(x).view(heads).transpose(1, 2)
        k = self.k_proj(x).view(heads).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        if self.explicit:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            if self.causal:
                future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
            y = scores.softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, config.d_ff)
        self.down_proj = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = Attention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.attn_dropout, self.mlp_dropout = _dropout(config), _dropout(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_dropout(self.attn(self.attn_norm(x)))
        return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(config.seq_len, config.d_model)
        self.embed_dropout = _dropout(config)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed_dropout(self.embed_tokens(idx) + self.embed_positions(positions))
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def example_batch(config: GPTConfig, *, batch: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch of token ids and next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def example(*, batch: int = 8, config: GPTConfig | None = None) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """The CLI's entry point (`autopar plan examples/gpt.py:example ...`): a model and a global batch."""
    config = config or GPTConfig()
    torch.manual_seed(0)
    return GPT(config), example_batch(config, batch=batch)
