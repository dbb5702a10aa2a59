"""The router's command, install checks and options, and the replica-header middlewares, without
the router binary (``test_router.py`` runs the real one)."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fineenvs.engine import router as router_module
from fineenvs.engine.router import (
    INSTALL_COMMAND,
    REPLICA_HEADER,
    RouterError,
    RouterOptions,
    router_command,
    router_executable,
    router_problem,
)
from fineenvs.engine.server import ReplicaHeader

PLUGIN = Path(router_module.__file__).with_name("vllm_plugin") / "fineenvs_vllm_plugin.py"


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_pins_the_session_policy_and_turns_retries_off() -> None:
    options = RouterOptions(health_check_interval_s=3, health_failure_threshold=4)
    cmd = router_command(
        options,
        ["http://127.0.0.1:9001/", "http://127.0.0.1:9002"],
        port=9000,
        prometheus_port=9009,
        executable="/x/vllm-router",
    )
    assert cmd[0] == "/x/vllm-router"
    assert (_flag(cmd, "--host"), _flag(cmd, "--port")) == ("127.0.0.1", "9000")
    i = cmd.index("--worker-urls")
    # The ring hashes the URL strings: no trailing slash, or it is another worker.
    assert cmd[i + 1 : i + 3] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert _flag(cmd, "--policy") == "consistent_hash"
    assert "--disable-retries" in cmd
    assert _flag(cmd, "--health-check-interval-secs") == "3"
    assert _flag(cmd, "--health-failure-threshold") == "4"
    assert (_flag(cmd, "--prometheus-host"), _flag(cmd, "--prometheus-port")) == ("127.0.0.1", "9009")
    assert _flag(cmd, "--worker-startup-check-interval") == "1"
    assert "--log-dir" not in cmd
    assert _flag(router_command(options, ["u"], port=1, prometheus_port=2, log_dir=Path("/l"), executable="r"), "--log-dir") == "/l"  # fmt: skip
    with pytest.raises(RouterError, match="at least one replica"):
        router_command(options, [], port=1, prometheus_port=2, executable="r")


def test_missing_router_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FINEENVS_CACHE", str(tmp_path))
    options = RouterOptions()
    assert router_executable(options) is None
    problem = router_problem(options)
    assert problem is not None and INSTALL_COMMAND in problem and str(tmp_path) in problem
    with pytest.raises(RouterError, match="install-router"):
        router_command(options, ["http://h:1"], port=1, prometheus_port=2)
    # A build without its stamp file is incomplete: not installed.
    binary = router_module.router_dir() / "bin" / "vllm-router"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    assert router_executable(options) is None
    (router_module.router_dir() / router_module.STAMP).write_text(json.dumps({"version": "0.1.17"}))
    assert router_executable(options) == binary and router_problem(options) is None
    missing = RouterOptions(executable="/nowhere/vllm-router")
    assert "engine.router.executable" in (router_problem(missing) or "")
    assert router_problem(RouterOptions(url="http://elsewhere:30000")) is None


def test_router_module_imports_only_the_standard_library() -> None:
    """``fineenvs.config`` imports ``RouterOptions``: nothing heavy may come with it."""
    tree = ast.parse(Path(router_module.__file__).read_text())
    names = []
    for node in tree.body:  # top level only; TYPE_CHECKING blocks are ast.If, not imports
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    assert names and all(n.split(".")[0] in sys.stdlib_module_names | {"__future__"} for n in names), names


def test_options_defaults_are_a_session_router_on_this_machine() -> None:
    options = RouterOptions()
    assert (options.url, options.policy, options.host, options.port) == (
        None,
        "consistent_hash",
        "127.0.0.1",
        0,
    )
    assert options.health_check_interval_s * options.health_failure_threshold <= 5


# --- replica header ---------------------------------------------------------------------------


async def _streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
    for chunk in (b"data: 1\n\n", b"data: [DONE]\n\n"):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _run(app: Any, scope_type: str = "http") -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app({"type": scope_type, "path": "/", "headers": []}, receive, send))
    return sent


def _plugin(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The plugin module from its source (it is installed in vLLM's venv, not importable here)."""
    spec = importlib.util.spec_from_file_location("fineenvs_vllm_plugin_under_test", PLUGIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def test_plugin_middleware_stamps_streamed_responses_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugin = _plugin(monkeypatch)
    assert plugin.REPLICA_HEADER == REPLICA_HEADER.encode()
    monkeypatch.setenv(plugin.REPLICA_ENV, "gpu-3")
    sent = _run(plugin.ReplicaHeaderMiddleware(_streaming_app))
    start = sent[0]
    assert (REPLICA_HEADER.encode(), b"gpu-3") in start["headers"]
    assert (b"content-type", b"text/event-stream") in start["headers"]
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"data: 1\n\ndata: [DONE]\n\n"
    monkeypatch.delenv(plugin.REPLICA_ENV)
    untouched = _run(plugin.ReplicaHeaderMiddleware(_streaming_app))
    assert all(h[0] != REPLICA_HEADER.encode() for h in untouched[0]["headers"])
    monkeypatch.setenv(plugin.REPLICA_ENV, "a\r\nb")
    with pytest.raises(ValueError, match="FINEENVS_REPLICA"):
        plugin.ReplicaHeaderMiddleware(_streaming_app)


def test_plugin_module_imports_no_web_framework() -> None:
    tree = ast.parse(PLUGIN.read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    modules = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert all(m.split(".")[0] in sys.stdlib_module_names | {"__future__"} for m in modules), modules


def test_embedded_engine_middleware_replaces_any_upstream_value() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": 404, "headers": [(REPLICA_HEADER.encode(), b"x")]}
        )
        await send({"type": "http.response.body", "body": b"no"})

    sent = _run(ReplicaHeader(app, "A"))
    assert [h for h in sent[0]["headers"] if h[0] == REPLICA_HEADER.encode()] == [
        (REPLICA_HEADER.encode(), b"A")
    ]
    with pytest.raises(ValueError, match="one-line"):
        ReplicaHeader(app, "")
