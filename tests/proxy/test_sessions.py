"""Sessions, auth, budgets and the durable, delta-encoded records (openai_chat through the proxy)."""

from __future__ import annotations

from typing import Any

import orjson

from fineenvs.proxy.store import CallStore
from fineenvs.proxy.upstream import call_seed


def chat(h: Any, base: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
    body = {"model": "whatever/leaf", "messages": messages, **extra}
    return h.run(h.client.post(f"{base}/v1/chat/completions", json=body))


def test_session_create_and_call_records_exact_engine_tokens(make_proxy: Any) -> None:
    h = make_proxy()
    s = h.session(task="t1", group="g1", harness="opencode", attempt=0, policy_version=3)
    assert s["base_url"].endswith(f"/s/{s['key']}")
    assert s["metadata"] == {
        "task": "t1",
        "group": "g1",
        "harness": "opencode",
        "attempt": 0,
        "policy_version": 3,
    }
    base = f"/s/{s['key']}"
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]
    r = chat(h, base, messages, temperature=0.1, top_p=0.5, top_k=5, max_tokens=100000)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["choices"][0]["message"]["content"] == "reply to: hello"
    assert reply["model"] == "whatever/leaf"
    sent = h.engine.requests[-1]
    assert sent["model"] == "tiny_qwen" and sent["stream"] is False and sent["n"] == 1
    assert sent["logprobs"] is True and sent["top_logprobs"] == 0 and sent["return_token_ids"] is True
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["min_p"]) == (0.8, 1.0, -1, 0.0)
    assert sent["max_tokens"] == 4096
    data = h.store.read_session(s["session_id"])
    (call,) = data["calls"]
    assert call["prompt_ids"] == h.engine.prompt_ids(sent["messages"])
    engine_sampled = h.engine.render_message(reply["choices"][0]["message"])
    assert call["sampled_ids"] == engine_sampled[len(h.engine.enc("<|im_start|>assistant\n")) : -1]
    assert len(call["logprobs"]) == len(call["sampled_ids"]) and all(lp <= 0 for lp in call["logprobs"])
    assert call["logprobs_aligned"] is True
    assert call["sampling_requested"] == {"temperature": 0.1, "top_p": 0.5, "top_k": 5}
    assert call["sampling_applied"]["temperature"] == 0.8
    assert call["max_tokens_requested"] == 100000 and call["max_tokens_applied"] == 4096
    assert call["weight_version"] == 7
    assert call["request"]["messages"] == sent["messages"]


def test_api_key_headers_identify_session_and_harness_ids_are_recorded_not_routed(make_proxy: Any) -> None:
    h = make_proxy()
    a, b = h.session(), h.session()
    msgs = [{"role": "user", "content": "hi"}]
    for headers in (
        {"authorization": f"Bearer {a['key']}"},
        {"x-api-key": a["key"]},
        {"x-goog-api-key": a["key"]},
    ):
        # A harness session header naming session b must not route the call there.
        headers = {**headers, "x-session-id": b["session_id"], "session-id": "codex-123"}
        r = h.run(
            h.client.post("/v1/chat/completions", json={"model": "m", "messages": msgs}, headers=headers)
        )
        assert r.status_code == 200, r.text
    assert len(h.store.read_session(a["session_id"])["calls"]) == 3
    assert h.store.read_session(b["session_id"])["calls"] == []
    call = h.store.read_session(a["session_id"])["calls"][0]
    assert call["harness_ids"]["x-session-id"] == b["session_id"]
    assert call["harness_ids"]["session-id"] == "codex-123"


def test_unknown_or_missing_key_is_401_in_chat_format(make_proxy: Any) -> None:
    h = make_proxy()
    h.session()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for kwargs in ({}, {"headers": {"authorization": "Bearer nope"}}):
        r = h.run(h.client.post("/v1/chat/completions", json=body, **kwargs))
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["message"].startswith("fineenvs proxy:")
    r = h.run(h.client.post("/s/bogus/v1/chat/completions", json=body))
    assert r.status_code == 401 and "unknown" in r.json()["error"]["message"]
    assert h.engine.requests == []


