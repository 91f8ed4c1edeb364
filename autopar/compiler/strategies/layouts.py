"""Which modules of a model play which role in Megatron tensor parallelism.

A `TransformerLayout` lists module-path globs: column-parallel linears (their output features
are split), row-parallel linears (their input features are split), the vocabulary embedding and
LM head, and the attention / MLP blocks whose boundaries carry the f/g conjugate operators.
`weight_in_out` marks Conv1D-style weights stored [in, out] (HF GPT-2); `fused_column` lists
column-parallel linears whose outputs are several blocks (GPT-2's q|k|v `c_attn`), which are
block-sharded (`_StridedShard`) so each rank holds its heads of every block.

`tensor_parallel()` finds the layout in the traced graph (`autopar/compiler/strategies/find_layout.py`); a layout
declared here overrides that: `tensor_parallel(layout=LLAMA)`, or a user's own
`TransformerLayout`. `EXAMPLE_GPT`, `LLAMA` (Llama-family names) and `GPT2` (HF GPT-2) are
ready-made ones.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerLayout:
    name: str
    column: tuple[str, ...]
    row: tuple[str, ...]
    embedding: tuple[str, ...]
    lm_head: tuple[str, ...]
    blocks: tuple[str, ...]
    weight_in_out: bool = False
    fused_column: tuple[tuple[str, int], ...] = ()


LLAMA = TransformerLayout(
    name="llama",
    column=("*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj", "*.mlp.gate_proj", "*.mlp.up_proj"),
    row=("*.self_attn.o_proj", "*.mlp.down_proj"),
    embedding=("*embed_tokens",),
    lm_head=("*lm_head",),
    blocks=("*.self_attn", "*.mlp"),
)

EXAMPLE_GPT = TransformerLayout(
    name="example_gpt",
    column=("*layers.*.attn.q_proj", "*layers.*.attn.k_proj", "*layers.*.attn.v_proj", "*layers.*.mlp.up_proj"),
    row=("*layers.*.attn.o_proj", "*layers.*.mlp.down_proj"),
    embedding=("*embed_tokens",),
    lm_head=("*lm_head",),
    blocks=("*layers.*.attn", "*layers.*.mlp"),
)

GPT2 = TransformerLayout(
    name="hf_gpt2",
    column=("*.mlp.c_fc",),
    row=("*.attn.c_proj", "*.mlp.c_proj"),
    embedding=("*transformer.wte",),
    lm_head=("*lm_head",),
    blocks=("*.attn", "*.mlp"),
    weight_in_out=True,
    fused_column=(("*.attn.c_attn", 3),),
)
