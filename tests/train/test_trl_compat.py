"""The TRL integration: internals present, loud failure when they move, and TRL's loss numerically
equal to the formula we rely on, for every loss type and micro-batch split."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from fineenvs.train import trl_compat
from fineenvs.train.grpo import CapturedGRPOTrainer
from fineenvs.train.grpo_config import GRPOSettings
from fineenvs.train.train_rows import TrainRow
from fineenvs.train.trl_compat import TrlInternalsMoved, check_trl_internals, importance_gate
from tests.train.cpu_settings import cpu_settings


def test_pinned_internals_are_present() -> None:
    import trl

    assert trl.__version__ == trl_compat.TRL_VERSION == "1.16.0"
    check_trl_internals()


def test_moved_attribute_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from trl.trainer.grpo_trainer import GRPOTrainer

    monkeypatch.delattr(GRPOTrainer, "_get_per_token_logps_and_entropies")
    with pytest.raises(
        TrlInternalsMoved, match=r"trl==1\.16\.0.*_get_per_token_logps_and_entropies is missing"
    ):
        check_trl_internals()


def test_changed_loss_source_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from trl.trainer.grpo_trainer import GRPOTrainer

    def _compute_loss(self: object, model: object, inputs: dict[str, object]) -> None:  # a "refactored" TRL
        return None

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", _compute_loss)
    with pytest.raises(TrlInternalsMoved, match=r"_compute_loss no longer contains"):
        check_trl_internals()


def test_other_version_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    import trl

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(TrlInternalsMoved, match=r"written against trl==1\.16\.0, installed trl==1\.17\.0"):
        check_trl_internals()


def test_importance_gate() -> None:
    log_rho = torch.log(torch.tensor([0.1, 0.5, 1.0, 2.0, 5.0]))
    assert torch.allclose(importance_gate(log_rho, "none", 3.0), torch.ones(5))
    assert torch.allclose(importance_gate(log_rho, "tis", 3.0), torch.tensor([1.0, 1.0, 1.0, 1.0, 0.6]))
    assert importance_gate(log_rho, "mask", 3.0).tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]


def stale_rows(trainer: CapturedGRPOTrainer, seed: int = 0) -> list[TrainRow]:
    """Rows whose behaviour logprobs differ from the trainer's by up to +-0.6 nats."""
    rng = random.Random(seed)
    rows = []
    for a, n in enumerate([7, 11, 5, 9]):
        ids = [rng.randrange(20, 900) for _ in range(n + 4)]
        mask = [0] * 4 + [1] * n
        mask[6] = 0  # a context token inside the completion
        # Attempt a0 has two rows (per_attempt normalisation differs from per_row).
        rows.append(TrainRow(ids, mask, [0.0] * len(ids), float(a % 3) - 1.4, f"a{a % 3}", "g", 0))
    logps = trainer.token_logprobs(rows)
    out = []
    for r, lp in zip(rows, logps, strict=True):
        old = [
            min(0.0, x + rng.uniform(-0.6, 0.6)) if m else 0.0 for x, m in zip(lp, r.loss_mask, strict=True)
        ]
        out.append(TrainRow(r.input_ids, r.loss_mask, old, r.advantage, r.attempt_id, r.group_id, 0))
    return out


def manual_loss(
    rows: list[TrainRow], logps: list[list[float]], weights: list[list[float]], s: GRPOSettings
) -> float:
    eps_hi = s.epsilon_high if s.epsilon_high is not None else s.epsilon
    total = 0.0
    for r, lp, w in zip(rows, logps, weights, strict=True):
        a = r.advantage
        trained = [t for t, m in enumerate(r.loss_mask) if m]
        seq_log_rho = sum(lp[t] - r.behaviour_logprobs[t] for t in trained) / len(trained)
        for t, m in enumerate(r.loss_mask):
            if not m:
                continue
            rho = math.exp(lp[t] - r.behaviour_logprobs[t])
            if s.importance_sampling_level == "sequence":  # GSPO
                rho = math.exp(seq_log_rho)
            if s.loss_type == "cispo":
                per = -min(rho, eps_hi) * a * lp[t]
            elif s.loss_type == "sapo":
                tau = 1.0 if a > 0 else 1.05  # TRL's sapo_temperature_pos / _neg defaults
                per = -(1 / (1 + math.exp(-tau * (rho - 1)))) * 4 / tau * a
            else:
                per = -min(rho * a, min(max(rho, 1 - s.epsilon), 1 + eps_hi) * a)
            total += w[t] * per
    return total


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return Path(tiny_model_factory("tiny_qwen"))


@pytest.mark.parametrize(
    ("loss_type", "normalisation"),
    [
        ("dapo", "per_token"),
        ("bnpo", "loss_type"),  # TRL's per-micro-batch token mean: split-dependent without our weights
        pytest.param("grpo", "loss_type", marks=pytest.mark.slow),
        pytest.param("dr_grpo", "loss_type", marks=pytest.mark.slow),
        pytest.param("luspo", "loss_type", marks=pytest.mark.slow),
        pytest.param("grpo", "per_attempt", marks=pytest.mark.slow),
        pytest.param("cispo", "per_token", marks=pytest.mark.slow),
        pytest.param("sapo", "per_row", marks=pytest.mark.slow),
        pytest.param("dapo", "gspo", marks=pytest.mark.slow),  # importance_sampling_level="sequence"
    ],
)
def test_trl_loss_equals_formula_for_every_split(
    qwen_dir: Path, tmp_path: Path, loss_type: str, normalisation: str
) -> None:
    from fineenvs.train.batching import resolve_normalisation, token_weights

    level = "sequence" if normalisation == "gspo" else "token"
    normalisation = "per_token" if normalisation == "gspo" else normalisation
    s = cpu_settings(
        loss_type=loss_type,
        normalisation=normalisation,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=32,
        importance_sampling_level=level,
    )
    trainer = CapturedGRPOTrainer(qwen_dir, s, tmp_path)
    rows = stale_rows(trainer)
    logps = trainer.token_logprobs(rows)
    weights = token_weights(rows, resolve_normalisation(normalisation, loss_type), 32)
    expected = manual_loss(rows, logps, weights, s)
    for mbs in (4, 2, 1):
        s.per_device_batch_size = mbs
        got = trainer.loss_and_gradients(rows)["train/loss"]
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6), (loss_type, normalisation, mbs)


@pytest.mark.slow
def test_vespo_runs_with_per_token_only(qwen_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vespo"):
        cpu_settings(loss_type="vespo", normalisation="per_attempt").check()
    trainer = CapturedGRPOTrainer(
        qwen_dir, cpu_settings(loss_type="vespo", per_device_batch_size=2), tmp_path
    )
    m = trainer.loss_and_gradients(stale_rows(trainer))
    assert math.isfinite(m["train/loss"]) and m["train/loss"] != 0.0
