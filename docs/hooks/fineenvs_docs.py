"""MkDocs hooks of the fineenvs docs site (registered under ``hooks:`` in ``mkdocs.yml``).

1. **Repository files as pages.** The recipes' write-ups (``experiments/**/README.md``) and the
   dated results files (``experiments/*/results/*.md``, ``benchmarks/results/*.md``) live next to
   what they describe, outside ``docs/``. They are added to the site at their repository paths, so
   a link between them works both on the site and in the repository; a page under ``docs/`` links
   to them with a repository-relative path (``../benchmarks/results/X.md``), which is rewritten to
   the page's site path before MkDocs checks links (strict mode fails on any that still miss).
2. **Generated lists.** ``<!-- results: GLOB -->`` in a page becomes a list of the files matching
   ``GLOB`` (repository-relative), newest first, each with its title.
3. **Configuration reference.** ``<!-- config-reference -->`` becomes one table per config section:
   every YAML key reachable from ``fineenvs.config.RunConfig``, with its type, default, the
   dataclass and ``file:line`` that define it, and the field's doc. The schema is walked
   generically (``dataclasses.fields`` + ``typing.get_type_hints``; unions, ``Optional``,
   ``dict[str, X]``, ``list[X]``, nested dataclasses; a section typed ``Any`` takes the schemas
   registered for its Hydra group), so settings classes can move or be renamed freely.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import io
import json
import logging
import posixpath
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

log = logging.getLogger("mkdocs.hooks.fineenvs_docs")

ROOT_SCHEMA = "fineenvs.config:RunConfig"
AGENTS = "fineenvs.harnesses:HARNESSES"
AGENTS_LEFT_OUT = "fineenvs.harnesses:UNAVAILABLE"
MIRRORED = (
    "experiments/README.md",
    "experiments/*/README.md",
    "experiments/*/results/*.md",
    "benchmarks/results/*.md",
)
_REPO = Path(".")
_MIRRORED_URIS: set[str] = set()
_LINK = re.compile(r"(\]\()([^)\s#]+\.md)(#[^)\s]*)?(\))")
_RESULTS_MARK = re.compile(r"<!--\s*results:\s*(\S+)\s*-->")
_CONFIG_MARK = "<!-- config-reference -->"
_AGENTS_MARK = "<!-- agents-table -->"
_ROOMS_MARK = "<!-- rooms -->"
PACKAGE = "fineenvs"


# --------------------------------------------------------------------------- mkdocs events


def on_config(config: Any) -> Any:
    global _REPO
    _REPO = Path(config.config_file_path).resolve().parent
    if str(_REPO) not in sys.path:
        sys.path.insert(0, str(_REPO))
    return config


def on_files(files: Files, config: Any) -> Files:
    for pattern in MIRRORED:
        for path in sorted(_REPO.glob(pattern)):
            uri = path.relative_to(_REPO).as_posix()
            _MIRRORED_URIS.add(uri)
            # Not in the nav: reached from the pages that list or link them.
            files.append(
                File.generated(config, uri, abs_src_path=str(path), inclusion=InclusionLevel.NOT_IN_NAV)
            )
    return files


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    for folder in ("experiments", "benchmarks/results", "fineenvs", "conf"):
        server.watch(str(_REPO / folder))
    return server


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if _CONFIG_MARK in markdown:
        markdown = markdown.replace(_CONFIG_MARK, config_reference())
    if _AGENTS_MARK in markdown:
        markdown = markdown.replace(_AGENTS_MARK, agents_table())
    if _ROOMS_MARK in markdown:
        markdown = markdown.replace(_ROOMS_MARK, rooms_table())
    markdown = _RESULTS_MARK.sub(lambda m: _results_list(m.group(1), page.file.src_uri), markdown)
    return _LINK.sub(lambda m: _rewrite_link(m, page.file, files), markdown)


# --------------------------------------------------------------------------- links and lists


def _rewrite_link(m: re.Match[str], page: File, files: Files) -> str:
    """A link written between repository paths -> the same link between site pages.

    A page under ``docs/`` sits at ``docs/<src_uri>`` in the repository, a mirrored file at its own
    path. A target under ``docs/`` is the page ``<rest>``; a mirrored file keeps its path; anything
    else is left for MkDocs to report."""
    target = m.group(2)
    if "://" in target or target.startswith("/"):
        return m.group(0)
    here = page.src_uri if page.src_uri in _MIRRORED_URIS else f"docs/{page.src_uri}"
    repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(here), target))
    if repo_path.startswith("docs/"):
        uri = repo_path.removeprefix("docs/")
    elif files.get_file_from_path(repo_path) is not None:
        uri = repo_path
    else:
        return m.group(0)
    rel = posixpath.relpath(uri, posixpath.dirname(page.src_uri) or ".")
    return f"{m.group(1)}{rel}{m.group(3) or ''}{m.group(4)}"


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def _results_list(pattern: str, src_uri: str) -> str:
    paths = sorted(_REPO.glob(pattern), key=lambda p: p.name, reverse=True)
    if not paths:
        log.warning("<!-- results: %s --> in %s matches no file", pattern, src_uri)
        return ""
    here = posixpath.dirname(src_uri) or "."
    lines = []
    for path in paths:
        uri = path.relative_to(_REPO).as_posix()
        lines.append(f"- [{_title(path)}]({posixpath.relpath(uri, here)}) (`{uri}`)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- rooms of the package


def _first_sentence(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except SyntaxError:
        return ""
    text = " ".join(doc.split())
    end = re.search(r"\.(\s|$)", text)
    text = text[: end.start() + 1] if end else text
    return text if len(text) <= 180 else text[:180].rsplit(" ", 1)[0] + " …"


def _imports(path: Path) -> set[str]:
    """Top-level names under ``PACKAGE`` this file imports (absolute or relative, lazy included)."""
    rel = path.relative_to(_REPO).with_suffix("").parts
    package = list(rel[:-1])  # a relative import's anchor, for a module and an __init__ alike
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names = [".".join([*base, *([node.module] if node.module else [])])]
                if not node.module:
                    names = [".".join([*base, a.name]) for a in node.names]
            else:
                names = [node.module or ""]
                if node.module == PACKAGE:
                    names = [f"{PACKAGE}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == PACKAGE and len(parts) > 1:
                found.add(parts[1])
    return found


def rooms_table() -> str:
    """Every room of the package (a subpackage or a top-level module): what it is, what it imports."""
    root = _REPO / PACKAGE
    rooms: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        room = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else ""
        if room and room != "__main__":
            rooms.setdefault(room, []).append(path)
    lines = ["| room | what it is | modules | imports from |", "|---|---|---|---|"]
    for room, paths in rooms.items():
        is_pkg = (root / room).is_dir()
        head = root / room / "__init__.py" if is_pkg else root / f"{room}.py"
        name = f"`{PACKAGE}/{room}/`" if is_pkg else f"`{PACKAGE}/{room}.py`"
        uses = sorted(set().union(*(_imports(p) for p in paths)) - {room})
        uses = [u for u in uses if u in rooms]
        modules = sorted(
            p.relative_to(root / room).with_suffix("").as_posix()
            for p in paths
            if is_pkg and p.name not in ("__init__.py", "__main__.py")
        )
        main = " (`python -m`)" if (root / room / "__main__.py").is_file() else ""
        lines.append(
            f"| {name}{main} | {_cell(_first_sentence(head))} | {', '.join(modules)} | "
            f"{', '.join(f'`{u}`' for u in uses)} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- agents


def agents_table() -> str:
    """One row per agent adapter: what it installs (pinned) and the formats it speaks."""
    rows = [
        "| harness | package (pinned) | registry | wire formats (default first) | step limit | needs |",
        "|---|---|---|---|---|---|",
    ]
    for name, h in _import(AGENTS).items():
        formats = [h.default_format, *(f for f in h.api_formats if f != h.default_format)]
        package = f"`{h.package}` {h.version}" + "".join(f", `{r}`" for r in h.extra_requirements)
        needs = f"Python ≥ {h.python_version}" if h.python_version else ""
        rows.append(
            f"| `{name}` | {package} | {h.registry} | {', '.join(formats)} | "
            f"{'yes' if h.honours_step_limit else 'no'} | {needs} |"
        )
    for name, why in _import(AGENTS_LEFT_OUT).items():
        rows.append(f"| {name} | no adapter | | | | {_cell(why)} |")
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------- config reference


@dataclasses.dataclass
class _Row:
    key: str
    type: str
    default: str
    where: str
    doc: str


def _import(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: fall back to its text
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _args(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()


def _dataclasses_in(tp: Any) -> list[type]:
    """The dataclasses a field holds directly: itself, or the members of a union / Optional."""
    return [t for t in (_args(tp) or (tp,)) if isinstance(t, type) and dataclasses.is_dataclass(t)]


def _store_entries(group: str) -> dict[str, type]:
    """Schemas registered in Hydra's ConfigStore under ``group``: name (``grpo_schema``) -> class."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    entries = {}
    for key, node in ConfigStore.instance().repo.get(group, {}).items():
        kind = OmegaConf.get_type(node.node) if hasattr(node, "node") else None
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            entries[key.removesuffix(".yaml")] = kind
    return entries


