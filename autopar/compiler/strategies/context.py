"""Context parallelism as data: the sequence of every input sharded along one axis, and how
attention on sequence shards is lowered.

`context_parallel(axis="cp", method="ring", load_balance=True, seq_dim=1)` shards every user
input on `seq_dim` over `axis`. Position-wise ops (embeddings, norms, MLPs, residuals) then stay
sequence-sharded with no communication; replicated tensors with a sequence dimension that meet a
shard (position tables, rotary tables built from an `arange`) are sliced to the rank's positions
by propagation itself; the loss reduces over the sequence shards in one all-reduce of (sum,
count) (`op_rules.nll_loss_rule`). Attention on sequence shards is the one op that needs the
other ranks' keys and values: `attention_rules.sdpa_rule` lowers it to `autopar/core/ops/context_attention.py`
by `method`:

- "ring": K/V blocks circulate around the axis (send to the next rank, receive from the previous),
  the next block in flight while the current one is computed; partial results merged by their
  log-sum-exp; backward circulates K/V again with the dK/dV accumulators, which end at home.
- "allgather": K and V all-gathered (torchtitan's current choice); dK/dV reduce-scattered.
- "alltoall": Ulysses: heads <-> sequence by all-to-all, whole-sequence attention on H/N heads,
  and back; needs the query and key/value heads divisible by the axis size.

`load_balance=True` gives rank i the chunks i and 2N-1-i of 2N (`autopar/core/sequence_chunks.py`):
equal causal attention work per rank. Without it rank i holds chunk i of N and the last rank does
about (2N-1)/N of the mean work.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Shard

from autopar.compiler.strategies import InputRule, Strategy
from autopar.core.errors import PlanError
from autopar.core.sequence_chunks import BALANCED, CONTIGUOUS

METHODS = {
    "ring": "K/V blocks passed around the axis by send/recv, merged by log-sum-exp (ring attention)",
    "allgather": "K and V all-gathered over the axis, dK/dV reduce-scattered back",
    "alltoall": "heads <-> sequence by all-to-all (Ulysses); heads divisible by the axis size",
}


@dataclass(frozen=True)
class ContextDeclaration:
    """What `context_parallel()` declares; read by attention_rules.sdpa_rule, insert_collectives and the runtime."""

    method: str
    load_balance: bool
    seq_dim: int

    @property
    def layout(self) -> str:
        return BALANCED if self.load_balance else CONTIGUOUS


def context_parallel(*, axis: str = "cp", method: str = "ring", load_balance: bool = True, seq_dim: int = 1) -> Strategy:
    """Context parallelism over `axis` (see the module docstring)."""
    if method not in METHODS:
        raise PlanError(f"unknown context-parallel method {method!r}; choose one of: "
                        + "; ".join(f"{name} ({what})" for name, what in METHODS.items()))
    declaration = ContextDeclaration(method=method, load_balance=bool(load_balance), seq_dim=seq_dim)
    return Strategy(name="context_parallel", axis=axis, inputs=(InputRule(index=None, placement=Shard(seq_dim)),),
                    context=declaration)
