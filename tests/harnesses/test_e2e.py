"""Every harness, the real CLI, headless, through the real capture proxy (``-m harness``).

Scripted policy (tests/harnesses/scripted_engine.py) as the model: a shell tool call first, a final
answer once the tool result is back. Checks per harness and wire format: the calls arrived in the
expected format; a shell tool call was executed and its output sent back; answer.txt was written;
the proxy recorded exactly the token ids and logprobs the engine produced for every call; the
AttemptResult agrees. One attempt per harness also runs the real tiny model (embedded engine): the
attempt must end cleanly (bounded by the call budget and the timeout, nothing left running).

Needs: ``python -m fineenvs.harnesses install all``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fineenvs.harnesses import HARNESSES, check_installed
from fineenvs.harnesses.sandbox import WORK_ROOT_NAME, AttemptResult, proxy_stats_from_rollout, run_attempt
from tests.harnesses.scripted_engine import ANSWER, SHELL_TOOLS, TOOL_MARKER, ScriptedEngine, scripted_logprob
from tests.harnesses.stack import EmbeddedEngine, Proxy, start_embedded_engine, start_proxy

pytestmark = pytest.mark.harness

MODEL = "tiny_qwen"
# The random model of the tiny-model attempts: tiny_lfm2 has two attention layers to tiny_qwen's four,
# so prefilling an agent's 13-25k-token prompt takes half as long (the harness tier: -250 s).
RANDOM_MODEL = "tiny_lfm2"
TASK = "Compute 6*7 and write only the number to a file named answer.txt in the current directory using the shell."
CASES = [
    pytest.param(name, fmt, id=f"{name}-{fmt}") for name, h in HARNESSES.items() for fmt in h.api_formats
]
# Slow starters (Python agents on 2 shared cores) get more time; the scripted policy needs 2-5 calls.
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def scripted_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ScriptedEngine, Proxy]]:
    root = tmp_path_factory.mktemp("scripted")
    engine = ScriptedEngine(tokenizer_model=MODEL, served_model=MODEL).start()
    proxy = start_proxy(engine.url, MODEL, root / "store")
    yield engine, proxy
    proxy.stop()
    engine.stop()


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedEngine, Proxy]]:
    root = tmp_path_factory.mktemp("tiny")
    engine = start_embedded_engine(RANDOM_MODEL, root / "engine.log")
    # Short replies: a random model otherwise samples thousands of tokens per call on the CPU.
    proxy = start_proxy(engine.url, RANDOM_MODEL, root / "store", extra_args=("--max-output-tokens", "48"))
    yield engine, proxy
    proxy.stop()
    engine.stop()


def _require_installed(name: str) -> None:
    problems = check_installed([name])
    if problems:
        pytest.fail("; ".join(problems))


def _attempt(
    proxy: Proxy, name: str, fmt: str, attempt_dir: Path, model: str = MODEL, **kw: Any
) -> tuple[AttemptResult, dict[str, Any]]:
    session = proxy.new_session(harness=name, max_model_calls=kw.pop("max_model_calls", 12))
    result = run_attempt(
        HARNESSES[name],
        task_prompt=TASK,
        input_files={},
        attempt_dir=attempt_dir,
        base_url=session["base_url"],
        session_key=session["key"],
        model=model,
        api_format=fmt,
        timeout_seconds=kw.pop("timeout_seconds", TIMEOUT_S),
        step_limit=kw.pop("step_limit", 8),
        proxy_stats=lambda: proxy_stats_from_rollout(proxy.rollout(session["session_id"])),
        **kw,
    )
    return result, proxy.rollout(session["session_id"])


def _why(result: AttemptResult) -> str:
    d = Path(result.attempt_dir)
    tail = lambda p: (d / p).read_text(errors="replace")[-2500:] if (d / p).exists() else ""  # noqa: E731
    return f"{json.dumps(result.to_json(), indent=1)}\nstdout: {tail('stdout.txt')}\nstderr: {tail('stderr.txt')}"


def _tool_texts(messages: list[dict[str, Any]]) -> str:
    out = []
    for m in messages:
        if m.get("role") == "tool":
            content = m.get("content")
            out.append(content if isinstance(content, str) else json.dumps(content))
    return "\n".join(out)


@pytest.mark.parametrize(("name", "fmt"), CASES)
def test_scripted_policy_end_to_end(
    name: str, fmt: str, scripted_stack: tuple[ScriptedEngine, Proxy], tmp_path: Path
) -> None:
    _require_installed(name)
    engine, proxy = scripted_stack
    result, rollout = _attempt(proxy, name, fmt, tmp_path / "attempt")
    calls = rollout["calls"]

    assert result.exit_reason == "finished", _why(result)
    assert result.returncode == 0
    assert result.answer == ANSWER, _why(result)
    assert (tmp_path / "attempt" / "work" / "answer.txt").read_text().strip() == ANSWER
    assert result.leftover_pids == []

    # The model was called through the expected wire format, every time.
    assert calls, "the proxy recorded no call"
    assert {c["dialect"] for c in calls} == {fmt}

    # Exact tokens: every recorded call holds the very prompt and sampled ids the engine produced,
    # with one logprob per sampled token equal to the engine's.
    for c in calls:
        assert (tuple(c["prompt_ids"]), tuple(c["sampled_ids"])) in engine.replies, c["call_id"]
        assert c["logprobs_aligned"] is True
        assert c["logprobs"] == [scripted_logprob(t) for t in c["sampled_ids"]]
        assert all(lp <= 0 for lp in c["logprobs"])

    if HARNESSES[name].actions_in_text:
        # No tools on the wire (aider): the edit travelled as text, the proxy counted no tool call,
        # and the agent's own trace counts the applied edit, unchallenged by the proxy's zero.
        assert all(not c["response"].get("tool_calls") for c in calls)
        assert "answer.txt" in calls[0]["response"]["content"]
        assert result.proxy_tool_calls == 0
        assert result.native_tool_calls == 1, _why(result)
        assert not result.tool_calls_disagree
        return

    # A shell tool call was emitted, executed, and its output came back in a later request.
    shell_calls = [
        tc
        for c in calls
        for tc in (c["response"].get("tool_calls") or [])
        if tc["function"]["name"] in SHELL_TOOLS
    ]
    assert shell_calls, "no shell tool call recorded"
    first = next(i for i, c in enumerate(calls) if c["response"].get("tool_calls"))
    later_tool_output = "\n".join(_tool_texts(c["request"]["messages"]) for c in calls[first + 1 :])
    assert TOOL_MARKER in later_tool_output, "the tool result never reached the model"

    # The AttemptResult agrees with the proxy.
    assert result.proxy_model_calls == len(calls)
    assert result.proxy_tool_calls == len(
        [tc for c in calls for tc in (c["response"].get("tool_calls") or [])]
    )
    assert result.proxy_tool_calls >= 1
    if result.native_tool_calls is not None:
        assert not result.tool_calls_disagree, _why(result)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HARNESSES))
def test_tiny_model_attempt_ends_cleanly(
    name: str, tiny_stack: tuple[EmbeddedEngine, Proxy], tmp_path: Path
) -> None:
    """A random tiny model talks nonsense: the attempt must still end, bounded, with nothing left running."""
    _require_installed(name)
    _engine, proxy = tiny_stack
    h = HARNESSES[name]
    timeout = 120
    result, rollout = _attempt(
        proxy,
        name,
        h.default_format,
        tmp_path / "attempt",
        model=RANDOM_MODEL,
        max_model_calls=3,
        timeout_seconds=timeout,
        step_limit=3,
    )
    assert result.exit_reason in ("finished", "crashed", "budget_stop", "context_overflow", "timeout"), _why(
        result
    )
    assert result.proxy_model_calls is not None and result.proxy_model_calls >= 1, _why(result)
    assert result.leftover_pids == []
    assert result.duration_s < timeout + 15
    for c in rollout["calls"]:
        assert c["prompt_ids"] and all(isinstance(t, int) for t in c["prompt_ids"])
        assert c["logprobs"] is None or all(lp <= 0 for lp in c["logprobs"])


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)")
@pytest.mark.parametrize("name", list(HARNESSES))
def test_scripted_policy_in_bwrap_sandbox(
    name: str, scripted_stack: tuple[ScriptedEngine, Proxy], tmp_path: Path
) -> None:
    """The same task with a read-only root and a loopback-only network that reaches just the proxy."""
    _require_installed(name)
    engine, proxy = scripted_stack
    cache = HARNESSES[name].install_dir / ".node-compile-cache"
    before = _files(cache)
    result, rollout = _attempt(
        proxy, name, HARNESSES[name].default_format, tmp_path / "attempt", use_bwrap=True
    )
    assert result.exit_reason == "finished", _why(result)
    assert result.answer == ANSWER
    assert result.leftover_pids == []
    # An npm agent's compile cache is read-only in the sandbox: no attempt plants compiled code
    # that a later attempt would run.
    assert _files(cache) == before
    assert rollout["calls"] and all(
        (tuple(c["prompt_ids"]), tuple(c["sampled_ids"])) in engine.replies for c in rollout["calls"]
    )
    # The agent works at the sandbox's fixed paths: neither the host's per-attempt working
    # directory nor the attempt folder reaches what it sends (agents put both into their prompts,
    # and per-attempt paths would leave the attempts of a group nothing to share).
    sent = json.dumps([c["request"] for c in rollout["calls"]])
    assert WORK_ROOT_NAME not in sent and str(tmp_path) not in sent


# Droid in a container: its Execute tool's shell is SIGKILLed ~22 ms after it starts in about two
# tries of three (droid 0.225.1; 2 of 6 passed on 2026-12-07; it passes every time in bwrap). Not
# yet explained, so droid is left out here rather than retried into a pass (docs/concepts/isolation.md).
DOCKER_HARNESSES = [name for name in HARNESSES if name != "droid"]


@pytest.mark.containers
@pytest.mark.usefixtures("docker_daemon")
@pytest.mark.parametrize("name", DOCKER_HARNESSES)
def test_scripted_policy_in_docker_sandbox(
    name: str, scripted_stack: tuple[ScriptedEngine, Proxy], tmp_path: Path
) -> None:
    """Every harness in the container sandbox (``make test-containers``): its pinned CLI mounted
    read-only into the default image, no network but the proxy's bridge, fixed HOME and workdir."""
    from fineenvs.harnesses.container import DockerSettings

    _require_installed(name)
    engine, proxy = scripted_stack
    result, rollout = _attempt(
        proxy,
        name,
        HARNESSES[name].default_format,
        tmp_path / "attempt",
        docker=DockerSettings(),  # the defaults a run gets (memory 4g, 512 pids, 1 cpu)
    )
    assert result.exit_reason == "finished", _why(result)
    assert result.answer == ANSWER and result.leftover_pids == []
    assert rollout["calls"] and all(
        (tuple(c["prompt_ids"]), tuple(c["sampled_ids"])) in engine.replies for c in rollout["calls"]
    )
    sent = json.dumps([c["request"] for c in rollout["calls"]])
    assert WORK_ROOT_NAME not in sent and str(tmp_path) not in sent
    # The image has the C.UTF-8 locale agents' shells ask for: no warning in what the model reads.
    assert "setlocale" not in sent
    assert HARNESSES[name].actions_in_text or TOOL_MARKER in sent  # aider edits in text: no shell output