def test_budget_stop_is_nonempty_not_recorded_and_counted(make_proxy: Any) -> None:
    h = make_proxy(max_model_calls=2)
    s = h.session()
    base = f"/s/{s['key']}"
    msgs = [{"role": "user", "content": "go"}]
    for _ in range(2):
        assert chat(h, base, msgs).status_code == 200
    r = chat(h, base, msgs)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "model calls" in choice["message"]["content"]
    r = chat(h, base, msgs, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"
    assert b"model calls" in r.content and r.content.rstrip().endswith(b"data: [DONE]")
    assert len(h.engine.requests) == 2
    data = h.store.read_session(s["session_id"])
    assert len(data["calls"]) == 2
    assert [e["kind"] for e in data["events"]] == ["budget_stop", "budget_stop"]
    stats = h.admin("GET", f"/sessions/{s['session_id']}").json()
    assert stats["model_calls"] == 2 and stats["budget_stops"] == 2 and stats["recorded_calls"] == 2


def test_budget_override_per_session(make_proxy: Any) -> None:
    h = make_proxy()
    s = h.session(max_model_calls=1)
    base = f"/s/{s['key']}"
    assert chat(h, base, [{"role": "user", "content": "a"}]).status_code == 200
    r = chat(h, base, [{"role": "user", "content": "b"}])
    assert "model calls" in r.json()["choices"][0]["message"]["content"]
    assert len(h.engine.requests) == 1


def test_a_session_seed_gives_each_call_its_own_engine_seed_the_same_in_every_session(
    make_proxy: Any, tmp_path: Any
) -> None:
    h = make_proxy(store_dir=tmp_path / "st")
    a, b, free = h.session(sampling_seed=12345), h.session(sampling_seed=12345), h.session()
    assert a["sampling_seed"] == 12345 and "sampling_seed" not in free
    msgs = [{"role": "user", "content": "hi"}]
    sent: dict[str, list[Any]] = {}
    for name, s in (("a", a), ("b", b), ("free", free)):
        for _ in range(2):
            # The agent's own seed is recorded, never applied: the session's decides.
            assert chat(h, f"/s/{s['key']}", msgs, seed=7).status_code == 200
            sent.setdefault(name, []).append(h.engine.requests[-1].get("seed"))
    assert sent["a"] == sent["b"] == [call_seed(12345, 0), call_seed(12345, 1)]
    assert sent["a"][0] != sent["a"][1] and all(0 <= x < 2**31 for x in sent["a"])
    assert sent["free"] == [None, None]
    calls = h.store.read_session(a["session_id"])["calls"]
    assert [c["sampling_applied"]["seed"] for c in calls] == sent["a"]
    assert all(c["sampling_requested"]["seed"] == 7 for c in calls)
    assert "seed" not in h.store.read_session(free["session_id"])["calls"][0]["sampling_applied"]
    # A proxy restarted on the same store keeps the session's seed and its call count.
    h.store.close()
    h2 = make_proxy(store_dir=tmp_path / "st")
    assert chat(h2, f"/s/{a['key']}", msgs).status_code == 200
    assert h2.engine.requests[-1]["seed"] == call_seed(12345, 2)


def test_a_bad_session_seed_is_refused_with_the_fix(make_proxy: Any) -> None:
    h = make_proxy()
    for bad in (-1, 2**63, "3", True, 1.5):
        r = h.run(h.client.post("/sessions", json={"sampling_seed": bad}))
        assert r.status_code == 400, (bad, r.text)
        assert "sampling_seed" in r.json()["error"] and "[0, 2**63)" in r.json()["error"]
    assert h.admin("GET", "/sessions").json()["sessions"] == []


def test_delta_encoded_multi_turn_reads_back_exactly_and_is_smaller(make_proxy: Any) -> None:
    h = make_proxy()
    s = h.session()
    base = f"/s/{s['key']}"
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "system prompt " * 400},
        {"role": "user", "content": "task: do TOOL things"},
    ]
    expected_prompts = []
    for turn in range(6):
        r = chat(h, base, messages, tools=tools)
        assert r.status_code == 200, r.text
        expected_prompts.append(h.engine.prompt_ids(h.engine.requests[-1]["messages"]))
        msg = r.json()["choices"][0]["message"]
        messages.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls")})
        if msg.get("tool_calls"):
            messages.append(
                {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": f"out {turn}"}
            )
        else:
            messages.append({"role": "user", "content": f"more TOOL {turn}"})
    # A retry of the first call (same prompt) and a compaction (new root) also link correctly.
    chat(h, base, messages[:2], tools=tools)
    expected_prompts.append(h.engine.prompt_ids(h.engine.requests[-1]["messages"]))
    data = h.store.read_session(s["session_id"])
    assert [c["prompt_ids"] for c in data["calls"]] == expected_prompts
    raw = [
        orjson.loads(line)
        for line in (h.store.session_dir(s["session_id"]) / "calls.jsonl").read_bytes().splitlines()
    ]
    assert raw[0]["prompt"]["parent"] is None
    for prev, cur in zip(raw, raw[1:6], strict=False):
        # Each turn extends the previous call's prompt + sampled tokens: stored as a short suffix.
        assert cur["prompt"]["parent"] == prev["call_id"]
        assert cur["prompt"]["offset"] == prev["prompt"]["len"] + len(prev["sampled_ids"])
        assert len(cur["prompt"]["suffix"]) < 40
    assert raw[6]["prompt"]["parent"] == "c00000" and raw[6]["prompt"]["suffix"] == []
    assert "tools" in raw[0]["request"] and all("tools" not in r["request"] for r in raw[1:])
    assert all(c["request"]["tools"] == tools for c in data["calls"])
    full = sum(len(orjson.dumps(p)) for p in expected_prompts)
    stored = sum(len(orjson.dumps(r["prompt"])) for r in raw)
    assert stored * 5 < full


def test_store_reopen_rebuilds_delta_index_and_accepts_old_keys(make_proxy: Any, tmp_path: Any) -> None:
    h = make_proxy(store_dir=tmp_path / "st")
    s = h.session(task="t")
    base = f"/s/{s['key']}"
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "first"}]
    r = chat(h, base, msgs)
    msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "second"}]
    h.store.close()
    h2 = make_proxy(store_dir=tmp_path / "st")
    r = chat(h2, base, msgs)
    assert r.status_code == 200, r.text
    stats = h2.admin("GET", f"/sessions/{s['session_id']}").json()
    assert stats["model_calls"] == 2 and stats["metadata"] == {"task": "t"}
    rollout = h2.admin("GET", f"/sessions/{s['session_id']}/rollout").json()
    calls = rollout["calls"]
    assert [c["call_id"] for c in calls] == ["c00000", "c00001"]
    raw = (h2.store.session_dir(s["session_id"]) / "calls.jsonl").read_bytes().splitlines()
    assert orjson.loads(raw[1])["prompt"]["parent"] == "c00000"
    assert calls[1]["prompt_ids"] == h2.engine.prompt_ids(h2.engine.requests[-1]["messages"])
    # The trajectory graph links the second call under the first across the restart.
    graph_calls = {c["node_id"]: c for c in rollout["trajectory"]["calls"]}
    assert graph_calls["c00001"]["parent_id"] == "c00000"
    assert graph_calls["c00001"]["sampled_ids"] == calls[1]["sampled_ids"]
    assert rollout["trajectory"]["metadata"]["session_id"] == s["session_id"]
    calls_only = h2.admin("GET", f"/sessions/{s['session_id']}/rollout?trajectory=false").json()
    assert "trajectory" not in calls_only and calls_only["calls"] == calls


