"""The CPU weight-sync loop through the embedded engine's HTTP API: rows from
``/v1/chat/completions`` (token ids + processed logprobs), a trainer step, the weight push through
``POST /update_weights_from_path`` (``EmbeddedWeightSync``), and the next rows on-policy again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fineenvs.train.grpo import CapturedGRPOTrainer
from fineenvs.train.train_rows import TrainRow
from tests.train.cpu_settings import cpu_settings

pytestmark = pytest.mark.slow


def engine_rows(url: str, n: int, version: int, temperature: float) -> list[TrainRow]:
    import httpx

    rows = []
    with httpx.Client(timeout=300) as client:
        for i in range(n):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"task {i}: list three files"}],
                "max_tokens": 10,
                "temperature": temperature,
                "top_p": 1.0,
                "logprobs": True,
                "return_token_ids": True,
                "return_weight_versions": True,
                "seed": 100 + i,
            }
            answer = client.post(url + "/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            data = answer.json()
            choice = data["choices"][0]
            prompt, tokens = data["prompt_token_ids"], choice["token_ids"]
            logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            assert len(logprobs) == len(tokens) > 0
            assert data["weight_version"] == version
            rows.append(
                TrainRow(
                    input_ids=prompt + tokens,
                    loss_mask=[0] * len(prompt) + [1] * len(tokens),
                    behaviour_logprobs=[0.0] * len(prompt) + logprobs,
                    advantage=1.0 if i % 2 else -1.0,
                    attempt_id=f"a{version}-{i}",
                    group_id=f"g{version}",
                    policy_version=int(data["weight_version"]),
                )
            )
    return rows


def test_weight_sync_through_the_embedded_engine(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    from fineenvs.engine.server import create_engine_app, serve_in_thread
    from fineenvs.engine.weights import EmbeddedWeightSync

    model_dir = tiny_model_factory("tiny_qwen")
    temperature = 0.8
    app = create_engine_app(model_dir, served_model_name="tiny", dtype="float32")
    with serve_in_thread(app) as url:
        sync = EmbeddedWeightSync(url, tmp_path / "staging")
        served: list[int] = []
        trainer = CapturedGRPOTrainer(
            model_dir,
            cpu_settings(learning_rate=1e-2, temperature=temperature, per_device_batch_size=4),
            tmp_path / "trainer",
            on_weights_updated=lambda t: served.append(sync.push(t.state_dict(), t.policy_version)),
        )
        first = trainer.step(engine_rows(url, 4, 0, temperature))
        assert abs(first["train/ratio"] - 1.0) <= 1e-4, first
        assert served == [1]  # the engine now serves version 1

        fresh = engine_rows(url, 4, 1, temperature)
        on_policy = trainer.loss_and_gradients(fresh)
        assert abs(on_policy["train/ratio"] - 1.0) <= 1e-4, on_policy
        assert on_policy["train/staleness_max"] == 0
        second = trainer.step(fresh)
        assert served == [1, 2] and second["train/policy_version"] == 2
        sync.close()
