"""Local report for people without W&B: ``python -m fineenvs.report RUN [--out DIR]``.

Reads what every run writes next to its checkpoints — ``metrics.jsonl`` (the logger's per-step
metrics), ``attempts.jsonl`` (one line per attempt) and ``eval/results.json`` (evaluation jobs and
the in-training hook) — and writes ``report/index.html`` with PNG plots: reward and pass rate per
harness over steps, ``train/ratio`` over steps, tool calls per attempt by harness, and the
evaluation matrix (checkpoint × harness pass@1) as a heatmap, plus the tables. A sweep directory
(Hydra multirun: numbered job folders) gets one section per job.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

from fineenvs.jsonl import JsonObject, read_jsonl
from fineenvs.results import label

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def find_runs(root: Path) -> list[Path]:
    """A run directory holds metrics.jsonl, attempts.jsonl or eval/results.json; a sweep holds runs."""
    marks = ("metrics.jsonl", "attempts.jsonl", "eval/results.json")
    if any((root / m).exists() for m in marks):
        return [root]
    runs = sorted(
        {
            p.parent if p.name != "results.json" else p.parent.parent
            for m in marks
            for p in root.glob(f"*/{m}")
        }
    )
    return runs


def _series(metrics: list[JsonObject], suffix: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per-harness series of ``rollout/harness/<h>/<suffix>``."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in metrics:
        for key, value in row.items():
            parts = key.split("/")
            if len(parts) == 4 and parts[0] == "rollout" and parts[1] == "harness" and parts[3] == suffix:
                xs, ys = out.setdefault(parts[2], ([], []))
                xs.append(int(row["step"]))
                ys.append(float(value))
    return out


def _plot_lines(
    series: dict[str, tuple[list[int], list[float]]], title: str, ylabel: str, path: Path
) -> bool:
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for name, (xs, ys) in sorted(series.items()):
        ax.plot(xs, ys, marker="o", markersize=3, label=name)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _plot_tool_calls(attempts: list[JsonObject], path: Path) -> bool:
    by_harness: dict[str, list[int]] = defaultdict(list)
    for a in attempts:
        if a.get("tool_calls") is not None:
            by_harness[a["harness"]].append(int(a["tool_calls"]))
    if not by_harness:
        return False
    names = sorted(by_harness)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.boxplot([by_harness[n] for n in names], tick_labels=names, showmeans=True)
    ax.set_title("tool calls per attempt")
    ax.set_ylabel("tool calls")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _plot_matrix(results: JsonObject, path: Path) -> bool:
    matrix = results.get("pass_at_1") or {}
    if not matrix:
        return False
    ckpts = list(matrix)
    harnesses = sorted({h for row in matrix.values() for h in row})
    values = [[float(matrix[c].get(h, float("nan"))) for h in harnesses] for c in ckpts]
    fig, ax = plt.subplots(figsize=(1.4 + 1.1 * len(harnesses), 1.2 + 0.6 * len(ckpts)), dpi=100)
    im = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(harnesses)), harnesses, rotation=30, ha="right")
    ax.set_yticks(range(len(ckpts)), [label(c) for c in ckpts])
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, "-" if v != v else f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
    fig.colorbar(im, ax=ax, label="pass@1")
    ax.set_title("evaluation: pass@1")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def render_run(run_dir: Path, out_dir: Path, prefix: str) -> tuple[str, list[Path]]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    attempts = read_jsonl(run_dir / "attempts.jsonl")
    results_path = run_dir / "eval" / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    pngs: list[Path] = []
    parts = [f"<h2>{html.escape(str(run_dir))}</h2>"]

    def add(ok: bool, path: Path) -> None:
        if ok:
            pngs.append(path)
            parts.append(f'<img src="{path.name}" alt="{path.stem}">')

    p = out_dir / f"{prefix}reward.png"
    add(_plot_lines(_series(metrics, "reward_mean"), "reward per harness", "mean reward", p), p)
    p = out_dir / f"{prefix}pass_rate.png"
    add(_plot_lines(_series(metrics, "pass_rate"), "pass rate per harness", "pass rate", p), p)
    ratio = {
        "train/ratio": (
            [int(r["step"]) for r in metrics if "train/ratio" in r],
            [float(r["train/ratio"]) for r in metrics if "train/ratio" in r],
        )
    }
    p = out_dir / f"{prefix}ratio.png"
    add(_plot_lines(ratio if ratio["train/ratio"][0] else {}, "importance ratio", "train/ratio", p), p)
    p = out_dir / f"{prefix}tool_calls.png"
    add(_plot_tool_calls(attempts, p), p)
    p = out_dir / f"{prefix}eval_matrix.png"
    add(_plot_matrix(results, p), p)

    if attempts:
        per: dict[str, list[JsonObject]] = defaultdict(list)
        for a in attempts:
            per[a["harness"]].append(a)
        rows = []
        for h, items in sorted(per.items()):
            graded = [a["reward"] for a in items if a.get("reward") is not None]
            solved = [a for a in items if (a.get("reward") or 0) > 0]
            rows.append(
                [
                    h,
                    len(items),
                    len(graded),
                    _fmt(sum(graded) / len(graded)) if graded else "-",
                    len(solved),
                    sum(int(a.get("rows", 0)) for a in items),
                ]
            )
        parts.append(
            "<h3>attempts</h3>"
            + _table(["harness", "attempts", "graded", "mean reward", "solved", "rows"], rows)
        )
    if results.get("pass_at_1"):
        m = results["pass_at_1"]
        hs = sorted({h for r in m.values() for h in r})
        rows = [
            [c] + [_fmt(m[c].get(h, "-")) for h in hs] + [_fmt(results.get("overall", {}).get(c, "-"))]
            for c in m
        ]
        parts.append("<h3>pass@1</h3>" + _table(["checkpoint", *hs, "overall"], rows))
    if results.get("tool_call_reduction"):
        rows = [[k, _fmt(v)] for k, v in results["tool_call_reduction"].items()]
        parts.append("<h3>tool calls on co-solved tasks</h3>" + _table(["comparison", "reduction"], rows))
    if metrics:
        last = metrics[-1]
        keys = [
            k
            for k in sorted(last)
            if k.startswith(("train/", "reward/", "rollout/")) and "/harness/" not in k
        ]
        parts.append("<h3>last step</h3>" + _table(["metric", "value"], [[k, _fmt(last[k])] for k in keys]))
    if len(parts) == 1:
        parts.append("<p>No metrics, attempts or evaluation results in this directory yet.</p>")
    return "\n".join(parts), pngs


def write_report(root: Path, out_dir: Path | None = None) -> Path:
    runs = find_runs(root)
    if not runs:
        raise FileNotFoundError(
            f"{root} holds no fineenvs run (no metrics.jsonl, attempts.jsonl or eval/results.json in it or "
            "in its job folders). Point the report at a run's output directory or a multirun sweep directory."
        )
    out = out_dir or root / "report"
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for i, run in enumerate(runs):
        body, _ = render_run(run, out, prefix=f"run{i}_" if len(runs) > 1 else "")
        sections.append(body)
    style = "body{font-family:sans-serif;margin:2em}img{margin:4px;border:1px solid #ddd}table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
    page = f"<!doctype html><html><head><meta charset='utf-8'><title>fineenvs report</title><style>{style}</style></head><body><h1>fineenvs report</h1>{''.join(sections)}</body></html>"
    index = out / "index.html"
    index.write_text(page)
    return index


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fineenvs.report",
        description=(
            "Plot a fineenvs run without W&B: reward and pass rate per harness over steps, train/ratio, tool "
            "calls per attempt by harness and the evaluation matrix (checkpoint x harness pass@1), from the "
            "run's metrics.jsonl, attempts.jsonl and eval/results.json. A Hydra multirun sweep directory "
            "gets one section per job."
        ),
    )
    parser.add_argument("run", type=Path, help="a run's output directory, or a multirun sweep directory")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where index.html and the PNG plots go (created if missing; default: RUN/report)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        index = write_report(args.run, args.out)
    except FileNotFoundError as err:
        print(f"fineenvs report: {err}", file=sys.stderr)
        return 1
    print(f"report: {index}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
