"""Expert parallelism as data: the experts of every mixture-of-experts block split over one axis,
tokens carried to their experts by all-to-all.

`expert_parallel(axis="ep", batch_dim=0)` binds to the traced graph (`bind`): every parameter
that a grouped matmul of an experts block reads as its weights (`autopar/compiler/passes/lower_moe.py`,
`expert_parameters`: stacked [E, ...] tensors) is sharded on its expert dimension, Shard(0), so
rank r of the axis owns experts r·E/N .. (r+1)·E/N-1; every user input is sharded on its batch
dimension over the same axis. The axis is thus carved from the data axes: everything but the
experts sees it as data parallelism (replicated weights, gradients all-reduced over it), the
experts see their tokens arrive by `moe_dispatch` and leave by `moe_combine`
(`autopar/core/ops/moe.py`), which `autopar/compiler/passes/lower_moe.py` puts around each block's experts. Composed with
`data_parallel` on `dp` it is torchtitan's dp_shard = efsdp · ep: tokens over dp × ep, attention
synchronised over both, experts over dp only. The other parameters' gradient buckets over the
axis are all-reduced as `data_parallel`'s are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.compiler.passes.lower_moe import expert_parameters
from autopar.compiler.rules.expert_rules import is_grouped_mm
from autopar.compiler.strategies import InputRule, ParamRule, Strategy
from autopar.core.errors import PlanError
from autopar.core.ir import hint, module_path
from autopar.core.mesh import Mesh


@dataclass(frozen=True)
class ExpertDeclaration:
    """What `expert_parallel` declared: a capacity factor (None: dropless) and whether the user
    accepts the tokens it drops."""

    batch_dim: int = 0
    capacity_factor: float | None = None
    drop_tokens: bool = False


@dataclass(frozen=True)
class ExpertParallel:
    """`expert_parallel()` before it has seen the graph; `bind` finds the experts' weights."""

    axis: str
    batch_dim: int = 0
    capacity_factor: float | None = None
    drop_tokens: bool = False
    name: str = "expert_parallel"

    def bind(self, *, mesh: Mesh, graph_module: torch.fx.GraphModule, placeholders: dict) -> Strategy:
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
                        experts=ExpertDeclaration(batch_dim=self.batch_dim, capacity_factor=self.capacity_factor,
                                                  drop_tokens=self.drop_tokens))


def expert_parallel(*, axis: str = "ep", batch_dim: int = 0, capacity_factor: float | None = None,
                    drop_tokens: bool = False) -> ExpertParallel:
    """Experts split over `axis` (module docstring). Dropless by default; `capacity_factor=c` lets
    each expert take at most ceil(c · rows / E) of a rank's routed rows, which drops tokens unless
    c >= E: then `drop_tokens=True` must say that is wanted (else a plan-time error)."""
    if capacity_factor is not None and capacity_factor <= 0:
        raise PlanError(f"expert_parallel(capacity_factor={capacity_factor}): a capacity factor is positive\n"
                        f"  fix: leave it out (dropless) or give a factor > 0, e.g. 1.25")
    return ExpertParallel(axis=axis, batch_dim=batch_dim, capacity_factor=capacity_factor, drop_tokens=drop_tokens)


# ---- experts under tensor parallelism (tensor_parallel() found in the graph binds these too)

_VIEW_DIMS = {torch.ops.aten.permute.default, torch.ops.aten.transpose.int}


def _param_dim(weight: torch.fx.Node, dim: int) -> tuple[torch.fx.Node, int] | None:
    """The parameter a grouped matmul's weight argument is a permuted view of, and which of its
    dimensions is the weight's `dim`; None when anything but permutes and transposes is in between."""
    node = weight
    while node.op == "call_function":
        if node.target not in _VIEW_DIMS:
            return None
        rank = len(node.meta["val"].shape)
        if node.target is torch.ops.aten.permute.default:
            dim = node.args[1][dim] % rank
        else:
            a, b = (d % rank for d in node.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        node = node.args[0]
    return (node, dim) if node.op == "placeholder" else None


def _split_in_two(node: torch.fx.Node) -> bool:
    """The grouped matmul's output is only split into two equal halves of its last dimension (gate | up)."""
    users = list(node.users)
    if len(users) != 1 or users[0].target not in (torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default,
                                                  torch.ops.aten.split.Tensor):
        return False
    split = users[0]
    last = len(node.meta["val"].shape) - 1
    dim = (split.args[2] if len(split.args) > 2 else 0) % (last + 1)
    parts = split.args[1]
    halves = parts == 2 if split.target is torch.ops.aten.chunk.default else (
        isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] == parts[1])
    return dim == last and halves


def expert_tensor_layout(graph_module: torch.fx.GraphModule, placeholders: dict, size: int
                         ) -> tuple[list[ParamRule], list[str], list[str]]:
    """Megatron's column | row split inside every expert of each two-matmul experts block: the
    first grouped matmul's weight split on its output features (a fused gate|up as two blocks,
    `_StridedShard(split_factor=2)`), the second's on its input features; the block's tokens enter
    replicated on the axis (gathered under sequence parallelism). Returns (parameter rules, experts
    modules to give replicated inputs, notes on blocks left replicated)."""
    blocks: dict[str, list[torch.fx.Node]] = {}
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and is_grouped_mm(node.target):
            blocks.setdefault(module_path(node), []).append(node)
    rules, modules, notes = [], [], []
    for path, grouped in blocks.items():
        if len(grouped) != 2:
            notes.append(f"{path}: {len(grouped)} grouped matmuls (tensor parallelism splits two) — experts replicated")
            continue
        column, row = _param_dim(grouped[0].args[1], 2), _param_dim(grouped[1].args[1], 1)
        if column is None or row is None:
            notes.append(f"{path}: expert weights are not plain parameters — experts replicated")
            continue
        fused = _split_in_two(grouped[0])
        (first, first_dim), (second, second_dim) = column, row
        widths = (hint(first.meta["val"].shape[first_dim]) // (2 if fused else 1), hint(second.meta["val"].shape[second_dim]))
        if any(width % size for width in widths):
            notes.append(f"{path}: expert widths {widths} do not divide over {size} — experts replicated")
            continue
        placement = _StridedShard(first_dim, split_factor=2) if fused else Shard(first_dim)
        rules += [ParamRule(placeholders[first.name].target, placement,
                            why=f"experts of {path}: columns of each expert's first matmul" + (" (gate|up blocks)" if fused else "")),
                  ParamRule(placeholders[second.name].target, Shard(second_dim),
                            why=f"experts of {path}: rows of each expert's second matmul")]
        modules.append(path)
    return rules, modules, notes
