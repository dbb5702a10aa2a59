"""Prefix-shared training (``trainer.prefix_sharing=shared``) against the padded path.

Rows come from the harness sessions the proxy recorded (``tests/trajectory/recorded``: real system
prompts and tool results in the tiny tokenizer's ids), continued into attempts with real branch
structure by the trajectory code (``benchmarks.trainer``): Claude Code re-renders its previous
reply in every prompt, so each call forks the graph and an attempt has one row per call, its
history shared by the later rows, trained (mask 1) in one row and context in the next; attempts
of a group share the prompt. The synthetic group of 8 shares a prompt, and each attempt forks
after its first turn. Prompts are cut short to keep the tests fast.

Gradient equality is measured on the whole gradient: ``|g_shared - g_padded| / |g_padded| <= 1e-5``
and no entry off by more than 1e-5 of the largest. Per tensor, the decay parameters of a Qwen3.5
linear-attention layer whose gradient is tiny (``A_log``, ``dt_bias``: norm 8e-4 against 4 for
the largest tensors) move by up to 1e-1 relative between the two summation orders in float32;
with the gated delta rule run in float64 every tensor agrees to 3e-7 (measured while building
this), so that is rounding, not another computation.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks.trainer import group_rows, load_recorded, synthetic_group
from fineenvs.train.grpo import CapturedGRPOTrainer
from fineenvs.train.prefix_tree import build_tree
from fineenvs.train.shared import layer_kinds
from fineenvs.train.train_rows import TrainRow
from tests.train.cpu_settings import cpu_settings

MODELS = ("tiny_qwen", "tiny_lfm2", "tiny_qwen3_5")
Grads = dict[str, torch.Tensor]


def recorded_rows(shared_prefix: str = "per_row", seed: int = 0) -> list[TrainRow]:
    """One step over three groups: Claude Code (2 attempts x 4 forked calls), OpenCode (with its
    title call) and Mini-SWE-Agent (2 attempts each)."""
    rows = []
    cc = load_recorded("claude_code", max_prompt_tokens=160)
    rows += group_rows(cc, attempts=2, turns=4, rerender=True, seed=seed, shared_prefix=shared_prefix,
                       reply_scale=0.25, tool_scale=0.3)  # fmt: skip
    for harness in ("opencode", "mini_swe_agent"):
        rec = load_recorded(harness, max_prompt_tokens=120)
        rows += group_rows(rec, attempts=2, turns=2, rerender=False, seed=seed + 1, shared_prefix=shared_prefix,
                           reply_scale=0.25, tool_scale=0.2)  # fmt: skip
    return rows


def group_of_8(shared_prefix: str = "per_row") -> list[TrainRow]:
    return synthetic_group(
        attempts=8, prompt_tokens=60, turn_tokens=8, tool_tokens=5, shared_prefix=shared_prefix
    )


@pytest.fixture(scope="module")
def trainers(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, CapturedGRPOTrainer]:
    """One trainer per model; tests switch ``settings.prefix_sharing`` (read at every step)."""
    out = {}
    for name in MODELS:
        out[name] = CapturedGRPOTrainer(
            tiny_model_factory(name), cpu_settings(per_device_batch_size=4), tmp_path_factory.mktemp(name)
        )
    return out


def run(trainer: CapturedGRPOTrainer, rows: list[TrainRow], path: str) -> tuple[dict[str, float], Grads]:
    trainer.settings.prefix_sharing = path
    m = trainer.loss_and_gradients(rows)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return m, grads


def assert_same_gradient(padded: Grads, shared: Grads, tol: float = 1e-5) -> None:
    assert padded.keys() == shared.keys()
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in padded.values()))
    diff = math.sqrt(sum(float(((padded[k] - shared[k]).double() ** 2).sum()) for k in padded))
    assert norm > 0, "no gradient at all"
    assert diff <= tol * norm, f"relative gradient difference {diff / norm:.2e}"
    top = max(float(g.abs().max()) for g in padded.values())
    worst = max((float((padded[k] - shared[k]).abs().max()), k) for k in padded)
    assert worst[0] <= tol * top, f"{worst[1]} off by {worst[0] / top:.2e} of the largest gradient entry"


def assert_same_metrics(padded: dict[str, float], shared: dict[str, float]) -> None:
    assert shared["train/loss"] == pytest.approx(padded["train/loss"], rel=1e-5, abs=1e-8)
    for key in ("train/ratio", "train/ratio_min", "train/ratio_max", "train/entropy"):
        assert shared[key] == pytest.approx(padded[key], rel=1e-4), key
    for key in (
        "train/clip_fraction",
        "train/tokens",
        "train/tokens_trained",
        "train/rows",
        "train/tokens_unique",
    ):
        assert shared[key] == padded[key], key


@pytest.mark.parametrize("model", MODELS)
def test_gradient_equals_padded_on_recorded_rows_and_a_group_of_8(
    model: str, trainers: dict[str, CapturedGRPOTrainer]
) -> None:
    trainer = trainers[model]
    rows = recorded_rows() + group_of_8()
    # Another attempt that produced exactly the same row: both end at one node of the tree.
    rows.append(dataclasses.replace(rows[0], attempt_id="twin", advantage=0.25))
    tree = build_tree([r.input_ids for r in rows])
    assert tree.row_tokens > 3 * tree.unique_tokens  # real sharing, or the test proves little
    claude = [r for r in rows if r.attempt_id == "claude_code-a0"]
    assert len(claude) == 4 and any(  # a token trained in one row is context in another
        a.loss_mask[i] != b.loss_mask[i] and a.input_ids[: i + 1] == b.input_ids[: i + 1]
        for a in claude for b in claude for i in range(min(len(a.input_ids), len(b.input_ids)))
    )  # fmt: skip
    m_pad, g_pad = run(trainer, rows, "padded")
    m_sh, g_sh = run(trainer, rows, "shared")
    assert_same_gradient(g_pad, g_sh)
    assert_same_metrics(m_pad, m_sh)
    assert m_pad["train/clip_fraction"] > 0  # off-policy rows: the clipped branch of the loss is tested too
    # Each shared prefix forwarded once (Qwen3.5 runs one-token continuations with a pad after them).
    assert m_sh["train/tokens_forwarded"] <= 1.01 * m_sh["train/tokens_unique"]
    assert m_pad["train/tokens_forwarded"] >= m_pad["train/tokens"] > 3 * m_sh["train/tokens_forwarded"]


@pytest.mark.parametrize("shared_prefix", ["once", "inverse_count"])
@pytest.mark.parametrize("normalisation", ["per_token", "per_attempt"])
def test_shared_prefix_policies_and_normalisations(
    shared_prefix: str, normalisation: str, trainers: dict[str, CapturedGRPOTrainer]
) -> None:
    """``once`` leaves a shared turn trained in one row and context in the others;
    ``inverse_count`` weighs it 1/k in each: per-row masks and weights on shared positions."""
    trainer = trainers["tiny_qwen"]
    trainer.settings.normalisation = normalisation
    try:
        rows = recorded_rows(shared_prefix, seed=3) + group_of_8(shared_prefix)
        if shared_prefix == "inverse_count":
            assert any(r.loss_weight is not None and 0 < min(w for w in r.loss_weight if w) < 1 for r in rows)
        m_pad, g_pad = run(trainer, rows, "padded")
        m_sh, g_sh = run(trainer, rows, "shared")
    finally:
        trainer.settings.normalisation = "per_token"
    assert_same_gradient(g_pad, g_sh)
    assert_same_metrics(m_pad, m_sh)


@pytest.mark.parametrize(
    "change",
    [
        {"loss_type": "grpo", "normalisation": "loss_type"},  # per-row mean over each sequence
        {"importance_sampling_level": "sequence"},  # GSPO: the row's mean log-ratio
        {"loss_type": "cispo"},
        # These rows' ratios lie around 1e-3..1e-2: a wide mask keeps some tokens and drops others.
        {"importance_sampling": "mask", "importance_sampling_clip": 200.0},
    ],
    ids=["grpo", "gspo", "cispo", "mask"],
)
def test_other_losses_equal_padded(
    change: dict[str, object], tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    settings = cpu_settings(**change)  # type: ignore[arg-type]
    trainer = CapturedGRPOTrainer(tiny_model_factory("tiny_qwen"), settings, tmp_path)
    rows = recorded_rows(seed=5)
    m_pad, g_pad = run(trainer, rows, "padded")
    m_sh, g_sh = run(trainer, rows, "shared")
    assert_same_gradient(g_pad, g_sh)
    assert_same_metrics(m_pad, m_sh)
    if "importance_sampling" in change:
        assert 0 < m_sh["train/is_masked_fraction"] == m_pad["train/is_masked_fraction"] < 1


@pytest.mark.parametrize("model", MODELS)
def test_token_logprobs_equal_padded(model: str, trainers: dict[str, CapturedGRPOTrainer]) -> None:
    trainer = trainers[model]
    rows = recorded_rows(seed=7)[:6] + group_of_8()[:3]
    trainer.settings.prefix_sharing = "padded"
    padded = trainer.token_logprobs(rows)
    trainer.settings.prefix_sharing = "shared"
    shared = trainer.token_logprobs(rows)
    for r, a, b in zip(rows, padded, shared, strict=True):
        assert len(a) == len(b) == len(r.input_ids) and a[0] == b[0] == 0.0
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 2e-5
        assert all(x < 0 for x in b[1:])  # every token scored, prompt included


def engine_group(model_dir: Path, temperature: float, seed: int) -> list[TrainRow]:
    """8 attempts sampled by the embedded engine at one shared prompt; attempt a's second turn is
    sampled twice (both kept: a fork after a trained turn), so on-policy rows share trained tokens."""
    from fineenvs.engine.generation import SamplingParams

    from .conftest import _generator

    gen: object = _generator(model_dir)
    rng = random.Random(seed)
    prompt = [rng.randrange(20, 900) for _ in range(24)]
    rows = []

    def sample(ids: list[int], n: int) -> tuple[list[int], list[float]]:
        params = SamplingParams(max_tokens=n, temperature=temperature, logprobs=True, ignore_eos=True,
                                seed=rng.randrange(1 << 30))  # fmt: skip
        res = gen.generate(ids, params)  # type: ignore[attr-defined]
        return list(res.token_ids), list(res.logprobs)

    for a in range(8):
        turn, lps = sample(prompt, 6)
        tool = [rng.randrange(20, 900) for _ in range(4)]
        head = prompt + turn + tool
        head_mask = [0] * len(prompt) + [1] * len(turn) + [0] * len(tool)
        head_lps = [0.0] * len(prompt) + lps + [0.0] * len(tool)
        for _ in range(2 if a % 2 == 0 else 1):
            second, lps2 = sample(head, 5)
            rows.append(TrainRow(head + second, head_mask + [1] * len(second), head_lps + lps2,
                                 a - 3.5, f"a{a}", "g", 0))  # fmt: skip
    return rows


@pytest.mark.parametrize("model", MODELS)
def test_on_policy_ratio_is_one_on_the_shared_path(
    model: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory(model)
    rows = engine_group(model_dir, temperature=0.7, seed=11)
    tree = build_tree([r.input_ids for r in rows])
    assert tree.row_tokens > 2 * tree.unique_tokens
    settings = cpu_settings(temperature=0.7, prefix_sharing="shared")
    m = CapturedGRPOTrainer(model_dir, settings, tmp_path).loss_and_gradients(rows)
    assert abs(m["train/ratio"] - 1.0) <= 1e-4, m
    assert 1 - 1e-3 <= m["train/ratio_min"] <= m["train/ratio_max"] <= 1 + 1e-3, m
    assert m["train/clip_fraction"] == 0.0


@pytest.mark.parametrize("model", ["tiny_qwen", "tiny_lfm2"])
def test_gradient_checkpointing_and_kl_on_the_shared_path(
    model: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Checkpointed decoder layers keep the branch cache (it is replay-safe), and the KL term's
    reference logprobs come from the same tree."""
    rows = recorded_rows(seed=9)
    model_dir = tiny_model_factory(model)
    settings = cpu_settings(gradient_checkpointing=True, beta=0.1, learning_rate=1e-2)
    trainer = CapturedGRPOTrainer(model_dir, settings, tmp_path)
    trainer.step(rows)  # move the policy away from the reference, so the KL term is not zero
    m_pad, g_pad = run(trainer, rows, "padded")
    m_sh, g_sh = run(trainer, rows, "shared")
    assert_same_gradient(g_pad, g_sh)
    assert_same_metrics(m_pad, m_sh)
    trainer.settings.beta = 0.0
    m_nokl, _ = run(trainer, rows, "shared")
    assert m_sh["train/loss"] - m_nokl["train/loss"] > 1e-6


