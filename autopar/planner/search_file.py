"""Search files: a planner search kept as a versioned JSON document, read back without searching again.

`search_document(result, target=, winner=)` is the search's data (`search_report.search_data`:
the cluster's name and figures, batch and sequence, every candidate in rank order with its peak
memory per rank, bytes, predicted step and parts, binding constraint or refusal and why it lost,
the candidates passed over unplanned) with what was searched (`target`), the autopar version that
searched, and optionally the winner's plan document (`winner`: a `Plan`; `autopar explain
search.json NODE` reads it). `save_search` writes it; `load_search` reads it back as a
`SearchDocument`, which prints what the search printed (`report`, `answer`, `table`) and hands
out the winner's plan (`winner_plan`).

A file is told apart by its content, never its name: its `"schema"` is `SCHEMA`. `load_search`
refuses, naming the file, a search file of another schema version, a plan file (`autopar.plan/…`)
and any other JSON; `file_kind(path)` says which kind a file is, for callers that take both.
"""
from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar.compiler.plan_file import SCHEMA as PLAN_SCHEMA
from autopar.compiler.plan_file import PlanDocument
from autopar.core.errors import PlanError
from autopar.planner.search_report import answer, ranking_table, report, search_data

if TYPE_CHECKING:
    from autopar.planner.search import SearchResult

SCHEMA = "autopar.search/1"
SEARCH_PREFIX = SCHEMA.split("/")[0] + "/"
PLAN_PREFIX = PLAN_SCHEMA.split("/")[0] + "/"


def autopar_version() -> str:
    try:
        return importlib.metadata.version("autopar")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@dataclass
class SearchDocument:
    """A search as data: from `search_document(result)` or a search file. Renders the search's report."""

    data: dict[str, Any]

    def report(self, *, top: int | None = None) -> str:
        return report(self.data, top=top)

    def answer(self) -> str:
        return answer(self.data)

    def table(self, *, top: int | None = None) -> str:
        return ranking_table(self.data, top=top)

    def winner_plan(self, *, path: "str | Path" = "the search") -> PlanDocument:
        """The winner's plan document, where the search file holds one."""
        plan = self.data.get("plan")
        if plan is None:
            raise PlanError(f"{path} holds no plan of the chosen layout; fix: search again with "
                            f"`autopar plan TARGET --cluster NAME --auto --save {path}`")
        if plan.get("schema") != PLAN_SCHEMA:
            raise PlanError(f"{path} holds a plan of schema {plan.get('schema')!r}, this autopar reads "
                            f"{PLAN_SCHEMA!r}; fix: search again with `autopar plan TARGET --cluster NAME --auto "
                            f"--save {path}`")
        return PlanDocument(plan)


def search_document(result: "SearchResult", *, target: str | None = None, winner: Any = None) -> SearchDocument:
    """The search's data with what was searched, this autopar's version and the winner's plan (module docstring)."""
    data = {"schema": SCHEMA, "autopar": autopar_version(), "target": target, **search_data(result),
            "plan": None if winner is None else winner.document().data}
    return SearchDocument(data)


def save_search(document: SearchDocument, path: "str | Path") -> None:
    Path(path).write_text(json.dumps(document.data, indent=1) + "\n")


def file_kind(path: "str | Path") -> str | None:
    """What the file at `path` is, by its content: "search" or "plan" (its `"schema"`), "json" for
    other JSON, None for a file that is not JSON (a TARGET's .py, say). Unreadable paths raise `PlanError`."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise PlanError(f"cannot read {path}: {error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    schema = data.get("schema") if isinstance(data, dict) else None
    if isinstance(schema, str) and schema.startswith(SEARCH_PREFIX):
        return "search"
    if isinstance(schema, str) and schema.startswith(PLAN_PREFIX):
        return "plan"
    return "json"


def load_search(path: "str | Path") -> SearchDocument:
    """A search file read back; another version, a plan file or other JSON refused (module docstring)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PlanError(f"cannot read search file {path}: {error}") from None
    found = data.get("schema") if isinstance(data, dict) else None
    again = f"fix: search again with `autopar plan TARGET --cluster NAME --auto --save {path}`"
    if isinstance(found, str) and found.startswith(PLAN_PREFIX):
        raise PlanError(f"{path} is a plan file ({found}), not a search file; `autopar explain {path} NODE` "
                        f"explains a node of it, and a search file comes from "
                        f"`autopar plan TARGET --cluster NAME --auto --save FILE`")
    if isinstance(found, str) and found.startswith(SEARCH_PREFIX) and found != SCHEMA:
        raise PlanError(f"search file {path} has schema {found!r} (written by autopar "
                        f"{data.get('autopar', 'unknown')}), this autopar {autopar_version()} reads {SCHEMA!r}; {again}")
    if found != SCHEMA:
        raise PlanError(f"{path} is not an autopar search file (its \"schema\" is {found!r}, a search file's is "
                        f"{SCHEMA!r}); {again}")
    return SearchDocument(data)
