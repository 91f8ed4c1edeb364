"""Repeated blocks traced once: a deep model is exported with its first three blocks and the
third block's graph is copied for every other one.

Tracing (`torch.export` and the decomposition to core ATen) costs most of planning time, about a
second per Llama layer on a small CPU host, and the layers of a transformer are the same graph again with other parameters.
1. `find_repeated_blocks`: the outermost `nn.ModuleList` of at least `MIN_BLOCKS` children whose
   `_signature`s are all equal (module types, parameter and buffer shapes and dtypes, plain
   attributes; only `layer_idx` may differ) is the candidate.
2. `truncated`: while exporting, the list holds its first `TRACED` (3) children only.
3. `replicate_blocks`, on the traced graph: blocks 1 and 2 must be isomorphic (`_isomorphic`:
   node for node the same op, module path, value shape and arguments, where an argument is the
   same shared node — an input, a position table, a mask, a symbolic size — or the same
   position in its own block, or, for block 2, a tensor of block 1: the value carried from one
   block to the next), nothing after block 1 may read it except block 2, and block 2's
   placeholders are its own parameters, buffers and lifted constants (tensors made in forward,
   such as an empty KV cache: export numbers them over the model, so they are paired by their
   order inside the block, `_relative`, and must hold equal values). Block 2 is then copied for
   blocks 3..n-1 (`_copy_block`): its parameters and buffers get placeholders named as export
   names them (`p_`/`b_` + the path; a constant `c_`, numbered on as export numbers them), its nodes are copied with their module paths renamed, a value carried
   from block 1 is read from the copy before, and what came after block 2 (the final norm, the
   head) reads the last copy. The result is the graph a full export would give, node for node,
   except that the copies' node names are fx's (`mm_13_1`) rather than export's counters. The
   module is not recompiled (generating and compiling the code of the 70B's 7,900 nodes costs about
   0.35 s): `trace.trace_model` wraps the graph in a module that generates its code when first read.
When a check fails the caller traces the whole model (`trace.trace_model`). Not seen by the
checks: a forward that reads the list's length for anything but iterating it (a constant such as
1/len(layers) computed in forward, rather than in __init__) sees three blocks; such a model
should be planned with `reuse_blocks=False`.
`tests/test_repeated_blocks.py` compares the reused plan with the full one: placements of every
node and the communication ledger.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from autopar.compiler.context import PlaceholderInfo
from autopar.core.ir import module_stack

MIN_BLOCKS = 4  # with three traced, fewer blocks would save nothing
TRACED = 3  # blocks 0 and 1 show what block 2 reads from the block before; 2 is the template
_PLAIN = (int, float, str, bool, type(None), torch.dtype)


def _plain(value: Any) -> Any:
    """A comparable stand-in for an attribute: plain values as they are, objects by identity."""
    if isinstance(value, _PLAIN):
        return type(value), value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return type(value), tuple(value)
    return "object", id(value)


def _signature(block: nn.Module) -> tuple:
    parts: list[Any] = []
    for name, module in block.named_modules():
        attributes = sorted((k, _plain(v)) for k, v in vars(module).items()
                            if not k.startswith("_") and k != "layer_idx")
        parts.append((name, type(module), tuple(attributes)))
    parts += [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()]
    parts += [(n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()]
    return tuple(parts)


def find_repeated_blocks(model: nn.Module) -> tuple[str, int] | None:
    """(path of the module list, number of blocks) of the outermost list of equal blocks, if any."""
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= MIN_BLOCKS:
            first = _signature(module[0])
            if all(_signature(block) == first for block in module):
                return path, len(module)
            return None  # the outermost list differs between blocks: trace it whole
    return None


@contextlib.contextmanager
def truncated(model: nn.Module, path: str, keep: int = TRACED) -> Iterator[None]:
    """The module list at `path` holds its first `keep` blocks meanwhile."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    full = parent._modules[name]
    parent._modules[name] = nn.ModuleList(list(full)[:keep])
    try:
        yield
    finally:
        parent._modules[name] = full


def _blocks(gm: torch.fx.GraphModule, path: str) -> list[list[torch.fx.Node]]:
    paths = [f"{path}.{i}" for i in range(TRACED)]
    blocks: list[list[torch.fx.Node]] = [[] for _ in paths]
    for node in gm.graph.nodes:
        stack = module_stack(node)
        found = next((i for i, p in enumerate(paths) if p in stack), None)
        if found is not None:
            blocks[found].append(node)
    return blocks


def _own_placeholders(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo], prefix: str
                      ) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in placeholders
            and placeholders[n.name].kind != "input" and placeholders[n.name].target.startswith(prefix)]


_LIFTED = re.compile(r"(^|\.)lifted_tensor_(\d+)$")


