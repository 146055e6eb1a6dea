"""The package's layering, read from the source: the planner is pure arithmetic (no process
group, engine, trainer or CLI), checkpoints know formats but never import an engine, and
no module grows past ~600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[1] / "src" / "scaletrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every scaletrain module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("scaletrain"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("scaletrain"))
    return found


GRAPH = {module_name(p): imports_of(p) for p in SRC.rglob("*.py")}


def closure(start: str) -> set[str]:
    seen, todo = set(), [m for m in GRAPH if m == start or m.startswith(start + ".")]
    while todo:
        m = todo.pop()
        if m in seen or m not in GRAPH:
            continue
        seen.add(m)
        todo.extend(GRAPH[m])
    return seen


def test_the_planner_is_pure():
    reached = closure("scaletrain.plan")
    for forbidden in (
        "scaletrain.engines",
        "scaletrain.trainer",
        "scaletrain.distributed",
        "scaletrain.cli",
        "scaletrain.preflight",
    ):
        assert not any(m == forbidden or m.startswith(forbidden + ".") for m in reached), forbidden


def test_checkpoints_never_import_an_engine():
    assert not any(m.startswith("scaletrain.engines") for m in closure("scaletrain.checkpoint"))


def test_no_module_over_600_lines():
    long = {module_name(p): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long
