"""Per-attempt isolation: fresh dirs, env from scratch, whole-group kill at the timeout, result logic."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses.base import Harness, Launch, Outputs
from fineenvs.harnesses.sandbox import (
    ProxyStats,
    classify,
    count_tool_calls,
    proxy_stats_from_rollout,
    run_attempt,
)


class ScriptHarness(Harness):
    """A 'harness' that runs a shell script: stands in for an agent CLI in isolation tests."""

    name = "script"
    package = "none"
    registry = "npm"
    version = "0"
    binary = "sh"
    api_formats = (ApiFormat.openai_chat,)
    default_format = ApiFormat.openai_chat

    def __init__(self, script: str) -> None:
        self.script = script

    def write_config(self, launch: Launch) -> None:
        (launch.home / "agent.conf").write_text(f"url={launch.base_url}\n")

    def command(self, launch: Launch) -> list[str]:
        return ["/bin/sh", *self.arguments(launch)]

    def arguments(self, launch: Launch) -> list[str]:
        return ["-c", self.script]

    def env(self, launch: Launch) -> dict[str, str]:
        env = self.base_env(launch.home)
        env["AGENT_KEY"] = launch.session_key
        return env

    def parse_outputs(self, attempt_dir: Path) -> Outputs:
        return Outputs(
            final_text=(attempt_dir / "stdout.txt").read_text().strip() or None, native_tool_calls=3
        )


def run_script(tmp_path: Path, script: str, **kw: Any) -> Any:
    """``script`` as an attempt's agent through ``run_attempt`` (keywords override the defaults)."""
    params: dict[str, Any] = {
        "task_prompt": "do it",
        "input_files": {},
        "attempt_dir": tmp_path / "attempt",
        "base_url": "http://127.0.0.1:9/s/k",
        "session_key": "k-session",
        "model": "m",
        "timeout_seconds": 20,
    }
    params.update(kw)
    return run_attempt(ScriptHarness(script), **params)


def test_env_from_scratch_inputs_copied_and_outputs_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-LEAK-parent")
    monkeypatch.setenv("HF_TOKEN", "hf_LEAK")
    data = tmp_path / "data.csv"
    data.write_text("a,b\n1,2\n")
    result = run_script(
        tmp_path,
        'env > "$HOME/env.txt"; cat data/data.csv; pwd; echo 42 > answer.txt; echo done >&2',
        input_files={"data/data.csv": data},
        proxy_stats=lambda: ProxyStats(model_calls=2, tool_calls=3),
    )
    attempt = tmp_path / "attempt"
    env_dump = (attempt / "home" / "env.txt").read_text()
    assert "LEAK" not in env_dump
    assert "AGENT_KEY=k-session" in env_dump
    assert f"HOME={attempt / 'home'}" in env_dump
    csv_a, csv_b, cwd = (attempt / "stdout.txt").read_text().splitlines()
    assert [csv_a, csv_b] == ["a,b", "1,2"]
    # The agent worked in a neutral directory (nothing of the run in its path), moved back after.
    assert re.fullmatch(
        rf"{re.escape(str(Path(tempfile.gettempdir()).resolve()))}/fineenvs-work/[0-9a-f]{{8}}", cwd
    ), cwd
    assert str(tmp_path) not in cwd and not Path(cwd).exists()
    assert (attempt / "work" / "answer.txt").read_text() == "42\n"
    assert (attempt / "work" / "data" / "data.csv").read_text() == "a,b\n1,2\n"
    assert (attempt / "stderr.txt").read_text() == "done\n"
    assert result.exit_reason == "finished" and result.returncode == 0
    assert result.answer == "42"
    assert result.proxy_tool_calls == 3 and result.native_tool_calls == 3 and not result.tool_calls_disagree
    assert (attempt / "attempt.json").exists()


def test_workdir_is_kept_when_the_move_has_to_copy_and_meets_a_fifo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across filesystems ``shutil.move`` copies, which fails on a FIFO the agent left behind; the
    attempt's result and its regular files must survive that."""
    import fineenvs.harnesses.sandbox as sandbox

    def cross_device(src: str, dst: str) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(sandbox.shutil, "move", cross_device)
    result = run_script(
        tmp_path, "mkfifo pipe; echo 7 > answer.txt; mkdir -p out; echo x > out/log.txt; pwd > out/cwd.txt"
    )
    work = tmp_path / "attempt" / "work"
    assert result.answer == "7" and result.exit_reason == "finished"
    assert (work / "answer.txt").read_text() == "7\n" and (work / "out" / "log.txt").read_text() == "x\n"
    assert not (work / "pipe").exists()
    assert not Path((work / "out" / "cwd.txt").read_text().strip()).exists()  # the neutral copy is gone