def test_secrets_never_reach_the_store_or_logs(make_proxy: Any, tmp_path: Any, caplog: Any) -> None:
    import logging

    caplog.set_level(logging.DEBUG)
    h = make_proxy(store_dir=tmp_path / "sec", admin_key="ADMIN-SECRET-123")
    s = h.session()
    fake_key = "sk-FAKE-SECRET-4242"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    h.run(
        h.client.post(
            f"/s/{s['key']}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {fake_key}"}
        )
    )
    h.run(h.client.post("/v1/chat/completions", json=body, headers={"x-api-key": s["key"]}))
    h.store.close()
    blob = b"".join(p.read_bytes() for p in (tmp_path / "sec").rglob("*") if p.is_file())
    assert len(h.store.read_session(s["session_id"])["calls"]) == 2
    h.run(h.client.post("/v1/chat/completions", json={"messages": 5}, headers={"x-api-key": s["key"]}))
    h.run(h.client.post("/v1/chat/completions", json=body, headers={"x-api-key": fake_key}))
    # The test's own client logs its URLs (with the key, as an agent's would); the proxy must not.
    proxy_log = "\n".join(r.getMessage() for r in caplog.records if "http://proxy.test" not in r.getMessage())
    assert "engine.test" in proxy_log  # the proxy's side is captured
    for secret in (fake_key, s["key"], "ADMIN-SECRET-123"):
        assert secret.encode() not in blob
        assert secret not in proxy_log


