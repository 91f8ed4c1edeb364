"""Rule validator: every autopar op rule, on small modules, across the placements it claims.

For each case a module is planned with parameter/input placements that exercise one rule; two
gloo ranks run forward and backward, and the loss and every gradient shard must equal the
single-device module's (fp32, rel <= 1e-5). A wrong rule (wrong output placement, missing
conjugate, bad local kernel) fails here before it can hide inside a whole model."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import autopar
from autopar.core.shards import shard
from autopar.runtime.launch import launch
from autopar.compiler.strategies import InputRule, ParamRule, Strategy
from tests.numerics_checks import max_relative_error

TOLERANCE = 1e-5


class Attention(nn.Module):
    def __init__(self, *, causal: bool, with_mask: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(torch.randn(2, 4, 6, 8)) for _ in range(3))
        self.causal = causal
        self.register_buffer("mask", torch.rand(2, 1, 6, 6) > 0.3 if with_mask else None)

    def forward(self, weights: torch.Tensor) -> torch.Tensor:
        mask = self.mask.logical_or(torch.eye(6, dtype=torch.bool)) if self.mask is not None else None
        out = F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=mask, is_causal=self.causal)
        return (out * weights).sum()


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (F.embedding(ids, self.table) * torch.arange(4.0)).sum()


class CrossEntropy(nn.Module):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.randn(8, 16))
        self.reduction = reduction

    def forward(self, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.logits, targets, reduction=self.reduction, ignore_index=-100)
        return (loss * torch.arange(1.0, 9.0)).sum() if self.reduction == "none" else loss


class LogSoftmaxWeighted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.randn(8, 16))

    def forward(self, weights: torch.Tensor) -> torch.Tensor:
        return (F.log_softmax(self.logits, dim=-1) * weights).sum()


class FusedProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ self.weight).split([4, 4, 4], dim=-1)
        return (q * k + v.square()).sum()


class MeanSquaredError(nn.Module):
    """No autopar rule involved: DTensor's mean over a batch-sharded tensor gives Partial(avg)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.tanh(self.linear(x)), y)


def targets_with_ignored() -> torch.Tensor:
    targets = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(1))
    targets[[1, 6]] = -100
    return targets


def strategy(params: dict[str, object] = (), inputs: object | None = None) -> Strategy:
    return Strategy(name="rule_check", axis="tp", params=tuple(ParamRule(k, v) for k, v in dict(params).items()),
                    inputs=() if inputs is None else (InputRule(None, inputs),))


CASES = {
    "sdpa heads causal": (lambda: Attention(causal=True, with_mask=False), lambda: (torch.randn(2, 4, 6, 8),),
                          {"q": Shard(1), "k": Shard(1), "v": Shard(1)}, None),
    "sdpa batch masked": (lambda: Attention(causal=False, with_mask=True), lambda: (torch.randn(2, 4, 6, 8),),
                          {"q": Shard(0), "k": Shard(0), "v": Shard(0)}, None),
    "sdpa mixed -> replicate": (lambda: Attention(causal=True, with_mask=False), lambda: (torch.randn(2, 4, 6, 8),),
                                {"q": Shard(1), "k": Shard(0)}, None),
    "vocab-parallel embedding": (Embedding, lambda: (torch.randint(0, 16, (3, 5)),), {"table": Shard(0)}, None),
    "vocab-parallel cross-entropy mean": (lambda: CrossEntropy("mean"), lambda: (targets_with_ignored(),),
                                          {"logits": Shard(1)}, None),
    "vocab-parallel cross-entropy none": (lambda: CrossEntropy("none"), lambda: (targets_with_ignored(),),
                                          {"logits": Shard(1)}, None),
    "batch-sharded cross-entropy mean": (lambda: CrossEntropy("mean"), lambda: (targets_with_ignored(),),
                                         {"logits": Shard(0)}, Shard(0)),
    "batch-sharded cross-entropy sum": (lambda: CrossEntropy("sum"), lambda: (targets_with_ignored(),),
                                        {"logits": Shard(0)}, Shard(0)),
    "vocab-parallel log_softmax, any gradient": (LogSoftmaxWeighted, lambda: (torch.randn(8, 16),),
                                                 {"logits": Shard(1)}, Replicate()),
    "mean over batch shards (Partial avg)": (MeanSquaredError, lambda: (torch.randn(6, 4), torch.randn(6, 3)), {},
                                            Shard(0)),
    "block-sharded split": (FusedProjection, lambda: (torch.randn(5, 4),), {"weight": _StridedShard(1, split_factor=3)},
                            None),
}


def build(name: str) -> tuple[nn.Module, tuple]:
    make_module, make_inputs, _, _ = CASES[name]
    torch.manual_seed(0)
    module = make_module()
    torch.manual_seed(1)
    return module, make_inputs()


def run_cases(rank: int, world_size: int) -> dict[str, dict]:
    results = {}
    for name, (_, _, params, inputs) in CASES.items():
        module, example = build(name)
        parallel = autopar.parallelize(module, "tp=2", strategies=[strategy(params, inputs)], example_inputs=example)
        loss = parallel(*parallel.local_batch(*example))
        loss.backward()
        results[name] = {"loss": loss.detach(), "grads": {n: p.grad for n, p in parallel.named_parameters()},
                         "placements": parallel.plan.parameter_placements()}
    return results


def test_every_rule_matches_the_single_device_op():
    results = launch(run_cases, 2, timeout_s=120)
    mesh = autopar.Mesh(tp=2)
    for name in CASES:
        module, example = build(name)
        loss = module(*example)
        loss.backward()
        for rank, result in enumerate(results):
            got = result[name]
            assert max_relative_error(got["loss"], loss.detach()) <= TOLERANCE, (name, rank, "loss")
            for param, value in module.named_parameters():
                expected = shard(value.grad, got["placements"][param], mesh, rank)
                assert max_relative_error(got["grads"][param], expected) <= TOLERANCE, (name, rank, param)
