"""The package's layout, read from its source (AST, nothing imported): no import cycle at module level,
no module over :data:`MAX_LINES` lines, and ``verl_fastsync.tools`` (the CLI, doctor, benches) imported
by nothing outside it. Each rule is also run on a small package written here that breaks it, so a
rule that stopped seeing violations would fail too."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "verl_fastsync"
MAX_LINES = 500
TOOLS = "verl_fastsync.tools"


# -- reading the source -------------------------------------------------------------------------------


def _modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package`` (a package is its ``__init__``)."""
    found: dict[str, Path] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports executed when the module is imported: not in a function, not under
    ``if TYPE_CHECKING:`` (its ``else`` counts), but in class bodies, ``try``/``with``/``if`` blocks."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.ClassDef | ast.With | ast.AsyncWith | ast.For | ast.While):
            yield from _module_level(node.body)
            yield from _module_level(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try | ast.TryStar):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _module_level(block)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that an import statement in ``module`` names (``from p import m``
    names ``p`` and, when it is a module, ``p.m``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return {name for name in names if name in known}


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level, without the edges from a package's
    ``__init__`` to its own submodules (the one kind of cycle allowed)."""
    modules = _modules(package)
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in _module_level(tree.body):
            edges |= _targets(node, name, is_package, known)
        if is_package:
            edges = {e for e in edges if not e.startswith(name + ".")}
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def long_modules(package: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Every module over ``limit`` lines -> its line count."""
    counts = {name: len(path.read_text().splitlines()) for name, path in _modules(package).items()}
    return {name: n for name, n in counts.items() if n > limit}


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """Every module name an import anywhere in ``tree`` names (functions and TYPE_CHECKING included),
    and the constant first argument of ``importlib.import_module(...)`` / ``__import__(...)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            yield node.lineno, base
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def tools_importers(package: Path, tools: str = TOOLS) -> list[str]:
    """``module:line`` of every import of ``tools`` (or below) from a module outside it."""
    found = []
    for name, path in _modules(package).items():
        if name == tools or name.startswith(tools + "."):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, imported in _imported_names(tree, name, path.name == "__init__.py"):
            if imported == tools or imported.startswith(tools + "."):
                found.append(f"{name}:{line} imports {imported}")
    return found


# -- the rules on verl_fastsync -----------------------------------------------------------------------


def test_no_import_cycle_at_module_level() -> None:
    graph = import_graph(PACKAGE)
    assert "verl_fastsync.plugins" in graph and "verl_fastsync.chunks.meta" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


def test_no_module_over_the_line_limit() -> None:
    assert long_modules(PACKAGE) == {}, f"split these modules (over {MAX_LINES} lines)"


def test_nothing_outside_tools_imports_tools() -> None:
    assert tools_importers(PACKAGE) == []


# -- each rule sees a real violation ------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root / "pkg"


def test_cycle_rule_sees_a_cycle_and_allows_only_init_to_submodule(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub import thing\n",  # __init__ -> own submodule: allowed
            "pkg/sub/__init__.py": "from pkg.sub import a\nthing = 1\n",
            "pkg/sub/a.py": "import pkg\nfrom pkg.sub import b\n",  # a -> pkg -> sub -> (a allowed)
            "pkg/sub/b.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg.sub import a  # not executed: no edge
                def f():
                    from pkg.sub import a  # function level: no edge
                """,
        },
    )
    graph = import_graph(pkg)
    assert graph["pkg"] == set() and graph["pkg.sub"] == set()
    assert graph["pkg.sub.a"] == {"pkg", "pkg.sub", "pkg.sub.b"} and graph["pkg.sub.b"] == set()
    assert find_cycle(graph) is None
    # b importing a at module level (relative, inside a try block) closes a real cycle
    (pkg / "sub" / "b.py").write_text("try:\n    from . import a\nexcept ImportError:\n    pass\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]
    # so does a submodule importing a module that imports its package's __init__ ... which imports it
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "other.py").write_text("import pkg.sub.a\n")
    (pkg / "sub" / "a.py").write_text("from pkg import other\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.other", "pkg.sub.a", "pkg.other"]


def test_line_rule_sees_a_long_module(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {"pkg/__init__.py": "", "pkg/ok.py": "x = 1\n" * MAX_LINES})
    assert long_modules(pkg) == {}
    (pkg / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(pkg) == {"pkg.long": MAX_LINES + 1}


@pytest.mark.parametrize(
    "source",
    [
        "import pkg.tools.cli\n",
        "def main():\n    from pkg.tools import cli\n",
        "from pkg import tools\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.tools.cli import X\n",
        "def f():\n    from .tools import cli\n",
        "import importlib\nMOD = importlib.import_module('pkg.tools.cli')\n",
    ],
)
def test_tools_rule_sees_an_import_of_tools(tmp_path: Path, source: str) -> None:
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/tools/__init__.py": "",
            "pkg/tools/cli.py": "import pkg.core\nfrom . import __name__ as n\n",  # tools may import out
            "pkg/core.py": "",
        },
    )
    assert tools_importers(pkg, "pkg.tools") == []
    (pkg / "core.py").write_text(source)
    assert len(tools_importers(pkg, "pkg.tools")) >= 1
