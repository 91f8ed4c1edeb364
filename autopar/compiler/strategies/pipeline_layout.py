"""Pipeline stage layouts written as strings, the way Megatron-Core writes them.

`pipeline_parallel(layout="Et|(tt|)*3t|tL")` declares how many of the model's repeated blocks each
stage holds: `t` is one block (a transformer layer), `|` ends a stage, `E` the embedding (first
stage only, before its blocks), `L` the head and loss (last stage only, after its blocks);
`X*n` repeats one symbol and `(...)*n` a group; spaces are ignored. Stages are listed in order,
all `pp × virtual_stages` of them (dealt round-robin to the ranks of the axis, as
`pipeline_parallel` deals them). The example reads: 1 block and the embedding, then three stages
of 2, then 1 block and 1 block with the head: uneven stages, the ones carrying the embedding and
the head lighter.

`parse_layout(text)` gives the blocks per stage; `cut_points(counts)` the block indices where the
stages after the first start, as `pipeline_parallel(stages=...)` takes them (a block index matches
the block of that index in the model's layer list). The number of blocks the layout lists is
checked against the model's when the pipeline is split (`passes/split_pipeline.py`).
A stage holding only the embedding or only the head (Megatron's `E|t...`, `...t|L`) is refused:
stages start at blocks here.
"""
from __future__ import annotations

import re

from autopar.core.errors import PlanError

_TOKEN = re.compile(r"\s*(?:(\()|(\))(?:\*(\d+))?|([EtL|])(?:\*(\d+))?)")


def _expand(text: str) -> str:
    """`text` with every `X*n` and `(...)*n` written out."""
    stack: list[list[str]] = [[]]
    position = 0
    while position < len(text.rstrip()):
        match = _TOKEN.match(text, position)
        if match is None:
            rest = text[position:].lstrip()
            raise PlanError(f"pipeline layout {text!r}: cannot read {rest[0]!r} at position {len(text) - len(rest)} "
                            f"(symbols: E embedding, t block, L head and loss, | end of stage, X*n and (...)*n "
                            f"repeat)")
        opening, closing, group_times, symbol, symbol_times = match.groups()
        if opening:
            stack.append([])
        elif closing:
            if len(stack) == 1:
                raise PlanError(f"pipeline layout {text!r}: a ')' without its '('")
            group = "".join(stack.pop())
            stack[-1].append(group * int(group_times or 1))
        else:
            stack[-1].append(symbol * int(symbol_times or 1))
        position = match.end()
    if len(stack) != 1:
        raise PlanError(f"pipeline layout {text!r}: a '(' without its ')'")
    return "".join(stack[0])


def parse_layout(text: str) -> tuple[int, ...]:
    """Blocks per stage of a layout string (module docstring)."""
    expanded = _expand(text)
    if expanded.count("E") > 1 or expanded.count("L") > 1:
        raise PlanError(f"pipeline layout {text!r}: the embedding (E) and the head (L) appear once each")
    if "E" in expanded and not expanded.startswith("E"):
        raise PlanError(f"pipeline layout {text!r}: the embedding (E) comes first, in the first stage")
    if "L" in expanded and not expanded.rstrip("|").endswith("L"):
        raise PlanError(f"pipeline layout {text!r}: the head and loss (L) come last, in the last stage")
    stages = expanded.rstrip("|").split("|")
    counts = tuple(stage.count("t") for stage in stages)
    if any(count == 0 for count in counts):
        empty = counts.index(0)
        raise PlanError(f"pipeline layout {text!r}: stage {empty} ({stages[empty] or 'empty'}) holds no block; a stage "
                        f"of only the embedding or the head is not supported (stages start at blocks): give every "
                        f"stage at least one t")
    return counts


def cut_points(counts: tuple[int, ...]) -> tuple[str, ...]:
    """The block index where each stage after the first starts."""
    starts, total = [], 0
    for count in counts[:-1]:
        total += count
        starts.append(str(total))
    return tuple(starts)
