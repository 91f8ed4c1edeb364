"""Published models as Hugging Face builds them, on the meta device, for the planner at scale.

Each function returns (model, example_inputs) the way the CLI's TARGET does: a transformers
`*ForCausalLM` built from a config written out here (the released model's `config.json` fields
that change the graph or the sizes; no download, no weights), in bf16 under
`torch.device("meta")`, wrapped in `examples/hf_models.py`'s `CausalLMLoss`, with meta token
batches of the published run's sequence length and global batch:

- `llama3_8b`, `llama3_70b`, `llama3_405b` (`LlamaForCausalLM`: grouped-query attention with 8
  key/value heads, SwiGLU, vocabulary 128,256, untied) at 8K tokens and 512, 1,024 and 2,048
  sequences (the Llama 3 report's 16M-token batch for the 405B); `llama3_405b_128k`: the 405B at
  128K tokens, 128 sequences; `llama3(shape, layers=, batch=, seq=)` any of them resized;
- `moe_200b`: the lecture's 200B-total / 21B-active mixture of experts as a `Qwen3MoeForCausalLM`
  (d 6144, 48 layers, 48 query / 8 key-value heads of 128, 64 experts of 3,456, top 5), 8K tokens,
  1,024 sequences; `moe_200b_1m`: the same at 1M tokens, 16 sequences;
- `mixtral_8x22b` (`MixtralForCausalLM`: d 6144, 56 layers, 8 experts of 16,384, top 2), 4K
  tokens, 256 sequences;
- `deepseek_v3` (`DeepseekV3ForCausalLM`: multi-head latent attention, 3 dense blocks then 58
  blocks of 256 routed experts of 2,048, top 8 of 8 groups, and one shared expert; 671B
  parameters), 4K tokens, 15,360 sequences (the report's batch); `dense_blocks=0` for its blocks
  all alike, as the planner at scale needs them;
- `qwen3_30b_a3b` (`Qwen3MoeForCausalLM`, 128 experts of 768, top 8), 8K tokens, 1,024
  sequences; `layers=` and `batch=` shrink it (`tests/test_planner_moe.py`).

Parameters, activations, gradients and AdamW's moments are bf16: 8 bytes per parameter, the
lecture's pure-bf16 recipe (fp32 masters would be ZeRO's `param_dtype`, which the search does
not vary). transformers is imported inside the builders: it is an optional dependency of autopar
and these shapes are the only code here that needs it.
"""
from __future__ import annotations

import torch

DTYPE = torch.bfloat16

# the released configurations (config.json of meta-llama/Meta-Llama-3-8B, -70B, Llama-3.1-405B): the
# fields a LlamaConfig reads; the 405B's rope scaling (llama3, factor 8) is left out: it changes the
# rotary table's values, not the graph
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False,
               mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
               initializer_range=0.02)
LLAMA3 = {
    "8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
    "405b": dict(_LLAMA3, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                 num_attention_heads=128, num_key_value_heads=8),
}


def _on_meta(model_class, config, *, batch: int, seq: int):
    from examples.hf_models import CausalLMLoss

    with torch.device("meta"):
        model = CausalLMLoss(model_class(config)).to(DTYPE)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, torch.empty(batch, seq, dtype=torch.long, device="meta"))


def llama3(shape: str, *, batch: int, seq: int, layers: int | None = None):
    """The released Llama 3 `shape` ("8b", "70b", "405b"), `layers` blocks if given."""
    from transformers import LlamaConfig, LlamaForCausalLM  # optional dependency (module docstring)

    fields = dict(LLAMA3[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = LlamaConfig(**fields, max_position_embeddings=max(seq, 8192), use_cache=False,
                         attn_implementation="sdpa")
    return _on_meta(LlamaForCausalLM, config, batch=batch, seq=seq)


def llama3_8b():
    return llama3("8b", batch=512, seq=8192)


def llama3_70b():
    return llama3("70b", batch=1024, seq=8192)


def llama3_405b():
    return llama3("405b", batch=2048, seq=8192)


def llama3_405b_128k():
    return llama3("405b", batch=128, seq=131072)


def _qwen3_moe(*, d: int, layers: int, heads: int, kv_heads: int, experts: int, d_expert: int, top_k: int,
               d_ff: int, vocab: int, seq: int, batch: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # optional dependency (module docstring)

    config = Qwen3MoeConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, head_dim=128, intermediate_size=d_ff, num_experts=experts,
                            moe_intermediate_size=d_expert, num_experts_per_tok=top_k, norm_topk_prob=True,
                            vocab_size=vocab, rope_theta=1e6, rms_norm_eps=1e-6,
                            max_position_embeddings=max(seq, 40960), decoder_sparse_step=1, mlp_only_layers=[],
                            tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    return _on_meta(Qwen3MoeForCausalLM, config, batch=batch, seq=seq)


def moe_200b():
    return _qwen3_moe(d=6144, layers=48, heads=48, kv_heads=8, experts=64, d_expert=3456, top_k=5, d_ff=4 * 6144,
                      vocab=128256, seq=8192, batch=1024)


def moe_200b_1m():
    return _qwen3_moe(d=6144, layers=48, heads=48, kv_heads=8, experts=64, d_expert=3456, top_k=5, d_ff=4 * 6144,
                      vocab=128256, seq=1048576, batch=16)


def qwen3_30b_a3b(*, layers: int = 48, batch: int = 1024, seq: int = 8192):
    """Qwen3-30B-A3B's released shape (module docstring)."""
    return _qwen3_moe(d=2048, layers=layers, heads=32, kv_heads=4, experts=128, d_expert=768, top_k=8, d_ff=6144,
                      vocab=151936, seq=seq, batch=batch)


def mixtral_8x22b(*, layers: int = 56, batch: int = 256, seq: int = 4096):
    """Mixtral 8x22B's released shape (config.json of mistralai/Mixtral-8x22B-v0.1)."""
    from transformers import MixtralConfig, MixtralForCausalLM  # optional dependency (module docstring)

    config = MixtralConfig(vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=layers,
                           num_attention_heads=48, num_key_value_heads=8, head_dim=128, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=65536, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                           router_jitter_noise=0.0, use_cache=False, attn_implementation="sdpa")
    return _on_meta(MixtralForCausalLM, config, batch=batch, seq=seq)


def deepseek_v3(*, layers: int = 61, batch: int = 15360, seq: int = 4096, dense_blocks: int = 3):
    """DeepSeek-V3's released shape (config.json of deepseek-ai/DeepSeek-V3; the multi-token
    prediction module left out, as transformers leaves it out of training). `dense_blocks=0`
    makes its first three blocks mixture-of-experts blocks like the others (685B): the planner at
    scale prices one kind of block and refuses a model whose blocks differ."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # optional dependency (module docstring)

    config = DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                              num_hidden_layers=layers, num_attention_heads=128, num_key_value_heads=128,
                              n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                              q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                              topk_group=4, num_experts_per_tok=8, first_k_dense_replace=dense_blocks, norm_topk_prob=True,
                              max_position_embeddings=max(seq, 4096), rms_norm_eps=1e-6, tie_word_embeddings=False,
                              use_cache=False, attn_implementation="sdpa")
    return _on_meta(DeepseekV3ForCausalLM, config, batch=batch, seq=seq)
