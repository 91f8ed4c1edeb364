"""Layout copies around collectives, counted from outside: a dispatch mode records every ATen
`clone`, `copy_` and `cat` a training step's forward and backward dispatch on 2 gloo ranks, with
the runtime function it was called from (read off the Python stack), and the tests assert the
exact list for the steps that move data.

- Sequence parallelism where the batch splits over tp shards the batch (autopar/compiler/strategies/token_shard.py):
  its all-gathers and reduce-scatters copy nothing; what is left are the row-parallel biases made
  Partial (rank 0 clones each, the other ranks take zeros).
- Context parallelism's all-gather attention uses the gathered K/V block by block in the
  collective's rank-major buffer: the only copies are the shards sent (K and V are transposed
  views, made contiguous for the collective), in forward and in backward's re-gather; nothing the
  size of the gathered sequence.
- Ulysses' all-to-alls lay out one buffer a side: the send buffer and the received one, each the
  size of the rank's tensor, once per all-to-all.
"""
from __future__ import annotations

import collections
import math
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.runtime.launch import launch
from examples.gpt import GPT, GPTConfig, example_batch

pytestmark = pytest.mark.timeout(300)

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
BATCH = 4
_COPIES = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten.cat.default}
_RUNTIME = ("autopar/core/ops/collectives.py", "autopar/core/ops/collective_calls.py", "autopar/core/ops/in_flight.py",
            "autopar/core/ops/context_attention.py")


class RuntimeCopies(TorchDispatchMode):
    """(op, innermost runtime function's qualified name, output shape) -> count, for copies made
    inside the redistribution and context-attention runtime."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _COPIES:
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.endswith(_RUNTIME):
                frame = frame.f_back
            if frame is not None:  # the innermost runtime function on the stack
                self.seen[(func.__name__.split(".")[0], frame.f_code.co_qualname, tuple(out.shape))] += 1
        return out


def _copies(rank: int, world: int, mesh: str, strategies: list) -> dict:
    batch = example_batch(CONFIG, batch=BATCH)
    torch.manual_seed(0)
    module = autopar.parallelize(GPT(CONFIG), mesh, strategies=strategies, example_inputs=batch)
    local = module.plan.local_inputs(list(batch), rank)
    counter = RuntimeCopies()
    with counter:
        module(*local).backward()
    return dict(counter.seen)


def test_sequence_parallel_on_the_batch_copies_nothing_in_its_collectives():
    per_rank = launch(_copies, 2, "tp=2", [autopar.sequence_parallel()], timeout_s=120)
    biases = 2 * CONFIG.n_layer  # o_proj and down_proj per layer
    assert per_rank[0] == {("clone", "_PartialFromReplicate.forward", (CONFIG.d_model,)): biases}, per_rank[0]
    assert per_rank[1] == {}, per_rank[1]


def test_all_gather_attention_copies_only_the_shards_it_sends():
    per_rank = launch(_copies, 2, "cp=2", [autopar.context_parallel(method="allgather")], timeout_s=120)
    shard = (BATCH, CONFIG.n_head, CONFIG.seq_len // 2, CONFIG.d_model // CONFIG.n_head)
    for copies in per_rank:
        gathering = {key: n for key, n in copies.items() if "all_gather" in key[1] or "_GatheredExchange" in key[1]}
        # K and V, forward and backward's re-gather, per layer
        assert gathering == {("clone", "issue_all_gather", shard): 4 * CONFIG.n_layer}, copies
        whole_sequence = [key for key in copies if len(key[2]) == 4 and key[2][2] == CONFIG.seq_len]
        assert not whole_sequence, copies


def test_ulysses_all_to_all_lays_out_one_buffer_a_side():
    per_rank = launch(_copies, 2, "cp=2", [autopar.context_parallel(method="alltoall")], timeout_s=120)
    # q, k, v to heads and the output back, forward; their conjugates in backward: 8 per layer
    exchanges = 8 * CONFIG.n_layer
    local = BATCH * CONFIG.n_head * (CONFIG.seq_len // 2) * (CONFIG.d_model // CONFIG.n_head)
    for copies in per_rank:
        sides = {key: n for key, n in copies.items() if "all_to_all" in key[1]}  # comprehensions inside included
        assert sum(n for key, n in sides.items() if key[1].startswith("issue_all_to_all")) == exchanges, copies
        assert sum(n for key, n in sides.items() if key[1].startswith("land_all_to_all")) == exchanges, copies
        assert all(math.prod(key[2]) == local for key in sides), copies
