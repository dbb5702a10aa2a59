from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from fineenvs.config import to_run_config
from fineenvs.jobs.builders import reward_function
from fineenvs.paths import CONF_DIR


def _run(*overrides: str):  # type: ignore[no-untyped-def]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=["+experiment=smoke", *overrides]))


def test_reward_function_applies_the_published_bonus_to_verified_counts_only() -> None:
    reward = reward_function(_run())
    assert reward(1.0, 15, True).reward == 1.05
    assert reward(1.0, 15, False).reward == 1.0
    assert reward(0.0, 3, True).reward == 0.0
    assert reward(None, 3, True).reward is None


def test_unverified_counts_trusted_when_configured() -> None:
    reward = reward_function(_run("reward.require_verified_tool_count=false"))
    assert reward(1.0, 15, False).reward == 1.05
    assert reward(1.0, None, False).reward == 1.0


def test_correctness_only_reward() -> None:
    reward = reward_function(_run("reward=correctness"))
    assert reward(1.0, 1, True).reward == 1.0 and reward(0.0, 1, True).reward == 0.0


def test_an_attached_engine_gets_the_weight_transport_its_sync_names(tmp_path: Path) -> None:
    from fineenvs.engine.weights import EmbeddedWeightSync, VLLMNcclWeightSync, VLLMReloadWeightSync
    from fineenvs.jobs.builders import attached_weight_sync

    url = "http://10.0.0.5:8000/v1"
    reload = attached_weight_sync(_run("engine=vllm", f"engine.url={url}"), url, tmp_path)
    assert isinstance(reload, VLLMReloadWeightSync) and reload.url == "http://10.0.0.5:8000"
    nccl = attached_weight_sync(
        _run("engine=vllm", f"engine.url={url}", "engine.weight_sync=nccl"), url, tmp_path
    )
    assert isinstance(nccl, VLLMNcclWeightSync)
    assert isinstance(attached_weight_sync(_run(f"engine.url={url}"), url, tmp_path), EmbeddedWeightSync)
    assert attached_weight_sync(_run("engine.weight_sync=none"), url, tmp_path) is None
