"""Embedded-engine behaviour beyond the contract: errors, queue, weight updates, concurrency."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM

from fineenvs.engine.__main__ import resolve_model
from fineenvs.engine.server import create_engine_app, serve_in_thread

USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(tiny_qwen_dir: Path) -> Iterator[TestClient]:
    with TestClient(create_engine_app(tiny_qwen_dir, served_model_name="tiny")) as c:
        yield c


def _post(client: TestClient, **body: Any) -> tuple[int, dict[str, Any]]:
    response = client.post("/v1/chat/completions", json={"messages": USER, **body})
    return response.status_code, response.json()


def _assert_error(status: int, body: dict[str, Any], code: int, *fragments: str) -> None:
    assert status == code, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    for fragment in fragments:
        assert fragment in err["message"], err["message"]


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        ({"temperature": "hot"}, ["temperature", "valid number"]),
        ({"max_tokens": 0}, ["max_tokens", "greater than or equal to 1"]),
        ({"top_p": 0}, ["top_p"]),
        ({"top_logprobs": 3}, ["`logprobs` must be set to true"]),
        ({"top_logprobs": 50, "logprobs": True}, ["top_logprobs", "less than or equal to 20"]),
        ({"n": 2}, ["n=2", "n=1"]),
        ({"stream": True}, ["stream=true", "stream=false"]),
        ({"tool_choice": "required"}, ["constrained decoding", "'auto'"]),
        ({"messages": []}, ["messages"]),
        ({"presence_penalty": 0.5}, ["presence_penalty=0.5", "neutral value"]),
        ({"repetition_penalty": 1.1}, ["repetition_penalty"]),
        ({"logit_bias": {"5": 10}}, ["logit_bias", "not supported"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, ["json_schema.schema"]),
        ({"response_format": {"type": "grammar"}}, ["response_format.type='grammar'"]),
        ({"structured_outputs": {"nonsense": 1}}, ["structured_outputs has none of"]),
        ({"messages": [{"content": "x"}]}, ["role"]),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            ["image_url"],
        ),
    ],
)
def test_bad_requests_get_vllm_400(client: TestClient, body: dict[str, Any], fragments: list[str]) -> None:
    status, reply = _post(client, **body)
    _assert_error(status, reply, 400, *fragments)


def test_invalid_json_and_unknown_model(client: TestClient) -> None:
    response = client.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    _assert_error(response.status_code, response.json(), 400, "not valid JSON")
    status, reply = _post(client, model="gpt-4o")
    _assert_error(status, reply, 404, "gpt-4o")


def test_unknown_fields_are_ignored_and_defaults_apply(client: TestClient) -> None:
    status, reply = _post(
        client,
        max_tokens=3,
        frobnicate=True,
        stream_options=None,
        parallel_tool_calls=False,
        presence_penalty=0,
        frequency_penalty=0.0,
        repetition_penalty=1,
        logit_bias={},
        response_format={"type": "text"},
    )
    assert status == 200, reply
    choice = reply["choices"][0]
    assert reply["model"] == "tiny" and reply["object"] == "chat.completion"
    assert choice["logprobs"] is None and choice["token_ids"] is None and reply["prompt_token_ids"] is None
    assert reply["weight_version"] == 0 and reply["usage"]["completion_tokens"] <= 3


def test_content_parts_and_tool_call_arguments_as_json_strings(client: TestClient) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "rain"},
    ]
    reply = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "return_token_ids": True}
    ).json()
    tok = client.app.state.engine.generator.tokenizer  # type: ignore[attr-defined]
    prompt = tok.decode(reply["prompt_token_ids"])
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\nrain\n</tool_response>" in prompt and "weather?" in prompt


def test_models_health_weight_info(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == 32768
    info = client.get("/weight_info").json()
    assert info["weight_version"] == 0 and info["dtype"] == "float32"


def test_stop_strings_truncate_content(client: TestClient) -> None:
    base = _post(client, max_tokens=30, temperature=0, ignore_eos=True)[1]["choices"][0]["message"]["content"]
    stop = base[10:13]
    first = base.find(stop)
    status, reply = _post(
        client, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop], return_token_ids=True
    )
    choice = reply["choices"][0]
    assert choice["message"]["content"] == base[:first]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_chat_template_kwargs_reach_the_template(tiny_qwen3_5_dir: Path) -> None:
    with TestClient(create_engine_app(tiny_qwen3_5_dir, served_model_name="q")) as c:
        tok = c.app.state.engine.generator.tokenizer  # type: ignore[attr-defined]
        on = _post(c, max_tokens=1, return_token_ids=True, chat_template_kwargs={"enable_thinking": True})[1]
        off = _post(c, max_tokens=1, return_token_ids=True)[1]
        assert tok.decode(on["prompt_token_ids"]).endswith("<|im_start|>assistant\n<think>\n")
        assert tok.decode(off["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
        # Template errors are the client's: Qwen3.5 refuses a conversation without a user query.
        response = c.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "s"}]})
        _assert_error(response.status_code, response.json(), 400, "No user query")


def test_max_model_len_override(tiny_qwen_dir: Path) -> None:
    with TestClient(create_engine_app(tiny_qwen_dir, served_model_name="t", max_model_len=64)) as c:
        status, reply = _post(c, max_tokens=40)
        _assert_error(status, reply, 400, "maximum context length is 64 tokens")
        status, reply = _post(c, messages=[{"role": "user", "content": "word " * 80}], max_tokens=1)
        _assert_error(status, reply, 400, "maximum context length is 64 tokens", "input tokens")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        create_engine_app(tiny_qwen_dir, served_model_name="t", max_model_len=10**6)


def _greedy_under(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_weight_update_from_dir_and_file(tiny_model_factory: Any) -> None:
    old_dir, new_dir = tiny_model_factory("tiny_qwen", 0), tiny_model_factory("tiny_qwen", 1)
    with TestClient(create_engine_app(old_dir, served_model_name="t")) as c:
        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        before = _post(c, **body)[1]
        reply = c.post("/update_weights_from_path", json={"path": str(new_dir)})
        assert reply.status_code == 200 and reply.json()["weight_version"] == 1
        after = _post(c, **body)[1]
        assert after["weight_version"] == 1
        assert after["choices"][0]["token_ids"] == _greedy_under(new_dir, after["prompt_token_ids"], 12)
        assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
        reply = c.post(
            "/update_weights_from_path",
            json={"path": str(old_dir / "model.safetensors"), "weight_version": 7},
        )
        assert reply.json()["weight_version"] == 7 and c.get("/weight_info").json()["weight_version"] == 7
        assert _post(c, **body)[1]["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_weight_update_rejects_bad_input(tiny_qwen_dir: Path, tiny_lfm2_dir: Path, tmp_path: Path) -> None:
    with TestClient(create_engine_app(tiny_qwen_dir, served_model_name="t")) as c:
        cases = [
            ({"path": str(tmp_path / "missing")}, "does not exist"),
            ({"path": str(tmp_path)}, "model.safetensors"),
            ({"path": str(tiny_lfm2_dir)}, "does not match the served model"),
            ({"path": str(tiny_qwen_dir), "weight_version": "2"}, "integer"),
            ({}, "path"),
        ]
        for body, fragment in cases:
            reply = c.post("/update_weights_from_path", json=body)
            _assert_error(reply.status_code, reply.json(), 400, fragment)
        assert c.get("/weight_info").json()["weight_version"] == 0


def test_weight_update_drains_the_request_in_flight(tiny_model_factory: Any) -> None:
    app = create_engine_app(tiny_model_factory("tiny_qwen", 0), served_model_name="t")
    new_dir = tiny_model_factory("tiny_qwen", 1)
    body = {"messages": USER, "max_tokens": 150, "ignore_eos": True, "seed": 1, "return_token_ids": True}
    with serve_in_thread(app) as url:
        reference = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        done: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: done.update(
                httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
            )
        )
        thread.start()
        while app.state.engine.pending == 0:
            time.sleep(0.002)
        update = httpx.post(f"{url}/update_weights_from_path", json={"path": str(new_dir)}, timeout=120)
        thread.join()
        assert update.json()["weight_version"] == 1
        # Had the swap happened mid-generation, the tail would come from the new weights.
        assert done["weight_version"] == 0
        assert done["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
        after = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert after["weight_version"] == 1
        assert after["choices"][0]["token_ids"] != reference["choices"][0]["token_ids"]


def _complete(url: str, **body: Any) -> httpx.Response:
    payload = {"messages": USER, "ignore_eos": True, "return_token_ids": True, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=120)


def test_full_queue_is_503(tiny_qwen_dir: Path) -> None:
    app = create_engine_app(tiny_qwen_dir, served_model_name="t", max_queue=2)
    state = app.state.engine
    with serve_in_thread(app) as url:
        replies: list[httpx.Response] = []
        running = threading.Thread(target=lambda: replies.append(_complete(url, max_tokens=150)))
        running.start()
        while state.pending < 1:
            time.sleep(0.002)
        waiting = threading.Thread(target=lambda: replies.append(_complete(url, max_tokens=2)))
        waiting.start()
        while state.pending < 2:
            time.sleep(0.002)
        refused = _complete(url, max_tokens=2)  # one running + one waiting = full
        _assert_error(refused.status_code, refused.json(), 503, "queue is full", "--max-queue")
        running.join()
        waiting.join()
        assert [r.status_code for r in replies] == [200, 200]
        assert state.pending == 0
        assert _complete(url, max_tokens=2).status_code == 200


def test_concurrent_requests_match_sequential_ones(tiny_lfm2_dir: Path) -> None:
    # The hybrid model carries recurrent state: interleaving would corrupt it visibly.
    app = create_engine_app(tiny_lfm2_dir, served_model_name="t")
    with serve_in_thread(app) as url:
        sequential = {seed: _complete(url, max_tokens=20, seed=seed).json() for seed in range(3)}
        results: dict[int, httpx.Response] = {}
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(i, _complete(url, max_tokens=20, seed=i % 3))
            )
            for i in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, response in results.items():
            assert response.status_code == 200
            reply, expected = response.json(), sequential[i % 3]
            assert reply["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
            assert reply["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_lfm2", "tiny_qwen3_5"])
def test_batched_rows_keep_exact_logprobs(tiny_model_factory: Any, name: str) -> None:
    model_dir = tiny_model_factory(name)
    app = create_engine_app(model_dir, served_model_name="t", max_batch_size=4)
    state = app.state.engine
    prompts = ["hi", "count the rows of data.csv please " * 3, "x", "print the total of the amount column"]
    with serve_in_thread(app) as url:
        replies: dict[int, dict[str, Any]] = {}

        def ask(i: int) -> None:  # rows differ in prompt, length, truncation and seed
            replies[i] = _complete(url, **_body_of(prompts, i), seed=i).json()

        threads = [threading.Thread(target=lambda: _complete(url, max_tokens=2))]
        with state.generator.lock:  # the worker takes the first request, then waits here
            threads[0].start()
            while state.pending < 1 or state.worker.queued():
                time.sleep(0.002)
            threads += [threading.Thread(target=ask, args=(i,)) for i in range(4)]
            for t in threads[1:]:
                t.start()
            while state.pending < 5:
                time.sleep(0.002)
        for t in threads:
            t.join()
        assert state.worker.batch_sizes == [1, 4]  # the four waited together and ran as one batch
        alone = {i: _complete(url, **_body_of(prompts, i), seed=i).json() for i in range(4)}
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for i, reply in replies.items():
        choice = reply["choices"][0]
        completion = choice["token_ids"]
        assert len(completion) == 12 + 4 * i
        assert completion == alone[i]["choices"][0]["token_ids"]  # same tokens as unbatched
        with torch.no_grad():
            ids = torch.tensor([reply["prompt_token_ids"] + completion])
            logits = model(input_ids=ids).logits[0, len(reply["prompt_token_ids"]) - 1 : -1] / 0.7
        if i % 2 == 0:
            kth = logits.topk(30, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        returned = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
        assert float((expected - returned).abs().max()) <= 1e-4


def test_short_request_is_answered_before_its_batch_ends(tiny_qwen_dir: Path) -> None:
    app = create_engine_app(tiny_qwen_dir, served_model_name="t", max_batch_size=4)
    state = app.state.engine
    with serve_in_thread(app) as url:
        still_running: dict[str, int] = {}

        def timed(name: str, tokens: int) -> None:
            assert _complete(url, max_tokens=tokens).status_code == 200
            still_running[name] = state.pending  # requests in flight when this one was answered

        threads = []
        with state.generator.lock:  # the worker takes the first request, then waits here
            for name, tokens in (("first", 2), ("long", 400), ("short", 3)):
                threads.append(threading.Thread(target=timed, args=(name, tokens)))
                threads[-1].start()
                while state.pending < len(threads) or (name == "first" and state.worker.queued()):
                    time.sleep(0.002)
        for t in threads:
            t.join()
        assert state.worker.batch_sizes == [1, 2]  # long and short decoded together
        assert still_running["short"] == 1  # answered while the long row kept decoding
        assert still_running["long"] == 0


def _body_of(prompts: list[str], i: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompts[i]}],
        "max_tokens": 12 + 4 * i,
        "temperature": 0.7,
        "top_k": 0 if i % 2 else 30,
        "logprobs": True,
    }


def test_cli_rejects_unknown_model() -> None:
    with pytest.raises(SystemExit, match="neither a tiny model"):
        resolve_model("definitely/not-here")


def test_client_disconnect_aborts_generation(tiny_qwen_dir: Path) -> None:
    app = create_engine_app(tiny_qwen_dir, served_model_name="t")
    state = app.state.engine
    with serve_in_thread(app) as url:
        start = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):  # ~20k tokens would take minutes to generate
            httpx.post(
                f"{url}/v1/chat/completions",
                json={"messages": USER, "max_tokens": 20000, "ignore_eos": True},
                timeout=httpx.Timeout(60, read=0.5),
            )
        while state.pending:
            assert time.monotonic() - start < 10, "the abandoned request still holds the queue"
            time.sleep(0.02)
        assert _complete(url, max_tokens=2).status_code == 200
