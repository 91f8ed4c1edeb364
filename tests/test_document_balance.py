"""The document balancer of packed sequences under context parallelism (`autopar/core/document_balance.py`):
each rank's attention blocks and pairs are what the document mask allows its query rows (counted
here from the mask itself, cut by `sequence_chunks.take`), reordering keeps every document whole
and every token once, and the balanced batch's most loaded rank computes fewer blocks than under
the causal zig-zag (the numerics: tests/test_packed_sequences.py's balanced case; the kernel time
the blocks predict: benchmarks/context_parallel.py, Table 3)."""
from __future__ import annotations

import pytest
import torch

from autopar.core.document_balance import attention_pairs, attention_work, balance_documents
from autopar.core.sequence_chunks import chunk_ids, chunks_total, take
from examples.hf_models import packed_token_batch


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """[batch, seq, seq]: query i may see key j when both are in one document and j <= i."""
    document = (positions == 0).cumsum(dim=1)
    seq = positions.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return (document[:, :, None] == document[:, None, :]) & causal


def counted_pairs(positions: torch.Tensor, size: int, layout: str) -> list[int]:
    mask = document_mask(positions)
    return [int(take(mask, 1, size, rank, layout).sum()) for rank in range(size)]


def counted_blocks(positions: torch.Tensor, size: int, layout: str) -> list[int]:
    """Per rank: its query chunks times the key chunks the whole batch's mask allows anything of."""
    total = chunks_total(size, layout)
    blocks = document_mask(positions).unflatten(1, (total, -1)).unflatten(3, (total, -1)).any(dim=(0, 2, 4))
    return [int(sum(blocks[a].sum() for a in chunk_ids(rank, size, layout))) for rank in range(size)]


CASES = [(8, 3, 16, 2), (2, 6, 256, 2), (1, 6, 256, 2), (1, 6, 256, 4), (1, 12, 512, 4)]  # rows, documents, seq, cp


@pytest.mark.parametrize("rows, documents, seq, size", CASES)
@pytest.mark.parametrize("load_balance", [True, False])
def test_attention_work_is_what_the_mask_allows_each_ranks_rows(rows, documents, seq, size, load_balance):
    _, positions, _ = packed_token_batch(batch=rows, seq=seq, documents=documents, seed=seq)
    layout = "balanced" if load_balance else "contiguous"
    assert attention_pairs(positions, size=size, load_balance=load_balance) == counted_pairs(positions, size, layout)
    assert attention_work(positions, size=size, load_balance=load_balance) == counted_blocks(positions, size, layout)


@pytest.mark.parametrize("rows, documents, seq, size", CASES)
def test_balancing_keeps_each_document_whole_and_lowers_the_most_blocks(rows, documents, seq, size):
    fewer = 0
    for seed in range(4):
        ids, positions, labels = packed_token_batch(batch=rows, seq=seq, documents=documents, seed=seed, separated=True)
        index = balance_documents(positions, size=size)
        moved = [t.gather(1, index) for t in (ids, positions, labels)]
        for row in range(rows):
            assert sorted(index[row].tolist()) == list(range(seq))  # every token once
            before = _documents(ids[row], positions[row], labels[row])
            after = _documents(moved[0][row], moved[1][row], moved[2][row])
            assert sorted(before) == sorted(after)  # the same documents, whole, positions restarting at each
        zigzag, balanced = attention_work(positions, size=size), attention_work(moved[1], size=size)
        assert max(balanced) <= max(zigzag), (zigzag, balanced)
        assert sum(attention_pairs(positions, size=size)) == sum(attention_pairs(moved[1], size=size))
        fewer += max(balanced) < max(zigzag)
    if rows == 1:  # a block is the whole batch's: with one row per rank the order decides which are empty
        assert fewer >= 2, f"the balancer lowered the most blocks of {fewer} of 4 batches"


def _documents(ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> list[tuple]:
    starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
    return [(tuple(ids[a:b].tolist()), tuple(positions[a:b].tolist()), tuple(labels[a:b].tolist()))
            for a, b in zip(starts, starts[1:])]


def test_a_row_that_does_not_start_a_document_is_refused():
    with pytest.raises(ValueError, match="start each document"):
        attention_work(torch.tensor([[1, 0, 1, 2]]), size=2)
