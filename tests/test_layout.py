"""The import graph runs one way: tools above the runtime, and the runtime's floors in order.

cli -> tools (train, bench, export, lookup, loadtest) and server -> api -> scheduler -> generate -> chain
-> strategies -> backends. Read from the source with `ast`, so a lazy import inside a function
counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import specdecode

PACKAGE = Path(specdecode.__file__).parent
ABOVE_RUNTIME = ("cli", "server", "train", "bench", "export", "lookup", "loadtest", "testing")
FLOORS = ("backends", "strategies", "chain", "generate", "scheduler", "api")  # each imports only floors below


@functools.cache
def modules() -> dict[str, set[str]]:
    """Each module's top-level name under specdecode ("strategies", "api", ...) -> the top-level
    names of the specdecode modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            imported |= {n.split(".")[1] for n in names if n.startswith("specdecode.")}
        graph["/".join(parts)] = imported - {parts[0]}
    return graph


def floor_of(module: str) -> str:
    return module.split("/")[0]


def test_the_graph_is_read():
    graph = modules()
    assert "chain" in graph["generate"] and "backends" in graph["strategies/eagle3"]


@pytest.mark.parametrize("module", sorted(m for m in modules() if floor_of(m) not in ABOVE_RUNTIME))
def test_the_runtime_imports_no_tool(module):
    assert not modules()[module] & set(ABOVE_RUNTIME), module


@pytest.mark.parametrize("module", sorted(m for m in modules() if floor_of(m) in FLOORS))
def test_each_floor_imports_only_floors_below(module):
    above = set(FLOORS[FLOORS.index(floor_of(module)) + 1 :])
    assert not modules()[module] & above, module
