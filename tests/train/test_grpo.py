"""CapturedGRPOTrainer on the tiny models: training, on-policy ratio, split invariance,
multi-row attempts, importance sampling, checkpoints and weight export."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fineenvs.train.batching import token_weights
from fineenvs.train.grpo import CapturedGRPOTrainer
from fineenvs.train.grpo_config import GRPOSettings
from fineenvs.train.train_rows import TrainRow
from tests.train.cpu_settings import cpu_settings

from .conftest import SampleRows

Grads = dict[str, torch.Tensor]
HYBRID = pytest.mark.slow


def grads_of(trainer: CapturedGRPOTrainer, rows: list[TrainRow]) -> tuple[float, Grads]:
    loss = trainer.loss_and_gradients(rows)["train/loss"]
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss, grads


def assert_grads_close(a: Grads, b: Grads, what: str) -> None:
    assert a.keys() == b.keys()
    scale = max(float(g.abs().max()) for g in a.values())
    assert scale > 0, "no gradient at all"
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-6 * scale), f"{what}: {name}"


def combine(parts: list[tuple[float, Grads]]) -> Grads:
    keys = parts[0][1].keys()
    return {k: sum(c * g[k] for c, g in parts) for k in keys}  # type: ignore[misc]


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("tiny_qwen")


@pytest.mark.parametrize(
    "model",
    ["tiny_qwen", pytest.param("tiny_lfm2", marks=HYBRID), pytest.param("tiny_qwen3_5", marks=HYBRID)],
)
def test_step_trains_and_reports_metrics(
    model: str, tiny_model_factory: Callable[..., Path], sampled_rows: SampleRows, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory(model)
    s = cpu_settings(learning_rate=1e-3, per_device_batch_size=2)
    trainer = CapturedGRPOTrainer(model_dir, s, tmp_path)
    rows = sampled_rows(model_dir, attempts=3, rows_per_attempt=[1, 2, 1])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    m = trainer.step(rows)
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before), f"parameters not updated: {sorted(set(before) - set(changed))}"
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
    assert m["train/rows"] == 4 and m["train/attempts"] == 3 and m["train/groups"] == 1
    assert m["train/tokens_trained"] == sum(sum(r.loss_mask) for r in rows)
    assert m["train/tokens"] == sum(len(r.input_ids) for r in rows)
    assert m["train/micro_batches"] == 2 and m["train/learning_rate"] == pytest.approx(1e-3)
    assert m["train/policy_version"] == 1 == trainer.policy_version
    assert m["train/ratio_min"] <= m["train/ratio"] <= m["train/ratio_max"]
    assert 0.0 <= m["train/clip_fraction"] <= 1.0 and m["train/tokens_per_s"] > 0
    # The update moved the policy: the same rows are now off-policy.
    assert abs(trainer.loss_and_gradients(rows)["train/ratio"] - 1.0) > 1e-4


@pytest.mark.parametrize(
    "model",
    ["tiny_qwen", pytest.param("tiny_lfm2", marks=HYBRID), pytest.param("tiny_qwen3_5", marks=HYBRID)],
)
def test_on_policy_ratio_is_one_at_step_zero(
    model: str, tiny_model_factory: Callable[..., Path], sampled_rows: SampleRows, tmp_path: Path
) -> None:
    """Rows sampled by the embedded engine's decoding loop (float32, T=0.7, KV cache) against the
    trainer's padded, batched forward at the same temperature."""
    model_dir = tiny_model_factory(model)
    rows = sampled_rows(model_dir, attempts=4, temperature=0.7, seed=3)
    trainer = CapturedGRPOTrainer(model_dir, cpu_settings(temperature=0.7, per_device_batch_size=4), tmp_path)
    m = trainer.step(rows)
    assert abs(m["train/ratio"] - 1.0) <= 1e-4, m
    assert 1 - 1e-3 <= m["train/ratio_min"] <= m["train/ratio_max"] <= 1 + 1e-3, m
    assert m["train/clip_fraction"] == 0.0
    # Negative control: a trainer at the wrong temperature sees these rows as off-policy.
    wrong = CapturedGRPOTrainer(model_dir, cpu_settings(temperature=1.0), tmp_path / "wrong")
    off = wrong.loss_and_gradients(rows)
    assert off["train/ratio_max"] - off["train/ratio_min"] > 0.05, off


