"""Tiny Hugging Face models built from configs (random weights, no downloads) for tests and examples.

`CausalLMLoss` wraps a `*ForCausalLM` so that forward(input_ids, labels) returns the scalar loss
autopar trains on. `tiny_llama()` and `tiny_gpt2()` build small configs; `example_llama` and
`example_gpt2` are CLI entry points returning (model, example_inputs).

`tiny_causal_lm(model_type)` builds any architecture of the zoo (`tests/test_zoo.py`) the way a
new user would: the config class with small sizes (`ZOO_SIZES`) and every other default left as
shipped (`use_cache`, tied embeddings, padding index, attention implementation). Sizes the
small config forces are set to fit it (`_fit_sizes`): a head dimension of hidden/heads, key/value
heads (2 where the architecture ships grouped-query attention, else one per query head), a
padding index or rotary width that would lie outside the small vocabulary or head, and each
architecture's own size fields (`_ZOO_EXTRA`), and any size a caller names (`tiny_causal_lm(...,
num_experts=8)`: more or wider experts for a planner to weigh). Dropout is set to 0: random masks
cannot be compared with one device.
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


class PackedCausalLMLoss(nn.Module):
    """A causal LM trained on packed sequences as Hugging Face passes them: several documents
    concatenated in one row, `position_ids` restarting at 0 where each document begins (what
    `DataCollatorWithFlattening` gives); transformers builds the document mask from them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, labels=labels).loss


def packed_llama(**sizes: int) -> PackedCausalLMLoss:
    """`tiny_llama(**sizes)` trained on packed sequences."""
    return PackedCausalLMLoss(tiny_llama(**sizes).model)


def packed_token_batch(*, batch: int = 8, seq: int = 16, vocab: int = 128, documents: int = 3,
                       seed: int = 0, separated: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, position ids, labels): each row `documents` documents of random, uneven lengths
    (at least one token each), positions restarting at each. `separated`: each document's first
    label is -100 (ignored), as `DataCollatorWithFlattening` gives, so no token predicts across a
    document boundary (and the order of a row's documents changes nothing the loss sums)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    positions = torch.empty(batch, seq, dtype=torch.long)
    for row in range(batch):
        cuts = sorted((torch.randperm(seq - 1, generator=generator)[:documents - 1] + 1).tolist())
        edges = [0, *cuts, seq]
        positions[row] = torch.cat([torch.arange(end - start) for start, end in zip(edges, edges[1:])])
    labels = ids.clone()
    if separated:
        labels[positions == 0] = -100
    return ids, positions, labels


def example_llama() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return tiny_llama(), token_batch()


def example_gpt2() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return tiny_gpt2(), token_batch()


ZOO_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=128,
                 max_position_embeddings=64)
_ZOO_EXTRA: dict[str, dict] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
    "deepseek_v3": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                    "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1},
    "minicpm3": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                 "v_head_dim": 16, "head_dim": 8},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}


def _field(config, name: str) -> bool:
    """A settable config field (not a property derived from others, not absent)."""
    return hasattr(config, name) and not isinstance(getattr(type(config), name, None), property)


def _fit_sizes(config, model_type: str, sizes: dict) -> None:
    """Size fields the small config forces (module docstring); nothing else is changed."""
    shipped = type(config)()
    heads = config.num_attention_heads
    if _field(config, "num_key_value_heads"):
        shipped_kv = shipped.num_key_value_heads
        grouped = shipped_kv is not None and shipped_kv < shipped.num_attention_heads
        config.num_key_value_heads = 2 if grouped else heads
    if getattr(config, "head_dim", None) and _field(config, "head_dim"):
        config.head_dim = config.hidden_size // heads
    if (getattr(config, "pad_token_id", None) or 0) >= config.vocab_size:
        config.pad_token_id = config.vocab_size - 1
    if getattr(config, "rotary_dim", None) and config.rotary_dim > config.hidden_size // heads:
        config.rotary_dim = config.hidden_size // heads // 2
    for name, value in {**_ZOO_EXTRA.get(model_type, {}), **sizes}.items():
        setattr(config, name, value)
    for name, value in list(config.to_dict().items()):
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)


def tiny_causal_lm(model_type: str, dtype: torch.dtype = torch.float32, **sizes: int) -> CausalLMLoss:
    """A small `model_type` causal LM (e.g. "gpt2", "qwen3") with the shipped defaults (see above),
    its floating-point parameters and buffers in `dtype`; `sizes`: size fields set over the small
    config's (e.g. `num_experts=8, moe_intermediate_size=64`)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**{**ZOO_SIZES, **_ZOO_EXTRA.get(model_type, {}), **sizes})
    _fit_sizes(config, model_type, sizes)
    return CausalLMLoss(AutoModelForCausalLM.from_config(config)).to(dtype)