def test_timeout_kills_whole_group_and_escaped_children(tmp_path: Path) -> None:
    # A foreground sleeper, a background one in the same group, and one that left the group
    # with setsid: all three must be gone after the timeout.
    # Durations unique to this run, so other processes on the machine cannot match them.
    tag = uuid.uuid4().int % 10**6
    sleeps = [f"{n}.{tag:06d}" for n in (300, 301, 302)]
    script = f"sleep {sleeps[0]} & setsid sleep {sleeps[1]} & echo started; sleep {sleeps[2]}"
    started = time.monotonic()
    result = run_script(tmp_path, script, timeout_seconds=1.5)
    elapsed = time.monotonic() - started
    assert result.exit_reason == "timeout"
    assert result.leftover_pids == []
    assert elapsed < 10
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        assert not any(f"sleep {n}" in cmd for n in sleeps), f"left running: {pid_dir.name} {cmd}"


def test_background_children_killed_after_clean_exit(tmp_path: Path) -> None:
    tag = uuid.uuid4().int % 10**6
    sleeps = [f"{n}.{tag:06d}" for n in (303, 304)]
    result = run_script(tmp_path, f"setsid sleep {sleeps[0]} & sleep {sleeps[1]} & echo ok")
    assert result.exit_reason == "finished"
    assert result.leftover_pids == []
    time.sleep(0.1)
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            assert not any(f"sleep {n}" in cmd for n in sleeps), f"left running: {pid_dir.name} {cmd}"


def test_crash_wiring_failure_and_budget_classification(tmp_path: Path) -> None:
    crashed = run_script(tmp_path, "exit 3", proxy_stats=lambda: ProxyStats(model_calls=1, tool_calls=0))
    assert crashed.exit_reason == "crashed" and crashed.returncode == 3
    no_calls = run_script(tmp_path, "exit 0", proxy_stats=lambda: ProxyStats(model_calls=0, tool_calls=0))
    assert no_calls.exit_reason == "wiring_failure"
    assert no_calls.tool_calls_disagree  # proxy 0 vs the script's own log of 3


def test_classify_precedence() -> None:
    budget = ProxyStats(model_calls=17, tool_calls=5, budget_stops=1)
    overflow = ProxyStats(model_calls=3, tool_calls=1, context_stops=1)
    assert classify(timed_out=True, returncode=None, stats=budget) == "budget_stop"
    assert classify(timed_out=False, returncode=1, stats=overflow) == "context_overflow"
    assert classify(timed_out=True, returncode=None, stats=ProxyStats(0, 0)) == "wiring_failure"
    assert classify(timed_out=True, returncode=None, stats=ProxyStats(2, 1)) == "timeout"
    assert classify(timed_out=False, returncode=0, stats=None) == "finished"
    assert classify(timed_out=False, returncode=-9, stats=ProxyStats(2, 1)) == "crashed"


def test_input_path_escape_is_rejected(tmp_path: Path) -> None:
    src = tmp_path / "x.txt"
    src.write_text("x")
    with pytest.raises(ValueError, match="escapes the working directory"):
        run_script(tmp_path, "true", input_files={"../x.txt": src})


def test_proxy_stats_count_recorded_tool_calls() -> None:
    rollout = {
        "session": {"model_calls": 3, "budget_stops": 0, "context_stops": 1},
        "calls": [
            {"response": {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}, {"id": "b"}]}},
            {"response": {"role": "assistant", "content": "done"}},
            {"response": {"role": "assistant", "tool_calls": [{"id": "c"}]}},
        ],
    }
    stats = proxy_stats_from_rollout(rollout)
    assert stats == ProxyStats(model_calls=3, tool_calls=3, budget_stops=0, context_stops=1)
    assert count_tool_calls([{"completion": {"choices": [{"message": {"tool_calls": [{}]}}]}}]) == 1


class HelloHandler(BaseHTTPRequestHandler):
    """A server the sandbox tests try to reach: it answers every GET with ``hello-from-proxy``."""

    def do_GET(self) -> None:  # noqa: N802
        body = b"hello-from-proxy"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)")
