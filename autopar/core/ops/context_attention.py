"""Attention on sequence shards: ring, all-gather K/V and all-to-all (Ulysses) kernels.

`context_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=, enable_gqa=, group=, size=,
index=, method=, layout=)` is what `attention_rules.sdpa_rule` puts in a rank graph in place of
`aten.scaled_dot_product_attention` when q, k and v are sharded on the sequence (dim 2 of
[batch, heads, seq, head_dim]) over a context-parallel axis: `group` names its process group,
`size` is N and `index` this rank's coordinate; `layout` says which chunks of the sequence this
rank holds (`autopar/core/sequence_chunks.py`: chunk i of N, or chunks i and 2N-1-i of 2N).

ring and allgather share one blockwise computation (`_ContextAttention`): the rank's query chunks
meet every key/value chunk of the sequence one block at a time; a block of query chunk a and
key chunk b is skipped under a causal mask when b > a, runs with the causal (top-left) mask
when b == a and unmasked when b < a. Each block gives an output and its row log-sum-exp; blocks
are merged by log-sum-exp in fp32 (online softmax: the outputs so far weighted by
sigmoid(lse so far - the block's lse), one `lerp`). Backward runs the block kernel's backward
with the merged output and log-sum-exp, which gives each block's exact share of dQ, dK and dV
(the softmax of a row is normalised by the merged log-sum-exp).

An attention mask read from the data (`mask="tensor"`: a document, padding or sliding-window
mask) arrives whole on every rank of the axis, in the sequence's natural order (what the rule
asks for). Each block then takes its piece (`_MaskBlocks`: the rows of its query chunk, the
columns of its key chunk), every pair of chunks is computed, and a block the mask allows nothing
of is skipped (at run time; at plan time, on fake tensors, every block is computed). A row its
block allows nothing of has log-sum-exp -inf and weighs nothing in the merge; a row the whole
mask allows nothing of ends as one device's kernel leaves it, zero.
- ring (`_RingExchange`): forward passes K/V to the next rank and receives the previous rank's
  while the current block computes (N-1 transfers); backward passes K/V again together with the
  dK/dV accumulated for them, and one last send returns each accumulator to its owner:
  (N-1) K/V and N dK/dV transfers.
- allgather (`_GatheredExchange`): K and V all-gathered; dK/dV reduce-scattered.
alltoall (`_ulysses`) is plain autograd over the all-to-all step: heads scattered and the
sequence gathered, whole-sequence attention on H/N heads, and back.

The block kernel (`attention_blocks.block_kernel`: CPU flash, CUDA memory-efficient attention, a
matmul kernel on any other device) gives each block's output and log-sum-exp, and its backward.
Grouped-query attention: K/V circulate with their own (fewer) heads and are repeated to the query
heads inside a block; their gradients are summed back over each group.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.core.ops import collective_calls, collectives
from autopar.core.ops.attention_blocks import block_kernel
from autopar.core.ops.collective_calls import on_lane
from autopar.core.sequence_chunks import chunk_ids, chunks_total, natural_order, rank_order



class _MaskBlocks:
    """The blocks of an attention mask given whole ([batch or 1, heads or 1, seq, seq], or fewer
    leading dims), in the sequence's natural order: block (a, b) is the rows of query chunk a and
    the columns of key chunk b (a dim of size 1 broadcasts and is not cut), additive in `dtype`."""

    def __init__(self, mask: torch.Tensor, total: int, dtype: torch.dtype) -> None:
        self.mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        self.total, self.dtype = total, dtype
        self.fake = isinstance(mask, FakeTensor)

    def _cut(self, t: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
        return t if t.shape[dim] == 1 else t.chunk(self.total, dim=dim)[chunk]

    def block(self, a: int, b: int) -> torch.Tensor:
        piece = self._cut(self._cut(self.mask, 2, a), 3, b)
        if piece.dtype == torch.bool:
            return torch.zeros(piece.shape, dtype=self.dtype, device=piece.device).masked_fill(~piece, float("-inf"))
        return piece.to(self.dtype)

    def empty(self, block: torch.Tensor) -> bool:
        """The block allows nothing (skipped); never so at plan time (fake tensors hold no values)."""
        return not self.fake and not bool((block > float("-inf")).any())

    @staticmethod
    def unmatched_rows(lse: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """The block's log-sum-exp with -inf on the rows it allows nothing of (the CPU kernel says 0)."""
        return lse.masked_fill(~(block > float("-inf")).any(-1), float("-inf"))


