"""Megatron tensor parallelism (and sequence parallelism on top of it) as data.

From the layout found in the traced graph (`FindLayout`, `autopar/compiler/strategies/find_layout.py`: which
projections are columns and rows, which embeddings and heads are vocabulary-parallel, and why) or
from a declared `TransformerLayout` (module-name globs, `autopar/compiler/strategies/layouts.py`) this builds one
`Strategy` on the tensor axis:
- column-parallel linears: weight split on output features (Shard(0) of an [out, in] weight),
  bias split too; row-parallel linears: weight split on input features, bias replicated;
- vocabulary-parallel embedding and LM head (both Shard(0) on the vocabulary); the loss then
  runs on vocabulary shards (`autopar.compiler.rules.op_rules`), never gathering the full logits;
- module layouts: attention / MLP blocks take a replicated input (Megatron's f: identity
  forward, all-reduce backward) and return a replicated output (g: all-reduce forward). With
  `sequence_parallel=True` the block outputs and the embedding output are sharded on their
  tokens instead (the batch or the sequence dimension, whichever needs no layout copies:
  `autopar/compiler/strategies/token_shard.py`), so g becomes a reduce-scatter and f an all-gather (whose
  backward is a reduce-scatter), and LayerNorm/dropout/residuals run on token shards;
- mixture-of-experts blocks (found in the graph only): every expert's FFN split column | row
  (`autopar/compiler/strategies/expert.py`, `expert_tensor_layout`), its tokens entering replicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.compiler.context import PlaceholderInfo
from autopar.compiler.strategies import ModuleLayout, ParamRule, Strategy
from autopar.compiler.strategies.expert import expert_tensor_layout
from autopar.compiler.strategies.find_layout import find_layout
from autopar.compiler.strategies.layouts import TransformerLayout
from autopar.compiler.strategies.token_shard import TokenShard
from autopar.core.mesh import Mesh


@dataclass(frozen=True)
class FindLayout:
    """`tensor_parallel()` without a layout: bound to the layout found in the traced graph
    (`autopar/compiler/strategies/find_layout.py`) once the model is traced."""

    axis: str
    sequence_parallel: bool
    sequence_dim: int | None
    regather_in_backward: bool = False

    @property
    def name(self) -> str:
        return "tensor_parallel+sp" if self.sequence_parallel else "tensor_parallel"

    def bind(self, *, mesh: Mesh, graph_module: torch.fx.GraphModule,
             placeholders: dict[str, PlaceholderInfo]) -> Strategy:
        name = f"{self.name}[graph]"
        if mesh.size(self.axis) == 1:  # nothing to shard: every placement on the axis is Replicate
            return Strategy(name=name, axis=self.axis)
        found = find_layout(graph_module, placeholders, axis=self.axis, size=mesh.size(self.axis))
        block_output = _block_output(self.sequence_parallel, self.sequence_dim)
        params = tuple(ParamRule(choice.fqn, choice.placement, why=choice.why) for choice in found.params)
        inputs = {"block": Replicate(), "head": Replicate(), "embedding": None}
        outputs = {"block": block_output, "embedding": block_output, "head": None}
        modules = tuple(ModuleLayout(module, inputs=inputs[role], outputs=outputs[role]) for module, role in found.modules)
        expert_params, expert_modules, expert_notes = expert_tensor_layout(graph_module, placeholders,
                                                                           mesh.size(self.axis))
        return Strategy(name=name, axis=self.axis, params=params + tuple(expert_params),
                        modules=modules + tuple(ModuleLayout(m, inputs=Replicate()) for m in expert_modules),
                        regather_in_backward=self.regather_in_backward, notes=tuple(found.notes) + tuple(expert_notes))


def _block_output(sequence_parallel: bool, sequence_dim: int | None) -> "Placement | TokenShard":
    if not sequence_parallel:
        return Replicate()
    return TokenShard() if sequence_dim is None else Shard(sequence_dim)


def tensor_parallel(*, layout: TransformerLayout | None = None, axis: str = "tp", sequence_parallel: bool = False,
                    sequence_dim: int | None = None, regather_in_backward: bool = False) -> "Strategy | FindLayout":
    """Megatron TP over `axis`; `layout=None` means: find it in the traced graph at plan time
    (`autopar/compiler/strategies/find_layout.py`); a `TransformerLayout` declares it by module names instead.

    `regather_in_backward` (with sequence parallelism): keep the sequence shard a block's
    all-gather takes in for backward instead of the gathered input of its first linears, and
    all-gather it again in backward, as Megatron does: s·b·h·(1 - 1/t) fewer saved elements per
    such linear, one more all-gather per block input in backward (both in the ledgers).

    `sequence_dim` (with sequence parallelism): None shards each block output's tokens on the
    first dimension that leaves every rank one contiguous piece — the batch when the local batch
    splits over the axis, else the sequence (dim 1) — so the gathers and reduce-scatters copy
    nothing (`autopar/compiler/strategies/token_shard.py`); an int pins that dimension."""
    if layout is None:
        return FindLayout(axis=axis, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                            regather_in_backward=regather_in_backward)
    out_dim, in_dim = (1, 0) if layout.weight_in_out else (0, 1)
    params: list[ParamRule] = []
    for module in layout.column:
        params += [ParamRule(f"{module}.weight", Shard(out_dim)), ParamRule(f"{module}.bias", Shard(0))]
    for module, blocks in layout.fused_column:
        params += [ParamRule(f"{module}.weight", _StridedShard(out_dim, split_factor=blocks)),
                   ParamRule(f"{module}.bias", _StridedShard(0, split_factor=blocks))]
    for module in layout.row:
        params += [ParamRule(f"{module}.weight", Shard(in_dim))]
    for module in layout.embedding + layout.lm_head:
        params += [ParamRule(f"{module}.weight", Shard(0))]
    block_output = _block_output(sequence_parallel, sequence_dim)
    modules = [ModuleLayout(block, inputs=Replicate(), outputs=block_output) for block in layout.blocks]
    modules += [ModuleLayout(module, outputs=block_output) for module in layout.embedding]
    modules += [ModuleLayout(module, inputs=Replicate()) for module in layout.lm_head]
    name = "tensor_parallel+sp" if sequence_parallel else "tensor_parallel"
    return Strategy(name=f"{name}[{layout.name}]", axis=axis, params=tuple(params), modules=tuple(modules),
                    regather_in_backward=regather_in_backward)


def sequence_parallel(*, layout: TransformerLayout | None = None, axis: str = "tp", sequence_dim: int | None = None,
                      regather_in_backward: bool = False) -> "Strategy | FindLayout":
    """Tensor parallelism with Megatron sequence parallelism on the same axis."""
    return tensor_parallel(layout=layout, axis=axis, sequence_parallel=True, sequence_dim=sequence_dim,
                           regather_in_backward=regather_in_backward)
