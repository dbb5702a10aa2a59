"""``+sweep=harness_mix`` and ``+cluster=slurm|local``: every job of the sweep composes and validates,
the launcher configs resolve, and a real multirun (Hydra's basic launcher and submitit_local) runs
every job with ``dry_run=true`` into its own output folder, grouped by sweep."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from fineenvs.config import RunConfig, to_run_config
from fineenvs.paths import CONF_DIR, REPO_ROOT

SINGLE = sorted(p.stem for p in (CONF_DIR / "harness").glob("*.yaml") if p.stem not in ("all", "paper_mix"))
PAPER_MIX = {"opencode", "claude_code", "codex", "mini_swe_agent"}
SWEEP_GROUP = "sweep_harness_mix"


def _compose(*overrides: str, hydra_cfg: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra_cfg)


def _sweep_values() -> list[str]:
    cfg = _compose("+experiment=rl_multi", "+sweep=harness_mix", hydra_cfg=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    return [v.strip() for v in str(cfg.hydra.sweeper.params.harness).split(",")]


def _expected(value: str) -> set[str]:
    return {"all": set(SINGLE), "paper_mix": PAPER_MIX}.get(value, {value})


def test_sweep_covers_opencode_the_paper_mix_all_and_every_single_harness() -> None:
    values = _sweep_values()
    assert len(values) == len(set(values))
    assert set(values) == {"opencode", "paper_mix", "all", *SINGLE}
    assert values[:3] == ["opencode", "paper_mix", "all"]


def _check_jobs(values: list[str]) -> None:
    experiment = "rl_multi"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfgs = [
            compose(
                config_name="config",
                overrides=[f"+experiment={experiment}", "+sweep=harness_mix", f"harness={v}"],
            )
            for v in values
        ]
    for value, cfg in zip(values, cfgs, strict=True):
        run: RunConfig = to_run_config(cfg)
        assert set(run.harness) == _expected(value), value
        assert run.logger.group == SWEEP_GROUP  # the sweep's group wins over the experiment's
        assert run.experiment == experiment


def test_mix_jobs_compose_and_validate() -> None:
    _check_jobs(["opencode", "paper_mix", "all"])


@pytest.mark.slow
def test_every_sweep_job_composes_and_validates() -> None:
    _check_jobs(_sweep_values())


def _launcher(*overrides: str) -> dict[str, Any]:
    cfg = _compose("+experiment=rl_multi", "+sweep=harness_mix", *overrides, hydra_cfg=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert isinstance(launcher, dict)
    return {str(k): v for k, v in launcher.items()}


def test_slurm_launcher_settings() -> None:
    launcher = _launcher("+cluster=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.account=proj")
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher["partition"] == "gpu" and launcher["account"] == "proj"
    assert launcher["gpus_per_node"] == 2 and launcher["tasks_per_node"] == 1 and launcher["nodes"] == 1
    assert launcher["timeout_min"] == 3000 and launcher["max_num_timeout"] == 3
    assert launcher["submitit_folder"] == "${hydra.sweep.dir}/.submitit/%j"
    cfg = _compose("+experiment=rl_multi", "+sweep=harness_mix", "+cluster=slurm", hydra_cfg=True)
    assert cfg.hydra.launcher.name == "fineenvs_rl_multi"


def test_local_launcher_settings() -> None:
    launcher = _launcher("+cluster=local")
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    assert launcher["gpus_per_node"] == 0 and launcher["cpus_per_task"] == 1


def test_without_cluster_the_basic_launcher_runs_the_sweep() -> None:
    launcher = _launcher()
    assert launcher["_target_"] == "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def _multirun(sweep_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "fineenvs.run", "-m", "+experiment=smoke", "+sweep=harness_mix",
        *extra, "dry_run=true", f"hydra.sweep.dir={sweep_dir}",
    ]  # fmt: skip
    env = dict(os.environ, WANDB_MODE="disabled")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)


@pytest.mark.slow
def test_submitit_local_multirun_dry_run(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    res = _multirun(sweep_dir, "+cluster=local")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    values = _sweep_values()
    results = sorted((sweep_dir / ".submitit").glob("*/*_result.pkl"))
    assert len(results) == len(values)
    seen: dict[str, set[str]] = {}
    for path in results:
        status, job = pickle.loads(path.read_bytes())
        assert status == "success", (path, job)
        value = next(o.split("=", 1)[1] for o in job.overrides if o.startswith("harness="))
        assert set(job.cfg.harness) == _expected(value)
        assert job.cfg.logger.group == SWEEP_GROUP and job.cfg.dry_run is True
        out = job.hydra_cfg.hydra.runtime.output_dir
        assert out not in seen, "two jobs shared an output folder"
        seen[out] = set(job.cfg.harness)
        assert Path(out).parent == sweep_dir
    logs = sorted((sweep_dir / ".submitit").glob("*/*_log.out"))
    assert len(logs) == len(values)
    for log in logs:
        text = log.read_text()
        assert (
            "dry_run=true: nothing was started." in text and "fineenvs plan: job=rl experiment=smoke" in text
        )


@pytest.mark.slow
def test_basic_launcher_multirun_dry_run(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    res = _multirun(sweep_dir, "hydra.sweeper.params.harness='opencode,paper_mix'")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (sweep_dir / "multirun.yaml").is_file()
    assert res.stdout.count("dry_run=true: nothing was started.") == 2
    assert "harnesses (4):" in res.stdout and "harnesses (1):" in res.stdout
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
