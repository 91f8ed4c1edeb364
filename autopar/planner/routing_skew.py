"""Routing skew: what the busiest expert-parallel rank holds when the router is not uniform.

The block ledgers are measured under uniform routing: each of a group's E experts receives T·k/E of
the rows its g ranks route (T tokens each, k picks per token), so every rank receives T·k rows.
`SearchSpace(routing_skew=s)` declares that the busiest expert receives s times that mean. The rank
holding it holds E/g − 1 other experts; with the rest of the rows spread evenly over the other
E − 1 experts, that rank receives

    f = (g / E) · (s + (E/g − 1) · (E − s) / (E − 1))

times its uniform share: f = s with one expert per rank (g = E), f = 1 whatever the skew without
expert parallelism (g = 1: every rank holds every expert and routes only its own tokens). A token
picks k different experts, so an expert receives at most one row per token: 1 ≤ s ≤ E/k.

`skewed(ledgers, s)` grows by f what the rows a rank received make: the block's saved
activations (`Part.received_activation_bytes`, `compiler/ledger/fake_run.received_rows`) and,
where the block is recomputed, what its forward saves again in backward
(`Part.received_transient_bytes`) — on every rank, as if each held the busiest rank's share: the
peak that must fit is that rank's. Still priced at uniform routing: the experts' compute and the
all-to-all bytes (the step's time) and backward's working memory.
"""
from __future__ import annotations

from dataclasses import replace

from autopar.core.errors import PlanError
from autopar.planner.block_ledgers import BlockLedgers, Part


def load_factor(skew: float, experts: int, ranks: int) -> float:
    """The busiest rank's received rows over its uniform share (module docstring's f)."""
    if skew == 1.0 or ranks <= 1 or experts <= 1:
        return 1.0
    per_rank = experts / ranks
    return (ranks / experts) * (skew + (per_rank - 1) * (experts - skew) / (experts - 1))


def check_skew(skew: float, experts: int, top_k: int) -> None:
    if skew < 1.0:
        raise PlanError(f"routing_skew={skew:g}: the busiest expert receives at least the mean of the rows "
                        f"(1.0 is uniform routing); declare SearchSpace(routing_skew=...) >= 1.0")
    if experts and top_k and skew > experts / top_k:
        raise PlanError(f"routing_skew={skew:g} is more than {experts} experts / top-{top_k} = "
                        f"{experts / top_k:g}: a token picks {top_k} different experts, so an expert receives "
                        f"at most one row per token; declare SearchSpace(routing_skew=...) <= {experts / top_k:g}")


def skewed(ledgers: BlockLedgers, skew: float) -> BlockLedgers:
    """`ledgers` with the block's received-row activations grown to the busiest rank's (module docstring)."""
    if skew == 1.0 or not ledgers.experts:
        return ledgers
    check_skew(skew, ledgers.experts, ledgers.top_k)
    factor = load_factor(skew, ledgers.experts, ledgers.expert_ranks)
    if factor == 1.0:
        return ledgers
    return replace(ledgers, block=_grown(ledgers.block, factor), rest=_grown(ledgers.rest, factor))


def _grown(part: Part, factor: float) -> Part:
    saved = int(round((factor - 1.0) * part.received_activation_bytes))
    again = int(round((factor - 1.0) * part.received_transient_bytes))
    return replace(part, activation_bytes=part.activation_bytes + saved,
                   received_activation_bytes=part.received_activation_bytes + saved,
                   transient_bytes=part.transient_bytes + again,
                   received_transient_bytes=part.received_transient_bytes + again)
