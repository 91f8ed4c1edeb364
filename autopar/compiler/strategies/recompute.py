"""Activation recomputation as data: which regions of the forward are run again in backward
instead of keeping what they save.

`recompute(policy=...)` declares one of
- `"selective"` (Korthikanti et al.): every attention core — a fused
  `scaled_dot_product_attention` (its output and log-sum-exp are not kept), or an explicit one
  from the score matmul q·kᵀ through the softmax (and dropout) to the probabilities·v matmul
  (the [b, h, s, s] scores and probabilities are not kept); q, k and v stay saved;
- `"full"`: every repeated block (`layers.3`): only the block's inputs are kept, the block's
  forward runs again when its backward starts, its forward collectives included (as Megatron's
  full recomputation does: the ledger counts them in backward);
- module globs (`("layers.*.mlp",)`): every module matching one, as `"full"` does for a block.

The declaration belongs to no mesh axis; `resolve_strategies` takes it out of the strategy list
(`ResolvedStrategy.recompute`). `autopar/compiler/passes/recompute.py` finds the regions in the planned graph and
marks them; emission (`autopar/compiler/passes/emit_rank_graph.py`) runs each region through
`torch.utils.checkpoint` (non-reentrant), so the rank graph itself recomputes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.core.errors import PlanError

POLICIES = ("selective", "full")


@dataclass(frozen=True)
class RecomputeDeclaration:
    """`policy` is "selective", "full" or "modules" (then `modules` holds the globs)."""

    policy: str
    modules: tuple[str, ...] = ()
    name: str = "recompute"

    def describe(self) -> str:
        return self.policy if self.policy != "modules" else "modules " + ", ".join(self.modules)


def recompute(policy: "str | Sequence[str]" = "selective") -> RecomputeDeclaration:
    """Recompute attention cores ("selective"), whole blocks ("full"), or the modules matching
    the given globs, in backward (module docstring)."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise PlanError(f"recompute(policy={policy!r}): expected 'selective', 'full' or a list of module globs "
                            f"(e.g. ['layers.*.mlp'])")
        return RecomputeDeclaration(policy=policy)
    globs = tuple(policy)
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise PlanError(f"recompute(policy={policy!r}): module globs must be a non-empty list of non-empty strings")
    return RecomputeDeclaration(policy="modules", modules=globs)
