"""Tiny Hugging Face models built from configs (random weights, no downloads) for tests and examples.

`CausalLMLoss` wraps a `*ForCausalLM` so that forward(input_ids, labels) returns the scalar loss
autopar trains on. `tiny_llama()` and `tiny_gpt2()` build small configs; `example_llama` and
`example_gpt2` are CLI entry points returning (model, example_inputs).
"""
from __future__ import annotations

import torch
from torch import nn


class CausalLMLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def tiny_llama(*, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 4, vocab: int = 128,
               positions: int = 64) -> CausalLMLoss:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=positions, use_cache=False, attn_implementation="sdpa",
                         tie_word_embeddings=False)
    return CausalLMLoss(LlamaForCausalLM(config))


def tiny_gpt2(*, layers: int = 2, hidden: int = 32, heads: int = 4, vocab: int = 128, positions: int = 64,
              tied: bool = False) -> CausalLMLoss:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=vocab, n_positions=positions,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="sdpa",
                        tie_word_embeddings=tied)
    return CausalLMLoss(GPT2LMHeadModel(config))


def token_batch(*, batch: int = 8, seq: int = 16, vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """HF causal LMs shift labels themselves: labels are the input ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return ids, ids.clone()


def example_llama() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return tiny_llama(), token_batch()


def example_gpt2() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return tiny_gpt2(), token_batch()