BWRAP = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time (ns)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("transport", "use_bwrap"),
    [
        ("websocket", False),
        ("http", False),
        pytest.param("websocket", True, marks=BWRAP, id="websocket-bwrap"),
    ],
)
def test_codex_transports(
    transport: str, use_bwrap: bool, scripted_stack: tuple[ScriptedEngine, Proxy], tmp_path: Path
) -> None:
    """Codex on its default transport (the Responses WebSocket of its built-in provider) and on
    HTTP (a custom provider): every call over the expected transport (a failed upgrade would
    show as HTTP calls after Codex's ~6 s of retries). In bwrap the upgrade and its frames cross
    the Unix-socket bridge (fineenvs.harnesses.netbridge)."""
    from fineenvs.harnesses.codex import Codex

    _require_installed("codex")
    engine, proxy = scripted_stack
    session = proxy.new_session(harness="codex", max_model_calls=12)
    result = run_attempt(
        Codex(transport=transport),
        task_prompt=TASK,
        input_files={},
        attempt_dir=tmp_path / "attempt",
        base_url=session["base_url"],
        session_key=session["key"],
        model=MODEL,
        timeout_seconds=TIMEOUT_S,
        use_bwrap=use_bwrap,
        proxy_stats=lambda: proxy_stats_from_rollout(proxy.rollout(session["session_id"])),
    )
    calls = proxy.rollout(session["session_id"])["calls"]
    assert result.exit_reason == "finished" and result.answer == ANSWER, _why(result)
    assert [c.get("transport", "http") for c in calls] == [transport] * len(calls)
    assert len(calls) == 2 and not result.tool_calls_disagree
    for c in calls:
        assert (tuple(c["prompt_ids"]), tuple(c["sampled_ids"])) in engine.replies
    later_tool_output = _tool_texts(calls[1]["request"]["messages"])
    assert TOOL_MARKER in later_tool_output


