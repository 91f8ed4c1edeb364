"""Expert parallelism as data: the experts of every mixture-of-experts block split over one axis,
tokens carried to their experts by all-to-all.

`expert_parallel(axis="ep", batch_dim=0)` binds to the traced graph (`bind`): every parameter
that a grouped matmul of an experts block reads as its weights (`passes/lower_moe.py`,
`expert_parameters`: stacked [E, ...] tensors) is sharded on its expert dimension, Shard(0), so
rank r of the axis owns experts r·E/N .. (r+1)·E/N-1; every user input is sharded on its batch
dimension over the same axis. The axis is thus carved from the data axes: everything but the
experts sees it as data parallelism (replicated weights, gradients all-reduced over it), the
experts see their tokens arrive by `moe_dispatch` and leave by `moe_combine`
(`runtime/moe.py`), which `passes/lower_moe.py` puts around each block's experts. Composed with
`data_parallel` on `dp` it is torchtitan's dp_shard = efsdp · ep: tokens over dp × ep, attention
synchronised over both, experts over dp only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Shard

from autopar.errors import PlanError
from autopar.mesh import Mesh
from autopar.strategies import InputRule, ParamRule, Strategy


@dataclass(frozen=True)
class ExpertDeclaration:
    """What `expert_parallel` declared (shown in reports)."""

    batch_dim: int = 0


@dataclass(frozen=True)
class ExpertParallel:
    """`expert_parallel()` before it has seen the graph; `bind` finds the experts' weights."""

    axis: str
    batch_dim: int = 0
    name: str = "expert_parallel"

    def bind(self, *, mesh: Mesh, graph_module: torch.fx.GraphModule, placeholders: dict) -> Strategy:
        from autopar.passes.lower_moe import expert_parameters

        found = expert_parameters(graph_module.graph)
        if not found:
            raise PlanError(f"expert_parallel on {self.axis!r}: the model has no mixture-of-experts block (grouped "
                            f"matmuls over stacked expert weights, e.g. Hugging Face's default experts)\n"
                            f"  fix: leave expert_parallel out, or use data_parallel on {self.axis!r}")
        rules = []
        for path, params in found.items():
            for param in params:
                info = placeholders[param.name]
                rules.append(ParamRule(info.target, Shard(0), why=f"experts of {path} split by expert"))
        return Strategy(name=self.name, axis=self.axis, params=tuple(rules),
                        inputs=(InputRule(index=None, placement=Shard(self.batch_dim)),),
                        experts=ExpertDeclaration(batch_dim=self.batch_dim))


def expert_parallel(*, axis: str = "ep", batch_dim: int = 0) -> ExpertParallel:
    return ExpertParallel(axis=axis, batch_dim=batch_dim)
