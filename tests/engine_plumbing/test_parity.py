"""The engine-trainer parity gate (``fineenvs.engine.parity``): its tolerance, its verdicts, and
the embedded engine's scoring route it uses (the same check on vLLM: ``test_vllm_cpu.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fineenvs.engine.parity import ParityError, ParityGate, tolerance
from fineenvs_recipes.tiny import ensure_tiny_model

from .vllm_helpers import scorer


def test_tolerance_follows_the_coarser_dtype() -> None:
    assert tolerance("float32") == 1e-4  # the floor: 32 float32 roundings are far below it
    assert tolerance("bfloat16") == 0.125 == tolerance("float32", "bfloat16")
    assert tolerance("float16") == pytest.approx(32 * 2.0**-11)
    with pytest.raises(ValueError, match="no parity tolerance for dtype 'int8'"):
        tolerance("int8")


@pytest.fixture(scope="module")
def embedded() -> Iterator[str]:
    from fineenvs.engine.server import create_engine_app, serve_in_thread

    app = create_engine_app(ensure_tiny_model("tiny_qwen"), served_model_name="tiny_qwen")
    with serve_in_thread(app) as url:
        yield url


def test_the_embedded_engine_scores_token_ids_like_vllm(embedded: str) -> None:
    """``/v1/completions`` with ``prompt_logprobs=0``: vLLM's shape, raw logprobs (temperature 1)."""
    seq = [5, 17, 33, 2, 9, 120]
    reply = httpx.post(
        embedded + "/v1/completions",
        json={"model": "tiny_qwen", "prompt": seq, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.5},
        timeout=60,
    ).json()
    entries = reply["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(seq)
    got = [entries[i][str(t)]["logprob"] for i, t in enumerate(seq) if i]
    assert all(entries[i][str(t)]["decoded_token"] == f"token_id:{t}" for i, t in enumerate(seq) if i)
    want = scorer(ensure_tiny_model("tiny_qwen"))([seq])[0]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    for body, message in (
        ({"prompt": seq, "max_tokens": 1}, "scoring only: set prompt_logprobs=0"),
        ({"prompt": "text", "prompt_logprobs": 0}, "only scores a token-id prompt"),
        ({"prompt": [1, 10**6], "prompt_logprobs": 0}, "outside the vocabulary"),
    ):
        refused = httpx.post(embedded + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400 and message in refused.json()["error"]["message"], refused.text


def test_the_gate_passes_the_same_weights_and_refuses_others(embedded: str, tmp_path: Path) -> None:
    gate = ParityGate(embedded, "tiny_qwen", tolerance=tolerance("float32"), out_dir=tmp_path)
    sequences = gate.prepare(0.8)
    assert len(sequences) == 4 and all(len(s) > 10 for s in sequences)
    assert json.loads((tmp_path / "sequences.json").read_text()) == sequences
    check = gate.check(0, scorer(ensure_tiny_model("tiny_qwen")))
    assert check.ok and check.mean_abs_diff < 1e-5 and check.tokens == sum(len(s) - 1 for s in sequences)
    with pytest.raises(ParityError, match="does not serve the weights the trainer holds at version 1"):
        gate.check(1, scorer(ensure_tiny_model("tiny_qwen", seed=1)))
    lines = [json.loads(line) for line in (tmp_path / "checks.jsonl").read_text().splitlines()]
    assert [line["ok"] for line in lines] == [True, False]
    assert lines[1]["mean_abs_diff"] > 0.1 and "Fix:" in lines[1]["problem"]
    gate.close()


class ScriptedEngine:
    """A fake engine whose prompt logprobs are set by the test (``logprob``)."""

    def __init__(self) -> None:
        self.logprob = -1.0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(
                200, json={"prompt_token_ids": [1, 2, 3], "choices": [{"token_ids": [4, 5]}]}
            )
        seq = body["prompt"]
        entries: list[Any] = [None] + [{str(t): {"logprob": self.logprob}} for t in seq[1:]]
        return httpx.Response(200, json={"choices": [{"prompt_logprobs": entries}]})


def test_a_push_that_did_not_take_is_caught_inside_the_tolerance() -> None:
    """bf16's tolerance (0.125) is wider than a small update: the gate also asks whether the engine
    is nearer the previous weights than the new ones, once the trainer moved well above the noise."""
    engine = ScriptedEngine()
    client = httpx.Client(transport=httpx.MockTransport(engine), base_url="http://e")
    gate = ParityGate("http://e", "m", tolerance=tolerance("bfloat16"), client=client)
    gate.prepare(0.8)

    def trainer_at(value: float) -> Any:
        return lambda seqs: [[value] * (len(s) - 1) for s in seqs]

    assert gate.check(0, trainer_at(-1.01)).mean_abs_diff == pytest.approx(0.01)  # the noise: 0.01
    engine.logprob = -1.05  # the push took: the engine follows the trainer
    took = gate.check(1, trainer_at(-1.06))
    assert (
        took.ok
        and took.trainer_moved == pytest.approx(0.05)
        and took.engine_to_previous == pytest.approx(0.04)
    )
    # The trainer moves by 0.08 (8x the noise) and the engine stays: inside 0.125, but not taken.
    with pytest.raises(
        ParityError, match="the push of version 2 did not take.*0.01 from the trainer's weights"
    ):
        gate.check(2, trainer_at(-1.14))
    # Moves within the noise are not judged: bf16 rounds small updates away.
    quiet = ParityGate("http://e", "m", tolerance=tolerance("bfloat16"), client=client)
    quiet.prepare(0.8)
    quiet.check(0, trainer_at(-1.06))
    assert quiet.check(1, trainer_at(-1.07)).ok


def test_small_steps_whose_pushes_never_take_are_caught_when_they_add_up() -> None:
    """Each step moves the trainer less than 3x the noise, so no single step can be judged; the
    gate keeps comparing with the last weights it could judge, so the sum of them is caught."""
    engine = ScriptedEngine()  # serves -1.0 throughout: no push takes
    client = httpx.Client(transport=httpx.MockTransport(engine), base_url="http://e")
    gate = ParityGate("http://e", "m", tolerance=tolerance("bfloat16"), client=client)
    gate.prepare(0.8)

    def trainer_at(value: float) -> Any:
        return lambda seqs: [[value] * (len(s) - 1) for s in seqs]

    gate.check(0, trainer_at(-1.01))  # noise 0.01
    assert gate.check(1, trainer_at(-1.02)).ok  # moved 0.01: inside the noise, not judged
    assert gate.check(2, trainer_at(-1.03)).ok  # 0.02 from the anchor: still not judged
    with pytest.raises(ParityError, match="the push of version 3 did not take"):
        gate.check(3, trainer_at(-1.05))  # 0.04 from version 0's, the engine still at version 0's
