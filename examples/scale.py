"""Large model shapes on the meta device, for the planner at scale (no memory, no weights).

Each function returns (model, example_inputs) the way the CLI's TARGET does: the example GPT
(`examples/gpt.py`) or its mixture-of-experts variant (`examples/moe.py`) at a published
model's width, depth, vocabulary, sequence and global batch, built under `torch.device("meta")`.
The example blocks are multi-head attention with a GELU MLP (or SwiGLU experts), not
grouped-query attention with a SwiGLU MLP: the dense MLP width is chosen so that each block has
the published model's parameters (a Llama block of width d, key/value heads g of heads a and
SwiGLU width f holds d²(2 + 2g/a) + 3df parameters; the example block 4d² + 2d·d_ff), so
memory and the gradient traffic match and the FLOPs per token match to a few per cent.

- `llama3_8b`: Llama 3 8B (d 4096, 32 layers, SwiGLU 14336, 8 of 32 key/value heads) at 8K
  tokens, 512 sequences (4M tokens);
- `llama3_70b`: 70B (d 8192, 80 layers, SwiGLU 28672, 8 of 64), 8K, 1024 sequences;
- `llama3_405b`: 405B (d 16384, 126 layers, SwiGLU 53248, 8 of 128), 8K, 2048 sequences (16M
  tokens, the Llama 3 report's batch); `llama3_405b_128k`: the same at 128K tokens, 128 sequences;
- `moe_200b`: a 200B-total / 21B-active MoE (d 6144, 48 layers, 64 experts of 3456, top 4), 8K,
  1024 sequences; `moe_200b_1m`: the same at 1M tokens, 16 sequences;
- `deepseek_v3`: DeepSeek-V3's width and experts (d 7168, 61 layers, 256 experts of 2048,
  top 8, vocabulary 129280; every block MoE, no shared expert, multi-head attention in place
  of MLA: 701B total, 34B active against 671B / 37B), 4K tokens, 15360 sequences;
- `qwen3_30b_a3b`: not a stand-in but the real Hugging Face `Qwen3MoeForCausalLM` (from a
  `Qwen3MoeConfig` written out here, no download) at Qwen3-30B-A3B's shape (d 2048, 48 layers,
  32 query / 4 key-value heads of 128, 128 experts of 768, top 8, vocabulary 151936), wrapped
  in `examples/hf_models.py`'s `CausalLMLoss`, 8K tokens, 1024 sequences; `layers=` and
  `batch=` shrink it (`tests/test_planner_moe.py`: all 48 layers, 128 sequences on `h100x8`).
"""
from __future__ import annotations

import torch

from examples.gpt import GPT, GPTConfig
from examples.moe import MoEConfig, MoEGPT

# parameters, activations, gradients and AdamW's moments in bf16: 8 bytes per parameter (the
# lecture's pure-bf16 recipe, without its Kahan-summation buffers); fp32 master weights would
# be ZeRO's param_dtype, which the search does not vary
DTYPE = torch.bfloat16


def _llama_equivalent_ff(d: int, heads: int, kv_heads: int, swiglu: int) -> int:
    """The example block's d_ff that gives a Llama block's parameters (module docstring)."""
    llama = d * d * (2 + 2 * kv_heads / heads) + 3 * d * swiglu
    return int(round((llama - 4 * d * d) / (2 * d) / 128) * 128)


def _tokens(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return ids, torch.empty(batch, seq, dtype=torch.long, device="meta")


def _dense(*, d: int, layers: int, heads: int, kv_heads: int, swiglu: int, vocab: int, seq: int,
           batch: int) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    config = GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads, d_model=d,
                       d_ff=_llama_equivalent_ff(d, heads, kv_heads, swiglu))
    with torch.device("meta"):
        model = GPT(config).to(DTYPE)
    return model, _tokens(batch, seq, vocab)


def _moe(*, d: int, layers: int, heads: int, experts: int, d_expert: int, top_k: int, vocab: int, seq: int,
         batch: int) -> tuple[MoEGPT, tuple[torch.Tensor, torch.Tensor]]:
    config = MoEConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads, d_model=d, d_ff=4 * d,
                       n_experts=experts, top_k=top_k, d_expert=d_expert)
    with torch.device("meta"):
        model = MoEGPT(config).to(DTYPE)
    return model, _tokens(batch, seq, vocab)


def llama3_8b():
    return _dense(d=4096, layers=32, heads=32, kv_heads=8, swiglu=14336, vocab=128256, seq=8192, batch=512)


def llama3_70b():
    return _dense(d=8192, layers=80, heads=64, kv_heads=8, swiglu=28672, vocab=128256, seq=8192, batch=1024)


def llama3_405b():
    return _dense(d=16384, layers=126, heads=128, kv_heads=8, swiglu=53248, vocab=128256, seq=8192, batch=2048)


def llama3_405b_128k():
    return _dense(d=16384, layers=126, heads=128, kv_heads=8, swiglu=53248, vocab=128256, seq=131072, batch=128)


def moe_200b():
    return _moe(d=6144, layers=48, heads=48, experts=64, d_expert=3456, top_k=4, vocab=128256, seq=8192, batch=1024)


def moe_200b_1m():
    return _moe(d=6144, layers=48, heads=48, experts=64, d_expert=3456, top_k=4, vocab=128256, seq=1048576, batch=16)


def deepseek_v3():
    return _moe(d=7168, layers=61, heads=128, experts=256, d_expert=2048, top_k=8, vocab=129280, seq=4096,
                batch=15360)


def qwen3_30b_a3b(*, layers: int = 48, batch: int = 1024, seq: int = 8192):
    """Qwen3-30B-A3B as Hugging Face builds it, on the meta device in bf16 (module docstring)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # optional dependency: only this shape needs it

    from examples.hf_models import CausalLMLoss

    config = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                            head_dim=128, intermediate_size=6144, num_experts=128, moe_intermediate_size=768,
                            num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, rope_theta=1e6,
                            rms_norm_eps=1e-6, max_position_embeddings=max(seq, 40960),
                            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, use_cache=False,
                            attn_implementation="sdpa")
    with torch.device("meta"):
        model = CausalLMLoss(Qwen3MoeForCausalLM(config)).to(DTYPE)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, torch.empty(batch, seq, dtype=torch.long, device="meta"))