def _relative(nodes: list[torch.fx.Node], placeholders: dict[str, PlaceholderInfo], prefix: str
              ) -> dict[torch.fx.Node, str]:
    """Each of a block's own placeholders -> its name inside the block. Tensors torch.export lifted
    out of the forward (an empty KV cache made in attention) are numbered over the whole model
    (`self_attn.lifted_tensor_2` in the second block for `_0` in the first): they are numbered
    again inside the block, in the same order, so that two blocks' constants pair up."""
    names = {node: placeholders[node.name].target.removeprefix(prefix) for node in nodes}
    lifted = sorted((int(found.group(2)), node) for node, name in names.items()
                    if placeholders[node.name].kind == "constant" and (found := _LIFTED.search(name)))
    for local, (_, node) in enumerate(lifted):
        names[node] = _LIFTED.sub(rf"\g<1>lifted_tensor_{local}", names[node])
    return names


def _lifted_numbers(nodes: list[torch.fx.Node], placeholders: dict[str, PlaceholderInfo]) -> list[int]:
    return sorted(int(found.group(2)) for node in nodes if placeholders[node.name].kind == "constant"
                  and (found := _LIFTED.search(placeholders[node.name].target)))


def _lifted_step(earlier: list[torch.fx.Node], later: list[torch.fx.Node], placeholders: dict[str, PlaceholderInfo]
                 ) -> int | None:
    """How far export's numbering of lifted constants moves from one block to the next (the
    copies are numbered on, as a whole export numbers them); None where it does not move evenly."""
    first, second = _lifted_numbers(earlier, placeholders), _lifted_numbers(later, placeholders)
    steps = {b - a for a, b in zip(first, second)}
    return steps.pop() if len(first) == len(second) and len(steps) == 1 else None


def _numbered(name: str, by: int) -> str:
    return _LIFTED.sub(lambda found: f"{found.group(1)}lifted_tensor_{int(found.group(2)) + by}", name)


def _constants_alike(first: dict[torch.fx.Node, str], second: dict[torch.fx.Node, str],
                     placeholders: dict[str, PlaceholderInfo], state: dict) -> bool:
    """The two blocks' lifted constants of the same name hold the same values (real tensors only:
    a constant on the meta device cannot be compared, and the blocks are then not copied)."""
    mine = {name: node for node, name in first.items() if placeholders[node.name].kind == "constant"}
    for node, name in second.items():
        if placeholders[node.name].kind != "constant":
            continue
        a, b = state.get(placeholders[mine[name].name].target), state.get(placeholders[node.name].target)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.is_meta or b.is_meta \
                or (a.shape, a.dtype) != (b.shape, b.dtype) or not torch.equal(a, b):
            return False
    return True


def _value_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(str(s) for s in value.shape), tuple(str(s) for s in value.stride()), value.dtype
    if isinstance(value, torch.SymInt):
        return "symint", str(value)
    return type(value).__name__


class _Isomorphism:
    """Block 1 against block 2 (module docstring, step 3); `carried` maps block 2's reads of
    block 1 to positions in block 1."""

    def __init__(self, blocks: list[list[torch.fx.Node]], own: list[dict[torch.fx.Node, str]], path: str) -> None:
        self.blocks, self.own, self.path = blocks, own, path
        self.position = [{node: i for i, node in enumerate(block)} for block in blocks]

    def _renamed(self, stack: list[str], block: int) -> list[str]:
        pattern = re.compile(rf"^{re.escape(self.path)}\.{block}(?=\.|$)")
        return [pattern.sub(f"{self.path}.{block + 1}", p) for p in stack]

    def _same_argument(self, earlier: Any, later: Any) -> bool:
        if not isinstance(later, torch.fx.Node):
            return not isinstance(earlier, torch.fx.Node) and type(earlier) is type(later) and earlier == later
        if not isinstance(earlier, torch.fx.Node):
            return False
        if later in self.position[2]:
            return self.position[1].get(earlier) == self.position[2][later]
        if later in self.position[1]:  # carried from the block before
            return earlier in self.position[0] and isinstance(later.meta.get("val"), torch.Tensor)
        if later in self.own[2]:
            return self.own[1].get(earlier) == self.own[2][later]
        return earlier is later  # shared: what block 1 reads there, every block reads

    def holds(self) -> bool:
        first, second = self.blocks[1], self.blocks[2]
        if len(first) != len(second) or not second:
            return False
        for a, b in zip(first, second):
            if (a.op, a.target) != (b.op, b.target) or _value_key(a.meta.get("val")) != _value_key(b.meta.get("val")):
                return False
            if self._renamed(module_stack(a), 1) != module_stack(b):
                return False
            a_leaves, a_spec = pytree.tree_flatten((a.args, a.kwargs))
            b_leaves, b_spec = pytree.tree_flatten((b.args, b.kwargs))
            if a_spec != b_spec or not all(self._same_argument(x, y) for x, y in zip(a_leaves, b_leaves)):
                return False
        inside = set(first) | set(second)
        return all(user in inside for node in first for user in node.users)


