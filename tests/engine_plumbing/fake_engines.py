"""In-process fake engines (httpx.MockTransport) with vLLM's chat-completions shapes and a
switch per capability, so the probe and the weight sync can be tested against each failure."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

LOGITS = [4.0, 2.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]  # a fixed next-token distribution


def log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


@dataclass
class FakeEngine:
    model: str = "fake-model"
    token_ids: bool = True
    token_id_strings: bool = True
    logprobs: bool = True
    raw: bool = False
    tools: str = "none"  # none: answers without a call; ok: emits a call; reject: 400
    reject_completions: bool = False
    reasoning_parser: bool = False  # moves the reply into `reasoning`, as a misconfigured vLLM does
    requests: list[dict[str, Any]] = field(default_factory=list)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=self.transport(), base_url="http://fake")

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            models = [{"id": self.model, "object": "model", "max_model_len": 4096}]
            return httpx.Response(200, json={"object": "list", "data": models})
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": 3})
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404, json={"error": "not found"})
        body = json.loads(request.content)
        self.requests.append(body)
        if self.reject_completions:
            return httpx.Response(500, json={"error": {"message": "engine crashed"}})
        if body.get("tools") and self.tools == "reject":
            return httpx.Response(
                400,
                json={"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and '
                                           "--tool-call-parser to be set"}},
            )  # fmt: skip
        return httpx.Response(200, json=self.completion(body))

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        temperature = float(body.get("temperature", 1.0))
        lps = log_softmax([x / (1.0 if self.raw else temperature) for x in LOGITS])
        sampling = log_softmax([x / temperature for x in LOGITS])
        rng = random.Random(body.get("seed", 0))
        ids = [
            rng.choices(range(len(LOGITS)), weights=[math.exp(x) for x in sampling])[0]
            for _ in range(body.get("max_tokens", 4))
        ]
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": " ".join(f"w{i}" for i in ids)},
            "finish_reason": "length",
        }
        if self.reasoning_parser:
            choice["message"] = {
                "role": "assistant",
                "content": None,
                "reasoning": choice["message"]["content"],
            }
        if body.get("tools") and self.tools == "ok":
            choice["message"] = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c0", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
            }  # fmt: skip
            choice["finish_reason"] = "tool_calls"
        name = (lambda i: f"token_id:{i}") if self.token_id_strings else (lambda i: f"w{i}")
        if body.get("logprobs") and self.logprobs:
            n = int(body.get("top_logprobs") or 0)
            ranked = sorted(range(len(LOGITS)), key=lambda i: -lps[i])[:n]
            choice["logprobs"] = {
                "content": [
                    {
                        "token": name(i),
                        "logprob": lps[i],
                        "bytes": None,
                        "top_logprobs": [
                            {"token": name(j), "logprob": lps[j], "bytes": None} for j in ranked
                        ],
                    }
                    for i in ids
                ]
            }
        result: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion", "model": self.model,
                                  "choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": len(ids)}}  # fmt: skip
        if body.get("return_token_ids") and self.token_ids:
            result["prompt_token_ids"] = [1, 2, 3, 4, 5]
            choice["token_ids"] = ids
        return result
