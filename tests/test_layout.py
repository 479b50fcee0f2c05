"""The package's layout, read from its source (AST, nothing imported): no import cycle, at module level
or at run time (function-level imports count: a lazy import hides a dependency, it does not remove it),
every package in its layer and importing only the layers below it, no module over :data:`MAX_LINES`
lines, and ``verl_fastsync.tools`` (the CLI, doctor, benches) imported by nothing outside it. Each rule
is also run on a small package written here that breaks it, so a rule that stopped seeing violations
would fail too."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "verl_fastsync"
MAX_LINES = 500
TOOLS = "verl_fastsync.tools"
LAYERS: tuple[tuple[str, ...], ...] = (
    ("limits", "io"),
    ("delta",),
    ("chunks",),
    ("wire",),
    ("config",),
    ("colocated",),
    ("transports",),
    ("cleanup", "hookspecs"),
    ("plugins",),
    ("selection",),
    ("verl",),
    ("tools", ""),
)
"""The package's layers, bottom first (names relative to ``verl_fastsync``; ``""`` is its ``__init__``,
which installs the adapter): a module imports, at run time, only its own package and the layers below
its own. The "Layers" section of docs/development.md shows the same list."""


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


def _import_call(node: ast.AST) -> str | None:
    """The module a call ``importlib.import_module("m")`` / ``__import__("m")`` names, else None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    value = node.args[0].value
    return value if called in ("import_module", "__import__") and isinstance(value, str) else None


def _executed(nodes: Iterable[ast.AST], run_time: bool) -> Iterator[ast.AST]:
    """The imports (statements, and constant :func:`_import_call` calls) that can execute. At module
    level: those run when the module is imported (class bodies, ``try``/``with``/``if``/loops, not
    functions); at run time: those in functions and lambdas too. Never those under
    ``if TYPE_CHECKING:`` (its ``else`` counts)."""
    for node in nodes:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _executed(node.orelse, run_time)
            continue
        if not run_time and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom) or _import_call(node) is not None:
            yield node
        yield from _executed(ast.iter_child_nodes(node), run_time)


