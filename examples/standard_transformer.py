"""The standard transformer layer of Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", section 4.1), for the activation ledger's formula tests.

Each layer is pre-LayerNorm self-attention with an EXPLICIT attention core (scores = q·kᵀ/√d,
causal mask, softmax, dropout on the probabilities, probabilities·v), an output projection and
dropout on the residual branch, then pre-LayerNorm MLP h → 4h → h with GELU and dropout on the
residual branch. Module names follow `autopar.compiler.strategies.layouts.EXAMPLE_GPT` (`layers.N.attn.q_proj`,
`layers.N.mlp.up_proj`, `embed_tokens`, ...) so `tensor_parallel()` recognises the model. A
token embedding feeds layer 0 and a final LayerNorm reads the last layer's output, so every
layer's output is saved by the next consumer exactly as a middle layer's is; the loss is
`norm(x).float().pow(2).mean()` (no LM head: the formulas are about the layers).
The causal mask is a non-persistent bool buffer (True above the diagonal) sliced to the sequence
length, so what masked_fill saves is a view of state, not an activation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class StandardConfig:
    vocab_size: int = 128
    max_seq_len: int = 64
    n_layer: int = 2
    n_head: int = 8
    d_model: int = 64
    dropout: float = 0.1


class Attention(nn.Module):
    def __init__(self, config: StandardConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.o_proj = nn.Linear(config.d_model, config.d_model)
        self.attn_dropout = nn.Dropout(config.dropout)
        future = torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = (batch, seq, -1, self.head_dim)
        q = self.q_proj(x).view(heads).transpose(1, 2)
        k = self.k_proj(x).view(heads).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(self.future[:seq, :seq], float("-inf"))
        probs = self.attn_dropout(F.softmax(scores, dim=-1))
        y = probs @ v
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: StandardConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, 4 * config.d_model)
        self.down_proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: StandardConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = Attention(config)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.mlp_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the residual-branch dropouts sit outside `attn` / `mlp`: tensor parallelism's block
        # boundary (the g operator) makes the branch replicated (or sequence-sharded) first
        x = x + self.attn_dropout(self.attn(self.attn_norm(x)))
        return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))


class StandardTransformer(nn.Module):
    def __init__(self, config: StandardConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x).float().pow(2).mean()


def example(*, batch: int = 3, seq: int = 16, config: StandardConfig | None = None,
            dtype: torch.dtype = torch.bfloat16) -> tuple[StandardTransformer, tuple[torch.Tensor]]:
    """A model built on the meta device in `dtype` and a batch of token ids (CLI entry point)."""
    config = config or StandardConfig()
    with torch.device("meta"):
        model = StandardTransformer(config).to(dtype)
    return model, (torch.zeros(batch, seq, dtype=torch.long),)
