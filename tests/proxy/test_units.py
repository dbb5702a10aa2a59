"""Units under the proxy: prompt-id extraction, the raw engine client, prefix matching."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import pytest

from fineenvs.proxy.delta import BLOCK, TokenIndex, block_chain, token_bytes
from fineenvs.proxy.engine_client import EngineResponse, EngineUnreachable, RawEngine
from fineenvs.proxy.upstream import decode_reply, split_prompt_ids


def test_split_prompt_ids_reads_digits_and_falls_back_on_anything_odd() -> None:
    raw = b'{"id":"x","prompt_token_ids":[5, 6,7],"choices":[]}'
    ids, rest = split_prompt_ids(raw)
    assert ids is not None and ids.tolist() == [5, 6, 7] and ids.dtype == np.int32
    assert orjson.loads(rest) == {"id": "x", "prompt_token_ids": None, "choices": []}
    assert split_prompt_ids(b'{"prompt_token_ids":[]}')[0].tolist() == []  # type: ignore[union-attr]
    for odd in (
        b'{"prompt_token_ids":[1.5,2]}',
        b'{"prompt_token_ids":[1,"a"]}',
        b'{"x":1}',
        b'{"prompt_token_ids":[-1]}',
    ):
        ids, rest = split_prompt_ids(odd)
        assert ids is None and rest == odd
    # A string that mentions the key is escaped, so only the real key matches.
    raw = orjson.dumps(
        {"choices": [{"message": {"content": '"prompt_token_ids":[9]'}}], "prompt_token_ids": [1, 2]}
    )
    ids, _ = split_prompt_ids(raw)
    assert ids is not None and ids.tolist() == [1, 2]


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
    data["choices"][0]["weight_versions"] = [3]
    result = decode_reply(EngineResponse(200, orjson.dumps(data)), attempts=1, upstream_s=0.0)
    assert result.prompt_ids is not None and result.prompt_ids.tolist() == [1, 2, 9]
    assert result.weight_version == [3] and result.logprobs == [-0.5, 0.0] and result.logprobs_aligned
    result = decode_reply(
        EngineResponse(200, _reply(prompt_token_ids=[7], weight_version=5)), attempts=1, upstream_s=0
    )
    assert result.prompt_ids.tolist() == [7] and result.weight_version == 5  # type: ignore[union-attr]
    assert (
        result.completion["usage"]["prompt_tokens"] == 1
        and result.completion["usage"]["completion_tokens"] == 2
    )


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