def test_prefix_sharing_setting_is_checked() -> None:
    with pytest.raises(ValueError, match=r"prefix_sharing='tree' is not one of \('shared', 'padded'\)"):
        cpu_settings(prefix_sharing="tree").check()


def test_layer_types_without_a_branch_cache_are_refused() -> None:
    from transformers import Qwen3Config

    config = Qwen3Config(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8
    )
    with pytest.raises(
        ValueError, match=r"layer types \['sliding_attention'\].*trainer.prefix_sharing=padded"
    ):
        layer_kinds(config)


def test_recipes_train_on_the_shared_path_and_bad_values_name_the_choices() -> None:
    from hydra import compose, initialize_config_dir

    from fineenvs.config import ConfigError, to_run_config
    from fineenvs.paths import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for experiment in ("smoke", "mini_repro"):
            run = to_run_config(compose(config_name="config", overrides=[f"+experiment={experiment}"]))
            assert run.trainer.prefix_sharing == "shared", experiment
        run = to_run_config(
            compose(config_name="config", overrides=["+experiment=smoke", "trainer.prefix_sharing=padded"])
        )
        assert run.trainer.prefix_sharing == "padded"
        bad = compose(config_name="config", overrides=["+experiment=smoke", "trainer.prefix_sharing=tree"])
    with pytest.raises(ConfigError) as err:
        to_run_config(bad)  # validates: the error comes at compose time, before anything starts
    assert "trainer.prefix_sharing='tree' is not one of ('shared', 'padded')" in str(err.value)