@pytest.mark.parametrize("normalisation", [pytest.param("per_token", marks=pytest.mark.slow), "per_attempt"])
@pytest.mark.parametrize(
    "model",
    ["tiny_qwen", pytest.param("tiny_lfm2", marks=HYBRID), pytest.param("tiny_qwen3_5", marks=HYBRID)],
)
def test_loss_and_gradients_do_not_depend_on_the_micro_batch_split(
    model: str,
    normalisation: str,
    tiny_model_factory: Callable[..., Path],
    sampled_rows: SampleRows,
    tmp_path: Path,
) -> None:
    model_dir = tiny_model_factory(model)
    rows = sampled_rows(model_dir, attempts=4, rows_per_attempt=[1, 3, 2, 2], seed=5)
    s = cpu_settings(normalisation=normalisation, per_device_batch_size=8)
    trainer = CapturedGRPOTrainer(model_dir, s, tmp_path)
    # Make it off-policy so that clipping and ratios are part of what must match.
    rows = [
        TrainRow(
            r.input_ids,
            r.loss_mask,
            [x * 0.9 for x in r.behaviour_logprobs],
            r.advantage,
            r.attempt_id,
            r.group_id,
            0,
        )
        for r in rows
    ]
    loss_1, grads_1 = grads_of(trainer, rows)
    for mbs, n_mb in ((4, 2), (2, 4)):
        s.per_device_batch_size = mbs
        m = trainer.loss_and_gradients(rows)
        assert m["train/micro_batches"] == n_mb
        loss, grads = grads_of(trainer, rows)
        assert loss == pytest.approx(loss_1, rel=1e-5, abs=1e-7), mbs
        assert_grads_close(grads_1, grads, f"{mbs} rows per micro-batch")


def test_multi_row_attempt_trains_every_row_and_per_attempt_weighs_attempts_equally(
    qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path
) -> None:
    rows = sampled_rows(qwen_dir, attempts=2, rows_per_attempt=[1, 4], advantages=[1.0, -0.5], seed=7)
    one, four = rows[:1], rows[1:]
    assert len({r.advantage for r in four}) == 1
    s = cpu_settings(normalisation="per_token", per_device_batch_size=2)
    trainer = CapturedGRPOTrainer(qwen_dir, s, tmp_path)

    # Every row of the 4-row attempt contributes: its gradient is the token-weighted sum of its rows'.
    _, g_four = grads_of(trainer, four)
    n = [sum(r.loss_mask) for r in four]
    parts = [(n_r / sum(n), grads_of(trainer, [r])[1]) for n_r, r in zip(n, four, strict=True)]
    assert_grads_close(g_four, combine(parts), "rows of one attempt")
    _, g_three = grads_of(trainer, four[:3])
    assert any(not torch.allclose(g_three[k], g_four[k]) for k in g_four), "the 4th row changed nothing"

    _, g_one = grads_of(trainer, one)
    # per_token: the 4-row attempt weighs by its token share.
    _, g_all = grads_of(trainer, rows)
    n_one = sum(one[0].loss_mask)
    total = n_one + sum(n)
    assert_grads_close(g_all, combine([(n_one / total, g_one), (sum(n) / total, g_four)]), "per_token")
    # per_attempt: each attempt weighs one half whatever its row count.
    s.normalisation = "per_attempt"
    _, g_all = grads_of(trainer, rows)
    assert_grads_close(g_all, combine([(0.5, g_one), (0.5, g_four)]), "per_attempt")
    weights = token_weights(rows, "per_attempt")
    assert sum(weights[0]) == pytest.approx(0.5) and sum(map(sum, weights[1:])) == pytest.approx(0.5)


