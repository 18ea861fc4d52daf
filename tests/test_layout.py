"""The package's layout: imports run one way, with no circles, and no module outgrows a reading.

cli -> tools (train, compare -> bench, export, lookup, loadtest) and server -> api -> scheduler
-> generate -> verdicts -> chain -> policy -> costs, acceptance -> strategies -> constraints -> drafts ->
backends. Read from the source with `ast`, so a lazy import inside a function counts as much as
one at the top of a module, and so does a command's handler named as "module:function" (see
`specdecode.cli.handler`).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

import specdecode

PACKAGE = Path(specdecode.__file__).parent
ABOVE_RUNTIME = ("cli", "server", "train", "bench", "compare", "export", "lookup", "loadtest", "testing")
# The runtime's floors, lowest first: each imports only floors below it.
FLOORS = (
    "backends",
    "drafts",
    "constraints",
    "strategies",
    "costs",
    "acceptance",
    "policy",
    "chain",
    "verdicts",
    "generate",
    "scheduler",
    "keywords",
    "speculative_config",
    "api",
)
MAX_LINES = 600
ONE_PIECE = "must be one piece"  # what the docstring of a longer module says, with why
HANDLER = re.compile(r"^(specdecode(?:\.\w+)+):\w+$")


def module_name(path: Path) -> str:
    """specdecode/backends/__init__.py -> "backends"; specdecode/bench/tasks.py -> "bench/tasks"."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return "/".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def imports() -> dict[str, set[str]]:
    """Each module -> the specdecode modules it imports (the deepest module a dotted name
    reaches: `from specdecode.backends import hf` is "backends/hf", `from specdecode.backends
    import Backend` is "backends")."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(paths) - {""}

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")[1:]
        while parts and "/".join(parts) not in known:
            parts.pop()
        return "/".join(parts) or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names += [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and HANDLER.match(node.value):
                names.append(HANDLER.match(node.value).group(1))
        targets = {resolve(n) for n in names if n.startswith("specdecode.")}
        graph[name] = {target for target in targets if target} - {name}
    return graph


def floor_of(module: str) -> str:
    return module.split("/")[0]


def floors() -> dict[str, set[str]]:
    """The top-level names ("strategies", "api", ...) each top-level name imports."""
    graph: dict[str, set[str]] = {}
    for module, targets in imports().items():
        if module:
            graph.setdefault(floor_of(module), set()).update(floor_of(t) for t in targets)
    return {floor: targets - {floor} for floor, targets in graph.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read():
    graph = imports()
    assert "chain" in graph["generate"] and "backends" in graph["strategies/eagle3"]
    assert "backends/hf" in graph["backends/load"]


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_in_a_circle():
    assert circles(imports()) == []


def test_no_import_runs_upward():
    """Between top-level modules and packages, too: a module of a package that imports a
    module which imports that package back is a circle through the package's `__init__`."""
    assert circles(floors()) == []


@pytest.mark.parametrize("module", sorted(m for m in imports() if m and floor_of(m) not in ABOVE_RUNTIME))
def test_the_runtime_imports_no_tool(module):
    assert not {floor_of(t) for t in imports()[module]} & set(ABOVE_RUNTIME), module


@pytest.mark.parametrize("module", sorted(m for m in imports() if floor_of(m) in FLOORS))
def test_each_floor_imports_only_floors_below(module):
    above = set(FLOORS[FLOORS.index(floor_of(module)) + 1 :])
    assert not {floor_of(t) for t in imports()[module]} & above, module


def test_benchmarks_a_user_runs_import_no_comparison():
    """`bench` is what a user runs; `compare` measures us beside other programs and may use it."""
    assert "compare" not in floors()["bench"]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_fit_a_reading(path):
    text = path.read_text()
    lines = len(text.splitlines())
    docstring = ast.get_docstring(ast.parse(text)) or ""
    assert lines <= MAX_LINES or ONE_PIECE in docstring, f"{lines} lines"


ROOT = PACKAGE.parent.parent
DOTTED = re.compile(r"\bspecdecode(?:\.[A-Za-z_]\w*)+")
SOURCE_PATH = re.compile(r"\bsrc/specdecode/[\w/.]*\w")


def named_at_top(path: Path) -> set[str]:
    """What a module defines or imports at its top level."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.If):  # TYPE_CHECKING imports and the like
            names.update(named_at_top_of(node.body))
    return names


def named_at_top_of(body: list[ast.stmt]) -> set[str]:
    module = ast.Module(body=body, type_ignores=[])
    return {n.name for n in module.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        (alias.asname or alias.name).split(".")[0]
        for n in module.body
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for alias in n.names
    }


def unresolved(reference: str) -> str | None:
    """Why `specdecode.a.b.c` names nothing: its module path, then the first name after it."""
    parts = reference.split(".")[1:]
    for cut in range(len(parts), -1, -1):
        base = PACKAGE.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if cut else PACKAGE / "__init__.py"
        if cut and base.is_dir():
            module = base / "__init__.py"
        if module.is_file() or (cut and base.is_dir()):
            rest = parts[cut:]
            if not rest or (module.is_file() and rest[0] in named_at_top(module)):
                return None
            return f"{'.'.join(['specdecode', *parts[:cut]])} has no {rest[0]}"
    return "no such module"


def referring_files() -> list[Path]:
    """The pages, the Makefile, the CI script and the package's own sources and tests."""
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "run"]
    files += sorted((ROOT / "docs").rglob("*.md")) + sorted(PACKAGE.rglob("*.py"))
    files += sorted(set((ROOT / "tests").glob("*.py")) - {Path(__file__)})  # this one names none on purpose
    return [path for path in files if path.is_file()]


def test_every_module_named_in_the_docs_and_sources_exists():
    """A page, a docstring or a `python -m` line that names a module or path moved away fails."""
    broken = []
    for path in referring_files():
        text = path.read_text()
        for reference in sorted(set(DOTTED.findall(text))):
            if "__" in reference or reference.startswith("specdecode.egg"):
                continue  # a module's own attributes; the build's metadata
            if (why := unresolved(reference)) is None:
                continue
            broken.append(f"{path.relative_to(ROOT)}: {reference} ({why})")
        for source in sorted(set(SOURCE_PATH.findall(text))):
            if not (ROOT / source).exists():
                broken.append(f"{path.relative_to(ROOT)}: {source} (no such file)")
    assert broken == []


def test_a_moved_name_is_found():
    assert unresolved("specdecode.backends.load") is None
    assert unresolved("specdecode.drafts.Draft") is None
    assert unresolved("specdecode.policy.NoSuchThing") == "specdecode.policy has no NoSuchThing"
    assert unresolved("specdecode.no_such_module") == "specdecode has no no_such_module"
