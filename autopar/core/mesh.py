"""The user-declared device mesh: named axes, outermost first, and the node hierarchy.

`Mesh(dp=2, tp=2)` or `Mesh.parse("dp=2,tp=2")` declares the axes; `ranks_per_node` says how
many consecutive ranks share a node, so each axis knows whether its groups stay inside a node
(`intra`) or cross nodes (`inter`). `device_mesh()` builds the matching torch DeviceMesh: a
real one under an initialised process group, or a plan-only one (no backend) for planning.

Collectives name their process group by a group key: an axis name (`dp`), `axis@i,j` for the
ranks at coordinates i, j of an axis (a tied parameter's pipeline stages), or `a+b` for the
ranks of several axes at once (the flattened group of `sync_keys`: one all-reduce over dp × cp
instead of one per axis). `group_slices`, `group_size` and `link` answer for every form.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, _redistribute

from autopar.core.errors import PlanError

KNOWN_AXES = ("pp", "dp", "dp_rep", "dp_shard", "cp", "ep", "tp")
JOIN = "+"  # between the axes of a group key over several axes (`dp+cp`)


def joined_by_link(axes: "Sequence[str]", link: "Callable[[str], str]", size: "Callable[[str], int]") -> tuple[str, ...]:
    """`axes` (in mesh order) as group keys reduced one after the other: those on one link joined
    into one key, node-local first; an axis of size 1 left out of a joined key (`Mesh.sync_keys`,
    and the planner's pricing of a candidate's mesh, `composed_cost`)."""
    keys = []
    for where in ("intra", "inter"):
        joined = [a for a in axes if link(a) == where]
        if len(joined) > 1:
            joined = [a for a in joined if size(a) > 1] or joined[:1]
        if joined:
            keys.append(JOIN.join(joined))
    return tuple(keys)


@dataclass(frozen=True)
class Mesh:
    """Named mesh axes (outermost first) and how many ranks share one node."""

    axes: tuple[tuple[str, int], ...]
    ranks_per_node: int | None = None
    _sizes: dict[str, int] = field(init=False, repr=False, compare=False)
    _links: dict[str, str] = field(init=False, repr=False, compare=False)  # `link` per group key, once

    def __init__(self, axes: dict[str, int] | None = None, *, ranks_per_node: int | None = None, **sizes: int) -> None:
        declared = dict(axes or {}, **sizes)
        if not declared:
            raise PlanError("a mesh needs at least one axis, e.g. Mesh(dp=2) or 'dp=2,tp=2'")
        for name, size in declared.items():
            if not name.isidentifier():
                raise PlanError(f"mesh axis name {name!r} is not an identifier; use names like dp, tp, pp")
            if not isinstance(size, int) or size < 1:
                raise PlanError(f"mesh axis {name!r} has size {size!r}; every axis needs a positive integer size")
        world = math.prod(declared.values())
        if ranks_per_node is not None and (ranks_per_node < 1 or (world % ranks_per_node and ranks_per_node < world)):
            raise PlanError(f"ranks_per_node={ranks_per_node} does not divide the world size {world}")
        object.__setattr__(self, "axes", tuple(declared.items()))
        object.__setattr__(self, "ranks_per_node", ranks_per_node)
        object.__setattr__(self, "_sizes", dict(declared))
        object.__setattr__(self, "_links", {})

    @classmethod
    def parse(cls, spec: "str | Mesh | dict[str, int]", *, ranks_per_node: int | None = None) -> "Mesh":
        """Accept a Mesh, a dict, or the string form "dp=2,tp=2" (optionally ";node=4").

        `ranks_per_node` fills in the node size where the declaration does not give one."""
        if isinstance(spec, Mesh):
            if spec.ranks_per_node is None and ranks_per_node is not None:
                return cls(dict(spec.axes), ranks_per_node=ranks_per_node)
            return spec
        if isinstance(spec, dict):
            return cls(spec, ranks_per_node=ranks_per_node)
        axes: dict[str, int] = {}
        text, _, node_part = spec.partition(";")
        if node_part:  # a node size written in the declaration wins
            key, _, value = node_part.partition("=")
            if key.strip() != "node" or not value.strip().isdigit():
                raise PlanError(f"cannot read {node_part!r} in mesh {spec!r}; write e.g. 'dp=2,tp=4;node=4'")
            ranks_per_node = int(value)
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, value = part.partition("=")
            if not eq or not value.strip().lstrip("-").isdigit():
                raise PlanError(f"cannot read {part!r} in mesh {spec!r}; write axes as name=size, e.g. 'dp=2,tp=2'")
            if name.strip() in axes:
                raise PlanError(f"mesh axis {name.strip()!r} is declared twice in {spec!r}")
            axes[name.strip()] = int(value)
        return cls(axes, ranks_per_node=ranks_per_node)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, axis: str) -> int:
        self.require_axis(axis)
        return self._sizes[axis]

    def require_axis(self, axis: str, *, wanted_by: str = "") -> None:
        if axis not in self._sizes:
            who = f" (named by {wanted_by})" if wanted_by else ""
            raise PlanError(f"unknown mesh axis {axis!r}{who}; the mesh has axes {list(self.names)}. "
                            f"Declare it, e.g. Mesh({axis}=2, ...), or drop it from the strategy")

    def coordinate(self, rank: int, axis: str) -> int:
        """This rank's index along `axis` (row-major, outermost axis first)."""
        index = self.names.index(axis)
        stride = math.prod(self.shape[index + 1:])
        return (rank // stride) % self.shape[index]

    def neighbour(self, rank: int, axis: str, offset: int) -> int:
        """The global rank whose coordinate on `axis` is this rank's plus `offset` (modulo the axis
        size), all other coordinates equal: a pipeline peer, a ring neighbour."""
        index = self.names.index(axis)
        stride = math.prod(self.shape[index + 1:])
        here = self.coordinate(rank, axis)
        return rank + (((here + offset) % self.shape[index]) - here) * stride

    def group_ranks(self, rank: int, axis: str, coordinates: "tuple[int, ...] | None" = None) -> list[int]:
        """The global ranks of `rank`'s group along `axis` (optionally only those coordinates on it)."""
        chosen = range(self.size(axis)) if coordinates is None else coordinates
        return [self.neighbour(rank, axis, c - self.coordinate(rank, axis)) for c in chosen]

    @staticmethod
    def split_group(key: str) -> tuple[str, tuple[int, ...] | None]:
        """A group key's axis part (an axis name, or `a+b` for several) and the coordinates after
        its `@`, or None (module docstring)."""
        axis, _, coordinates = key.partition("@")
        return axis, tuple(int(c) for c in coordinates.split(",")) if coordinates else None

    def group_slices(self, key: str) -> list[tuple[int, ...]]:
        """Every group of a key, each ascending, in a fixed order (the same on every rank: process
        groups are created in it). O(world size): the offsets inside a group plus the offsets of
        the other axes' coordinates, not one group per rank."""
        axis, coordinates = self.split_group(key)
        parts = axis.split(JOIN)
        strides = {name: math.prod(self.shape[i + 1:]) for i, name in enumerate(self.names)}
        inside = [0]
        for part in parts:
            chosen = coordinates if coordinates is not None else range(self.size(part))
            inside = [offset + c * strides[part] for offset in inside for c in chosen]
        outside = [0]
        for name in self.names:
            if name not in parts:
                outside = [offset + c * strides[name] for offset in outside for c in range(self.size(name))]
        return sorted(tuple(sorted(base + offset for offset in inside)) for base in outside)

    def group_size(self, key: str) -> int:
        axis, coordinates = self.split_group(key)
        if coordinates is not None:
            return len(coordinates)
        return math.prod(self.size(part) for part in axis.split(JOIN))

    def group_index(self, rank: int, key: str) -> int:
        """`rank`'s position in its group of `key`: its coordinate on a plain axis; over several
        axes (`ep+tp`), row-major over them in mesh order, which is its place in the group's
        ascending ranks (how nested Shard(0)s over those axes cut a tensor)."""
        axis, coordinates = self.split_group(key)
        if coordinates is None and JOIN not in axis:
            return self.coordinate(rank, axis)
        return next(group.index(rank) for group in self.group_slices(key) if rank in group)

    def sync_keys(self, axes: "tuple[str, ...] | list[str]") -> tuple[str, ...]:
        """The group keys a gradient partial over `axes` is all-reduced over, one after the other.

        Plain axes on the same link become one key (`dp+cp`, in mesh order): one all-reduce over
        the flattened group moves 2(ab−1)/ab of the gradient per rank where one per axis moves
        2(a−1)/a + 2(b−1)/b, in fewer calls (Megatron's data-parallel group with context
        parallelism, torchtitan's flattened dp_shard_cp mesh do the same). Axes on different links
        stay apart, the node-local one first: a ring over both would run every one of its
        2(ab−1) steps at the slow link's pace, where the chain runs only the cross-node axis's
        there. Sub-groups (`pp@0,3`) stay apart, last. Axes of size 1 are dropped from a joined
        key."""
        plain = [a for a in self.names if a in axes]
        return joined_by_link(plain, self.link, self.size) + tuple(a for a in axes if a not in plain)

    def link(self, key: str) -> str:
        """'intra' if every group of the key (an axis, `axis@i,j`, `a+b`) stays inside one node, else 'inter'."""
        if key not in self._links:
            self._links[key] = self._find_link(key)
        return self._links[key]

    def _find_link(self, key: str) -> str:
        per_node = self.ranks_per_node or self.world_size
        if any(len({member // per_node for member in group}) > 1 for group in self.group_slices(key)):
            return "inter"
        return "intra"

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise PlanError(f"mesh {self} has {self.world_size} ranks but the job has world size {world_size}; "
                            f"make the product of the axis sizes equal the number of processes")

    def device_mesh(self, *, device_type: str = "cpu", plan_rank: int | None = None) -> DeviceMesh:
        """A torch DeviceMesh over these axes. With `plan_rank` no process group is needed."""
        with unset_fake_temporarily():  # planning may run under the caller's FakeTensorMode
            ranks = torch.arange(self.world_size).reshape(self.shape)
            if plan_rank is not None:
                return DeviceMesh(device_type, ranks, mesh_dim_names=self.names, _init_backend=False, _rank=plan_rank)

        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)

    def __str__(self) -> str:
        text = ",".join(f"{name}={size}" for name, size in self.axes)
        return f"{text};node={self.ranks_per_node}" if self.ranks_per_node else text


def release_planning_caches() -> None:
    """Let planning-only DeviceMeshes go once a plan is made. Asking DTensor's rules fills three
    caches that keep the meshes of the specs they saw alive for the life of the process (and with
    them each mesh's rank map): the redistribution planner cache (keyed by a weak reference to the
    mesh, but the cached planner holds the mesh), and the sharding propagator's LRU caches of
    tensor metadata and of shardings. A plan keeps its own mesh; the layout checker's and earlier
    plans' would otherwise stay. DTensor refills the caches on demand."""
    _redistribute.clear_redistribute_planner_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator._propagate_tensor_meta_cached.cache_clear()
    propagator.propagate_op_sharding.cache.cache_clear()