def test_rows_of_one_attempt_must_share_its_advantage(qwen_dir: Path, tmp_path: Path) -> None:
    trainer = CapturedGRPOTrainer(qwen_dir, cpu_settings(), tmp_path)
    a = TrainRow([5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0], 1.0, "x", "g", 0)
    b = TrainRow([5, 6, 8], [0, 1, 1], [0.0, -1.0, -1.0], 0.5, "x", "g", 0)
    with pytest.raises(ValueError, match="attempt 'x' has rows with advantages 1.0 and 0.5"):
        trainer.step([a, b])


def test_rows_from_another_tokenizer_are_refused(qwen_dir: Path, tmp_path: Path) -> None:
    trainer = CapturedGRPOTrainer(qwen_dir, cpu_settings(), tmp_path)
    row = TrainRow([5, 6, 5000], [0, 1, 1], [0.0, -1.0, -1.0], 1.0, "x", "g", 0)
    with pytest.raises(ValueError, match="token id 5000, outside the model's vocabulary of 1024"):
        trainer.step([row])


RHOS = (0.1, 0.5, 1.0, 2.0, 5.0)


def crafted_stale_rows(
    trainer: CapturedGRPOTrainer, rows: list[TrainRow]
) -> tuple[list[TrainRow], list[list[float]]]:
    """Behaviour logprobs set so that the ratio of trained token k is RHOS[k % 5]."""
    logps = trainer.token_logprobs(rows)
    out, rhos = [], []
    k = 0
    for r, lp in zip(rows, logps, strict=True):
        old, rho_row = [], []
        for x, m in zip(lp, r.loss_mask, strict=True):
            rho = RHOS[k % len(RHOS)] if m else 1.0
            if m:
                k += 1
                if x - math.log(rho) > 0:  # a logprob must stay <= 0
                    rho = 1.0
            old.append(x - math.log(rho) if m else 0.0)
            rho_row.append(rho)
        out.append(TrainRow(r.input_ids, r.loss_mask, old, r.advantage, r.attempt_id, r.group_id, 0))
        rhos.append(rho_row)
    return out, rhos


def test_tis_and_mask_change_the_loss_as_specified(
    qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path
) -> None:
    C = 3.0
    # Wide clip range: the PPO clip stays inactive, so only the importance-sampling gate acts.
    s = cpu_settings(epsilon=10.0, epsilon_high=10.0, importance_sampling_clip=C, per_device_batch_size=2)
    trainer = CapturedGRPOTrainer(qwen_dir, s, tmp_path)
    rows, rhos = crafted_stale_rows(trainer, sampled_rows(qwen_dir, attempts=3, seed=11))
    weights = token_weights(rows, "per_token")
    trained = [
        (r.advantage, rho, w)
        for r, rr, ww in zip(rows, rhos, weights, strict=True)
        for rho, w, m in zip(rr, ww, r.loss_mask, strict=True)
        if m
    ]
    assert {round(t[1], 6) for t in trained} == set(RHOS)

    def expected(gate: Callable[[float], float]) -> float:
        return sum(-rho * a * gate(rho) * w for a, rho, w in trained)

    results = {}
    for mode, gate in (
        ("none", lambda rho: 1.0),
        ("tis", lambda rho: min(rho, C) / rho),  # effective importance weight min(rho, C)
        ("mask", lambda rho: 1.0 if 1 / C <= rho <= C else 0.0),
    ):
        s.importance_sampling = mode
        m = trainer.loss_and_gradients(rows)
        assert m["train/loss"] == pytest.approx(expected(gate), rel=1e-4), mode
        results[mode] = m
    n = len(trained)
    outside = sum(1 for t in trained if not 1 / C <= t[1] <= C)
    above = sum(1 for t in trained if t[1] > C)
    assert results["mask"]["train/is_masked_fraction"] == pytest.approx(outside / n)
    assert results["tis"]["train/is_truncated_fraction"] == pytest.approx(above / n)
    assert (
        results["none"]["train/is_masked_fraction"] == 0.0 == results["none"]["train/is_truncated_fraction"]
    )
    assert len({round(r["train/loss"], 8) for r in results.values()}) == 3