def replicate_blocks(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo], state: dict,
                     model: nn.Module, path: str, count: int) -> bool:
    """Copy block 2 of the traced graph for blocks 3..count-1 (module docstring); False, and the
    graph untouched, where the blocks are not the same graph."""
    blocks = _blocks(gm, path)
    own_nodes = [_own_placeholders(gm, placeholders, f"{path}.{i}.") for i in range(TRACED)]
    own = [_relative(nodes, placeholders, f"{path}.{i}.") for i, nodes in enumerate(own_nodes)]
    if any(not block for block in blocks) or not _Isomorphism(blocks, own, path).holds():
        return False
    if sorted(own[1].values()) != sorted(own[2].values()) or not _constants_alike(own[1], own[2], placeholders, state):
        return False
    trainable = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    template, previous = blocks[2], blocks[2]
    after = {user for node in template for user in node.users if user not in set(template)}
    cursor = template[-1]
    run_ends = _run_ends(own_nodes[2])
    step = _lifted_step(own_nodes[1], own_nodes[2], placeholders)
    for index in range(TRACED, count):
        names = {node: _numbered(placeholders[node.name].target.removeprefix(f"{path}.2."), (index - 2) * step)
                 if step is not None and placeholders[node.name].kind == "constant" else name
                 for node, name in own[2].items()}
        read = _copy_placeholders(gm, own_nodes[2], names, run_ends, placeholders, state, f"{path}.{index}.",
                                  trainable, tensors)
        previous, cursor = _copy_block(gm, template, previous, blocks[1], read, path, index, cursor)
    for user in after:
        for i, node in enumerate(template):
            if node in user.all_input_nodes:
                user.replace_input_with(node, previous[i])
    _renumber(gm, placeholders, state)
    gm.graph.lint()  # not recompiled: the caller wraps the graph in a module that generates its code when read
    return True


