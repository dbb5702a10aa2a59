"""``+sweep=mini_repro``: the recipe at several seeds, each job in its own folder with the seed
reaching its stages, and the sweep's pooled table (pass@1 over every run's cells, paired counts
summed over runs, runs with a gain of their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from fineenvs.config import Job, to_run_config
from fineenvs.jobs.mini_repro import DONE, pooled_table, sweep_runs, write_report
from fineenvs.paths import CONF_DIR, REPO_ROOT


def test_the_seed_sweep_composes_one_recipe_per_seed() -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["+experiment=mini_repro", "+sweep=mini_repro"],
            return_hydra_config=True,
        )
        assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
        seeds = [int(v) for v in str(cfg.hydra.sweeper.params.seed).split(",")]
        jobs = [
            to_run_config(
                compose(
                    config_name="config",
                    overrides=["+experiment=mini_repro", "+sweep=mini_repro", f"seed={s}"],
                )
            )
            for s in seeds
        ]
    assert seeds == [0, 1, 2]
    assert [j.seed for j in jobs] == seeds and {j.job for j in jobs} == {Job.mini_repro}


def test_a_real_multirun_gives_each_seed_its_own_recipe_folder(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable, "-m", "fineenvs.run", "-m", "+experiment=mini_repro", "+sweep=mini_repro",
        "seed=4,5", "dry_run=true", f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=dict(os.environ, WANDB_MODE="disabled"),
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (sweep / "multirun.yaml").is_file()  # what write_report looks for to pool the sweep
    assert res.stdout.count("fineenvs plan: job=mini_repro experiment=mini_repro") == 2
    assert f"output dir: {sweep / '0'}" in res.stdout and f"output dir: {sweep / '1'}" in res.stdout
    assert "#0 : seed=4 " in res.stdout and "#1 : seed=5 " in res.stdout  # Hydra's launch lines


def _run(out: Path, base: list[int], rl: list[int], calls: tuple[float, float], minutes: float) -> None:
    """A recipe run's evaluation: ``base`` and ``rl_one`` solved these of tasks t0..tN-1 in pi."""
    n = len(base)
    keys = [str(out / "base" / "checkpoints" / "step-9"), str(out / "rl_one" / "checkpoints" / "step-9")]
    results = {
        "harnesses": ["pi"],
        "tasks": n,
        "checkpoints": keys,
        "cells": {k: {"pi": {"solved": sum(v), "tasks": n}} for k, v in zip(keys, [base, rl], strict=True)},
        "overall": {k: sum(v) / n for k, v in zip(keys, [base, rl], strict=True)},
        "co_solved": {
            f"{keys[1]} vs {keys[0]}": {
                "cells": 2,
                "mean_tool_calls_base": calls[0],
                "mean_tool_calls": calls[1],
            }
        },
    }
    (out / "eval" / "eval").mkdir(parents=True)
    (out / "eval" / "eval" / "results.json").write_text(json.dumps(results))
    records = [
        {
            "checkpoint": k,
            "task_id": f"t{i}",
            "harness": "pi",
            "try_index": 0,
            "attempt_id": f"{k}-{i}",
            "reward": float(s),
        }
        for k, v in zip(keys, [base, rl], strict=True)
        for i, s in enumerate(v)
    ]
    (out / "eval" / "eval" / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "eval" / DONE).write_text(json.dumps({"seconds": minutes * 60}))


def test_the_pooled_table_sums_the_runs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # Run 0: rl_one wins 6 cells, loses none (p = 0.016, a gain of its own); run 1: wins 1, loses 2.
    _run(sweep / "0", [1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0], (2.0, 1.0), 50)
    _run(sweep / "1", [1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0], (1.0, 1.0), 60)
    (sweep / "10").mkdir()  # a job without an evaluation yet is left out
    runs = sweep_runs(sweep)
    assert [r.name for r in runs] == ["0", "1"]
    table = pooled_table(runs)
    assert "2 runs pooled (0, 1)" in table
    assert "| base | 0.19 [0.07, 0.43] | 0.19 [0.07, 0.43] |" in table  # 3 of 16 cells
    assert "| rl_one | 0.50 [0.28, 0.72] |" in table  # 8 of 16
    # 7 won / 2 lost over both runs: one sign test on the sums; one run gained on its own.
    assert "| rl_one vs base | 7 / 2 (p = 0.09) | 7 / 2 (p = 0.09) | 1 of 2 |" in table
    assert "rl_one vs base: 4 cells, 1.50 → 1.00 tool calls (-33%)" in table
    assert "Wall time per run (its stages): 0 50 min, 1 60 min" in table
    other = tmp_path / "other"
    _run(other, [1, 0], [1, 1], (1.0, 1.0), 1)
    json_path = other / "eval" / "eval" / "results.json"
    json_path.write_text(json_path.read_text().replace('["pi"]', '["pi", "opencode"]', 1))
    with pytest.raises(ValueError, match="same harnesses.*Fix"):
        pooled_table([*runs, other])


def test_a_sweep_job_writes_the_pooled_table_next_to_its_runs(tmp_path: Path) -> None:
    from fineenvs.config import MiniReproSpec

    sweep = tmp_path / "sweep"
    _run(sweep / "0", [1, 0], [1, 1], (1.0, 1.0), 1)
    write_report(sweep / "0", MiniReproSpec())
    assert (sweep / "0" / "mini_repro.md").is_file() and not (sweep / "mini_repro.md").exists()  # not a sweep
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    write_report(sweep / "0", MiniReproSpec())
    assert "1 runs pooled (0)" in (sweep / "mini_repro.md").read_text()