def test_bwrap_readonly_root_writable_workdir_loopback_only_to_proxy(tmp_path: Path) -> None:
    server = HTTPServer(("127.0.0.1", 0), HelloHandler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    other_port = other.getsockname()[1]
    # Root can write here outside the sandbox; inside, the host's root is mounted read-only.
    outside = Path("/usr/local/fineenvs-bwrap-probe.txt")
    tmp_outside = tmp_path / "tmp-outside.txt"  # /tmp is a private tmpfs inside: never reaches the host
    script = (
        f"(echo x > {outside}) 2>/dev/null && echo wrote-outside || echo ro-outside; "
        f"echo x > {tmp_outside}; "
        "echo 42 > answer.txt; "
        f"python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/').read().decode())\"; "
        f"python3 -c \"import socket; s=socket.socket(); s.settimeout(2); s.connect(('127.0.0.1', {other_port}))\" "
        "2>/dev/null && echo other-reachable || echo other-blocked"
    )
    try:
        result = run_script(tmp_path, script, base_url=f"http://127.0.0.1:{port}/s/k", use_bwrap=True)
    finally:
        server.shutdown()
        other.close()
    out = (tmp_path / "attempt" / "stdout.txt").read_text().split()
    assert result.exit_reason == "finished", (tmp_path / "attempt" / "stderr.txt").read_text()
    assert out == ["ro-outside", "hello-from-proxy", "other-blocked"]
    assert not outside.exists()
    assert not tmp_outside.exists()
    assert result.answer == "42"
    assert os.path.exists(tmp_path / "attempt" / "work" / "answer.txt")


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)")
def test_bwrap_reaches_the_proxy_from_an_attempt_folder_deeper_than_a_unix_socket_path(
    tmp_path: Path,
) -> None:
    # Evaluation attempts live deep in the output directory (.../eval/<checkpoint>/attempts/<id>);
    # a Unix socket path must fit in 108 bytes, so the bridge's socket cannot live there.
    server = HTTPServer(("127.0.0.1", 0), HelloHandler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "attempts" / "t00002-pi"
    assert len(str(deep / "proxy.sock")) > 108
    script = (
        f"python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/').read().decode())\"; "
        "echo 5 > answer.txt"
    )
    try:
        result = run_script(
            tmp_path, script, attempt_dir=deep, base_url=f"http://127.0.0.1:{port}/s/k", use_bwrap=True
        )
    finally:
        server.shutdown()
    assert result.exit_reason == "finished", (deep / "stderr.txt").read_text()
    assert (deep / "stdout.txt").read_text().split() == ["hello-from-proxy"]
    assert result.answer == "5"
    argv = json.loads((deep / "attempt.json").read_text())["argv"]
    host_sock_dir = argv[argv.index("/tmp/.fineenvs-bridge") - 1]
    assert len(host_sock_dir) < 60 and not Path(host_sock_dir).exists()  # short, and removed afterwards


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)")
def test_bwrap_that_cannot_set_up_its_sandbox_is_an_infra_failure_and_an_agents_exit_1_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fineenvs.harnesses.sandbox as sb

    # A bind bwrap cannot make: it fails before the agent runs (exit 1, its own one-line error).
    missing = str(tmp_path / "gone")
    monkeypatch.setattr(sb, "_keep_under_tmp", lambda: ["--ro-bind", missing, missing])
    broken = run_script(tmp_path, "echo 1 > answer.txt", attempt_dir=tmp_path / "a1", use_bwrap=True)
    assert broken.exit_reason == "infra_failure", (tmp_path / "a1" / "stderr.txt").read_text()
    assert "the bwrap sandbox did not start: bwrap: Can't find source path" in broken.detail
    assert broken.answer is None
    monkeypatch.undo()
    # The agent's own exit 1, whatever it says on stderr, stays the agent's.
    script = "echo 'bwrap: not really' >&2; echo more >&2; exit 1"
    agent = run_script(tmp_path, script, attempt_dir=tmp_path / "a2", use_bwrap=True)
    assert agent.exit_reason == "crashed" and agent.returncode == 1


def test_proxy_stats_failure_is_reported_not_raised(tmp_path: Path) -> None:
    def broken() -> ProxyStats:
        raise ConnectionError("proxy gone")

    result = run_script(tmp_path, "echo 42 > answer.txt", proxy_stats=broken)
    assert result.exit_reason == "finished" and result.answer == "42"
    assert result.proxy_model_calls is None
    assert "proxy stats unavailable: ConnectionError: proxy gone" in result.detail


def test_agent_that_cannot_start_is_a_crash(tmp_path: Path) -> None:
    class Missing(ScriptHarness):
        def command(self, launch: Launch) -> list[str]:
            return [str(tmp_path / "no-such-agent")]

    result = run_attempt(
        Missing("true"),
        task_prompt="x",
        input_files={},
        attempt_dir=tmp_path / "a",
        base_url="http://127.0.0.1:9",
        session_key="k",
        model="m",
        timeout_seconds=5,
    )
    assert result.exit_reason == "crashed" and "could not start" in result.detail


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)")
def test_bwrap_attempts_see_the_same_fixed_home_and_workdir(tmp_path: Path) -> None:
    # Agents write HOME and the working directory into their prompts: in bwrap every attempt must
    # see the same ones (so attempts share their prompt up to the task), backed by its own folders.
    script = (
        'echo "$PWD $HOME $TMPDIR"; cat "$HOME/agent.conf"; echo mine > "$HOME/note.txt"; echo 7 > answer.txt'
    )
    seen = []
    for name in ("a", "b"):
        result = run_script(tmp_path, script, attempt_dir=tmp_path / name, use_bwrap=True)
        assert result.exit_reason == "finished", (tmp_path / name / "stderr.txt").read_text()
        assert result.answer == "7"
        seen.append((tmp_path / name / "stdout.txt").read_text().splitlines())
        assert (tmp_path / name / "home" / "note.txt").read_text() == "mine\n"
        assert (tmp_path / name / "work" / "answer.txt").read_text() == "7\n"
    assert seen[0] == seen[1]
    assert seen[0][0] == "/tmp/work /tmp/home /tmp/home/tmp"
    assert seen[0][1] == "url=http://127.0.0.1:9/s/k"  # the config written on the host is read inside
