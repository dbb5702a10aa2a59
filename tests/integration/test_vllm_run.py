"""``engine=vllm`` end to end on the real vLLM, its CPU build: the smoke job as typed, with two real
agent CLIs, three optimizer steps and a push after each, once per weight sync; and a SIGKILLed run
that resumes on a fresh server.

A random tiny model solves nothing, so every reward and advantage is 0 and the policy gradient is
zero; AdamW's decoupled weight decay still moves every weight at each step. That is what makes the
pushed weights observable: the parity gate sees the trainer move and the engine follow, and a
recorded call that the engine served at version k has the logprobs of checkpoint step-k, not those
of the initial weights.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fineenvs.harnesses import check_installed
from fineenvs.lifecycle import run_processes
from fineenvs.paths import REPO_ROOT
from tests.engine_plumbing.vllm_helpers import build_python, scorer

pytestmark = pytest.mark.vllm

HARNESSES = ["opencode", "mini_swe_agent"]
TEMPERATURE = 0.8


def _cmd(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "fineenvs.run", "+experiment=smoke", "engine=vllm",
        f"harness=[{','.join(HARNESSES)}]", "trainer.max_steps=3", "trainer.learning_rate=1e-2",
        "trainer.weight_decay=0.5", f"hydra.run.dir={out}", *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")


def _needs() -> None:
    problems = check_installed(HARNESSES)
    if problems:
        pytest.fail("the run needs its agent CLIs: " + "; ".join(problems))
    build_python("cpu")


def _calls(out: Path) -> list[dict[str, Any]]:
    from fineenvs.proxy.store import CallStore

    store = CallStore(out / "records")
    calls = []
    for session in sorted((out / "records" / "sessions").iterdir()):
        data = store.read_session(session.name)
        assert not [e for e in data["events"] if e.get("kind") == "upstream_error"], data["events"]
        calls += data["calls"]
    return calls


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _left_in_tmp() -> set[str]:
    """Our scratch folders, and sockets named as vLLM names its IPC paths (a uuid) in case they
    escaped them; other programs' files in /tmp are not counted."""
    tmp = Path(tempfile.gettempdir())
    return {
        p.name
        for p in tmp.iterdir()
        if p.name.startswith("fineenvs-vllm-") or (_UUID.fullmatch(p.name) and p.is_socket())
    }


def _checks(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "parity" / "checks.jsonl").read_text().splitlines()]


def _sampled_logprobs(model_dir: Path, prompt: list[int], sampled: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + sampled])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]


@pytest.mark.parametrize("sync", ["reload", "file_transfer"])
def test_the_smoke_job_runs_on_real_vllm(tmp_path: Path, sync: str) -> None:
    _needs()
    out = tmp_path / "run"
    left_before = _left_in_tmp()
    started = time.monotonic()
    res = subprocess.run(
        _cmd(out, f"engine.weight_sync={sync}"),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=_env(),
        timeout=1500,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    # vLLM's IPC sockets lived in the launch's own directory, gone with the server.
    assert _left_in_tmp() <= left_before, _left_in_tmp() - left_before
    summary = json.loads((out / "summary.json").read_text())
    print(
        f"{sync}: {time.monotonic() - started:.0f} s; first train/ratio {summary['first_ratio']}, "
        f"parity max {summary['parity_max_mean_abs_diff']:.2e}"
    )
    assert summary["steps"] == 3 and summary["weight_pushes"] == 3, summary
    assert summary["attempts"] >= 6 and set(summary["attempt_exits"]) == {"finished"}, summary[
        "attempt_exits"
    ]
    assert summary["first_ratio"] == pytest.approx(1.0, abs=1e-3)  # float32 engine and trainer

    # The real server ran the launcher's command from the CPU build, with the chosen weight sync.
    log = (out / "engine" / "vllm.log").read_text()
    assert log.splitlines()[0].startswith(f"$ {build_python('cpu').parent / 'vllm'} serve ")
    assert "Initializing a V1 LLM engine (v0.32.0)" in log and "device_config=cpu" in log
    backend = "WeightTransferConfig(backend='fineenvs_file')" in log
    assert backend is (sync == "file_transfer")

    # The gate: at start and after each push the engine serves the trainer's weights, and each push
    # moved them (weight decay), the engine following.
    checks = _checks(out)
    assert [c["version"] for c in checks] == [0, 1, 2, 3] and all(c["ok"] for c in checks)
    assert all(c["mean_abs_diff"] < 1e-4 for c in checks), checks
    for c in checks[1:]:
        assert c["trainer_moved"] > 1e-3 and c["engine_to_previous"] > 1e-3, c

    # Every call carries the version the engine served it with, and the versions advance.
    calls = _calls(out)
    assert calls and all(c["logprobs_aligned"] for c in calls)
    versions = {c["weight_version"] for c in calls if c["weight_version"] is not None}
    assert 0 in versions and max(versions) >= 2, versions
    # A call served at version k has checkpoint step-k's logprobs, which differ from the initial ones.
    initial = Path(
        json.loads((out / "checkpoints" / "step-1" / "trainer_state.json").read_text())["model_dir"]
    )
    checked = 0
    for c in calls:
        k, spans = c["weight_version"], c["weight_versions"]
        if k not in (1, 2, 3) or not spans or len(spans) != 1:
            continue
        recorded = torch.tensor(c["logprobs"])
        served = _sampled_logprobs(out / "checkpoints" / f"step-{k}", c["prompt_ids"], c["sampled_ids"])
        before = _sampled_logprobs(initial, c["prompt_ids"], c["sampled_ids"])
        assert float((recorded - served).abs().max()) < 1e-4, (k, c["call_id"])
        assert float((recorded - before).abs().max()) > 1e-3, "the push changed nothing the engine sampled"
        checked += 1
        if checked == 2:
            break
    assert checked, "no call was served by a single pushed version"


def test_a_sigkilled_run_resumes_on_a_fresh_vllm_with_the_checkpoints_weights(tmp_path: Path) -> None:
    _needs()
    out = tmp_path / "resume"
    proc = subprocess.Popen(
        _cmd(out),
        cwd=REPO_ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = out / "checkpoints" / "step-1" / "COMPLETE"
    deadline = time.monotonic() + 900
    try:
        while not marker.exists():
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 15 minutes"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    # vLLM (its own process group) follows its dead parent within seconds.
    deadline = time.monotonic() + 60
    while run_processes(out) and time.monotonic() < deadline:
        time.sleep(1)
    assert not run_processes(out), "processes of the SIGKILLed run (vLLM's among them) are still alive"
    before = len(_checks(out))
    res = subprocess.run(_cmd(out), capture_output=True, text=True, cwd=REPO_ROOT, env=_env(), timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "Resumed from" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    # The fresh server loaded the base model; the restart pushed the checkpoint's weights and the
    # gate found them served (the base model's differ from them by far more than the gate allows).
    first = _checks(out)[before]
    assert first["ok"] and first["version"] >= 1 and first["previous_version"] is None, first
    sequences = json.loads((out / "parity" / "sequences.json").read_text())
    ckpt = out / "checkpoints" / f"step-{first['version']}"
    base = Path(json.loads((ckpt / "trainer_state.json").read_text())["model_dir"])
    ours, theirs = scorer(ckpt)(sequences), scorer(base)(sequences)
    moved = max(abs(a - b) for ra, rb in zip(ours, theirs, strict=True) for a, b in zip(ra, rb, strict=True))
    assert moved > 100 * first["mean_abs_diff"] and moved > 1e-3, (moved, first)
