"""How GPUs split between a launched vLLM and the trainer (fineenvs.engine.devices), and what a
run does with the split: the server gets its own CUDA_VISIBLE_DEVICES, the trainer the rest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fineenvs.engine.devices import DeviceError, Gpu, parse_nvidia_smi, plan_devices
from fineenvs.engine.vllm import VLLMServeArgs, build_serve_env

SMI = """GPU 0: NVIDIA H200 (UUID: GPU-aaaaaaaa-0000-0000-0000-000000000000)
GPU 1: NVIDIA H200 (UUID: GPU-bbbbbbbb-0000-0000-0000-000000000000)
GPU 2: NVIDIA H200 (UUID: GPU-cccccccc-0000-0000-0000-000000000000)
GPU 3: NVIDIA H200 (UUID: GPU-dddddddd-0000-0000-0000-000000000000)
"""
FOUR = parse_nvidia_smi(SMI)
TWO = FOUR[:2]


def test_nvidia_smi_listing_parses_indices_and_uuids() -> None:
    assert FOUR[1] == Gpu("1", "GPU-bbbbbbbb-0000-0000-0000-000000000000")
    assert parse_nvidia_smi("No devices were found\n") == []


def test_training_on_two_gpus_is_the_published_layout() -> None:
    plan = plan_devices(TWO, visible=None, engine_devices=[], needed=1, training=True)
    assert (plan.engine, plan.trainer) == (("1",), ("0",))
    plan = plan_devices(FOUR, visible=None, engine_devices=[], needed=2, training=True)
    assert (plan.engine, plan.trainer) == (("2", "3"), ("0", "1"))


def test_evaluation_takes_the_first_gpus_and_leaves_the_environment() -> None:
    plan = plan_devices(FOUR, visible=None, engine_devices=[], needed=2, training=False)
    assert (plan.engine, plan.trainer) == (("0", "1"), None)
    plan = plan_devices(FOUR, visible=["2", "3"], engine_devices=[], needed=2, training=False)
    assert plan.engine == ("2", "3")


def test_a_trainer_started_on_given_gpus_keeps_them() -> None:
    # accelerate launch / SLURM set CUDA_VISIBLE_DEVICES for the trainer: vLLM goes outside it.
    plan = plan_devices(FOUR, visible=["0", "1"], engine_devices=[], needed=1, training=True)
    assert (plan.engine, plan.trainer) == (("2",), None)
    # A SLURM job sees only its own GPUs: nothing outside, so they are split.
    plan = plan_devices(TWO, visible=["0", "1"], engine_devices=[], needed=1, training=True)
    assert (plan.engine, plan.trainer) == (("1",), ("0",))
    with pytest.raises(DeviceError, match="too few are visible to split"):
        plan_devices(TWO, visible=["0"], engine_devices=[], needed=2, training=True)


def test_every_trainer_process_needs_a_gpu() -> None:
    plan = plan_devices(FOUR, visible=None, engine_devices=[], needed=1, training=True, trainer_processes=3)
    assert (plan.engine, plan.trainer) == (("3",), ("0", "1", "2"))
    with pytest.raises(DeviceError, match="runs 2 processes") as err:
        plan_devices(TWO, visible=None, engine_devices=[], needed=1, training=True, trainer_processes=2)
    assert "--num_processes" in str(err.value)
    with pytest.raises(DeviceError, match="names a GPU twice"):
        plan_devices(FOUR, visible=None, engine_devices=["1", "1"], needed=2, training=True)


def test_explicit_devices_are_used_and_overlap_is_refused_with_the_fix() -> None:
    plan = plan_devices(FOUR, visible=None, engine_devices=["3"], needed=1, training=True)
    assert (plan.engine, plan.trainer) == (("3",), ("0", "1", "2"))
    uuid = FOUR[0].uuid
    assert uuid is not None
    assert plan_devices(FOUR, visible=["1"], engine_devices=[uuid], needed=1, training=True).engine == (uuid,)
    with pytest.raises(DeviceError, match="overlaps the trainer's GPUs") as err:
        plan_devices(FOUR, visible=["0", "1"], engine_devices=["1"], needed=1, training=True)
    assert "CUDA_VISIBLE_DEVICES" in str(err.value) and "Fix" in str(err.value)
    with pytest.raises(DeviceError, match="does not list"):
        plan_devices(TWO, visible=None, engine_devices=["7"], needed=1, training=True)
    with pytest.raises(DeviceError, match="exactly one GPU per rank"):
        plan_devices(FOUR, visible=None, engine_devices=["2"], needed=2, training=True)


def test_one_gpu_cannot_hold_both_when_training() -> None:
    with pytest.raises(DeviceError, match="at least one more for the trainer") as err:
        plan_devices(TWO[:1], visible=None, engine_devices=[], needed=1, training=True)
    assert "engine.url" in str(err.value)
    with pytest.raises(DeviceError, match="at least one more"):
        plan_devices(TWO, visible=None, engine_devices=["0", "1"], needed=2, training=True)


def test_the_server_environment_names_only_its_gpus() -> None:
    env = build_serve_env(VLLMServeArgs(model="m", devices=("1",)), base={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert (
        build_serve_env(VLLMServeArgs(model="m"), base={"CUDA_VISIBLE_DEVICES": "0"})["CUDA_VISIBLE_DEVICES"]
        == "0"
    )


def fake_nvidia_smi(directory: Path, gpus: int) -> Path:
    """A FAKE ``nvidia-smi`` (not NVIDIA's): ``-L`` lists ``gpus`` GPUs, so the launcher's GPU checks
    and its split of GPUs between vLLM and the trainer run on a machine without any."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    lines = "".join(
        f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-fa4e0000-0000-0000-0000-00000000000{i})\n"
        for i in range(gpus)
    )
    script.write_text(f"#!/bin/sh\n# fake nvidia-smi for fineenvs' tests\nprintf '%s' '{lines}'\n")
    script.chmod(0o755)
    return script


def test_a_run_splits_the_gpus_before_cuda_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hydra import compose, initialize_config_dir

    from fineenvs.config import to_run_config
    from fineenvs.jobs.builders import apply_trainer_devices
    from fineenvs.paths import CONF_DIR
    from fineenvs.plan import describe_plan, preflight

    fake_nvidia_smi(tmp_path / "bin", gpus=2)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # recorded, so the run's own value is undone after
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=rl_multi", f"output_dir={tmp_path}"])
    run = to_run_config(cfg)
    plan = describe_plan(run)
    assert "platform: cuda; GPUs: vLLM on GPU(s) 1 (the last), trainer on GPU(s) 0" in plan
    assert "weight sync: reload (auto)" in plan and "install-vllm-client" in plan
    assert "--port 0" in plan and "a free port is picked at launch" in plan
    assert f"chat template: {tmp_path}/engine/lfm2_5_nothink.jinja, written at launch" in plan
    assert apply_trainer_devices(run) == "0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    # Now the run was "started" on GPU 0; naming that GPU for vLLM is an overlap.
    run.engine.devices = ["0"]
    assert any("overlaps the trainer's GPUs" in p for p in preflight(run))
    run.engine.devices = []
    run.engine.weight_sync = type(run.engine.weight_sync).nccl
    monkeypatch.setenv("FINEENVS_VLLM_CLIENT", str(tmp_path / "no-client"))
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        assert any("install-vllm-client" in p for p in preflight(run))