def test_admin_key_guards_control_plane(make_proxy: Any) -> None:
    h = make_proxy(admin_key="adm")
    for method, url in (
        ("POST", "/sessions"),
        ("GET", "/sessions"),
        ("GET", "/sessions/x"),
        ("DELETE", "/sessions/x"),
    ):
        r = h.run(h.client.request(method, url))
        assert r.status_code == 401, (method, url)
        r = h.run(h.client.request(method, url, headers={"authorization": "Bearer adm-wrong"}))
        assert r.status_code == 401
    assert h.run(h.client.get("/health")).status_code == 200
    s = h.session()
    listed = h.admin("GET", "/sessions").json()["sessions"]
    assert [x["session_id"] for x in listed] == [s["session_id"]]
    assert "key" not in orjson.dumps(listed).decode().replace("key_", "")


def test_delete_closes_session_and_revokes_key(make_proxy: Any) -> None:
    h = make_proxy()
    s = h.session()
    base = f"/s/{s['key']}"
    assert chat(h, base, [{"role": "user", "content": "x"}]).status_code == 200
    assert h.admin("DELETE", f"/sessions/{s['session_id']}").json()["closed"] is True
    assert chat(h, base, [{"role": "user", "content": "x"}]).status_code == 401
    assert len(h.admin("GET", f"/sessions/{s['session_id']}/rollout").json()["calls"]) == 1
    h.admin("DELETE", f"/sessions/{s['session_id']}?purge=true")
    assert h.admin("GET", f"/sessions/{s['session_id']}").status_code == 404


def test_non_loopback_without_admin_key_refuses_to_start(make_proxy: Any) -> None:
    import pytest

    with pytest.raises(ValueError, match="admin key"):
        make_proxy(host="0.0.0.0")
    make_proxy(host="0.0.0.0", admin_key="k")


def test_aux_routes_answered_and_never_recorded(make_proxy: Any) -> None:
    h = make_proxy()
    s = h.session()
    r = h.run(h.client.get(f"/s/{s['key']}/v1/models"))
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny_qwen"
    r = h.run(
        h.client.post(
            "/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "abcd" * 10}]}
        )
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    assert h.run(h.client.head(f"/s/{s['key']}")).status_code == 200
    assert h.engine.requests == [] and h.store.read_session(s["session_id"])["calls"] == []


def test_empty_store_reads_an_unknown_session_as_empty(tmp_path: Any) -> None:
    store = CallStore(tmp_path / "x")
    assert store.read_session("s1") == {"meta": None, "calls": [], "events": []}
    store.close()


def test_cli_refuses_public_bind_without_admin_key(monkeypatch: Any, capsys: Any) -> None:
    from fineenvs.proxy.__main__ import build_parser, main, settings_from_args

    monkeypatch.delenv("FINEENVS_ADMIN_KEY", raising=False)
    assert (
        main(["serve", "--engine-url", "http://127.0.0.1:1", "--served-model", "m", "--host", "0.0.0.0"]) == 2
    )
    assert "--admin-key" in capsys.readouterr().err
    monkeypatch.setenv("FINEENVS_ADMIN_KEY", "k")
    args = build_parser().parse_args(
        [
            "serve",
            "--engine-url",
            "http://e:1",
            "--served-model",
            "m",
            "--temperature",
            "0.6",
            "--max-model-calls",
            "5",
        ]
    )
    settings = settings_from_args(args)
    assert (settings.admin_key, settings.sampling.temperature, settings.max_model_calls) == ("k", 0.6, 5)
    assert settings.sampling.top_p == 1.0 and settings.sampling.top_k == -1
