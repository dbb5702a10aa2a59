"""How the house stands: the measures of issue 33, printed as one table.

    .venv/bin/python scripts/house.py            # the table
    .venv/bin/python scripts/house.py --strict   # exit 1 when a target is missed

Lines are physical lines of ``.py`` files. "Scaffolding" is code that serves the project's own
tests, benchmarks and recipes rather than a user's run; it is listed in ``SCAFFOLDING`` below and
should live outside ``fineenvs/``. Duplicate pairs come from the ``duplicates`` tool where it is
installed (the development machines have it); elsewhere that row says n/a.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import shutil
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "fineenvs"
# Paths under fineenvs/ that are scaffolding: benchmarks, tiny-model builders and their corpus,
# the mini-reproduction recipe and its scripted teacher.
SCAFFOLDING = (
    "models/tiny.py",
    "models/agent_corpus.py",
    "models/corpus.py",
    "models/templates.py",
    "jobs/mini_repro.py",
    "engine/expert.py",
    "bench/",
)
SEAMS = (
    ("fineenvs/jobs/builders.py", "start_engine"),
    ("fineenvs/jobs/runtime.py", "JobRuntime"),
    ("fineenvs/plan.py", "vllm_args"),
    ("fineenvs/plan.py", "device_plan"),
    ("fineenvs/config.py", "RunConfig"),
)
RUN_HISTORY = re.compile(r"\b[Rr]uns? [A-Z](?:[-–][A-Z])?\b(?!\w)|\brun [A-Z]'s\b")
LONG_FUNCTION = 80


@dataclasses.dataclass
class Measure:
    name: str
    now: str
    target: str
    met: bool | None  # None: could not be measured here


def _py_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _is_scaffolding(path: Path) -> bool:
    rel = path.relative_to(LIBRARY).as_posix()
    return any(rel == s or (s.endswith("/") and rel.startswith(s)) for s in SCAFFOLDING)


def library_size() -> Measure:
    files = _py_files(LIBRARY)
    total = sum(_lines(p) for p in files)
    scaffold = [p for p in files if _is_scaffolding(p)]
    scaffold_lines = sum(_lines(p) for p in scaffold)
    share = scaffold_lines / total if total else 0.0
    return Measure(
        "files / lines in fineenvs/ (scaffolding share)",
        f"{len(files)} / {total / 1000:.1f}k ({share:.0%}: {len(scaffold)} files, {scaffold_lines} lines)",
        "the library holds the library (0 % scaffolding)",
        scaffold_lines == 0,
    )


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _own_field_names(cls: type) -> set[str]:
    """Fields a class declares itself: a subclass of a schema (``ProxySettings(ProxyOptions)``)
    inherits the schema's fields, written once, rather than mirroring them."""
    inherited = set().union(*(_field_names(b) for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)))
    return _field_names(cls) - inherited


# Dataclasses that model an interface outside the run config, which the config is mapped onto
# where it meets that interface: not a second home of a setting, but named in the output.
INTERFACE_MODELS = {
    "VLLMServeArgs": "the `vllm serve` command line (its defaults are vLLM's; tests/test_config_defaults.py "
    "checks the engine section agrees with it)",
    "SamplingParams": "one request's sampling parameters in the embedded engine (OpenAI's defaults)",
}


def _library_dataclasses() -> Iterator[type]:
    """Every dataclass defined in a library module (imported: dataclasses are runtime objects)."""
    import importlib

    seen: set[int] = set()
    for path in _py_files(LIBRARY):
        if _is_scaffolding(path) or "vllm_plugin" in path.parts:
            continue
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        try:
            mod = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a module needing an optional package is skipped
            continue
        for obj in vars(mod).values():
            if (
                isinstance(obj, type)
                and dataclasses.is_dataclass(obj)
                and obj.__module__ == mod.__name__
                and id(obj) not in seen
            ):
                seen.add(id(obj))
                yield obj


def _section_schemas() -> dict[str, type]:
    """The schema class of each config section (``trainer``: every class its group can hold)."""
    from fineenvs import config

    hints = typing.get_type_hints(config.RunConfig)
    sections: dict[str, type] = {}
    for f in dataclasses.fields(config.RunConfig):
        tp = hints[f.name]
        for arg in (tp, *typing.get_args(tp)):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                sections[f"{f.name}:{arg.__name__}"] = arg
    # Sections holding one of several schemas (``trainer``: GRPO or SFT) name them in a Union; where
    # a section is typed ``Any`` its group's schemas are found by their registered names.
    for cls_name in ("GRPOSettings", "SFTSettings"):
        cls = getattr(config, cls_name, None)
        if cls is not None:
            sections.setdefault(f"trainer:{cls.__name__}", cls)
    return sections


