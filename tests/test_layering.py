"""The package's layering, read from the source: imports never go round in a circle, between
modules or between packages (lazy imports inside functions included), nor up a layer; the
planner is pure arithmetic (no process group, engine, trainer or CLI), checkpoints know
formats but never import an engine, and no module grows past ~600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[1] / "src" / "scaletrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """Every scaletrain module `path` imports, at the top, inside a function or under
    TYPE_CHECKING: `from a.b import c` names a.b.c where that is a module, else a.b; and
    the packages above it, whose `__init__` runs first (launch.torchrun importing
    cli.startup ran cli/__init__, which imports cli.launch, which imports launch.torchrun:
    `import scaletrain.launch.torchrun` failed until startup moved to launch/)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("scaletrain"):
            found.update(full if (full := f"{node.module}.{a.name}") in MODULES else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("scaletrain"))
    return found | {parent for name in found for parent in _packages_above(name)}


def _packages_above(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]  # not scaletrain itself: its __init__ imports nothing at the top


# Less the importer and the packages above it: they are being imported already (a module's
# own package running first is no circle).
GRAPH = {name: {m for m in imports_of(path) if not (name + ".").startswith(m + ".")} for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected components of more than one
    module (or one importing itself), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_anywhere():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_one():
    # As models/llama.py and models/lora.py once were (each imported the other, one lazily).
    graph = {**GRAPH, "scaletrain.models.params": GRAPH["scaletrain.models.params"] | {"scaletrain.models.lora"}}
    assert ["scaletrain.models.lora", "scaletrain.models.params"] in cycles(graph)


# The packages from the bottom up (docs/architecture.md): a module imports only from its own
# layer or those below, lazily or not. The root's shared modules are below everything; its
# entry points (the package itself, __main__, api) are on top. A package's `registry` module
# (optim/registry.py: its kind's entries, docs/architecture.md) is its door for the layers
# below it, config validation among them: a room of its own in the bottom layer, so it may
# import nothing above that.
REGISTRIES = {"optim.registry"}
LAYERS = [
    {"errors", "files", "disk_cache", "strategies", *REGISTRIES},
    {"launch", "config"},
    {"models"},
    {"data"},
    {"optim", "planning"},
    {"resilience"},
    {"checkpoint"},
    {"engines"},
    {"telemetry"},
    {"training"},
    {"diagnose", "bench"},
    {"cli", "api", "__main__", ""},
]


def package_of(module: str) -> str:
    """scaletrain.engines.fsdp -> engines; scaletrain.api -> api; scaletrain -> '';
    scaletrain.optim.registry -> optim.registry (a registry is a room of its own)."""
    parts = module.split(".")
    if len(parts) == 3 and parts[2] == "registry":
        return ".".join(parts[1:])
    return parts[1] if len(parts) > 1 else ""


# A package whose __init__ imports nothing adds no dependency when a module inside it is
# imported (its __init__ runs, and runs nothing): importing optim.registry is not importing optim.
EMPTY_PACKAGES = {m for m, path in MODULES.items() if path.name == "__init__.py" and not GRAPH[m]}


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        mine = package_of(module)
        packages.setdefault(mine, set()).update(p for m in imported if m not in EMPTY_PACKAGES and (p := package_of(m)) != mine)
    return packages


def test_every_registry_is_in_the_bottom_layer():
    found = {package_of(m) for m in MODULES if m.endswith(".registry")}
    assert found == REGISTRIES and REGISTRIES.issubset(LAYERS[0])


def test_no_package_cycle_and_no_import_up_a_layer():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    packages = package_graph(GRAPH)
    assert set(packages) <= set(layer), f"put {sorted(set(packages) - set(layer))} in LAYERS"
    assert cycles(packages) == []
    upward = sorted((a, b) for a, imported in packages.items() for b in imported if layer[b] > layer[a])
    assert upward == []


def test_a_package_cycle_is_found():
    # As checkpoint and resilience once were: checkpoint/manager.py met resilience's fault
    # points, and resilience/oom.py wrote its records with checkpoint's write_atomic.
    graph = {**GRAPH, "scaletrain.resilience.oom": GRAPH["scaletrain.resilience.oom"] | {"scaletrain.checkpoint"}}
    assert ["checkpoint", "resilience"] in cycles(package_graph(graph))
    assert cycles(graph) == []  # the modules alone go round in no circle: only their packages do


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
    reached = closure("scaletrain.planning")
    for forbidden in (
        "scaletrain.engines",
        "scaletrain.training.trainer",
        "scaletrain.launch.distributed",
        "scaletrain.cli",
        "scaletrain.training.preflight",
    ):
        assert not any(m == forbidden or m.startswith(forbidden + ".") for m in reached), forbidden


def test_checkpoints_never_import_an_engine():
    assert not any(m.startswith("scaletrain.engines") for m in closure("scaletrain.checkpoint"))


# The package root holds the entry points and what every package needs without torch; every
# other module lives in the package that names its part of the architecture
# (docs/architecture.md: api is the Python API; disk_cache serves the planner, the engines
# and the CLI alike; files writes whole files for checkpoints, resilience and reports).
ROOT_MODULES = {"__init__", "__main__", "api", "strategies", "errors", "disk_cache", "files"}


def test_the_root_holds_only_the_entry_points_and_the_shared_torch_free_modules():
    assert {p.stem for p in SRC.glob("*.py")} == ROOT_MODULES


def test_no_module_over_600_lines():
    long = {module_name(p): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long
