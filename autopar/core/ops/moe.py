"""Mixture-of-experts token movement: permutation by expert, and expert parallelism's all-to-all.

`autopar/compiler/passes/lower_moe.py` replaces the routing bookkeeping of an experts block with these kernels and
keeps the experts' own computation (grouped matmuls, activation) as traced:

    x_perm, offsets, order, ids = moe_permute(x, top_k_index, num_experts=E)
    ... experts: rows of x_perm, grouped by expert (offsets: cumulative rows per expert) ...
    out = moe_unpermute(y_perm, order, top_k_weights, top_k=k, dtype=...)

Both run on whatever tokens the rank holds (every token is routed on its own), so data, ZeRO
and sequence shards of the tokens need nothing more. They reproduce what Hugging Face's grouped
experts do (`transformers.integrations.moe.grouped_mm_experts_forward`): sort the flattened
expert ids, gather the rows, count rows per expert with `histc`, weight each output row by its
router probability, restore the order and sum the k rows of a token.

Expert parallelism (`ep` axis, experts sharded by their first dimension) puts an exchange around
the experts' computation:

    x_local, offsets_local, received = moe_dispatch(x_perm, offsets, group=, size=, index=)
    ... local experts on x_local ...
    y_perm = moe_combine(y_local, received, offsets, group=, size=)

`moe_dispatch` sends every rank the rows of its experts (rank r owns experts r·E/N .. (r+1)·E/N-1;
rows are sorted by expert, so each destination's rows are contiguous) after one all-to-all of the
row counts per expert; what arrives (ordered by source rank, then expert) is regrouped by local
expert. `moe_combine` undoes both. The row all-to-alls have split sizes known only at run time;
their backward is the same exchange with the splits swapped (`_RowsAllToAll`). Dropless unless a
capacity factor is declared (`expert_parallel(capacity_factor=, drop_tokens=True)`): then each
expert takes at most ceil(factor · rows / E) of a rank's rows and the rest contribute zero. Every exchange
records its row counts in `ROUTING` (a run's exact all-to-all bytes: `routing_bytes`).
On fake tensors (the planner's shape check) the exchange keeps every row where it is.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from tabulate import tabulate
from torch._subclasses.fake_tensor import FakeTensor

from autopar.core.ops.collective_calls import on_lane

_c10d = torch.ops._c10d_functional

# (name of the experts block, rows sent per destination, rows received per source, this rank's rows
# per expert, recomputed) per dispatch, appended in call order; a harness clears it between steps
# (`ROUTING.clear()`). `recomputed`: the dispatch ran again in backward (activation recomputation of
# the block), with the routing of the forward's.
ROUTING: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]] = []


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward run then is a
    recomputation (torch.utils.checkpoint reads the same private id for the same question)."""
    return torch._C._current_graph_task_id() != -1


def moe_permute(x: torch.Tensor, top_k_index: torch.Tensor, *, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of `x` [T, d] once per chosen expert, sorted by expert: (rows [T·k, d], cumulative rows
    per expert [E] int32, the sorting permutation [T·k], the sorted expert ids [T·k])."""
    top_k = top_k_index.shape[-1]
    ids_sorted, order = torch.sort(top_k_index.reshape(-1), stable=True)
    rows = x[order // top_k]
    counts = torch.histc(ids_sorted.float(), bins=num_experts, min=0, max=num_experts - 1)
    return rows, torch.cumsum(counts, dim=0, dtype=torch.int32), order, ids_sorted


def moe_unpermute(y_perm: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor, *, top_k: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Each token's k expert outputs weighted by its router weights ([T, k] or flat) and summed: [T, d]."""
    tokens = top_k_weights.numel() // top_k
    weighted = y_perm * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return weighted[inverse].view(tokens, top_k, y_perm.shape[-1]).sum(dim=1).to(dtype)


def moe_rejoin(tokens: torch.Tensor) -> torch.Tensor:
    """The tokens `moe_unpermute` returned, unchanged: the graph point where tokens that the
    exchange of folded experts had each rank route a slice of are joined again (its sharding rule
    asks for the placement they had before `moe_permute`, so the gather lands on the [T, d] tokens,
    before the block reshapes them)."""
    return tokens


def _rows_all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group: str) -> torch.Tensor:
    out = _c10d.all_to_all_single(x.contiguous(), receive, send, on_lane(group))
    return _c10d.wait_tensor(out)


class _RowsAllToAll(torch.autograd.Function):
    """Rows of `x` split `send` (per destination) exchanged for rows split `receive` (per source)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], receive: list[int], group: str) -> torch.Tensor:
        ctx.splits = (send, receive, group)
        return _rows_all_to_all(x, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        send, receive, group = ctx.splits
        return _rows_all_to_all(grad, receive, send, group), None, None, None


def _counts_by_rank(offsets: torch.Tensor, size: int) -> torch.Tensor:
    """Rows per (destination rank, its local expert) [N, E/N] from cumulative rows per expert."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    return counts.view(size, -1)


