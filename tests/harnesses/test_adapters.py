"""Config, environment and command line of every harness: right wiring, no secret from the parent."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from fineenvs.api_formats import ApiFormat
from fineenvs.harnesses import HARNESSES, Harness, HarnessConfigError, check_installed, get_harness
from fineenvs.harnesses.base import API_FORMATS, Launch
from fineenvs.harnesses.node import NODE

BASE = "http://127.0.0.1:18100/s/sessKEY123"
KEY = "sessKEY123"
MODEL = "tiny_qwen"
SECRETS = {
    "OPENAI_API_KEY": "sk-LEAK-openai",
    "ANTHROPIC_API_KEY": "sk-ant-LEAK",
    "GEMINI_API_KEY": "LEAK-gemini",
    "GOOGLE_API_KEY": "LEAK-google",
    "HF_TOKEN": "hf_LEAK",
    "AWS_SECRET_ACCESS_KEY": "LEAK-aws",
    "GITHUB_TOKEN": "ghp_LEAK",
    "WANDB_API_KEY": "LEAK-wandb",
    "OPENAI_BASE_URL": "https://LEAK.example/v1",
}
CASES = [(name, fmt) for name, h in HARNESSES.items() for fmt in h.api_formats]


@pytest.fixture(autouse=True)
def parent_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)


def build(
    h: Harness, tmp_path: Path, fmt: str, step_limit: int | None = 7
) -> tuple[Path, Path, dict[str, str], list[str]]:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    launch = Launch(home, work, BASE, KEY, MODEL, fmt, step_limit, "Write 42 to answer.txt")
    h.write_config(launch)
    return home, work, h.env(launch), h.command(launch)


def config_text(home: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(home.rglob("*")) if p.is_file())


@pytest.mark.parametrize(("name", "fmt"), CASES)
def test_no_parent_secret_reaches_env_or_config(name: str, fmt: str, tmp_path: Path) -> None:
    h = HARNESSES[name]
    home, _work, env, argv = build(h, tmp_path, fmt)
    for k, v in env.items():
        assert "LEAK" not in v, f"{name}: env {k} carries a parent secret"
    assert "LEAK" not in config_text(home)
    assert not any("LEAK" in a for a in argv)
    # Only keys the adapter sets itself, never inherited ones (e.g. the parent's GOOGLE_API_KEY).
    inherited = {k for k in SECRETS if k in env and env[k] == os.environ[k]}
    assert not inherited


@pytest.mark.parametrize(("name", "fmt"), CASES)
def test_session_key_and_base_url_wired_but_not_in_argv(name: str, fmt: str, tmp_path: Path) -> None:
    h = HARNESSES[name]
    home, _work, env, argv = build(h, tmp_path, fmt)
    both = config_text(home) + "\n".join(env.values())
    assert KEY in both, f"{name}/{fmt}: the session key reaches the agent nowhere"
    assert "127.0.0.1:18100/s/sessKEY123" in both, f"{name}/{fmt}: base URL with the session prefix missing"
    # argv is world-readable through /proc; the key must not be there (the URL prefix holds it too).
    assert not any(KEY in a for a in argv)
    assert env["HOME"] == str(home)
    assert env["TERM"] == "dumb"
    assert argv[0].startswith(str(h.install_dir)), argv[0]
    assert env["PATH"].split(os.pathsep)[0] == str(h.bin_dir)


@pytest.mark.parametrize("name", list(HARNESSES))
def test_npm_agents_run_on_the_pinned_node_with_their_own_compile_cache(name: str, tmp_path: Path) -> None:
    h = HARNESSES[name]
    _home, _work, env, _argv = build(h, tmp_path, h.default_format)
    if h.registry != "npm":
        assert "NODE_COMPILE_CACHE" not in env
        return
    # The agents' `#!/usr/bin/env node` finds the first node on PATH: it must be the pinned one.
    dirs = env["PATH"].split(os.pathsep)
    assert str(NODE.bin_dir) in dirs
    assert all(not (Path(d) / "node").exists() for d in dirs[: dirs.index(str(NODE.bin_dir))]), dirs
    assert env["NODE_COMPILE_CACHE"] == str(h.install_dir / ".node-compile-cache")


@pytest.mark.parametrize("name", list(HARNESSES))
def test_unsupported_format_is_a_clear_error(name: str, tmp_path: Path) -> None:
    h = HARNESSES[name]
    bad = [f for f in API_FORMATS if f not in h.api_formats]
    if not bad:
        with pytest.raises(HarnessConfigError, match="cannot speak"):
            h.check_format("smoke_signals")
        return
    with pytest.raises(HarnessConfigError, match=f"supports {h.api_formats[0]}"):
        build(h, tmp_path, bad[0])


def test_claude_code_wiring(tmp_path: Path) -> None:
    home, _w, env, argv = build(
        get_harness("claude_code"), tmp_path, ApiFormat.anthropic_messages, step_limit=5
    )
    assert env["ANTHROPIC_BASE_URL"] == BASE  # no /v1: the SDK appends it
    assert env["ANTHROPIC_API_KEY"] == KEY
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert "--dangerously-skip-permissions" not in argv  # refused as root
    assert argv[argv.index("--allowedTools") + 1].startswith("Bash")
    assert argv[argv.index("--max-turns") + 1] == "5"
    settings = json.loads((home / ".claude" / "settings.json").read_text())
    assert "Bash" in settings["permissions"]["allow"]


def test_codex_default_transport_is_the_built_in_provider(tmp_path: Path) -> None:
    h = get_harness("codex")
    home, _w, env, argv = build(h, tmp_path, ApiFormat.openai_responses)
    cfg = tomllib.loads((home / ".codex" / "config.toml").read_text())
    # No custom provider: the built-in `openai` one, only its base URL moved (Codex then speaks
    # the Responses WebSocket, with HTTPS as its fallback).
    assert "model_provider" not in cfg and "model_providers" not in cfg
    assert cfg["openai_base_url"] == BASE + "/v1"
    assert env["CODEX_API_KEY"] == KEY
    assert cfg["analytics"]["enabled"] is False
    assert cfg["check_for_update_on_startup"] is False
    assert env["CODEX_HOME"] == str(home / ".codex")
    assert argv[1:3] == ["exec", "--json"]


def test_codex_http_transport_uses_a_custom_provider(tmp_path: Path) -> None:
    from fineenvs.harnesses.codex import Codex

    home, _w, env, _argv = build(Codex(transport="http"), tmp_path, ApiFormat.openai_responses)
    cfg = tomllib.loads((home / ".codex" / "config.toml").read_text())
    provider = cfg["model_providers"][cfg["model_provider"]]
    assert cfg["model_provider"] != "openai" and "openai_base_url" not in cfg
    assert provider["base_url"] == BASE + "/v1"
    assert provider["wire_api"] == "responses"
    assert env[provider["env_key"]] == KEY and "CODEX_API_KEY" not in env
    with pytest.raises(HarnessConfigError, match="transport 'grpc' is unknown"):
        Codex(transport="grpc")


@pytest.mark.parametrize(
    ("fmt", "sdk", "base"),
    [
        (ApiFormat.openai_chat, "@ai-sdk/openai-compatible", BASE + "/v1"),
        (ApiFormat.openai_responses, "@ai-sdk/openai", BASE + "/v1"),
        (ApiFormat.anthropic_messages, "@ai-sdk/anthropic", BASE + "/v1"),
        (ApiFormat.gemini, "@ai-sdk/google", BASE + "/v1beta"),
    ],
)
def test_opencode_provider_per_format(fmt: str, sdk: str, base: str, tmp_path: Path) -> None:
    home, _w, env, argv = build(get_harness("opencode"), tmp_path, fmt)
    cfg = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
    assert "openai" not in cfg["provider"]  # a provider named openai breaks opencode
    ((name, provider),) = cfg["provider"].items()
    assert provider["npm"] == sdk
    assert provider["options"]["baseURL"] == base
    assert cfg["model"] == f"{name}/{MODEL}"
    assert cfg["tools"]["task"] is False
    # The prompt travels as words (one quoted argument reaches the model with literal quotes).
    assert argv[-4:] == ["Write", "42", "to", "answer.txt"]


@pytest.mark.parametrize(
    ("fmt", "api", "base"),
    [
        (ApiFormat.openai_chat, "openai-completions", BASE + "/v1"),
        (ApiFormat.openai_responses, "openai-responses", BASE + "/v1"),
        (ApiFormat.anthropic_messages, "anthropic-messages", BASE),
        (ApiFormat.gemini, "google-generative-ai", BASE + "/v1beta"),
    ],
)
def test_pi_models_json(fmt: str, api: str, base: str, tmp_path: Path) -> None:
    home, _w, env, _argv = build(get_harness("pi"), tmp_path, fmt)
    cfg = json.loads((home / ".pi" / "agent" / "models.json").read_text())
    (provider,) = cfg["providers"].values()
    assert provider["api"] == api and provider["baseUrl"] == base
    assert env[provider["apiKey"]] == KEY  # apiKey names an env var: the key stays out of the file
    assert env["PI_OFFLINE"] == "1"


def test_gemini_cli_settings_and_model_flag(tmp_path: Path) -> None:
    home, _w, env, argv = build(get_harness("gemini_cli"), tmp_path, ApiFormat.gemini, step_limit=4)
    settings = json.loads((home / ".gemini" / "settings.json").read_text())
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["model"]["maxSessionTurns"] == 4
    assert env["GOOGLE_GEMINI_BASE_URL"] == BASE and env["GEMINI_API_KEY"] == KEY
    assert argv[argv.index("-m") + 1] == MODEL  # -m avoids the model router side call
    assert "--yolo" in argv


@pytest.mark.parametrize(
    ("fmt", "auth", "var", "value"),
    [
        (ApiFormat.openai_chat, "openai", "OPENAI_BASE_URL", BASE + "/v1"),
        (ApiFormat.anthropic_messages, "anthropic", "ANTHROPIC_BASE_URL", BASE),
        (ApiFormat.gemini, "gemini", "GOOGLE_GEMINI_BASE_URL", BASE),
    ],
)
def test_qwen_code_auth_types(fmt: str, auth: str, var: str, value: str, tmp_path: Path) -> None:
    home, _w, env, argv = build(get_harness("qwen_code"), tmp_path, fmt)
    settings = json.loads((home / ".qwen" / "settings.json").read_text())
    assert settings["security"]["auth"]["selectedType"] == auth
    assert argv[argv.index("--auth-type") + 1] == auth
    assert env[var] == value


def test_mini_swe_agent_step_limit_and_config_order(tmp_path: Path) -> None:
    home, _w, env, argv = build(get_harness("mini_swe_agent"), tmp_path, ApiFormat.openai_chat, step_limit=9)
    params = json.loads((home / "mini_params.yaml").read_text())
    assert params["agent"]["step_limit"] == 9
    assert params["model"]["model_kwargs"]["api_base"] == BASE + "/v1"
    configs = [argv[i + 1] for i, a in enumerate(argv) if a == "-c"]
    assert configs[0] == "mini.yaml"  # -c replaces the default, so the built-in config comes first
    assert argv[argv.index("-m") + 1] == f"openai/{MODEL}"
    assert env["OPENAI_API_KEY"] == KEY and env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"


@pytest.mark.parametrize(
    ("fmt", "mode", "url"),
    [
        (ApiFormat.openai_chat, "chat_completions", BASE + "/v1"),
        (ApiFormat.anthropic_messages, "anthropic_messages", BASE),
        (ApiFormat.openai_responses, "codex_responses", BASE + "/v1"),
    ],
)
def test_hermes_custom_provider(fmt: str, mode: str, url: str, tmp_path: Path) -> None:
    home, _w, env, _argv = build(get_harness("hermes"), tmp_path, fmt, step_limit=6)
    cfg = json.loads((home / ".hermes" / "config.yaml").read_text())  # JSON is YAML
    assert cfg["model"]["provider"] == "custom:fineenvs"  # plain `custom` ignores api_mode
    (prov,) = cfg["custom_providers"]
    assert prov["api_mode"] == mode and prov["base_url"] == url and prov["api_key"] == KEY
    assert cfg["agent"]["max_turns"] == 6
    assert env["HERMES_HOME"] == str(home / ".hermes")


@pytest.mark.parametrize(
    ("fmt", "ptype", "wire", "base"),
    [
        (ApiFormat.openai_chat, "openai", "completions", BASE + "/v1"),
        (ApiFormat.openai_responses, "openai", "responses", BASE + "/v1"),
        (ApiFormat.anthropic_messages, "anthropic", None, BASE),
    ],
)
def test_copilot_byok_provider(fmt: str, ptype: str, wire: str | None, base: str, tmp_path: Path) -> None:
    h = get_harness("copilot")
    home, work, env, argv = build(h, tmp_path, fmt)
    assert env["COPILOT_PROVIDER_BASE_URL"] == base and env["COPILOT_PROVIDER_API_KEY"] == KEY
    assert env["COPILOT_PROVIDER_TYPE"] == ptype
    assert env.get("COPILOT_PROVIDER_WIRE_API") == wire
    assert env["COPILOT_MODEL"] == MODEL
    # Offline: no GitHub login, telemetry, MCP or update traffic; state under the fresh HOME.
    assert env["COPILOT_OFFLINE"] == "true" and env["COPILOT_AUTO_UPDATE"] == "false"
    assert env["COPILOT_HOME"] == str(home / ".copilot")
    # The unpacked JavaScript is shared from the install directory, not unpacked per attempt.
    assert env["COPILOT_PKG_CACHE_HOME"].startswith(str(h.install_dir))
    assert {"--allow-all-tools", "--no-auto-update", "--disable-client-telemetry"} <= set(argv)
    assert argv[argv.index("-C") + 1] == str(work)
    assert argv[argv.index("--output-format") + 1] == "json"


def test_copilot_websocket_transport_is_responses_only(tmp_path: Path) -> None:
    from fineenvs.harnesses.copilot import Copilot

    h = Copilot(transport="websocket")
    _home, _work, env, _argv = build(h, tmp_path, ApiFormat.openai_responses)
    assert env["COPILOT_PROVIDER_TRANSPORT"] == "websockets"
    assert env["COPILOT_PROVIDER_WIRE_API"] == "responses"
    assert "COPILOT_PROVIDER_TRANSPORT" not in get_harness("copilot").env(
        Launch(tmp_path, tmp_path, BASE, KEY, MODEL, ApiFormat.openai_chat)
    )
    with pytest.raises(HarnessConfigError, match="WebSocket transport carries Responses"):
        h.check_format(ApiFormat.openai_chat)


def test_copilot_unpacks_its_package_at_install(tmp_path: Path) -> None:
    ((argv, env),) = get_harness("copilot").post_install(tmp_path)
    assert argv == [str(tmp_path / "node_modules" / ".bin" / "copilot"), "--binary-version"]
    assert env["COPILOT_SEA_EXTRACT_ONLY"] == "1"
    assert env["COPILOT_PKG_CACHE_HOME"] == str(tmp_path / "pkg-cache")
    assert "LEAK" not in "".join(env.values())


@pytest.mark.parametrize(
    ("fmt", "sdk", "base"),
    [
        (ApiFormat.openai_chat, "@ai-sdk/openai-compatible", BASE + "/v1"),
        (ApiFormat.openai_responses, "@ai-sdk/openai", BASE + "/v1"),
        (ApiFormat.anthropic_messages, "@ai-sdk/anthropic", BASE + "/v1"),
        (ApiFormat.gemini, "@ai-sdk/google", BASE + "/v1beta"),
    ],
)
def test_kilo_provider_per_format_and_step_limit(fmt: str, sdk: str, base: str, tmp_path: Path) -> None:
    home, work, env, argv = build(get_harness("kilo"), tmp_path, fmt, step_limit=6)
    cfg = json.loads(Path(env["KILO_CONFIG"]).read_text())
    ((name, provider),) = cfg["provider"].items()
    assert name not in ("openai", "kilo")  # those select Kilo's built-in providers
    assert cfg["enabled_providers"] == [name]  # the built-in gateway would fetch its model list
    assert provider["npm"] == sdk and provider["options"]["baseURL"] == base
    assert provider["options"]["apiKey"] == KEY
    assert cfg["model"] == f"{name}/{MODEL}"
    assert cfg["agent"][cfg["default_agent"]]["steps"] == 6
    assert env["KILO_TELEMETRY_LEVEL"] == "off" and env["KILO_DISABLE_AUTOUPDATE"] == "1"
    assert argv[1:3] == ["run", "--format"] and "--auto" in argv
    assert argv[argv.index("--dir") + 1] == str(work)
    assert argv[-4:] == ["Write", "42", "to", "answer.txt"]


def test_kilo_without_step_limit_sets_no_steps(tmp_path: Path) -> None:
    _home, _work, env, _argv = build(get_harness("kilo"), tmp_path, ApiFormat.openai_chat, step_limit=None)
    cfg = json.loads(Path(env["KILO_CONFIG"]).read_text())
    assert cfg["agent"][cfg["default_agent"]] == {}


@pytest.mark.parametrize(
    ("fmt", "provider", "base"),
    [
        (ApiFormat.openai_chat, "generic-chat-completion-api", BASE + "/v1"),
        (ApiFormat.openai_responses, "openai", BASE + "/v1"),
        (ApiFormat.anthropic_messages, "anthropic", BASE),
    ],
)
def test_droid_custom_model(fmt: str, provider: str, base: str, tmp_path: Path) -> None:
    h = get_harness("droid")
    home, work, env, argv = build(h, tmp_path, fmt)
    settings = json.loads((home / ".factory" / "settings.json").read_text())
    (custom,) = settings["customModels"]
    assert custom["provider"] == provider and custom["baseUrl"] == base
    assert custom["apiKey"] == KEY and custom["model"] == MODEL
    assert settings["autoUpdateEnabled"] is False
    # Airgap mode: no Factory API (login, org settings, cloud sync, feature flags, telemetry).
    assert env["FACTORY_AIRGAP_ENABLED"] == "true"
    assert argv[1] == "exec" and argv[argv.index("-m") + 1] == f"custom:{MODEL}"
    assert argv[argv.index("--auto") + 1] == "high"
    assert "Execute" in argv[argv.index("--only-tools") + 1].split(",")
    assert argv[argv.index("--cwd") + 1] == str(work)
    # The platform binary is pinned next to the wrapper (the wrapper's own version has none).
    assert h.install_requirements() == ["@factory/cli@0.225.1", "@factory/cli-linux-x64@0.225.2"]


@pytest.mark.parametrize(
    ("fmt", "prefix", "key_var", "base_var", "base"),
    [
        (ApiFormat.openai_chat, "openai", "OPENAI_API_KEY", "OPENAI_API_BASE", BASE + "/v1"),
        (ApiFormat.anthropic_messages, "anthropic", "ANTHROPIC_API_KEY", "ANTHROPIC_API_BASE", BASE),
    ],
)
def test_aider_litellm_wiring(
    fmt: str, prefix: str, key_var: str, base_var: str, base: str, tmp_path: Path
) -> None:
    h = get_harness("aider")
    home, _work, env, argv = build(h, tmp_path, fmt)
    assert env[key_var] == KEY and env[base_var] == base
    assert argv[argv.index("--model") + 1] == f"{prefix}/{MODEL}"
    assert argv[argv.index("--edit-format") + 1] == "whole"
    assert {"--yes-always", "--no-git", "--no-check-update", "--analytics-disable"} <= set(argv)
    # Local metadata for the model keeps aider from fetching litellm's price list from GitHub.
    meta = json.loads(Path(argv[argv.index("--model-metadata-file") + 1]).read_text())
    assert meta[f"{prefix}/{MODEL}"]["litellm_provider"] == prefix
    assert h.actions_in_text is True


def test_aider_counts_applied_edits_from_its_chat_history(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "aider.chat.history.md").write_text(
        "\n# aider chat started at 2026-12-02 02:20:22\n\n> Aider v0.86.2  \n\n"
        "#### Write 42 to answer.txt  \n\nI will write it.\n\nanswer.txt\n```\n42\n```\n\n"
        "> Tokens: 610 sent, 15 received.  \n> answer.txt  \n> Applied edit to answer.txt  \n"
        "> Applied edit to notes.md  \n"
    )
    out = get_harness("aider").parse_outputs(tmp_path)
    assert out.native_tool_calls == 2
    assert out.final_text is not None and out.final_text.startswith("I will write it.")
    assert get_harness("aider").parse_outputs(tmp_path / "missing").native_tool_calls is None


@pytest.mark.parametrize(
    ("fmt", "ptype", "base"),
    [
        (ApiFormat.openai_chat, "openai", BASE + "/v1"),
        (ApiFormat.openai_responses, "openai_responses", BASE + "/v1"),
        (ApiFormat.anthropic_messages, "anthropic", BASE),
        (ApiFormat.gemini, "google-genai", BASE),
    ],
)
def test_kimi_code_provider_per_format(fmt: str, ptype: str, base: str, tmp_path: Path) -> None:
    h = get_harness("kimi_code")
    home, _work, env, argv = build(h, tmp_path, fmt, step_limit=6)
    cfg = tomllib.loads((home / ".kimi-code" / "config.toml").read_text())
    ((pname, provider),) = cfg["providers"].items()
    assert provider == {"type": ptype, "base_url": base, "api_key": KEY}
    model = cfg["models"][cfg["default_model"]]
    assert model["provider"] == pname and model["model"] == MODEL
    assert "tool_use" in model["capabilities"]  # an unknown model name gets no tools otherwise
    assert cfg["loop_control"]["max_steps_per_turn"] == 6
    assert cfg["telemetry"] is False and env["KIMI_DISABLE_TELEMETRY"] == "1"
    assert env["KIMI_CODE_NO_AUTO_UPDATE"] == "1"
    tui = tomllib.loads((home / ".kimi-code" / "tui.toml").read_text())
    assert tui["upgrade"]["auto_install"] is False
    assert env["KIMI_CODE_HOME"] == str(home / ".kimi-code")
    # The pinned Node (>= 22.19: the CLI needs node:sqlite) comes before any other, and the prefix's
    # ripgrep keeps the Grep tool from downloading one.
    path = env["PATH"].split(os.pathsep)
    assert path[:3] == [str(h.bin_dir), str(h.install_dir / "ripgrep" / "bin"), str(NODE.bin_dir)]
    assert argv[1:3] == ["-p", "Write 42 to answer.txt"]
    assert argv[argv.index("--output-format") + 1] == "stream-json"
    assert h.install_requirements() == ["@moonshot-ai/kimi-code@2.1.0"]


def test_kimi_code_without_step_limit_and_its_install_step(tmp_path: Path) -> None:
    h = get_harness("kimi_code")
    home, _work, _env, _argv = build(h, tmp_path, ApiFormat.openai_chat, step_limit=None)
    assert "loop_control" not in tomllib.loads((home / ".kimi-code" / "config.toml").read_text())
    ((argv, env),) = h.post_install(tmp_path / "prefix")
    assert argv[argv.index("--target") + 1] == str(tmp_path / "prefix" / "ripgrep")
    assert argv[-1] == "ripgrep==14.1.0" and "--only-binary=:all:" in argv
    assert "LEAK" not in "".join(env.values())


def test_kimi_code_counts_tool_calls_from_stream_json(tmp_path: Path) -> None:
    lines = [
        {"role": "meta", "type": "system.version", "version": "2.1.0"},
        {"role": "assistant", "content": "Writing.", "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "Bash", "arguments": "{}"}},
            {"type": "function", "id": "c2", "function": {"name": "Read", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "c3", "function": {"name": "Bash", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c3", "content": "ok"},
        {"role": "assistant", "content": "I wrote 42."},
        {"role": "meta", "type": "session.resume_hint", "content": "To resume this session: kimi -r x"},
    ]  # fmt: skip
    (tmp_path / "stdout.txt").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = get_harness("kimi_code").parse_outputs(tmp_path)
    assert out.native_tool_calls == 3 and out.final_text == "I wrote 42."
    assert get_harness("kimi_code").parse_outputs(tmp_path / "missing").native_tool_calls is None


def test_hyphenated_names_resolve_and_unknown_name_is_clear() -> None:
    assert get_harness("mistral-vibe").name == "mistral_vibe"
    with pytest.raises(HarnessConfigError, match="known harnesses"):
        get_harness("nonesuch")
    with pytest.raises(HarnessConfigError, match="crush' has no adapter: .*GitHub release.*known harnesses"):
        get_harness("crush")


def test_check_installed_reports_missing_with_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FINEENVS_CACHE", str(tmp_path))
    problems = check_installed(["codex", "pi"])
    assert len(problems) == 3  # the two agents, and first the pinned Node they run on
    assert "Node.js, the npm agents' runtime," in problems[0] and f"node-{NODE.version}" in problems[0]
    assert "python -m fineenvs.harnesses install codex" in problems[1]
    assert "not installed" in problems[1]
    (pypi_only,) = check_installed(["mini_swe_agent"])  # a PyPI agent needs no Node
    assert "harness mini_swe_agent" in pypi_only
    assert check_installed(["nope"])[0].startswith("unknown harness")


RECORDS = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "harness_records").glob("*.json"))


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_recorded_requests_are_scrubbed_and_detected_as_their_format(path: Path) -> None:
    from fineenvs.dialects import detect

    record = json.loads(path.read_text())
    req = record["request"]
    assert record["harness"] in HARNESSES and record["api_format"] in HARNESSES[record["harness"]].api_formats
    assert req["path"].startswith("/s/SESSION_KEY/")
    for name in ("authorization", "x-api-key", "x-goog-api-key"):
        assert req["headers"].get(name, "<scrubbed>") == "<scrubbed>"
    assert isinstance(req["body"], dict) and req["body"]
    route = req["path"][len("/s/SESSION_KEY") :].split("?")[0]
    assert detect(route, req["headers"], req["body"]) == record["api_format"]