def _pairs(q_ids: list[int], kv_ids: list[int], causal: bool, blocks: _MaskBlocks | None):
    """(i, j, diagonal, the block's mask or None) for every query chunk q_ids[i] that attends to key
    chunk kv_ids[j]: all of them without a causal mask; under it the earlier key chunks whole and
    the same chunk with the causal (top-left) mask; later key chunks not at all. Under a mask given
    whole (`blocks`), every pair but those it allows nothing of."""
    for i, a in enumerate(q_ids):
        for j, b in enumerate(kv_ids):
            if causal and b > a:
                continue
            piece = None if blocks is None else blocks.block(a, b)
            if piece is None or not blocks.empty(piece):
                yield i, j, causal and b == a, piece


def _kv_chunks(source: int, k: torch.Tensor, v: torch.Tensor, size: int, layout: str, groups: int):
    """The chunk numbers of rank `source`'s K/V block and its K and V chunks, repeated to the query heads."""
    kv_ids = chunk_ids(source, size, layout)
    return kv_ids, _repeat_heads(k, groups).chunk(len(kv_ids), dim=2), _repeat_heads(v, groups).chunk(len(kv_ids), dim=2)


def _process_group(name: str) -> Any:
    return _resolve_process_group(on_lane(name))


class _RingExchange:
    """K/V blocks around the ring of the axis: block t is the one of rank (index - t) mod N."""

    def __init__(self, group: str, size: int, index: int, *, shapes_only: bool = False) -> None:
        # the group is resolved at each shift (`on_lane`): the backward may run on another thread than the forward
        self.group, self.shapes_only = group, shapes_only
        self.size, self.index = size, index
        self.next, self.prev = (index + 1) % size, (index - 1) % size

    def _shift(self, tensors: list[torch.Tensor], tag: int) -> tuple[list[Any], list[torch.Tensor]]:
        """Post sends of `tensors` to the next rank and receives of the previous rank's (on fake
        tensors, at plan time: only the buffers, as functional collectives' fake kernels do)."""
        works, received = [], []
        pg = None if self.shapes_only else _process_group(self.group)
        for j, tensor in enumerate(tensors):
            buffer = torch.empty_like(tensor)
            received.append(buffer)
            if pg is None:
                continue
            works.append(dist.isend(tensor.contiguous(), group=pg, group_dst=self.next, tag=tag + j))
            works.append(dist.irecv(buffer, group=pg, group_src=self.prev, tag=tag + j))
        return works, received

    def forward_blocks(self, k: torch.Tensor, v: torch.Tensor):
        """(source rank, k, v) for every block; the next pair is in flight while one is used."""
        current = [k.contiguous(), v.contiguous()]
        for step in range(self.size):
            pending = self._shift(current, 4 * step) if step < self.size - 1 else ([], [])
            yield (self.index - step) % self.size, current[0], current[1]
            for work in pending[0]:
                work.wait()
            current = pending[1]

    def backward_blocks(self, k: torch.Tensor, v: torch.Tensor, accumulate: Callable[..., None]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Calls accumulate(source, k, v, dk, dv) per block; dK/dV travel with their K/V and the last
        send brings each rank's own accumulators home. Returns this rank's (dk, dv)."""
        current = [k.contiguous(), v.contiguous()]
        grads = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                 torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        tag = 4 * self.size
        for step in range(self.size):
            ahead = self._shift(current, tag + 8 * step) if step < self.size - 1 else ([], [])
            accumulate((self.index - step) % self.size, current[0], current[1], grads[0], grads[1])
            # on a ring of one the accumulators are home already (a send to oneself is no transfer)
            home = self._shift(grads, tag + 8 * step + 4) if self.size > 1 else ([], grads)
            for work in ahead[0] + home[0]:
                work.wait()
            current, grads = ahead[1], home[1]
        return grads[0], grads[1]


class _GatheredExchange:
    """Every K/V block at once: all-gathered over the axis; gradients reduce-scattered.

    The blocks are used one rank's at a time, so they stay in the collective's rank-major buffer
    ([N, batch, heads, seq/N, head_dim]: rank r's block is a contiguous view of it) instead of
    being laid out along the sequence, and the gradients accumulate in the same layout, which is
    what the reduce-scatter takes: neither direction copies a gathered tensor."""

    def __init__(self, group: str, size: int, index: int) -> None:
        self.group, self.size, self.index = group, size, index

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        pending = collective_calls.issue_all_gather(t, self.group, self.size)
        return collective_calls.wait(pending).view(self.size, *t.shape)

    def forward_blocks(self, k: torch.Tensor, v: torch.Tensor):
        whole = [self._gathered(t) for t in (k, v)]
        for rank in range(self.size):
            yield rank, whole[0][rank], whole[1][rank]

    def backward_blocks(self, k: torch.Tensor, v: torch.Tensor, accumulate: Callable[..., None]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        whole = [self._gathered(t) for t in (k, v)]
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in whole]
        for rank in range(self.size):
            accumulate(rank, whole[0][rank], whole[1][rank], grads[0][rank], grads[1][rank])
        return tuple(collective_calls.raw_reduce_scatter(g.flatten(0, 1), self.group, self.size, 0) for g in grads)


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.unflatten(1, (t.shape[1] // groups, groups)).sum(2)


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, exchange, layout, mask):
        kernel = block_kernel(q, k, v, masked=mask is not None)
        size, index = exchange.size, exchange.index
        groups = q.shape[1] // k.shape[1]
        blocks = None if mask is None else _MaskBlocks(mask, chunks_total(size, layout), q.dtype)
        q_ids = chunk_ids(index, size, layout)
        q_chunks = q.chunk(len(q_ids), dim=2)
        outs: list[torch.Tensor | None] = [None] * len(q_ids)
        lses: list[torch.Tensor | None] = [None] * len(q_ids)
        for source, k_blk, v_blk in exchange.forward_blocks(k, v):
            kv_ids, k_chunks, v_chunks = _kv_chunks(source, k_blk, v_blk, size, layout, groups)
            for i, j, diagonal, piece in _pairs(q_ids, kv_ids, causal, blocks):
                out, lse = kernel.forward(q_chunks[i], k_chunks[j], v_chunks[j], diagonal, scale, mask=piece)
                out = out.float()
                if piece is not None:
                    lse = blocks.unmatched_rows(lse, piece)
                if outs[i] is None:
                    outs[i], lses[i] = out, lse
                    continue
                # the earlier blocks' share of the merged softmax is exp(lse_a - logaddexp(lse_a, lse_b)),
                # i.e. sigmoid(lse_a - lse_b): one weight and one lerp instead of two exps and a sum
                weight = torch.sigmoid(lses[i] - lse)
                if blocks is not None:  # a row this block allows nothing of keeps what it had (-inf - -inf is NaN)
                    weight = weight.masked_fill(lse == float("-inf"), 1.0)
                outs[i] = torch.lerp(out, outs[i], weight.unsqueeze(-1))
                lses[i] = torch.logaddexp(lses[i], lse)
        for i, chunk in enumerate(q_chunks):  # every block of the chunk skipped: the mask allows it nothing
            if outs[i] is None:
                outs[i] = torch.zeros(chunk.shape[:-1] + v.shape[-1:], dtype=torch.float32, device=q.device)
                lses[i] = torch.full(chunk.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        out = torch.cat(outs, dim=2).to(q.dtype)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.args = (causal, scale, exchange, layout, groups, q_ids)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        causal, scale, exchange, layout, groups, q_ids = ctx.args
        kernel = block_kernel(q, k, v, masked=mask is not None)
        blocks = None if mask is None else _MaskBlocks(mask, chunks_total(exchange.size, layout), q.dtype)
        if blocks is not None:  # rows allowed nothing: probabilities exp(-inf - 0) = 0, no gradient
            lse = lse.masked_fill(lse == float("-inf"), 0.0)
        count = len(q_ids)
        q_chunks, out_chunks = q.chunk(count, dim=2), out.chunk(count, dim=2)
        dout_chunks, lse_chunks = dout.contiguous().chunk(count, dim=2), lse.chunk(count, dim=2)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dq_chunks = dq.chunk(count, dim=2)

        def accumulate(source, k_blk, v_blk, dk_acc, dv_acc):
            kv_ids, k_chunks, v_chunks = _kv_chunks(source, k_blk, v_blk, exchange.size, layout, groups)
            dk_chunks, dv_chunks = dk_acc.chunk(len(kv_ids), dim=2), dv_acc.chunk(len(kv_ids), dim=2)
            for i, j, diagonal, piece in _pairs(q_ids, kv_ids, causal, blocks):
                dq_b, dk_b, dv_b = kernel.backward(dout_chunks[i], q_chunks[i], k_chunks[j], v_chunks[j],
                                                   out_chunks[i], lse_chunks[i], diagonal, scale, mask=piece)
                dq_chunks[i].add_(dq_b)
                dk_chunks[j].add_(_sum_heads(dk_b, groups))
                dv_chunks[j].add_(_sum_heads(dv_b, groups))

        dk, dv = exchange.backward_blocks(k, v, accumulate)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _ulysses(q, k, v, causal, scale, enable_gqa, group, size, index, layout, mask):
    """Heads scattered and the sequence gathered by all-to-all, attention over the whole sequence
    (under the whole mask, cut to the rank's heads where it has them), and back."""
    def to_heads(t):
        gathered = collectives.all_to_all(t, group=group, size=size, from_dim=2, to_dim=1)
        return natural_order(gathered, 2, size, layout)

    if mask is not None and mask.dim() >= 3 and mask.shape[-3] > 1:
        mask = mask.chunk(size, dim=-3)[index]  # the all-to-all gives rank r the r-th block of heads
    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), attn_mask=mask, is_causal=causal,
                                         scale=scale, enable_gqa=enable_gqa)
    return collectives.all_to_all(rank_order(out, 2, size, layout), group=group, size=size, from_dim=1, to_dim=2)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                      dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                      enable_gqa: bool = False, group: str, size: int, index: int, method: str,
                      layout: str, mask: str = "absent") -> torch.Tensor:
    """scaled_dot_product_attention of the rank's query positions over the whole sequence (module
    docstring). `mask`: what the planner read the attention mask as ("causal", "none": a mask built
    from positions alone, `mask_kind.static_mask_kind`; then `attn_mask` is ignored), "tensor" (a
    mask read from the data, given whole in `attn_mask`), or "absent"."""
    if mask in ("causal", "none"):
        is_causal, attn_mask = mask == "causal", None
    if (attn_mask is not None) != (mask == "tensor") or dropout_p:
        raise RuntimeError("context_attention takes a whole mask only where the plan says so, and no dropout "
                           "(refused at plan time)")
    if method == "alltoall":
        return _ulysses(q, k, v, is_causal, scale, enable_gqa, group, size, index, layout, attn_mask)
    return _blockwise(q, k, v, is_causal, scale, group, size, index, method, layout, attn_mask)


# Compiled rank graphs (`parallelize(compile=True)`) run the blockwise attention eagerly, a graph
# break on each side: traced, AOT autograd merges its backward's all-gather of K and V with the
# forward's (the same inputs) and saves the gathered K/V instead of re-gathering them, so the
# compiled program would move half the all-gathers the comm ledger states and hold memory the
# activation ledger does not (measured: 4 all-gathers per step instead of 8, 2 layers at cp=2);
# the ring's sends and receives are Python-side exchanges dynamo cannot trace anyway. Ulysses'
# all-to-alls are plain functional collectives and compile with the graph.
@torch._dynamo.disable
def _blockwise(q, k, v, is_causal, scale, group, size, index, method, layout, mask):
    if method == "ring":
        exchange = _RingExchange(group, size, index, shapes_only=isinstance(q, FakeTensor))
    else:
        exchange = _GatheredExchange(group, size, index)
    return _ContextAttention.apply(q, k, v, is_causal, scale, exchange, layout, mask)