def _source_major_to_expert_major(received: torch.Tensor) -> torch.Tensor:
    """The permutation taking rows ordered (source rank, local expert) to (local expert, source rank)."""
    sources, experts = received.shape
    segment = torch.repeat_interleave(torch.arange(sources * experts, device=received.device), received.reshape(-1))
    return torch.argsort((segment % experts) * sources + segment // experts, stable=True)


def _kept_rows(offsets: torch.Tensor, rows: int, capacity_factor: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows per expert kept under a capacity of ceil(factor · rows / E) per expert (all of them when
    the factor is 0: dropless), and the positions of the kept rows in the permuted rows (None: all)."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    if not capacity_factor:
        return counts, None
    capacity = math.ceil(capacity_factor * rows / counts.numel())
    kept = counts.clamp(max=capacity)
    segment = torch.repeat_interleave(torch.arange(counts.numel(), device=offsets.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(segment.numel(), device=offsets.device) - starts[segment]
    return kept, torch.nonzero(position < capacity).reshape(-1)


def moe_dispatch(x_perm: torch.Tensor, offsets: torch.Tensor, *, group: str, size: int, index: int, block: str = "",
                 capacity_factor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's experts' rows from every rank: (rows grouped by local expert, their cumulative
    counts [E/N] in `offsets`' dtype, rows received per (source, local expert) [N, E/N]). With a
    capacity factor, each expert takes at most ceil(factor · rows / E) of a rank's rows (the first
    in sorted order); the others are dropped (their output is zero)."""
    local_experts = offsets.shape[0] // size
    if isinstance(x_perm, FakeTensor):
        return x_perm * 1, offsets[:local_experts], offsets.new_zeros((size, local_experts), dtype=torch.long)
    counts, kept_rows = _kept_rows(offsets, x_perm.shape[0], capacity_factor)
    sending = counts.view(size, -1)
    received = _c10d.wait_tensor(_c10d.all_to_all_single(sending.reshape(-1).contiguous(), [local_experts] * size,
                                                         [local_experts] * size, on_lane(group)))
    received = received.view(size, local_experts)
    demand = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    sizes = torch.cat([sending.sum(1), received.sum(1), demand]).tolist()  # one sync: all_to_all's splits are host ints
    send, receive = sizes[:size], sizes[size:2 * size]
    ROUTING.append((block, tuple(send), tuple(receive), tuple(sizes[2 * size:]), _in_backward()))
    arrived = _RowsAllToAll.apply(x_perm if kept_rows is None else x_perm[kept_rows], send, receive, group)
    grouped = arrived[_source_major_to_expert_major(received)]
    local_offsets = torch.cumsum(received.sum(0), 0).to(offsets.dtype)
    return grouped, local_offsets, received


def moe_combine(y_local: torch.Tensor, received: torch.Tensor, offsets: torch.Tensor, *, group: str, size: int,
                capacity_factor: float = 0.0) -> torch.Tensor:
    """The experts' output rows back to the ranks and positions `moe_dispatch` took them from
    (dropped rows: zero)."""
    if isinstance(y_local, FakeTensor):
        return y_local * 1
    order = _source_major_to_expert_major(received)
    source_major = torch.empty_like(order)
    source_major[order] = torch.arange(order.numel(), device=order.device)
    rows = int(offsets[-1])
    counts, kept_rows = _kept_rows(offsets, rows, capacity_factor)
    sizes = torch.cat([received.sum(1), counts.view(size, -1).sum(1)]).tolist()  # all_to_all's splits are host ints
    back = _RowsAllToAll.apply(y_local[source_major], sizes[:size], sizes[size:], group)
    if kept_rows is None:
        return back
    return back.new_zeros((rows, back.shape[1])).index_copy(0, kept_rows, back)


def routing_bytes(routing: list[tuple], *, row_bytes: dict[str, int], count_bytes: dict[str, int]) -> dict[str, int]:
    """All-to-all logical bytes (each call's input, the ledger's convention) a run's routing implies,
    forward and backward: per dispatch the counts exchange, the rows sent (forward) and, in
    backward, their gradients coming back (the rows received); per combine the rows received
    (forward) and the gradients of the rows sent (backward). A recomputed dispatch moves its
    forward bytes again, in backward; its gradients are the ones counted for the forward's."""
    forward = backward = 0
    for block, send, receive, _, recomputed in routing:
        moved = count_bytes[block] + (sum(send) + sum(receive)) * row_bytes[block]
        if recomputed:
            backward += moved
            continue
        forward += moved
        backward += (sum(receive) + sum(send)) * row_bytes[block]
    return {"forward": forward, "backward": backward}


def expert_load(routing: list[tuple]) -> str:
    """Rows this rank routed to each expert, per experts block, summed over the recorded dispatches,
    with the busiest expert's load over the mean (1.00: balanced)."""
    totals: dict[str, list[int]] = {}
    for block, _, _, per_expert, recomputed in routing:
        if recomputed:  # the same tokens routed again
            continue
        totals[block] = [a + b for a, b in zip(totals.get(block, [0] * len(per_expert)), per_expert)]
    rows = [[block, " ".join(map(str, load)), f"{max(load) / (sum(load) / len(load)):.2f}" if sum(load) else "-"]
            for block, load in totals.items()]
    return tabulate(rows, headers=["experts module", "rows per expert (this rank's tokens)", "max/mean"])
