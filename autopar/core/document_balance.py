"""Packed sequences placed on context-parallel ranks by their attention work.

Under a document mask a query token attends to the keys of its own document up to itself. Ring
and all-gather attention (`autopar/core/ops/context_attention.py`) compute attention in blocks of
one query chunk by one key chunk of the whole batch, and skip a block the mask allows nothing of;
a computed block costs its whole area, however few of its pairs the mask allows. So a rank's work
is the number of blocks it computes (`attention_work`: its query chunks times the key chunks that
share a document with them, under the causal order), and the pairs the mask allows it
(`attention_pairs`: the token at position p of its document sees p + 1 keys) are what a kernel
that skips inside blocks would do. The causal zig-zag of `sequence_chunks` (rank i holds chunks
i and 2N-1-i of 2N) gives every rank 2N+1 blocks of one long document; documents that begin
inside chunks leave some blocks empty, unevenly.

`balance_documents` reorders the documents of each row (each stays whole and contiguous, so its
positions still restart where it begins and transformers' document mask is still the document
mask) to make the most blocks any rank computes as few as it can, then its pairs as even as they
can be: rows one after another, each taking the order of its documents that least raises the
most loaded rank so far (every order where a row has at most `EXHAUSTIVE` documents, else the
best of `SAMPLED` seeded orders and a longest-first one). A block is the whole batch's, so with
several rows it is computed when any row needs it; long-context training runs one row per rank.

Reordering documents changes nothing a loss computes when no token predicts across a document
boundary, as in Hugging Face's `DataCollatorWithFlattening`, whose labels put -100 (ignored) on
each document's first token: the same (token, target) pairs are summed. Where labels do predict
across boundaries the reordered batch is a different batch; `balance_documents` does not know
the labels and leaves that to the caller (`examples/hf_models.packed_token_batch(separated=True)`).

This is a data step, before the batch reaches the model: the plan and its ledgers do not change.
"""
from __future__ import annotations

import itertools
import random
from typing import Iterator

import torch

from autopar.core.sequence_chunks import chunk_ids, chunks_total

EXHAUSTIVE = 7  # rows of up to this many documents try every order (7! = 5,040)
SAMPLED = 2000  # orders tried for a row with more


