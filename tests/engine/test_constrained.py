"""Structured output in the embedded engine (llguidance): valid JSON under a schema, and the
logprobs of the masked distribution, as vLLM 0.33 reports them under guided decoding."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM

from fineenvs.engine.server import create_engine_app

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 10},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "done": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["csv", "sql", "plot"]}, "maxItems": 2},
    },
    "required": ["title", "score", "done", "tags"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "Rate this."}]


@pytest.fixture(scope="module", params=["tiny_qwen", "tiny_lfm2", "tiny_qwen3_5"])
def engine(request: pytest.FixtureRequest, tiny_model_factory: Any) -> Iterator[tuple[TestClient, Path]]:
    model_dir = tiny_model_factory(request.param)
    with TestClient(create_engine_app(model_dir, served_model_name="m")) as client:
        yield client, model_dir


def _chat(client: TestClient, **body: Any) -> dict[str, Any]:
    reply = client.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 200, "logprobs": True, "return_token_ids": True, **body},
    )
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_json_schema_outputs_validate(engine: tuple[TestClient, Path]) -> None:
    client, _ = engine
    fmt = {"type": "json_schema", "json_schema": {"name": "rating", "schema": SCHEMA}}
    for seed in range(4):
        choice = _chat(client, response_format=fmt, seed=seed, temperature=1.0)["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_structured_outputs_regex_and_choice(engine: tuple[TestClient, Path]) -> None:
    client, _ = engine
    choice = _chat(client, structured_outputs={"choice": ["yes", "no"]})["choices"][0]
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop"
    choice = _chat(client, structured_outputs={"regex": "[0-9]{3}-[a-c]"})["choices"][0]
    content = choice["message"]["content"]
    assert len(content) == 5 and content[:3].isdigit() and content[3] == "-" and content[4] in "abc"


def test_logprobs_are_the_masked_distributions(engine: tuple[TestClient, Path]) -> None:
    """Renormalised over the tokens the grammar allows: above the policy's own logprob (vLLM 0.33
    applies the grammar bitmask before its sampler, so processed_logprobs are these too)."""
    client, model_dir = engine
    reply = _chat(client, structured_outputs={"choice": ["yes", "no"]}, temperature=1.0)
    sampled = reply["choices"][0]["token_ids"]
    recorded = [e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([reply["prompt_token_ids"] + sampled])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(reply["prompt_token_ids"]) - 1 : -1]
    policy = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]
    assert recorded[0] > float(policy[0]) + 1e-3, (recorded, policy.tolist())
    assert all(r >= float(p) - 1e-4 for r, p in zip(recorded, policy.tolist(), strict=True))


def test_json_object_and_text(engine: tuple[TestClient, Path]) -> None:
    client, _ = engine
    content = _chat(client, response_format={"type": "json_object"}, max_tokens=12)["choices"][0]["message"][
        "content"
    ]
    assert content.startswith("{")  # a random model may not close it within 12 tokens
    plain = _chat(client, response_format={"type": "text"}, max_tokens=4)["choices"][0]
    assert len(plain["token_ids"]) == 4
