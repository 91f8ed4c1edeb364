"""Running a benchmark's rows: each row's job on local processes, a failed row reported, not fatal.

Shared by the comparison benchmarks (`compare_step_time.py`, `compare_fsdp.py`,
`compare_pipeline.py`; `failure_reason` also by `moe_expert_parallel.py` and `pipeline_bubble.py`).
"""
from __future__ import annotations

import re
import time
from typing import Any, Callable

from autopar.runtime.launch import launch


def failure_reason(text: str, *, limit: int = 400) -> str:
    """The exception line of the last traceback in `text` and what follows it, on one line."""
    lines = text.strip().splitlines()
    exception_lines = [i for i, line in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    start = exception_lines[-1] if exception_lines else len(lines) - 1
    return " ".join(line.strip() for line in lines[start:])[:limit]


def run_rows(row_names: list[str], settings: Any, *, timeout_s: float, run: Callable, summarize: Callable,
             world_size: int, columns: int = 9) -> list[tuple]:
    """Each row on `world_size` processes (`run(rank, world, row_name, settings)`), summarised
    (`summarize(row_name, ranks)`); a failed row becomes `columns` n/a cells and a note."""
    summaries = []
    for row_name in row_names:
        start = time.perf_counter()
        try:
            ranks = launch(run, world_size, row_name, settings, timeout_s=timeout_s)
        except RuntimeError as error:
            summaries.append(([row_name, *["n/a"] * columns], [], [f"{row_name}: failed: {failure_reason(str(error))}"]))
            print(f"{row_name}: failed in {time.perf_counter() - start:.0f} s", flush=True)
            continue
        summaries.append(summarize(row_name, ranks))
        print(f"{row_name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return summaries
