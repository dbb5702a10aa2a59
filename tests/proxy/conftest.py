"""In-process proxy fixtures: ``httpx.ASGITransport`` in front, a scripted fake engine behind.

The fake engine speaks vLLM's chat-completions reply shape with real token ids from the tiny
Qwen tokenizer: each message is encoded separately (header, body, newline) so a later prompt
starts with exactly ``prompt + sampled`` of the call before it, as a real chat template does.
The last user message steers it: ``FAIL500``, ``FAIL400``, ``OVERFLOW``, ``SLOW``, ``TOOL``,
``BADLOGPROBS``, ``NOPROMPT``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from fineenvs.proxy.app import create_proxy_app
from fineenvs.proxy.settings import ProxySettings
from fineenvs.proxy.store import CallStore
from fineenvs_recipes.tiny import ensure_tiny_model


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(ensure_tiny_model("tiny_qwen") / "tokenizer.json"))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


@dataclass
class FakeEngine:
    tokenizer: Tokenizer
    requests: list[dict[str, Any]] = field(default_factory=list)
    weight_version: int = 7
    slow_s: float = 0.3
    down: bool = False
    throttle: int = 0  # answer this many calls with 429 + Retry-After first

    def enc(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def render_message(self, m: dict[str, Any]) -> list[int]:
        ids = self.enc(f"<|im_start|>{m['role']}\n")
        body = _text(m.get("content"))
        for call in m.get("tool_calls") or []:
            body += json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
        return ids + self.enc(body + "<|im_end|>") + self.enc("\n")

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        out: list[int] = []
        for m in messages:
            out += self.render_message(m)
        return out + self.enc("<|im_start|>assistant\n")

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content)
        self.requests.append(body)
        if self.throttle > 0:
            self.throttle -= 1
            return httpx.Response(429, json={"error": {"message": "busy"}}, headers={"retry-after": "0"})
        last = _text(body["messages"][-1].get("content"))
        if "FAIL500" in last:
            return httpx.Response(500, json={"error": {"message": "engine exploded"}})
        if "FAIL400" in last:
            return httpx.Response(400, json={"error": {"message": "bad sampling parameter 'foo'"}})
        if "OVERFLOW" in last:
            return httpx.Response(
                400, json={"error": {"message": "This model's maximum context length is 512 tokens."}}
            )
        if "SLOW" in last:
            await asyncio.sleep(self.slow_s)
        prompt = self.prompt_ids(body["messages"])
        message: dict[str, Any] = {"role": "assistant", "content": f"reply to: {last[:40]}"}
        if "TOOL" in last and body.get("tools"):
            name = body["tools"][0]["function"]["name"]
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": name, "arguments": '{"cmd": "ls"}'},
                    }
                ],
            }
        sampled = self.render_message(message)[len(self.enc("<|im_start|>assistant\n")) :][:-1]
        sampled = sampled[: body.get("max_tokens") or len(sampled)]
        logprobs = [{"token": f"token_id:{t}", "logprob": -0.1 - (i % 5) / 10} for i, t in enumerate(sampled)]
        if "BADLOGPROBS" in last:
            logprobs[0]["token"] = "token_id:999999"
        reply: dict[str, Any] = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 1,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                    "token_ids": sampled,
                    "logprobs": {"content": logprobs},
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(sampled), "total_tokens": 0},
            "weight_version": self.weight_version,
        }
        if "NOPROMPT" not in last:
            reply["prompt_token_ids"] = prompt
        return httpx.Response(200, json=reply)


@dataclass
class Harness:
    """One proxy + fake engine + store, driven through ``call(coro)`` from sync tests."""

    settings: ProxySettings
    engine: FakeEngine
    store: CallStore
    app: Any
    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def session(self, **payload: Any) -> dict[str, Any]:
        headers = {"authorization": f"Bearer {self.settings.admin_key}"} if self.settings.admin_key else {}
        r = self.run(self.client.post("/sessions", json=payload, headers=headers))
        assert r.status_code == 201, r.text
        return dict(r.json())

    def admin(self, method: str, url: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {self.settings.admin_key}"} if self.settings.admin_key else {}
        return self.run(self.client.request(method, url, headers=headers))  # type: ignore[no-any-return]


@pytest.fixture
def make_proxy(tokenizer: Tokenizer, tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(**overrides: Any) -> Harness:
        settings = ProxySettings(
            upstream_url="http://engine.test",
            served_model="tiny_qwen",
            store_dir=overrides.pop("store_dir", tmp_path / "store"),
            keepalive_seconds=overrides.pop("keepalive_seconds", 2.0),
            retry_backoff_s=0.01,
            **overrides,
        )
        engine = FakeEngine(tokenizer)
        store = CallStore(settings.store_dir)
        upstream = httpx.AsyncClient(transport=httpx.MockTransport(engine.handle))
        app = create_proxy_app(settings, upstream=upstream, store=store)
        loop = asyncio.new_event_loop()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy.test")
        h = Harness(settings, engine, store, app, loop, client)
        made.append(h)
        return h

    yield make
    for h in made:
        h.run(h.client.aclose())
        h.loop.close()
        h.store.close()