@pytest.mark.parametrize("use_bwrap", [False, pytest.param(True, marks=BWRAP, id="bwrap")])
def test_copilot_responses_over_websocket(
    use_bwrap: bool, scripted_stack: tuple[ScriptedEngine, Proxy], tmp_path: Path
) -> None:
    """Copilot CLI's own Responses WebSocket client (COPILOT_PROVIDER_TRANSPORT=websockets),
    also across the bwrap sandbox's Unix-socket bridge."""
    from fineenvs.harnesses.copilot import Copilot

    _require_installed("copilot")
    engine, proxy = scripted_stack
    session = proxy.new_session(harness="copilot", max_model_calls=12)
    result = run_attempt(
        Copilot(transport="websocket"),
        task_prompt=TASK,
        input_files={},
        attempt_dir=tmp_path / "attempt",
        base_url=session["base_url"],
        session_key=session["key"],
        model=MODEL,
        api_format="openai_responses",
        timeout_seconds=TIMEOUT_S,
        use_bwrap=use_bwrap,
        proxy_stats=lambda: proxy_stats_from_rollout(proxy.rollout(session["session_id"])),
    )
    calls = proxy.rollout(session["session_id"])["calls"]
    assert result.exit_reason == "finished" and result.answer == ANSWER, _why(result)
    assert calls and [c.get("transport") for c in calls] == ["websocket"] * len(calls)
    assert all((tuple(c["prompt_ids"]), tuple(c["sampled_ids"])) in engine.replies for c in calls)
    assert TOOL_MARKER in "\n".join(_tool_texts(c["request"]["messages"]) for c in calls[1:])
