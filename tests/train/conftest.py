"""Fixtures for the trainer tests: on-policy rows sampled by the embedded engine's decoding loop.

``sampled_rows`` builds multi-turn rows the way the capture proxy does: a prompt (mask 0), a
sampled turn (mask 1, the engine's processed logprobs), a tool result (mask 0), a second sampled
turn. Sampling uses ``fineenvs.engine.generation.Generator`` (KV-cached decoding, the logprob of
each token taken from the distribution it was drawn from), so the rows are on-policy for the
weights in ``model_dir`` at ``temperature``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from fineenvs.train.train_rows import TrainRow

SampleRows = Callable[..., list[TrainRow]]
_GENERATORS: dict[tuple[Path, int], object] = {}


def _generator(model_dir: Path) -> object:
    """One engine generator per model directory (loading is the slow part; sampling is seeded
    per call, so sharing it keeps rows deterministic)."""
    from fineenvs.engine.generation import Generator

    path = Path(model_dir).resolve()
    # Keyed by the weights' mtime too: a tiny model rebuilt mid-session must not be sampled stale.
    key = (path, (path / "model.safetensors").stat().st_mtime_ns)
    if key not in _GENERATORS:
        _GENERATORS[key] = Generator(path, dtype="float32")
    return _GENERATORS[key]


def sample_rows(
    model_dir: Path,
    *,
    attempts: int = 4,
    rows_per_attempt: int | list[int] = 1,
    temperature: float = 1.0,
    turn_tokens: int = 6,
    seed: int = 0,
    advantages: list[float] | None = None,
    policy_version: int = 0,
) -> list[TrainRow]:
    from fineenvs.engine.generation import Generator, SamplingParams

    gen = _generator(model_dir)
    assert isinstance(gen, Generator)
    rng = random.Random(seed)
    counts = rows_per_attempt if isinstance(rows_per_attempt, list) else [rows_per_attempt] * attempts
    out: list[TrainRow] = []
    for a, n_rows in enumerate(counts):
        adv = advantages[a] if advantages is not None else (a - (len(counts) - 1) / 2)
        for _ in range(n_rows):
            ids: list[int] = [rng.randrange(20, 900) for _ in range(5 + rng.randrange(4))]
            mask = [0] * len(ids)
            lps = [0.0] * len(ids)
            for turn in range(2):
                params = SamplingParams(
                    max_tokens=turn_tokens + rng.randrange(3),
                    temperature=temperature,
                    logprobs=True,
                    ignore_eos=True,
                    seed=rng.randrange(1 << 30),
                )
                res = gen.generate(ids, params)
                ids += res.token_ids
                mask += [1] * len(res.token_ids)
                lps += res.logprobs
                if turn == 0:  # a tool result between the two turns: context, not trained
                    tool = [rng.randrange(20, 900) for _ in range(3 + rng.randrange(3))]
                    ids += tool
                    mask += [0] * len(tool)
                    lps += [0.0] * len(tool)
            out.append(
                TrainRow(
                    input_ids=ids,
                    loss_mask=mask,
                    behaviour_logprobs=lps,
                    advantage=float(adv),
                    attempt_id=f"a{a}",
                    group_id="g0",
                    policy_version=policy_version,
                )
            )
    return out


@pytest.fixture(scope="session")
def sampled_rows() -> SampleRows:
    return sample_rows