def _documents(positions: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each document of one row: a document begins where its position is 0."""
    starts = [i for i, p in enumerate(positions) if p == 0]
    if not starts or starts[0] != 0:
        raise ValueError("packed position_ids must start each document (and the row) at position 0")
    ends = starts[1:] + [len(positions)]
    return [(s, e - s) for s, e in zip(starts, ends)]


def _pairs(first: int, last: int) -> int:
    """Query-key pairs of the tokens at positions first..last-1 of one document (p + 1 each)."""
    return (last * (last + 1) - first * (first + 1)) // 2


def _owners(position_ids: torch.Tensor, size: int, load_balance: bool) -> list[int]:
    """The rank holding each chunk of the sequence under `context_parallel(load_balance=...)`'s
    layout, the positions checked to be [batch, seq] with seq a whole number of chunks."""
    layout = "balanced" if load_balance else "contiguous"
    owner = [0] * chunks_total(size, layout)
    if position_ids.dim() != 2 or position_ids.shape[1] % len(owner):
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)}: expected [batch, seq] with seq "
                         f"divisible by {len(owner)} chunks")
    for rank in range(size):
        for chunk in chunk_ids(rank, size, layout):
            owner[chunk] = rank
    return owner


def _row_pieces(lengths: list[int], seq: int, chunks: int) -> list[list[tuple[int, int, int]]]:
    """Per document of one row (in the order of `lengths`): (chunk, first position, last position
    + 1) of its tokens in each chunk it reaches."""
    size = seq // chunks
    documents, start = [], 0
    for length in lengths:
        pieces, position = [], 0
        while position < length:
            index = (start + position) // size
            take = min(length - position, (index + 1) * size - (start + position))
            pieces.append((index, position, position + take))
            position += take
        documents.append(pieces)
        start += length
    return documents


def _row_blocks(documents: list[list[tuple[int, int, int]]]) -> set[tuple[int, int]]:
    """The (query chunk, key chunk) blocks one row's document mask allows something of."""
    blocks = set()
    for pieces in documents:
        held = [index for index, _, _ in pieces]
        blocks.update((a, b) for a in held for b in held if b <= a)
    return blocks


def _row_pairs(documents: list[list[tuple[int, int, int]]], owner: list[int], size: int) -> list[int]:
    """Each rank's allowed query-key pairs in one row."""
    work = [0] * size
    for pieces in documents:
        for index, first, last in pieces:
            work[owner[index]] += _pairs(first, last)
    return work


def _per_rank(blocks: set[tuple[int, int]], owner: list[int], size: int) -> list[int]:
    counts = [0] * size
    for a, _ in blocks:
        counts[owner[a]] += 1
    return counts


def _rows(position_ids: torch.Tensor, owner: list[int]) -> Iterator[list[list[tuple[int, int, int]]]]:
    for row in position_ids.tolist():
        yield _row_pieces([length for _, length in _documents(row)], len(row), len(owner))


def attention_work(position_ids: torch.Tensor, *, size: int, load_balance: bool = True) -> list[int]:
    """Each context-parallel rank's attention blocks (query chunk x key chunk, the whole batch's,
    that the document mask allows something of) for a packed batch ([batch, seq] positions) under
    the layout `context_parallel(load_balance=...)` gives (module docstring)."""
    owner = _owners(position_ids, size, load_balance)
    blocks: set[tuple[int, int]] = set()
    for documents in _rows(position_ids, owner):
        blocks |= _row_blocks(documents)
    return _per_rank(blocks, owner, size)


def attention_pairs(position_ids: torch.Tensor, *, size: int, load_balance: bool = True) -> list[int]:
    """Each rank's query-key pairs the document mask allows (module docstring)."""
    owner = _owners(position_ids, size, load_balance)
    totals = [0] * size
    for documents in _rows(position_ids, owner):
        totals = [t + w for t, w in zip(totals, _row_pairs(documents, owner, size))]
    return totals


def _orders(count: int, lengths: list[int], seed: int) -> list[tuple[int, ...]]:
    if count <= EXHAUSTIVE:
        return list(itertools.permutations(range(count)))
    generator = random.Random(seed)
    longest_first = tuple(sorted(range(count), key=lambda d: -lengths[d]))
    orders = [tuple(range(count)), longest_first]
    for _ in range(SAMPLED):
        order = list(range(count))
        generator.shuffle(order)
        orders.append(tuple(order))
    return orders


def balance_documents(position_ids: torch.Tensor, *, size: int, load_balance: bool = True,
                      seed: int = 0) -> torch.Tensor:
    """The gather index ([batch, seq], long) that reorders each row's documents to balance the
    ranks' attention work (module docstring): `t.gather(1, index)` for every [batch, seq] tensor
    of the batch (input ids, positions, labels)."""
    owner = _owners(position_ids, size, load_balance)
    seq = position_ids.shape[1]
    blocks: set[tuple[int, int]] = set()
    pairs = [0] * size
    rows = []
    for row_index, row in enumerate(position_ids.tolist()):
        spans = _documents(row)
        lengths = [length for _, length in spans]
        best = None
        for order in _orders(len(spans), lengths, seed + row_index):
            documents = _row_pieces([lengths[d] for d in order], seq, len(owner))
            row_blocks = blocks | _row_blocks(documents)
            row_pairs = [t + w for t, w in zip(pairs, _row_pairs(documents, owner, size))]
            key = (max(_per_rank(row_blocks, owner, size)), len(row_blocks), max(row_pairs),
                   sum(w * w for w in row_pairs))
            if best is None or key < best[0]:
                best = (key, order, row_blocks, row_pairs)
        _, order, blocks, pairs = best
        rows.append([i for d in order for i in range(spans[d][0], spans[d][0] + spans[d][1])])
    return torch.tensor(rows, dtype=torch.long, device=position_ids.device)


def imbalance(work: list[int]) -> float:
    """The most loaded rank's work over the mean (1.0: even)."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0
