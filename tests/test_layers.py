"""The house's rules, checked: the layer contracts of pyproject.toml (import-linter), no import
cycle anywhere in the library, an import inside a function only with its reason on the line, no
folder of the library with more than 15 modules at its top, and no talk of the machine it happens
to run on in library code."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "autopar"


def _import_cycles() -> list[list[str]]:
    """Every strongly connected component of more than one module in the import graph that
    import-linter checks (grimp's; imports for type annotations only are left out)."""
    graph = grimp.build_graph("autopar", exclude_type_checking_imports=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_layer_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "import-linter is a dependency of the test extra (pip install -e '.[test]')"
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "BROKEN" not in result.stdout and result.stdout.count("KEPT") >= 6, result.stdout[-3000:]


def test_no_import_cycle():
    assert _import_cycles() == []


def _function_imports(path: Path) -> list[tuple[int, str]]:
    lines = path.read_text().splitlines()
    found = set()
    for function in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found.add((node.lineno, lines[node.lineno - 1]))
    return sorted(found)


def test_imports_inside_functions_say_why():
    unexplained = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                   for path in sorted(LIBRARY.rglob("*.py")) for number, line in _function_imports(path)
                   if "#" not in line]
    assert unexplained == [], "an import inside a function needs its reason on the line (an optional " \
                              "dependency, start-up time), never a cycle:\n" + "\n".join(unexplained)


def test_no_folder_holds_more_than_15_modules():
    crowded = {str(folder.relative_to(ROOT)): count for folder in [LIBRARY, *LIBRARY.rglob("*")] if folder.is_dir()
               and (count := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > 15}
    assert crowded == {}


MACHINE_TALK = re.compile(r"2-core|two[- ]core|this (CPU )?machine|on this CPU", re.IGNORECASE)


def test_library_does_not_talk_about_the_machine_it_runs_on():
    talk = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in sorted(LIBRARY.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if MACHINE_TALK.search(line)]
    assert talk == []


@pytest.mark.parametrize("package", ["core", "compiler", "cost", "planner", "artifacts", "runtime", "tools",
                                     "measure"])
def test_each_folder_says_what_it_owns(package):
    init = LIBRARY / package / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"autopar/{package}/__init__.py needs a module docstring"