def _restated_defaults(group: str, schema: type) -> list[str]:
    """Keys of the ``conf/<group>/`` options built on ``schema`` that set a field to its default again
    (the check ``tests/test_config_defaults.py`` enforces)."""
    from hydra.core.config_store import ConfigStore

    from fineenvs.config import register_configs

    register_configs()
    stored = ConfigStore.instance().repo.get(group, {})
    defaults = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        defaults[f.name] = value.value if hasattr(value, "value") else value
    restated = []
    for option in sorted((REPO / "conf" / group).glob("*.yaml")):
        data = yaml.safe_load(option.read_text()) or {}
        names = [d for d in data.get("defaults") or [] if isinstance(d, str) and d.endswith("_schema")]
        node = stored.get(f"{names[0]}.yaml") if names else None
        if node is None or node.node._metadata.object_type is not schema:
            continue
        for key, value in data.items():
            if key in defaults and value == defaults[key] and not str(value).startswith("${"):
                restated.append(f"{option.name}:{key}")
    return restated


def setting_homes() -> Measure:
    """Homes of one setting: its schema field, each library dataclass that mirrors the schema
    (most of its fields under the same names), and an option file that states the default again."""
    schemas = _section_schemas()
    classes = list(_library_dataclasses())
    worst = 1
    notes = []
    for section, schema in schemas.items():
        names = _field_names(schema)
        if len(names) < 5:
            continue
        mirrors = [
            c.__name__
            for c in classes
            if c not in schemas.values()
            and c.__name__ not in INTERFACE_MODELS
            and len(names & _own_field_names(c)) >= max(5, len(names) // 2)
        ]
        group = section.split(":")[0]
        restated = _restated_defaults(group, schema)
        homes = 1 + len(mirrors) + (1 if restated else 0)
        if homes > 1:
            notes.append(f"{section} {homes} ({', '.join(mirrors) or 'YAML'})")
        worst = max(worst, homes)
    interfaces = f"not counted, interface models: {', '.join(INTERFACE_MODELS)}"
    return Measure(
        "homes of one setting (worst section)",
        f"{worst}: " + "; ".join([*notes, interfaces]),
        "1",
        worst == 1,
    )


def duplicate_pairs() -> Measure:
    tool = shutil.which("duplicates")
    if tool is None:
        return Measure(
            "`duplicates fineenvs` pairs", "n/a (the duplicates tool is not installed)", "<= 40", None
        )
    out = subprocess.run(
        [tool, "--most", "1", "--seconds", "120"], cwd=LIBRARY, capture_output=True, text=True, check=False
    ).stdout
    m = re.search(r"^(\d+) pairs", out, re.M)
    pairs = int(m.group(1)) if m else 0
    return Measure("`duplicates fineenvs` pairs", str(pairs), "<= 40", pairs <= 40)


def _annotations(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Each annotation node, and whether it is a return annotation."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and arg.annotation is not None:
                    yield arg.annotation, False
            if node.returns is not None:
                yield node.returns, True
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation, False


def _any_count(annotation: ast.AST) -> int:
    return sum(
        1
        for n in ast.walk(annotation)
        if (isinstance(n, ast.Name) and n.id == "Any")
        or (isinstance(n, ast.Attribute) and n.attr == "Any")
        or (isinstance(n, ast.Constant) and isinstance(n.value, str) and re.search(r"\bAny\b", n.value))
    )


def _json_object_count(annotation: ast.AST) -> int:
    return sum(
        1
        for n in ast.walk(annotation)
        if (isinstance(n, ast.Name) and n.id == "JsonObject")
        or (
            isinstance(n, ast.Constant) and isinstance(n.value, str) and re.search(r"\bJsonObject\b", n.value)
        )
    )


def any_annotations() -> Measure:
    """Bare ``Any``; ``JsonObject`` (a parsed JSON object, ``dict[str, Any]`` by another name) is
    counted beside it, so naming JSON does not pass for typing it."""
    total = returns = json_objects = 0
    for path in _py_files(LIBRARY):
        for annotation, is_return in _annotations(ast.parse(path.read_text())):
            total += _any_count(annotation)
            json_objects += _json_object_count(annotation)
            returns += is_return and _any_count(annotation) == 1 and not isinstance(annotation, ast.Subscript)
    at_seams = []
    for rel, name in SEAMS:
        path = REPO / rel
        if not path.exists():
            at_seams.append(f"{rel} missing")
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if getattr(node, "name", None) == name and any(_any_count(a) for a, _ in _annotations(node)):
                at_seams.append(name)
    return Measure(
        "`Any` in annotations (at the top floor's seams)",
        f"{total} ({returns} `-> Any`; besides, {json_objects} `JsonObject`); seams with Any: {', '.join(at_seams) or 'none'}",
        "<= 150, none at the seams",
        total <= 150 and not at_seams,
    )


def long_functions() -> Measure:
    lengths = []
    for path in _py_files(LIBRARY):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                lengths.append((length, f"{path.relative_to(REPO)}:{node.name}"))
    lengths.sort(reverse=True)
    found = [entry for entry in lengths if entry[0] > LONG_FUNCTION]
    longest = ", ".join(f"{name} {n}" for n, name in lengths[:3])
    return Measure(
        f"functions over {LONG_FUNCTION} lines",
        f"{len(found)} (longest: {longest})",
        "<= 5",
        len(found) <= 5,
    )


def readme_size() -> Measure:
    size = (REPO / "README.md").stat().st_size
    return Measure("README.md", f"{size / 1000:.1f} KB", "<= 15 KB", size <= 15_000)


def _docstrings_and_comments(path: Path) -> Iterator[tuple[int, str]]:
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        # Docstrings of modules, classes and functions, and attribute docstrings (a string statement
        # after an assignment, the settings' style).
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield node.lineno, node.value.value
    for i, line in enumerate(text.splitlines(), 1):
        if "#" in line:
            yield i, line.split("#", 1)[1]


def run_history() -> Measure:
    hits = set()
    for path in _py_files(LIBRARY):
        for line, text in _docstrings_and_comments(path):
            for m in RUN_HISTORY.finditer(text):
                hits.add((path.relative_to(REPO).as_posix(), line, m.group(0)))
    where = sorted({h[0] for h in hits})
    return Measure(
        "references to runs in code docs",
        f"{len(hits)}" + (f" (in {', '.join(where[:4])}{', ...' if len(where) > 4 else ''})" if hits else ""),
        "0",
        not hits,
    )


_SECTIONS = "job|model|engine|proxy|harness|tasks|sampling|reward|trainer|scheduler|rows|logger|eval|recipe"
# A dotted key names a setting; a file name (model.safetensors, tasks.json) does not.
_NAMES_A_SETTING = re.compile(
    rf"\b(?:{_SECTIONS})(?:\.(?!safetensors\b|jsonl?\b|ya?ml\b|py\b)[a-z_]+)+\b|\bjob="
)


def _message_start(call: ast.Call) -> str:
    if not call.args:
        return ""
    first = call.args[0]
    parts = first.values if isinstance(first, ast.JoinedStr) else [first]
    return "".join(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))


def config_errors_outside_validate() -> Measure:
    """Errors about a setting raised where the job starts, outside ``fineenvs/config.py``'s
    validation: ``dry_run=true`` misses them."""
    places = []
    for path in _py_files(LIBRARY):
        if path == LIBRARY / "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
                if name in ("ValueError", "ConfigError", "RunAborted") and _NAMES_A_SETTING.search(
                    _message_start(node.exc)[:80]
                ):
                    places.append(f"{path.relative_to(LIBRARY).as_posix()}:{node.lineno}")
    return Measure(
        "config errors raised outside validation",
        f"{len(places)}"
        + (f" ({', '.join(places[:4])}{', ...' if len(places) > 4 else ''})" if places else ""),
        "0: every config error at compose time",
        not places,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    measures = [
        library_size(),
        setting_homes(),
        duplicate_pairs(),
        any_annotations(),
        long_functions(),
        readme_size(),
        run_history(),
        config_errors_outside_validate(),
    ]
    print("| measure | now | target | met |")
    print("|---|---|---|---|")
    for m in measures:
        met = "n/a" if m.met is None else ("yes" if m.met else "no")
        print(f"| {m.name} | {m.now} | {m.target} | {met} |")
    missed = [m.name for m in measures if m.met is False]
    if args.strict and missed:
        print(f"house: {len(missed)} target(s) missed: " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
