"""The shipped accelerate launch configs parse into the intended plugins, and the trainer runs
under ``accelerate launch``: one process with ``single_gpu.yaml`` (on CPU), and two CPU processes
(DDP over gloo) giving the same losses and weights as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[2] / "fineenvs" / "train" / "accelerate"


def launch_env(config: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment ``accelerate launch --config_file config`` gives the training processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    args, _, _ = _validate_launch_command(args)
    if args.num_processes > 1:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def test_single_gpu_config_is_one_plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(CONFIGS / "single_gpu.yaml"))
    assert (cfg.distributed_type.value, cfg.num_processes, cfg.mixed_precision) == ("NO", 1, "no")
    env = launch_env(CONFIGS / "single_gpu.yaml", monkeypatch)
    assert env.get("ACCELERATE_USE_FSDP", "false") == "false"
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"


def test_fsdp_config_builds_an_fsdp2_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import FullyShardedDataParallelPlugin

    cfg = load_config_from_file(str(CONFIGS / "fsdp_multi_gpu.yaml"))
    assert (cfg.distributed_type.value, cfg.num_processes) == ("FSDP", 4)
    env = launch_env(CONFIGS / "fsdp_multi_gpu.yaml", monkeypatch)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    plugin = FullyShardedDataParallelPlugin()  # reads the launch environment, as Accelerator does
    assert plugin.fsdp_version == 2
    assert "FULL_STATE_DICT" in str(plugin.state_dict_type)  # weight pushes need full tensors
    assert plugin.reshard_after_forward is True


def run_launch(args: list[str], extra_env: dict[str, str] | None = None) -> list[dict[str, object]]:
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", **(extra_env or {})}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *args, "-m", "fineenvs.train", "--steps", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_trainer_runs_under_accelerate_launch_on_cpu() -> None:
    single = run_launch(["--config_file", str(CONFIGS / "single_gpu.yaml"), "--cpu"])
    assert single[-1]["final"] == {**single[-1]["final"], "processes": 1, "policy_version": 2}  # type: ignore[dict-item]
    assert abs(float(single[0]["train/ratio"]) - 1.0) <= 1e-4  # type: ignore[arg-type]

    # Two processes (DDP over gloo on CPU): same rows, micro-batches split between the processes.
    double = run_launch(
        [
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "29581",
        ],
        {"ACCELERATE_USE_CPU": "true"},
    )
    final_1, final_2 = single[-1]["final"], double[-1]["final"]
    assert final_2["processes"] == 2 and final_2["distributed_type"] == "DistributedType.MULTI_CPU"  # type: ignore[index]
    for a, b in zip(single[:-1], double[:-1], strict=True):
        assert float(b["train/loss"]) == pytest.approx(float(a["train/loss"]), rel=1e-5, abs=1e-8)  # type: ignore[arg-type]
        assert b["train/rows"] == a["train/rows"] and b["train/tokens_trained"] == a["train/tokens_trained"]
    assert float(final_2["weights_abs_sum"]) == pytest.approx(float(final_1["weights_abs_sum"]), rel=1e-8)  # type: ignore[index]
