"""An attention mask computed from positions alone: recognised at plan time (at its own size, or
at 64 positions when it is too large to evaluate) and, where it is the causal triangle or allows
everything, replaced by `is_causal=True` or no mask (`autopar/compiler/passes/causal_masks.py`,
`autopar/compiler/rules/mask_kind.py`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.compiler.rules import mask_kind
from autopar.compiler.trace import trace_model
from autopar.runtime.launch import launch
from examples.hf_models import tiny_llama, token_batch
from tests.numerics import STEPS, distributed_rank, single_device
from tests.numerics_checks import assert_cases_match

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class PositionMaskedAttention(torch.nn.Module):
    """Attention under a mask built from positions: causal, every position, or a causal window."""

    def __init__(self, kind: str, window: int = 0) -> None:
        super().__init__()
        self.kind, self.window = kind, window
        self.embed = torch.nn.Embedding(128, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 128)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, seq = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(batch, seq, 3, 4, 8).permute(2, 0, 3, 1, 4)
        positions = torch.arange(seq, device=ids.device)
        distance = positions[:, None] - positions[None, :]
        if self.kind == "causal":
            mask = distance >= 0
        elif self.kind == "none":
            mask = distance > -seq
        else:
            mask = (distance >= 0) & (distance < self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(batch, seq, 32)
        return F.cross_entropy(self.head(out).flatten(0, 1), ids.flatten())


def _mask_kind(model: torch.nn.Module, args: tuple) -> str | None:
    graph = trace_model(model, args).graph_module.graph
    attention = next(n for n in graph.nodes if n.target is SDPA)
    return mask_kind.static_mask_kind(attention.args[3])


CASES = [("causal", 0, "causal"), ("none", 0, "none"), ("window", 8, None), ("window", 100, None)]


@pytest.mark.parametrize("small", [False, True], ids=["own size", "at 64 positions"])
@pytest.mark.parametrize("kind,window,expected", CASES)
def test_a_mask_is_read_at_its_own_size_or_at_64_positions(kind, window, expected, small, monkeypatch):
    """At 64 positions a window of 8 still shows, and one of 100 (a constant that is not a size)
    makes the mask unknown rather than causal-looking."""
    if small:
        monkeypatch.setattr(mask_kind, "_EVALUATED_ENTRIES", 0)
    assert _mask_kind(PositionMaskedAttention(kind, window), (torch.zeros(2, 256, dtype=torch.long),)) == expected


def test_hugging_face_masks_are_read_at_64_positions(monkeypatch):
    """transformers' traced mask (positions, document boundaries) read at 64 positions."""
    monkeypatch.setattr(mask_kind, "_EVALUATED_ENTRIES", 0)
    torch.manual_seed(0)
    assert _mask_kind(tiny_llama(positions=256), token_batch(batch=2, seq=256)) == "causal"


def test_a_causal_mask_becomes_the_causal_flag_and_is_no_longer_computed():
    torch.manual_seed(0)
    model, batch = tiny_llama(), token_batch(batch=2, seq=16)
    plan = autopar.plan(model, autopar.Mesh(tp=2), strategies=[autopar.tensor_parallel()], example_inputs=batch)
    attention = [n for n in plan.graph_module.graph.nodes if n.target is SDPA]
    assert attention and all(n.args[3] is None and n.args[5] is True for n in attention)
    squares = [n.name for n in plan.graph_module.graph.nodes
               if isinstance(n.meta.get("val"), torch.Tensor) and tuple(n.meta["val"].shape[-2:]) == (16, 16)]
    assert squares == []


def _windowed() -> PositionMaskedAttention:
    return PositionMaskedAttention("window", 4)


WINDOW_BATCHES = [(torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(step)),)
                  for step in range(STEPS)]
WINDOW_CASES = {"dp2": ("dp=2", [autopar.data_parallel()])}


def test_a_window_keeps_its_mask():
    plan = autopar.plan(_windowed(), autopar.Mesh(dp=2), strategies=[autopar.data_parallel()],
                        example_inputs=WINDOW_BATCHES[0])
    attention = next(n for n in plan.graph_module.graph.nodes if n.target is SDPA)
    assert attention.args[3] is not None and not (len(attention.args) > 5 and attention.args[5])


def _run_window_cases(rank: int, world: int, names: list[str]) -> list[dict]:
    return [distributed_rank(rank, world, _windowed, WINDOW_BATCHES, *WINDOW_CASES[name]) for name in names]


def test_a_mask_without_a_batch_dimension_under_data_parallelism_equals_one_device():
    """A [query, key] mask broadcast over batch and heads stays whole on every data-parallel rank
    (the batch shard is not its first dimension)."""
    per_rank = launch(_run_window_cases, 2, ["dp2"], timeout_s=120)
    assert_cases_match(["dp2"], per_rank, single_device(_windowed, WINDOW_BATCHES))
