"""Which config keys the code reads: a static scan of ``fineenvs/`` (``config.py``, which only
declares and validates them, excluded).

A read is an attribute access on a value known to be a config section: ``<expr>.<section>.<key>``
(``run.trainer.learning_rate``), ``name.<key>`` where ``name`` was bound to a section in the same
function (``t = run.trainer``, ``t, s = run.trainer, run.scheduler``, ``for n, h in
run.harness.items()``, ``run.harness[n].weight``) or annotated with its spec class (``m:
MiniReproSettings``), ``self.<attr>`` where the class annotates ``attr`` with a spec class
(``settings: GRPOSettings``), and ``run.<key>`` for the top-level keys. Passing the whole config somewhere
(``asdict(run)`` into the logger's run config) reads nothing, and neither does showing a key:
printing or logging it, naming it in an error, or rendering the printed plan (``describe_plan``).
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from fineenvs import config as C
from fineenvs.paths import REPO_ROOT
from fineenvs_recipes.mini_repro.settings import MiniReproSettings

SECTIONS: dict[str, tuple[type, ...]] = {
    "model": (C.ModelSpec,),
    "engine": (C.EngineSpec,),
    "proxy": (C.ProxyOptions, C.ProxySettings),
    "harness": (C.HarnessSpec,),
    "tasks": (C.TasksSpec,),
    "sampling": (C.SamplingSpec,),
    "reward": (C.RewardSpec,),
    "trainer": (C.GRPOSettings, C.SFTSettings),
    "scheduler": (C.SchedulerSpec,),
    "rows": (C.RowOptions,),
    "logger": (C.LoggerSpec,),
    "eval": (C.EvalSpec,),
    "recipe": (MiniReproSettings,),
}
TOP = tuple(f.name for f in dataclasses.fields(C.RunConfig) if f.name not in SECTIONS)
_CLASS_SECTION = {cls.__name__: name for name, classes in SECTIONS.items() for cls in classes}
_RUN_NAMES = {"run", "ckpt_run", "cfg_run"}
DISPLAY_CALLS = {"print", "echo", "debug", "info", "warning", "error", "exception", "critical", "warn"}
"""Calls that show their arguments (print, logging, the installer's echo)."""
DISPLAY_FUNCTIONS = {"describe_plan"}
"""Functions that only render the config for people (the plan ``fineenvs.run`` prints)."""


def _section_of(node: ast.expr, bound: dict[str, str]) -> str | None:
    """The section ``node`` evaluates to, when it is one."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        if (section := bound.get(f"self.{node.attr}")) is not None:
            return section
    if isinstance(node, ast.Attribute) and node.attr in SECTIONS:
        return node.attr
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "harness"
    ):
        return "harness"
    return None


def _is_run(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in _RUN_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "run"
    )


def _annotation_section(annotation: ast.expr | None) -> str | None:
    if annotation is None:
        return None
    names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
    names |= {
        n.value for n in ast.walk(annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    found = {_CLASS_SECTION[n] for n in names if n in _CLASS_SECTION}
    return found.pop() if len(found) == 1 else None


class _Scope(ast.NodeVisitor):
    def __init__(self, reads: set[tuple[str, str]]) -> None:
        self.reads = reads
        self.bound: dict[str, str] = {}

    def _bind(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Name):
            section = _section_of(value, self.bound)
            if section is not None:
                self.bound[target.id] = section
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts, strict=False):
                self._bind(t, v)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if node.name in DISPLAY_FUNCTIONS:
            return
        inner = _Scope(self.reads)
        inner.bound = dict(self.bound)
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            section = _annotation_section(arg.annotation)
            if section is not None:
                inner.bound[arg.arg] = section
        for stmt in node.body:
            inner.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        """An attribute the class annotates with a section's class (``settings: GRPOSettings``) is
        that section in its methods, as ``self.settings``."""
        inner = _Scope(self.reads)
        inner.bound = dict(self.bound)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                section = _annotation_section(stmt.annotation)
                if section is not None:
                    inner.bound[f"self.{stmt.target.id}"] = section
        for stmt in node.body:
            inner.visit(stmt)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._bind(node.target, node.value)
        self.generic_visit(node)

    def visit_For(self, node: ast.For | ast.comprehension) -> None:
        # for n, h in run.harness.items() / for h in run.harness.values()
        it = node.iter
        if (
            isinstance(it, ast.Call)
            and isinstance(it.func, ast.Attribute)
            and it.func.attr in ("items", "values")
            and _section_of(it.func.value, self.bound) == "harness"
        ):
            target = node.target
            if it.func.attr == "items" and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                target = target.elts[1]
            if isinstance(target, ast.Name):
                self.bound[target.id] = "harness"
        self.generic_visit(node)

    visit_comprehension = visit_For  # type: ignore[assignment]

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in DISPLAY_CALLS:
            return  # printed or logged: shown, not used
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        """An error message names keys; it does not use them."""

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp) -> None:
        for generator in node.generators:  # bind the loop variables before reading the element
            self.visit(generator)
        for child in ("key", "value", "elt"):
            if isinstance(getattr(node, child, None), ast.AST):
                self.visit(getattr(node, child))

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension  # type: ignore[assignment]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        section = _section_of(node.value, self.bound)
        if section == "harness" and isinstance(node.value, ast.Attribute):
            pass  # run.harness.items(): the dict of harnesses, not one harness's key
        elif section is not None:
            self.reads.add((section, node.attr))
        elif _is_run(node.value) and node.attr in TOP:
            self.reads.add(("", node.attr))
        self.generic_visit(node)


def config_reads(*packages: Path) -> set[tuple[str, str]]:
    """(section, key) pairs the packages read (default: the library and its recipes, whose settings
    are the ``recipe`` section); section "" for the top-level keys. The modules that only declare
    and validate the keys (the library's ``config.py``, a recipe's ``settings.py``) do not count."""
    reads: set[tuple[str, str]] = set()
    for package in packages or (REPO_ROOT / "fineenvs", REPO_ROOT / "fineenvs_recipes"):
        for path in sorted(package.rglob("*.py")):
            if (path.name == "config.py" and path.parent == package) or path.name == "settings.py":
                continue
            _Scope(reads).visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return reads


def schema_keys() -> set[tuple[str, str]]:
    """Every (section, key) the typed config declares."""
    keys = {("", name) for name in TOP}
    for section, classes in SECTIONS.items():
        for cls in classes:
            keys |= {(section, f.name) for f in dataclasses.fields(cls)}
    return keys


__all__ = ["config_reads", "schema_keys", "typing"]
