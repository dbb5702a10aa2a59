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

from fineenvs.paths import CONF_DIR, REPO_ROOT
from fineenvs_recipes.mini_repro.recipe import DONE, pooled_table, sweep_runs, write_report


def test_the_seed_sweep_is_a_multirun_over_three_seeds() -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["+experiment=mini_repro", "+sweep=mini_repro"],
            return_hydra_config=True,
        )
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert [int(v) for v in str(cfg.hydra.sweeper.params.seed).split(",")] == [0, 1, 2]
    assert set(cfg.hydra.sweeper.params) == {"seed"}  # a seed sweep: nothing else varies between its jobs


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
    assert res.stdout.count("fineenvs plan: job=recipe experiment=mini_repro") == 2
    assert f"output dir: {sweep / '0'}" in res.stdout and f"output dir: {sweep / '1'}" in res.stdout
    assert "#0 : seed=4 " in res.stdout and "#1 : seed=5 " in res.stdout  # Hydra's launch lines


def _run(
    out: Path, solved: dict[str, dict[str, list[int]]], calls: tuple[float, float], minutes: float, seed: int
) -> None:
    """A finished recipe run: ``solved[checkpoint][harness]`` lists which of tasks t0..tN-1 it solved."""
    keys = {c: str(out / c / "checkpoints" / "step-9") for c in solved}
    harnesses = list(next(iter(solved.values())))
    n = len(next(iter(next(iter(solved.values())).values())))
    results = {
        "harnesses": harnesses,
        "tasks": n,
        "checkpoints": list(keys.values()),
        "cells": {
            keys[c]: {h: {"solved": sum(v), "tasks": n} for h, v in hs.items()} for c, hs in solved.items()
        },
        "overall": {keys[c]: sum(map(sum, hs.values())) / (n * len(hs)) for c, hs in solved.items()},
        "co_solved": {
            f"{keys['rl_one']} vs {keys['base']}": {
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
            "checkpoint": keys[c],
            "task_id": f"t{i}",
            "harness": h,
            "try_index": 0,
            "attempt_id": f"{c}-{h}-{i}",
            "reward": float(x),
        }
        for c, hs in solved.items()
        for h, v in hs.items()
        for i, x in enumerate(v)
    ]
    (out / "eval" / "eval" / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "eval" / DONE).write_text(json.dumps({"seconds": minutes * 60, "extra": [f"seed={seed}"]}))
    (out / ".hydra").mkdir()
    (out / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n- +experiment=mini_repro\n")


ZERO = [0, 0, 0, 0]


def test_the_pooled_table_sums_the_runs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # Run 0: rl_one wins all 4 pi cells and 2 opencode cells, loses none; run 1: wins 1, loses 2 (pi).
    _run(
        sweep / "0",
        {
            "base": {"pi": ZERO, "opencode": [1, 0, 0, 0]},
            "rl_one": {"pi": [1, 1, 1, 1], "opencode": [1, 1, 1, 0]},
        },
        (2.0, 1.0),
        50,
        seed=0,
    )
    _run(
        sweep / "1",
        {"base": {"pi": [1, 1, 0, 0], "opencode": ZERO}, "rl_one": {"pi": [0, 0, 1, 0], "opencode": ZERO}},
        (1.0, 1.0),
        60,
        seed=1,
    )
    _run(
        sweep / "2",
        {"base": {"pi": ZERO, "opencode": ZERO}, "rl_one": {"pi": ZERO, "opencode": ZERO}},
        (1.0, 1.0),
        1,
        seed=2,
    )
    (sweep / "2" / "eval" / DONE).unlink()  # its evaluation did not finish: left out
    (sweep / "10").mkdir()  # a job that has not got that far
    runs = sweep_runs(sweep)
    assert [r.name for r in runs] == ["0", "1"]
    table = pooled_table(runs)
    assert "2 runs pooled (0: seed 0, 1: seed 1)" in table
    # base: pi 2 of 8, opencode 1 of 8, all 3 of 16; rl_one: pi 5 of 8, opencode 3 of 8, all 8 of 16.
    assert "| base | 0.25 [0.07, 0.59] | 0.12 [0.02, 0.47] | 0.19 [0.07, 0.43] | 2 |" in table
    assert "| rl_one | 0.62 [0.31, 0.86] | 0.38 [0.14, 0.69] | 0.50 [0.28, 0.72] | 2 |" in table
    # Summed: pi 5 won / 2 lost, opencode 2 / 0, all 7 / 2 (one test on the sums); each run's own.
    assert (
        "| rl_one vs base | 5 / 2 (p = 0.23) | 2 / 0 (p = 0.25) | 7 / 2 (p = 0.09) | 6 / 0*, 1 / 2 |" in table
    )
    assert "rl_one vs base: 4 cells, 1.50 → 1.00 tool calls (-33%)" in table
    assert "Wall time per run (its stages): 0 50 min, 1 60 min" in table
    other = tmp_path / "other"
    _run(other, {"base": {"pi": [1, 0]}, "rl_one": {"pi": [1, 1]}}, (1.0, 1.0), 1, seed=0)
    with pytest.raises(ValueError, match="same harnesses.*Fix"):
        pooled_table([*runs, other])


def test_a_sweep_job_pools_only_runs_of_its_own_configuration(tmp_path: Path) -> None:
    from fineenvs_recipes.mini_repro.settings import MiniReproSettings

    sweep = tmp_path / "sweep"
    one = {"base": {"pi": [1, 0]}, "rl_one": {"pi": [1, 1]}}
    _run(sweep / "0", one, (1.0, 1.0), 1, seed=0)
    write_report(sweep / "0", MiniReproSettings())
    assert (sweep / "0" / "mini_repro.md").is_file() and not (sweep / "mini_repro.md").exists()  # not a sweep
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    _run(sweep / "1", one, (1.0, 1.0), 1, seed=1)
    _run(sweep / "2", one, (1.0, 1.0), 1, seed=2)  # another setting: not a repeat of job 0
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("- seed=2\n- recipe.rl_steps=6\n")
    assert [p.name for p in sweep_runs(sweep, like=sweep / "2")] == ["2"]
    write_report(sweep / "1", MiniReproSettings())
    assert "2 runs pooled (0: seed 0, 1: seed 1)" in (sweep / "mini_repro.md").read_text()