def test_checkpoint_resume_continues_exactly(
    qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path
) -> None:
    batches = [sampled_rows(qwen_dir, attempts=2, seed=20 + i) for i in range(3)]
    s = cpu_settings(
        learning_rate=2e-3, lr_scheduler_type="linear", warmup_steps=1, max_steps=6, per_device_batch_size=2
    )
    a = CapturedGRPOTrainer(qwen_dir, s, tmp_path / "a")
    a.step(batches[0])
    a.step(batches[1])
    ckpt = a.save_checkpoint(tmp_path / "ckpt")
    m_a = a.step(batches[2])
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer_config.json",
        "optimizer.pt",
        "scheduler.pt",
        "trainer_state.json",
    ):
        assert (ckpt / name).is_file(), name

    b = CapturedGRPOTrainer(qwen_dir, GRPOSettings(**vars(s)), tmp_path / "b")
    b.load_checkpoint(ckpt)
    assert b.policy_version == 2 and b.global_step == 2
    m_b = b.step(batches[2])
    assert m_b["train/loss"] == pytest.approx(m_a["train/loss"], rel=1e-6, abs=1e-9)
    assert m_b["train/learning_rate"] == m_a["train/learning_rate"]
    assert m_b["train/policy_version"] == m_a["train/policy_version"] == 3
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-7), n  # optimizer moments were restored too

    # A fresh trainer without the optimizer state diverges (the test can fail).
    c = CapturedGRPOTrainer(ckpt, GRPOSettings(**vars(s)), tmp_path / "c")
    c.step(batches[2])
    assert any(
        not torch.allclose(p, q, atol=1e-7)
        for p, q in zip(a.model.parameters(), c.model.parameters(), strict=True)
    )


def test_load_checkpoint_refuses_a_plain_model_dir(qwen_dir: Path, tmp_path: Path) -> None:
    trainer = CapturedGRPOTrainer(qwen_dir, cpu_settings(), tmp_path)
    with pytest.raises(FileNotFoundError, match="not a CapturedGRPOTrainer checkpoint"):
        trainer.load_checkpoint(qwen_dir)


@pytest.mark.slow
def test_exported_weights_reload_into_the_engine_and_stay_on_policy(
    qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path
) -> None:
    """The CPU weight-sync loop: step, export safetensors, the embedded engine's generator loads
    them, samples new rows, and the next step sees them on-policy."""
    from fineenvs.engine.generation import Generator

    from .conftest import sample_rows

    pushed: list[int] = []
    s = cpu_settings(learning_rate=1e-2, per_device_batch_size=4)
    trainer = CapturedGRPOTrainer(
        qwen_dir, s, tmp_path, on_weights_updated=lambda t: pushed.append(t.policy_version)
    )
    trainer.step(sampled_rows(qwen_dir, attempts=4, seed=30))
    assert pushed == [1]
    path = trainer.export_weights(tmp_path / "push")
    # A directory: what vLLM's reload_weights(weights_path=...) and the embedded engine load.
    assert path == tmp_path / "push" and (path / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="writes a directory"):
        trainer.export_weights(tmp_path / "flat" / "v1.safetensors")
    half = trainer.export_weights(tmp_path / "half", dtype="bfloat16")
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(half / "model.safetensors")).values()} == {torch.bfloat16}

    gen = Generator(qwen_dir, dtype="float32")
    gen.load_weights(path, version=1)
    for name, p in trainer.model.state_dict().items():
        assert torch.equal(gen.model.state_dict()[name], p), name

    # Sample with the reloaded engine weights: reuse the sampler with the exported directory.
    (tmp_path / "push_model").mkdir()
    trainer.unwrapped_model.save_pretrained(tmp_path / "push_model")
    trainer.tokenizer.save_pretrained(tmp_path / "push_model")
    fresh = sample_rows(tmp_path / "push_model", attempts=4, seed=31, policy_version=1)
    m = trainer.loss_and_gradients(fresh)
    assert abs(m["train/ratio"] - 1.0) <= 1e-4 and m["train/staleness_max"] == 0
    stale = trainer.loss_and_gradients(sampled_rows(qwen_dir, attempts=4, seed=31))
    assert abs(stale["train/ratio"] - 1.0) > 1e-3 and stale["train/staleness_max"] == 1