def _named(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules an import names: ``import a.b`` names ``a.b``; ``from p import n`` names ``p.n``
    when that is a module, else ``p`` (relative imports resolved against ``module``)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        return {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    called = _import_call(node)
    return set() if called is None else {called}


def _edges(module: str, named: str, known: set[str]) -> set[str]:
    """What importing ``named`` from ``module`` runs: ``named`` and every package above it
    (``import a.b.c`` runs ``a`` and ``a.b`` first), except ``module`` and its own packages, which run
    before it whatever it imports (a package's ``__init__`` importing its own modules, which may import
    the package, is the one kind of cycle allowed)."""
    parts = named.split(".")
    targets = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
    return {t for t in targets if t in known and t != module and not module.startswith(t + ".")}


def import_graph(package: Path, run_time: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level (``run_time``: anywhere but under
    ``if TYPE_CHECKING:``), with the packages above each (see :func:`_edges`)."""
    modules = _modules(package)
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in _executed(tree.body, run_time):
            for named in _named(node, name, is_package, known):
                edges |= _edges(name, named, known)
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


def upward_imports(graph: dict[str, set[str]], root: str, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every edge of ``graph`` from a package to a package of its own layer or above (``layers``:
    bottom first, names relative to ``root``, ``""`` for ``root`` itself), and every module in no
    layer."""

    def place(module: str) -> tuple[int, str] | None:
        relative = "" if module == root else module.removeprefix(root + ".")
        found = [
            (level, name)
            for level, names in enumerate(layers)
            for name in names
            if relative == name or (name and relative.startswith(name + "."))
        ]
        return max(found, key=lambda found: len(found[1])) if found else None

    problems = []
    for module, targets in sorted(graph.items()):
        here = place(module)
        if here is None:
            problems.append(f"{module} is in no layer")
            continue
        for target in sorted(targets):
            there = place(target)
            if there is not None and there[1] != here[1] and there[0] >= here[0]:
                problems.append(f"{module} (layer {here[0]}) imports {target} (layer {there[0]})")
    return problems


def tools_importers(package: Path, tools: str = TOOLS) -> list[str]:
    """``module:line`` of every import of ``tools`` (or below) from a module outside it."""
    modules = _modules(package)
    known = set(modules)
    found = []
    for name, path in modules.items():
        if name == tools or name.startswith(tools + "."):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # functions and TYPE_CHECKING included
            for imported in sorted(_named(node, name, path.name == "__init__.py", known)):
                if imported == tools or imported.startswith(tools + "."):
                    found.append(f"{name}:{getattr(node, 'lineno', 0)} imports {imported}")
    return found


# -- the rules on verl_fastsync -----------------------------------------------------------------------


@pytest.mark.parametrize("run_time", [False, True], ids=["module-level", "run-time"])
def test_no_import_cycle(run_time: bool) -> None:
    graph = import_graph(PACKAGE, run_time)
    assert "verl_fastsync.plugins" in graph and "verl_fastsync.chunks.meta" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_package_imports_only_the_layers_below_it() -> None:
    graph = import_graph(PACKAGE, run_time=True)
    assert "verl_fastsync.selection" in graph["verl_fastsync.verl.adapter"]  # the graph is not empty
    assert upward_imports(graph, PACKAGE.name, LAYERS) == []


def test_the_readme_shows_the_layers() -> None:
    readme = (ROOT / "docs" / "development.md").read_text()  # the user's guide's development page
    block = readme[readme.index("## Layers") :].split("```text\n", 1)[1].split("```", 1)[0]
    shown = [tuple(name.strip() for name in line.split("  ")[0].split(",")) for line in block.splitlines()]
    shown = [tuple("" if name == "__init__" else name for name in names) for names in shown]
    assert shown[::-1] == list(LAYERS)


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


def test_cycle_rule_sees_a_cycle_and_allows_only_a_package_importing_its_own_modules(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub import thing\n",
            "pkg/sub/__init__.py": "from pkg.sub import a\nthing = 1\n",  # __init__ -> own module: an edge
            "pkg/sub/a.py": "import pkg\nfrom pkg.sub import b\n",  # its own packages: no edge
            "pkg/sub/b.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg.sub import a  # never executed: no edge
                def f():
                    from pkg.sub import a  # function level: an edge at run time only
                """,
        },
    )
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.sub"} and graph["pkg.sub"] == {"pkg.sub.a"}
    assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == set()
    assert find_cycle(graph) is None
    assert import_graph(pkg, run_time=True)["pkg.sub.b"] == {"pkg.sub.a"}
    assert find_cycle(import_graph(pkg, run_time=True)) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]
    # b importing a at module level (relative, inside a try block) closes a cycle at module level too
    (pkg / "sub" / "b.py").write_text("try:\n    from . import a\nexcept ImportError:\n    pass\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]
    # importing pkg.sub.a from outside runs pkg.sub's __init__ first, which imports c, which imports back
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import c\nthing = 1\n")
    (pkg / "sub" / "c.py").write_text(
        "def f():\n    import importlib\n    importlib.import_module('pkg.other')\n"
    )
    (pkg / "other.py").write_text("import pkg.sub.a\n")
    assert import_graph(pkg)["pkg.other"] == {"pkg.sub", "pkg.sub.a"}
    assert find_cycle(import_graph(pkg)) is None  # the way back is a lazy import
    assert find_cycle(import_graph(pkg, run_time=True)) == ["pkg.sub", "pkg.sub.c", "pkg.other", "pkg.sub"]


def test_layer_rule_sees_an_upward_import_and_a_module_in_no_layer(tmp_path: Path) -> None:
    layers = (("low",), ("high",), ("",))
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "def install():\n    import pkg.high\n",
            "pkg/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import high\n",
            "pkg/high/__init__.py": "from pkg.high import impl\n",
            "pkg/high/impl.py": "import pkg.low\nfrom pkg import high\n",
        },
    )
    assert upward_imports(import_graph(pkg, run_time=True), "pkg", layers) == []
    (pkg / "low.py").write_text("def f():\n    from pkg.high.impl import x\n")
    assert upward_imports(import_graph(pkg, run_time=True), "pkg", layers) == [
        "pkg.low (layer 0) imports pkg.high (layer 1)",
        "pkg.low (layer 0) imports pkg.high.impl (layer 1)",
    ]
    assert upward_imports(import_graph(pkg), "pkg", layers) == []  # at module level it is not seen
    (pkg / "low.py").write_text("")
    (pkg / "extra.py").write_text("")
    assert upward_imports(import_graph(pkg, run_time=True), "pkg", layers) == ["pkg.extra is in no layer"]
    (pkg / "extra.py").unlink()
    (pkg / "other.py").write_text("")
    assert upward_imports(import_graph(pkg), "pkg", (("low", "other"), ("high",), ("",))) == []
    (pkg / "other.py").write_text("import pkg.low\n")  # a package of its own layer is not below it
    assert upward_imports(import_graph(pkg), "pkg", (("low", "other"), ("high",), ("",))) == [
        "pkg.other (layer 0) imports pkg.low (layer 0)"
    ]


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
