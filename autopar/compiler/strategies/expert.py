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

**Folding** (Megatron's "parallel folding"): `expert_parallel(axis="ep", fold=("tp",))` splits the
experts over the ranks of `ep` and of the folded axes together (their flattened group, mesh order:
the exchange's group key `ep+tp`), while everything else keeps the folded axes' own strategies.
On mesh `ep=4,tp=2` with `tensor_parallel()` the attention runs 4-way data × 2-way tensor
parallel and the experts 8-way expert parallel with no expert-tensor split; without `fold` the
same mesh splits each expert's FFN over tp (expert-tensor × expert = 2 × 4). `fold_experts`
(called by `resolve_strategies` once every strategy is bound) takes the experts out of the folded
axes' strategies — their expert weight rules and the replicated-tokens layout tensor parallelism
gives an experts module — and shards the expert weights by expert there. A folded axis on which
the tokens are replicated (tensor parallelism without sequence parallelism) has each rank route
its 1/n of them (`autopar/compiler/rules/expert_rules.py`, `permute_rule`); the tokens are
gathered again where the next op needs them whole. Folding onto a ZeRO/FSDP or pipeline axis is
refused: the training-state shards and the stages are cut from the same ranks the experts would be.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.compiler.passes.lower_moe import expert_parameters
from autopar.compiler.rules.expert_rules import is_grouped_mm
from autopar.compiler.strategies import ROLES, InputRule, ParamRule, Strategy, strategy_role
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
    fold: tuple[str, ...] = ()  # axes of other strategies the experts are also split over (module docstring)


@dataclass(frozen=True)
class ExpertParallel:
    """`expert_parallel()` before it has seen the graph; `bind` finds the experts' weights."""

    axis: str
    batch_dim: int = 0
    capacity_factor: float | None = None
    drop_tokens: bool = False
    fold: tuple[str, ...] = ()
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
                                                  drop_tokens=self.drop_tokens, fold=self.fold))

    def fold_onto(self, *, mesh: Mesh, strategies: list[Strategy], graph_module: torch.fx.GraphModule,
                  placeholders: dict) -> list[Strategy]:
        """The bound strategies with the experts folded onto `fold`'s axes (`fold_experts`)."""
        if not self.fold or mesh.size(self.axis) == 1:
            return strategies
        return fold_experts(mesh, strategies, self.fold, graph_module, placeholders)


def expert_parallel(*, axis: str = "ep", fold: "tuple[str, ...] | list[str] | str" = (), batch_dim: int = 0,
                    capacity_factor: float | None = None, drop_tokens: bool = False) -> ExpertParallel:
    """Experts split over `axis`, and over the axes in `fold` too (module docstring). Dropless by
    default; `capacity_factor=c` lets each expert take at most ceil(c · rows / E) of a rank's routed
    rows, which drops tokens unless c >= E: then `drop_tokens=True` must say that is wanted (else a
    plan-time error)."""
    if capacity_factor is not None and capacity_factor <= 0:
        raise PlanError(f"expert_parallel(capacity_factor={capacity_factor}): a capacity factor is positive\n"
                        f"  fix: leave it out (dropless) or give a factor > 0, e.g. 1.25")
    folded = (fold,) if isinstance(fold, str) else tuple(fold)
    if axis in folded or len(set(folded)) != len(folded):
        raise PlanError(f"expert_parallel(axis={axis!r}, fold={folded}): each axis once, the expert axis not among "
                        f"the folded ones\n  fix: fold the other strategies' axes only, e.g. fold=('tp',)")
    return ExpertParallel(axis=axis, batch_dim=batch_dim, capacity_factor=capacity_factor, drop_tokens=drop_tokens,
                          fold=folded)


_FOLDABLE = {"data", "tensor", "context"}


def fold_experts(mesh: Mesh, strategies: list[Strategy], fold: tuple[str, ...], graph_module: torch.fx.GraphModule,
                 placeholders: dict) -> list[Strategy]:
    """The strategies with the experts moved onto the folded axes of the expert-parallel one
    (module docstring): on each folded axis a strategy sharding every expert weight by expert comes
    first, and the other strategies there lose their rules for expert weights and their layouts of
    experts modules."""
    found = expert_parameters(graph_module.graph)
    targets = {placeholders[p.name].target for params in found.values() for p in params}
    folded = []
    for axis in fold:
        mesh.require_axis(axis, wanted_by=f"expert_parallel(fold={fold})")
        if mesh.size(axis) == 1:
            continue
        on_axis = [s for s in strategies if s.axis == axis]
        refused = [f"{s.name} {ROLES[strategy_role(s)]}" for s in on_axis
                   if strategy_role(s) is not None and strategy_role(s) not in _FOLDABLE]
        refused += [f"{s.name} shards the training state" for s in on_axis if s.sharded_state is not None]
        if refused or not on_axis:
            what = "; ".join(refused) or "no strategy uses it"
            raise PlanError(f"expert_parallel(fold={fold}): the experts cannot be folded onto {axis!r}: "
                            f"{what}\n  fix: fold only axes of data, tensor or context parallelism without ZeRO/FSDP "
                            f"(keep the experts' own axis for the rest: mesh 'dp=2,ep=2,tp=2' with fold=('tp',))")
        folded.append(axis)
    result = []
    for strategy in strategies:
        if strategy.axis in folded:
            strategy = replace(strategy, params=tuple(r for r in strategy.params if r.pattern not in targets),
                               modules=tuple(m for m in strategy.modules if m.pattern not in found))
        result.append(strategy)
    for axis in folded:
        rules = tuple(ParamRule(target, Shard(0), why=f"experts split by expert over {axis} too (folded)")
                      for target in sorted(targets))
        result.insert(0, Strategy(name="expert_parallel[folded]", axis=axis, params=rules))
    return result


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