def _run_ends(template: list[torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each template placeholder -> the last of its run (placeholders next to each other)."""
    ends: dict[torch.fx.Node, torch.fx.Node] = {}
    run: list[torch.fx.Node] = []
    for node in template:
        if run and run[-1].next is not node:
            ends.update((member, run[-1]) for member in run)
            run = []
        run.append(node)
    ends.update((member, run[-1]) for member in run)
    return ends


def _copy_placeholders(gm: torch.fx.GraphModule, template: list[torch.fx.Node], relative: dict[torch.fx.Node, str],
                       run_ends: dict[torch.fx.Node, torch.fx.Node], placeholders: dict[str, PlaceholderInfo],
                       state: dict, prefix: str, trainable: set[str], tensors: dict[str, torch.Tensor]
                       ) -> dict[torch.fx.Node, torch.fx.Node]:
    """A block's parameters and buffers as placeholders, each after its run in the template (and
    the copies already made there: `run_ends` moves on)."""
    copies = {}
    for node in template:
        target = prefix + relative[node]
        end = run_ends[node]
        with gm.graph.inserting_after(end):
            copy = gm.graph.placeholder(node.name[:2] + target.replace(".", "_"))
        copy.meta = dict(node.meta)
        for member, last in list(run_ends.items()):
            if last is end:
                run_ends[member] = copy
        info = placeholders[node.name]
        placeholders[copy.name] = PlaceholderInfo(info.kind, target, 0, target in trainable)
        # a lifted constant is no tensor of the model: the template's value (the blocks' are equal)
        state[target] = state[info.target] if info.kind == "constant" else tensors[target]
        copies[node] = copy
    return copies


def _copy_block(gm: torch.fx.GraphModule, template: list[torch.fx.Node], previous: list[torch.fx.Node],
                before: list[torch.fx.Node], read: dict[torch.fx.Node, torch.fx.Node], path: str, index: int,
                cursor: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node]:
    """Block 2's nodes again as block `index`: own nodes mapped to the copy, block 1's values to
    the copy before (`previous`), own placeholders to `read`, anything else shared."""
    position_in_template = {node: i for i, node in enumerate(template)}
    position_before = {node: i for i, node in enumerate(before)}
    pattern = re.compile(rf"^{re.escape(path)}\.2(?=\.|$)")
    copies: list[torch.fx.Node] = []

    def mapped(node: torch.fx.Node) -> torch.fx.Node:
        if node in position_in_template:
            return copies[position_in_template[node]]
        if node in position_before:
            return previous[position_before[node]]
        return read.get(node, node)

    for node in template:
        with gm.graph.inserting_after(cursor):
            copy = gm.graph.node_copy(node, mapped)
        copy.meta["nn_module_stack"] = {key: (pattern.sub(f"{path}.{index}", p) if isinstance(p, str) else p, kind)
                                        for key, (p, kind) in node.meta.get("nn_module_stack", {}).items()}
        copies.append(copy)
        cursor = copy
    return copies, cursor


def _renumber(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo], state: dict) -> None:
    """Placeholder positions and the state's order in graph order, as export gives them (user
    inputs keep their index)."""
    ordered = {}
    for position, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        info = placeholders[node.name]
        if info.kind != "input":
            placeholders[node.name] = PlaceholderInfo(info.kind, info.target, position, info.requires_grad)
            ordered[info.target] = state[info.target]
    ordered.update((target, tensor) for target, tensor in state.items() if target not in ordered)
    state.clear()
    state.update(ordered)


def drop_last_block(gm: torch.fx.GraphModule, placeholders: dict[str, PlaceholderInfo], state: dict, path: str,
                    count: int) -> bool:
    """The traced graph of a model whose list at `path` holds `count` (2 or 3) blocks turned into
    the graph of the same model with `count - 1`: the last block's nodes, parameters and buffers
    removed and what came after it (the final norm, the head, the output) reading the block
    before at the same position. The planner at scale plans each layout's model cut to one and to
    two blocks (`autopar/planner/block_ledgers.py`): one export instead of two. Checked as `replicate_blocks`
    checks its template — the two last blocks the same graph node for node, the last one's reads
    of the one before in place of what that one read, their own parameters named alike, and
    nothing but the last block reading the one before — False, and the graph untouched, where not."""
    if count not in (2, TRACED):
        return False
    blocks = _blocks(gm, path)
    kept, dropped = blocks[count - 2], blocks[count - 1]
    own_kept, own_dropped = (_own_placeholders(gm, placeholders, f"{path}.{i}.") for i in (count - 2, count - 1))
    # lifted constants keep their model-wide numbers here, so blocks that lift any are not dropped:
    # transformers' MoE blocks (Qwen3-MoE's KV-cache constants) read as a chain under-count a
    # block's activations under tp (1.15% of the held bytes at tp=4, `tests/test_planner_moe.py`),
    # while the two plans differenced agree
    relative = [{node: placeholders[node.name].target.removeprefix(f"{path}.{i}.") for node in nodes}
                for i, nodes in ((count - 2, own_kept), (count - 1, own_dropped))]
    if not kept or len(kept) != len(dropped) or sorted(relative[0].values()) != sorted(relative[1].values()):
        return False
    position = [{node: i for i, node in enumerate(block)} for block in (kept, dropped)]
    inside = set(kept) | set(dropped)
    if any(user not in inside for node in kept for user in node.users):
        return False
    if any(user not in set(dropped) for node in own_dropped for user in node.users):
        return False
    pattern = re.compile(rf"^{re.escape(path)}\.{count - 2}(?=\.|$)")

    def same_argument(earlier: Any, later: Any) -> bool:
        if not isinstance(later, torch.fx.Node):
            return not isinstance(earlier, torch.fx.Node) and type(earlier) is type(later) and earlier == later
        if not isinstance(earlier, torch.fx.Node):
            return False
        if later in position[1]:
            return position[0].get(earlier) == position[1][later]
        if later in position[0]:  # carried from the block before: that one read its own predecessor there
            return earlier not in inside and isinstance(later.meta.get("val"), torch.Tensor)
        if later in relative[1]:
            return relative[0].get(earlier) == relative[1][later]
        return earlier is later

    for a, b in zip(kept, dropped):
        if (a.op, a.target) != (b.op, b.target) or _value_key(a.meta.get("val")) != _value_key(b.meta.get("val")):
            return False
        if [pattern.sub(f"{path}.{count - 1}", p) for p in module_stack(a)] != module_stack(b):
            return False
        a_leaves, a_spec = pytree.tree_flatten((a.args, a.kwargs))
        b_leaves, b_spec = pytree.tree_flatten((b.args, b.kwargs))
        if a_spec != b_spec or not all(same_argument(x, y) for x, y in zip(a_leaves, b_leaves)):
            return False
    for node, counterpart in zip(dropped, kept):
        for user in list(node.users):
            if user not in position[1]:
                user.replace_input_with(node, counterpart)
    for node in reversed(dropped):
        gm.graph.erase_node(node)
    for node in own_dropped:
        state.pop(placeholders.pop(node.name).target, None)
        gm.graph.erase_node(node)
    _renumber(gm, placeholders, state)
    gm.graph.lint()
    gm.recompile()
    return True
