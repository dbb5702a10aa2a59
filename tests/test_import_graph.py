"""No import cycle among the project's modules, counting every import.

Top-level, function-level (lazy) and ``TYPE_CHECKING`` imports all count: a cycle hidden behind a
lazy import is still two modules that cannot be understood, tested or moved apart. The graph is
read from the source with ``ast`` (nothing is imported), so the test is fast and exact.
"""

from __future__ import annotations

import ast
from pathlib import Path

from fineenvs.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "fineenvs"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the project modules it imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    files = {_module_name(p, package.parent): p for p in package.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package_name.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                found = resolve(target)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One concrete loop through a component, for the failure message."""
    members = set(component)
    path = [component[0]]
    while True:
        nxt = sorted(graph[path[-1]] & members)[0]
        if nxt in path:
            return " -> ".join(path[path.index(nxt) :] + [nxt])
        path.append(nxt)


def test_no_import_cycle_among_project_modules() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "fineenvs.jobs.rl" in graph and "fineenvs.proxy.app" in graph
    found = cycles(graph)
    assert not found, (
        "import cycles (cut them: move the shared piece down, or take a Protocol):\n"
        + "\n".join(_path(graph, c) for c in found)
    )


def test_the_checker_sees_lazy_type_checking_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "fineenvs"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("def f():\n    from fineenvs.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n"
    )
    (pkg / "c.py").write_text("import fineenvs.a\n")
    graph = import_graph(pkg)
    assert graph["fineenvs.a"] == {"fineenvs.sub.b"}
    assert graph["fineenvs.sub"] == {"fineenvs.sub.b"}
    assert graph["fineenvs.sub.b"] == {"fineenvs.c"}
    assert cycles(graph) == [["fineenvs.a", "fineenvs.c", "fineenvs.sub.b"]]
    assert _path(graph, cycles(graph)[0]) == "fineenvs.a -> fineenvs.sub.b -> fineenvs.c -> fineenvs.a"


SCAFFOLDING = ("fineenvs_recipes", "benchmarks", "tests", "experiments", "scripts", "docs")
"""Top-level folders that may import the library and that the library never imports: each can be
deleted without touching ``fineenvs/``."""


def scaffolding_imports(package: Path = PACKAGE) -> list[str]:
    """``module -> import`` for every import of a scaffolding folder inside ``package``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [
                f"{_module_name(path, package.parent)} -> {name}"
                for name in names
                if name.split(".")[0] in SCAFFOLDING
            ]
    return found


def test_the_library_never_imports_its_scaffolding() -> None:
    found = scaffolding_imports()
    assert not found, (
        "fineenvs/ imports scaffolding (fineenvs_recipes, benchmarks, tests, experiments, scripts), which "
        "must stay deletable: move what the library needs into fineenvs/, or invert the dependency "
        "(an entry point of fineenvs/plugins.py):\n" + "\n".join(found)
    )


def test_the_scaffolding_check_sees_a_lazy_import(tmp_path: Path) -> None:
    pkg = tmp_path / "fineenvs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from benchmarks.common import free_port\n    import tests.x\n")
    assert scaffolding_imports(pkg) == ["fineenvs.a -> benchmarks.common", "fineenvs.a -> tests.x"]