def _group_schemas(group: str) -> list[type]:
    """The schemas of a section typed ``Any``: those registered for its Hydra group."""
    return list(dict.fromkeys(_store_entries(group).values()))


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(f"`{m.name}`" for m in tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"`{tp.__name__}`"
    members = _args(tp)
    if members:
        return " \\| ".join(_type_name(m) for m in members)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    return getattr(tp, "__name__", str(tp))


def _yaml(value: Any) -> str:
    def plain(v: Any) -> Any:
        if isinstance(v, enum.Enum):
            return v.name
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        return v

    v = plain(value)
    text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False).replace('"', "")
    return f"`{text}`" if text != "" else '`""`'


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        if f.default == "???":
            return "required"
        return _yaml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _yaml(f.default_factory())
    return "required"


class _Source:
    """Where each field of a class is written: line numbers, attribute docstrings and comments."""

    _cache: dict[type, _Source] = {}

    def __init__(self, cls: type) -> None:
        self.path = Path(inspect.getsourcefile(cls) or "?").resolve()
        lines, start = inspect.getsourcelines(cls)
        text = textwrap.dedent("".join(lines))
        self.line: dict[str, int] = {}
        self.doc: dict[str, str] = {}
        body = ast.parse(text).body[0]
        assert isinstance(body, ast.ClassDef)
        comments: dict[int, str] = {}
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string.lstrip("#").strip()
        for i, stmt in enumerate(body.body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            name = stmt.target.id
            self.line[name] = start + stmt.lineno - 1
            parts: list[str] = []
            above = stmt.lineno - 1
            while above in comments:
                parts.insert(0, comments[above])
                above -= 1
            parts += [
                comments[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in comments
            ]
            nxt = body.body[i + 1] if i + 1 < len(body.body) else None
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                parts.append(inspect.cleandoc(nxt.value.value))
            self.doc[name] = " ".join(" ".join(parts).split())

    @classmethod
    def of(cls, owner: type) -> _Source:
        if owner not in cls._cache:
            cls._cache[owner] = cls(owner)
        return cls._cache[owner]


def _class_file(cls: type) -> str:
    try:
        path = Path(inspect.getsourcefile(cls) or "?").resolve()
        _, line = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return cls.__module__
    try:
        return f"{path.relative_to(_REPO).as_posix()}:{line}"
    except ValueError:
        return f"{path.name}:{line}"


def _owner(cls: type, name: str) -> type:
    for base in cls.__mro__:
        if name in base.__dict__.get("__annotations__", {}):
            return base
    return cls


def _where(cls: type, name: str) -> tuple[str, str]:
    owner = _owner(cls, name)
    try:
        src = _Source.of(owner)
    except (OSError, TypeError):
        return f"`{owner.__qualname__}`", ""
    try:
        rel = src.path.relative_to(_REPO).as_posix()
    except ValueError:
        rel = src.path.name
    return f"`{owner.__qualname__}` `{rel}:{src.line.get(name, '?')}`", src.doc.get(name, "")


def _cell(text: str) -> str:
    """Markdown table cell: ``|`` and ``<`` escaped outside code spans (a table ignores pipes inside)."""
    pieces = re.split(r"(``.*?``|`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("|", "\\|").replace("<", "&lt;") for p in pieces)


def _rows(cls: type, prefix: str) -> list[_Row]:
    rows: list[_Row] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name, f.type)
        key = f"{prefix}{f.name}"
        nested = _dataclasses_in(tp)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        where, doc = _where(cls, f.name)
        if nested:
            if type(None) in _args(tp):  # an optional section: its own key may be null
                rows.append(_Row(key, _type_name(tp), _default(f), where, doc))
            for sub in nested:
                rows.extend(_rows(sub, f"{key}."))
            continue
        if origin in (dict, list) and args and _dataclasses_in(args[-1]):
            item = "<name>" if origin is dict else "<i>"
            rows.append(_Row(key, _type_name(tp), _default(f), where, doc))
            for sub in _dataclasses_in(args[-1]):
                rows.extend(_rows(sub, f"{key}.{item}."))
            continue
        rows.append(_Row(key, _type_name(tp), _default(f), where, doc))
    return rows


def _note(text: str) -> str:
    """First sentence of a YAML file's leading comment (``@package`` and ``Run:`` lines skipped)."""
    block: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            if block:
                break
            continue
        body = line.lstrip("#").strip()
        if "@package" in body or body.startswith("Run:"):
            continue
        block.append(body)
    words = " ".join(block)
    end = re.search(r"[.?](\s|$)", words)
    words = words[: end.start() + 1] if end else words
    return words if len(words) <= 200 else words[:200].rsplit(" ", 1)[0] + " …"


def _conf_files(group: str, schemas: dict[str, type] | None = None) -> list[str]:
    lines = []
    for path in sorted((_REPO / "conf" / group).glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        item = f"- `conf/{group}/{path.name}`"
        used = [cls for name, cls in (schemas or {}).items() if re.search(rf"\b{name}\b", text)]
        if used:
            item += f" (`{used[0].__qualname__}`)"
        note = _note(text)
        lines.append(item + (f": {_cell(note)}" if note else ""))
    return lines


def config_reference() -> str:
    root = _import(ROOT_SCHEMA)
    hints = _hints(root)
    out: list[str] = []
    top: list[_Row] = []
    sections: list[tuple[str, list[type], list[_Row]]] = []
    for f in dataclasses.fields(root):
        tp = hints.get(f.name, f.type)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        schemas = _dataclasses_in(tp) or (_group_schemas(f.name) if tp is Any or tp is object else [])
        if schemas:
            rows = [r for s in schemas for r in _rows(s, f"{f.name}.")]
            sections.append((f.name, schemas, rows))
        elif origin is dict and args and _dataclasses_in(args[-1]):
            schemas = _dataclasses_in(args[-1])
            sections.append((f.name, schemas, [r for s in schemas for r in _rows(s, f"{f.name}.<name>.")]))
        else:
            where, doc = _where(root, f.name)
            top.append(_Row(f.name, _type_name(tp), _default(f), where, doc))
    seen = {name for name, _, _ in sections}
    out.append("### Top level\n")
    out.append(_table(top))
    for name, schemas, rows in sections:
        out.append(f"### `{name}`\n")
        classes = ", ".join(f"`{s.__qualname__}` (`{_class_file(s)}`)" for s in schemas)
        out.append(f"Schema: {classes}.\n")
        if len(schemas) > 1:
            out.append(
                f"The option chosen for `{name}` decides which schema applies (named after each option below).\n"
            )
            for schema in schemas:
                out.append(f"#### `{schema.__qualname__}`\n")
                out.append(_table(_rows(schema, f"{name}.")))
        else:
            out.append(_table(rows))
        entries = _store_entries(name)
        files = _conf_files(name, entries if len(set(entries.values())) > 1 else None)
        if files:
            out.append(f"Options (`{name}=<option>`):\n\n" + "\n".join(files) + "\n")
    conf = _REPO / "conf"
    others = (
        sorted(p.name for p in conf.iterdir() if p.is_dir() and p.name not in seen) if conf.is_dir() else []
    )
    if others:
        out.append("### Other groups\n")
        out.append(
            "These groups carry no schema of their own: their files override keys of the sections above.\n"
        )
        for group in others:
            out.append(f"#### `{group}`\n\n" + "\n".join(_conf_files(group)) + "\n")
    return "\n".join(out)


def _table(rows: list[_Row]) -> str:
    head = "| YAML key | type | default | defined in | what it does |\n|---|---|---|---|---|\n"
    return head + "".join(
        f"| `{r.key}` | {r.type} | {_cell(r.default)} | {r.where} | {_cell(r.doc)} |\n" for r in rows
    )