def test_weight_sync_interval(qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path) -> None:
    calls: list[int] = []
    s = cpu_settings(weight_sync_interval=2)
    trainer = CapturedGRPOTrainer(
        qwen_dir, s, tmp_path, on_weights_updated=lambda t: calls.append(t.policy_version)
    )
    rows = sampled_rows(qwen_dir, attempts=2, seed=40)
    for _ in range(3):
        trainer.step(rows)
    assert calls == [2]


def test_over_budget_rows_are_counted_not_trained(
    qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path
) -> None:
    rows = sampled_rows(qwen_dir, attempts=3, seed=50)
    budget = sorted(len(r.input_ids) for r in rows)[1]
    trainer = CapturedGRPOTrainer(qwen_dir, cpu_settings(token_budget=budget), tmp_path)
    m = trainer.loss_and_gradients(rows)
    kept = [r for r in rows if len(r.input_ids) <= budget]
    assert m["train/rows"] == len(kept) and m["train/rows_over_budget"] == len(rows) - len(kept)
    trainer.settings.token_budget = 2
    with pytest.raises(ValueError, match="token_budget=2"):
        trainer.step(rows)


def test_settings_errors_name_the_field() -> None:
    with pytest.raises(ValueError) as err:
        cpu_settings(
            loss_type="ppo",
            normalisation="per_seq",
            importance_sampling="is",
            temperature=0.0,
            per_device_batch_size=0,
        ).check()
    text = str(err.value)
    for part in (
        "loss_type='ppo'",
        "normalisation='per_seq'",
        "importance_sampling='is'",
        "temperature=0.0",
        "per_device_batch_size must be >= 1 (got 0)",
    ):
        assert part in text
    with pytest.raises(ValueError, match="importance_sampling_clip=0.5 must be > 1"):
        cpu_settings(importance_sampling="tis", importance_sampling_clip=0.5).check()


@pytest.mark.slow
def test_kl_to_the_initial_policy(qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path) -> None:
    rows = sampled_rows(qwen_dir, attempts=3, seed=60)
    s = cpu_settings(beta=0.1, learning_rate=1e-2)
    trainer = CapturedGRPOTrainer(qwen_dir, s, tmp_path)
    plain = CapturedGRPOTrainer(qwen_dir, cpu_settings(learning_rate=1e-2), tmp_path / "plain")
    # Policy == reference at step 0: the KL term is exactly zero.
    assert trainer.loss_and_gradients(rows)["train/loss"] == pytest.approx(
        plain.loss_and_gradients(rows)["train/loss"], abs=1e-7
    )
    trainer.step(rows)
    with_kl = trainer.loss_and_gradients(rows)["train/loss"]
    s.beta = 0.0
    without = trainer.loss_and_gradients(rows)["train/loss"]
    assert with_kl > without


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_gradients(
    qwen_dir: Path, sampled_rows: SampleRows, tmp_path: Path
) -> None:
    rows = sampled_rows(qwen_dir, attempts=3, seed=70)
    _, g_plain = grads_of(CapturedGRPOTrainer(qwen_dir, cpu_settings(), tmp_path / "p"), rows)
    _, g_ckpt = grads_of(
        CapturedGRPOTrainer(qwen_dir, cpu_settings(gradient_checkpointing=True), tmp_path / "c"), rows
    )
    assert_grads_close(g_plain, g_ckpt, "gradient checkpointing")
