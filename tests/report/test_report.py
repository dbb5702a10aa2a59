from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from fineenvs.report import main, write_report


def _fake_run(root: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    with (root / "metrics.jsonl").open("w") as f:
        for step in range(1, 9):
            row: dict[str, float | int] = {
                "step": step,
                "train/ratio": 1.0 + float(rng.normal(0, 1e-3)),
                "train/loss": 0.1,
            }
            for h in ("opencode", "codex"):
                row[f"rollout/harness/{h}/reward_mean"] = float(rng.uniform(0, 1))
                row[f"rollout/harness/{h}/pass_rate"] = float(rng.uniform(0, 1))
            f.write(json.dumps(row) + "\n")
    with (root / "attempts.jsonl").open("w") as f:
        for i in range(20):
            h = "opencode" if i % 2 else "codex"
            f.write(
                json.dumps(
                    {
                        "harness": h,
                        "reward": float(i % 3 == 0),
                        "tool_calls": int(rng.integers(1, 20)),
                        "rows": 1,
                    }
                )
                + "\n"
            )
    (root / "eval").mkdir(exist_ok=True)
    (root / "eval" / "results.json").write_text(
        json.dumps(
            {
                "pass_at_1": {
                    "base": {"opencode": 0.4, "codex": 0.3},
                    "rl": {"opencode": 0.55, "codex": 0.5},
                },
                "overall": {"base": 0.35, "rl": 0.525},
                "tool_call_reduction": {"rl vs base": 0.31},
            }
        )
    )
    return root


def _nontrivial(png: Path) -> None:
    assert png.stat().st_size > 5_000, png
    img = mpimg.imread(png)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(np.std(img[..., :3])) > 0.02, f"{png} looks blank"


def test_report_renders_all_plots(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    index = write_report(run)
    text = index.read_text()
    for name in ("reward.png", "pass_rate.png", "ratio.png", "tool_calls.png", "eval_matrix.png"):
        assert (index.parent / name).exists(), name
        _nontrivial(index.parent / name)
        assert name in text
    assert "0.525" in text and "opencode" in text


def test_report_over_sweep_dir(tmp_path: Path) -> None:
    _fake_run(tmp_path / "sweep" / "0", seed=1)
    _fake_run(tmp_path / "sweep" / "1", seed=2)
    index = write_report(tmp_path / "sweep")
    assert (index.parent / "run0_reward.png").exists() and (index.parent / "run1_reward.png").exists()


def test_report_cli_errors_on_empty_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 1
    assert "holds no fineenvs run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as missing:
        main([])
    assert missing.value.code == 2
    assert "the following arguments are required: run" in capsys.readouterr().err


def test_report_cli_help_says_where_it_writes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as shown:
        main(["--help"])
    assert shown.value.code == 0
    text = capsys.readouterr().out
    assert "--out" in text and "RUN/report" in text


def test_report_cli_writes_to_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _fake_run(tmp_path / "run")
    assert main([str(run), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "index.html").is_file() and (tmp_path / "plots" / "reward.png").is_file()
    assert not (run / "report").exists()
    assert str(tmp_path / "plots" / "index.html") in capsys.readouterr().out


def test_checkpoint_labels_stay_distinct_across_runs() -> None:
    from fineenvs.results import label

    assert label("/o/rl_one/checkpoints/step-12") == "rl_one/step-12"
    assert label("/o/rl_mix/checkpoints/step-12") == "rl_mix/step-12"
    assert label("outputs/x/step-700") == "x/step-700"
    assert label("base") == "base" and label("LiquidAI/LFM2.5-2.6B") == "LiquidAI/LFM2.5-2.6B"
