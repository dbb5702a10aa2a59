"""Capability probe: can this engine produce training data? Run once against any engine URL.

Grades, best first (reference: published-system.md §4.5):

- ``tokens``: prompt and completion token IDs, one processed logprob per sampled token, and
  ``token_id:<id>`` logprob strings that pair with the token IDs. Training needs this grade.
- ``logprobs``: logprobs come back but cannot be trusted for training: no token IDs, no
  ``token_id:`` strings (vLLM without ``--return-tokens-as-token-ids``), or raw logprobs (vLLM's
  default ``--logprobs-mode raw_logprobs``). Good enough for evaluation.
- ``text``: no logprobs at all.

Raw vs processed is measured, not assumed: the gap between the two most likely first tokens at
temperature 1 and 2 (same prompt and seed). Processed logprobs are ``log_softmax(logits / T)``, so
the gap halves at T=2; raw logprobs ignore T and the gap stays. Tool calling is probed too, but
only reported: the tiny random models cannot be expected to emit a call.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum

import httpx

from fineenvs.jsonl import JsonObject

log = logging.getLogger(__name__)

_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")
_PROMPT = [{"role": "user", "content": "Count from one to ten, then say done."}]
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
FLAG_TOKEN_IDS = "--return-tokens-as-token-ids"
FLAG_PROCESSED = "--logprobs-mode processed_logprobs"
FLAG_TOOLS = "--enable-auto-tool-choice --tool-call-parser <parser>"


class Grade(StrEnum):
    text = "text"
    logprobs = "logprobs"
    tokens = "tokens"

    @property
    def rank(self) -> int:
        return ["text", "logprobs", "tokens"].index(self.value)


class EngineProbeError(RuntimeError):
    """The engine could not be probed at all (unreachable, or it rejected a plain completion)."""


class EngineGradeError(RuntimeError):
    """The engine cannot produce training data (graded below ``tokens``)."""


@dataclass
class ProbeReport:
    url: str
    model: str
    grade: Grade = Grade.text
    served_models: list[str] = field(default_factory=list)
    prompt_token_ids: bool = False
    token_ids: bool = False
    logprobs: bool = False
    token_id_strings: bool = False
    logprobs_paired: bool = False
    """Every ``token_id:<id>`` string equals the sampled token at its position, one per token."""
    logprobs_mode: str = "unknown"
    """``processed``, ``raw`` or ``unknown`` (top-2 gap too small to tell, or an odd ratio)."""
    gap_t1: float | None = None
    gap_t2: float | None = None
    tool_calling: str = "not_probed"
    """``ok``, ``no_tool_call_emitted``, ``no_tool_calling`` (the engine refuses tools) or ``error``."""
    weight_version: object = None
    max_model_len: int | None = None
    """Context limit listed by ``/v1/models`` (vLLM lists it), for the proxy's budget checks."""
    visible_reply: bool = False
    """The plain reply came back as content (or tool calls), not swallowed into a reasoning field."""
    problems: list[str] = field(default_factory=list)
    missing_flags: list[str] = field(default_factory=list)

    def downgrade(self, grade: Grade, problem: str, flag: str | None = None) -> None:
        if grade.rank < self.grade.rank:
            self.grade = grade
        self.problems.append(problem)
        if flag and flag not in self.missing_flags:
            self.missing_flags.append(flag)

    def summary(self) -> str:
        gap = (
            f"top-2 gap {self.gap_t1:.4f} at T=1, {self.gap_t2:.4f} at T=2"
            if self.gap_t1 is not None and self.gap_t2 is not None
            else "top-2 gap not measured"
        )
        text = (
            f"engine {self.url} model {self.model}: grade {self.grade.value}; logprobs {self.logprobs_mode} "
            f"({gap}); tools {self.tool_calling}; weight version {self.weight_version}"
        )
        if self.problems:
            text += "; problems: " + " | ".join(self.problems)
        return text


def _post(client: httpx.Client, url: str, body: JsonObject) -> httpx.Response:
    try:
        return client.post(url + "/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        raise EngineProbeError(f"POST {url}/v1/chat/completions failed: {exc}") from exc


def _completion(client: httpx.Client, url: str, body: JsonObject) -> JsonObject:
    response = _post(client, url, body)
    if response.status_code != 200:
        raise EngineProbeError(
            f"{url} rejected a plain chat completion ({response.status_code}): {response.text[:500]}"
        )
    result: JsonObject = response.json()
    return result


def _logprob_entries(choice: JsonObject) -> list[JsonObject]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [entry for entry in content if isinstance(entry, dict)]


def _top2_gap(result: JsonObject) -> float | None:
    entries = _logprob_entries(result["choices"][0])
    if not entries:
        return None
    tops = {t.get("token"): float(t["logprob"]) for t in entries[0].get("top_logprobs") or []}
    values = sorted(tops.values(), reverse=True)
    if len(values) < 2 or not all(math.isfinite(v) for v in values[:2]):
        return None
    return values[0] - values[1]


def _check_visible(report: ProbeReport, result: JsonObject) -> None:
    message = result["choices"][0].get("message") or {}
    reasoning = str(message.get("reasoning") or message.get("reasoning_content") or "")
    report.visible_reply = bool(message.get("content") or message.get("tool_calls")) and not reasoning
    if reasoning:
        # The published LFM runs hit this: a reasoning parser ate non-thinking replies and tool calls.
        report.problems.append(
            f"the reply went into a reasoning field ({len(reasoning)} chars): serve non-thinking models "
            "without --reasoning-parser"
        )


def _check_tokens(report: ProbeReport, result: JsonObject) -> None:
    choice = result["choices"][0]
    prompt_ids = result.get("prompt_token_ids") or choice.get("prompt_token_ids")  # SGLang: per choice
    token_ids = choice.get("token_ids")
    entries = _logprob_entries(choice)
    report.prompt_token_ids = bool(prompt_ids) and all(isinstance(t, int) for t in prompt_ids)
    report.token_ids = bool(token_ids) and all(isinstance(t, int) for t in token_ids)
    report.logprobs = bool(entries) and all(isinstance(e.get("logprob"), int | float) for e in entries)
    if not report.logprobs:
        report.downgrade(
            Grade.text,
            "no per-token logprobs (asked with logprobs=true, top_logprobs=0)",
        )
        return
    if any(float(e["logprob"]) > 1e-6 or math.isnan(float(e["logprob"])) for e in entries):
        report.downgrade(Grade.logprobs, "logprobs above 0 or NaN: these are not log-probabilities")
    strings = [_TOKEN_ID.match(str(e.get("token", ""))) for e in entries]
    report.token_id_strings = all(strings)
    if not report.token_id_strings:
        report.downgrade(
            Grade.logprobs,
            "logprob tokens are text, not token_id:<id> strings, so they cannot be paired with token IDs",
            FLAG_TOKEN_IDS,
        )
    if not (report.prompt_token_ids and report.token_ids):
        report.downgrade(
            Grade.logprobs,
            "no prompt_token_ids / choices[0].token_ids with return_token_ids=true (vLLM >= 0.10.2 has them)",
        )
        return
    if report.token_id_strings:
        ids = [int(m.group(1)) for m in strings if m]
        report.logprobs_paired = ids == list(token_ids)
        if not report.logprobs_paired:
            report.downgrade(
                Grade.logprobs,
                f"logprob tokens {ids[:8]} do not pair with token_ids {list(token_ids)[:8]} position by position",
            )


def _check_mode(report: ProbeReport, client: httpx.Client, model: str) -> None:
    base = {
        "model": model,
        "messages": _PROMPT,
        "max_tokens": 1,
        "top_p": 1.0,
        "seed": 0,
        "logprobs": True,
        # vLLM lists the sampled token first, then the n-1 most likely: with 5 the two most likely
        # are there whichever token was sampled (with 2, a sampled third token hides the second).
        "top_logprobs": 5,
    }
    report.gap_t1 = _top2_gap(_completion(client, report.url, base | {"temperature": 1.0}))
    report.gap_t2 = _top2_gap(_completion(client, report.url, base | {"temperature": 2.0}))
    if report.gap_t1 is None or report.gap_t2 is None or report.gap_t1 < 1e-3:
        report.problems.append("could not tell raw from processed logprobs (no usable top-2 gap)")
        return
    ratio = report.gap_t2 / report.gap_t1
    if abs(ratio - 0.5) < 0.05:
        report.logprobs_mode = "processed"
    elif abs(ratio - 1.0) < 0.05:
        report.logprobs_mode = "raw"
        report.downgrade(
            Grade.logprobs,
            "raw logprobs: the top-2 gap does not shrink with temperature, so they are not the sampled "
            "distribution the trainer recomputes",
            FLAG_PROCESSED,
        )
    else:
        report.problems.append(f"top-2 gap ratio {ratio:.3f} between T=2 and T=1 is neither 0.5 nor 1")


def _check_tools(report: ProbeReport, client: httpx.Client, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}],
        "tools": [_TOOL],
        "tool_choice": "auto",
        "max_tokens": 64,
        "temperature": 1.0,
        "seed": 0,
    }
    try:
        response = _post(client, report.url, body)
    except EngineProbeError as exc:
        report.tool_calling = "error"
        report.problems.append(f"tool probe failed: {exc}")
        return
    if response.status_code == 200:
        message = response.json()["choices"][0].get("message") or {}
        report.tool_calling = "ok" if message.get("tool_calls") else "no_tool_call_emitted"
        return
    report.tool_calling = "no_tool_calling" if response.status_code in (400, 422) else "error"
    report.problems.append(f"tool request rejected ({response.status_code}): {response.text[:300]}")
    if report.tool_calling == "no_tool_calling" and FLAG_TOOLS not in report.missing_flags:
        report.missing_flags.append(FLAG_TOOLS)


def probe_engine(
    url: str, model: str | None = None, *, client: httpx.Client | None = None, timeout_s: float = 120.0
) -> ProbeReport:
    """Probe ``url`` serving ``model`` (the only served model if None) and log the grade."""
    url = url.rstrip("/")
    own = client is None
    http = client or httpx.Client(timeout=timeout_s)
    try:
        try:
            listed = http.get(url + "/v1/models")
        except httpx.HTTPError as exc:
            raise EngineProbeError(f"GET {url}/v1/models failed: {exc}. Is the engine running?") from exc
        entries = listed.json().get("data", []) if listed.status_code == 200 else []
        served = [str(m["id"]) for m in entries]
        if model is None:
            if len(served) != 1:
                raise EngineProbeError(f"{url} serves {served or 'no models'}; name the model to probe.")
            model = served[0]
        report = ProbeReport(url=url, model=model, grade=Grade.tokens, served_models=served)
        if served and model not in served:
            report.problems.append(f"model {model!r} is not listed by /v1/models ({', '.join(served)})")
        limits = [m.get("max_model_len") for m in entries if m.get("id") == model]
        report.max_model_len = limits[0] if limits and isinstance(limits[0], int) else None
        main = {
            "model": model,
            "messages": _PROMPT,
            "max_tokens": 8,
            "temperature": 1.0,
            "top_p": 1.0,
            "seed": 0,
            "logprobs": True,
            "top_logprobs": 0,  # must be 0, not omitted: vLLM leaves logprobs.content empty otherwise
            "return_token_ids": True,
            "stream": False,
        }
        first = _completion(http, url, main)
        _check_tokens(report, first)
        _check_visible(report, first)
        if report.logprobs:
            _check_mode(report, http, model)
        _check_tools(report, http, model)
        try:
            info = http.get(url + "/weight_info")
            if info.status_code == 200:
                report.weight_version = info.json().get("weight_version")
        except httpx.HTTPError:
            pass  # /weight_info is a dev route on vLLM; its absence is not a capability problem
    finally:
        if own:
            http.close()
    log.info("%s", report.summary())
    return report


def require_training_grade(report: ProbeReport) -> None:
    """Raise unless the engine is graded ``tokens``, naming the vLLM flags that would fix it."""
    if report.grade is Grade.tokens:
        return
    fix = (
        f"If it is vLLM, restart it with {' and '.join(f for f in report.missing_flags if f != FLAG_TOOLS)} "
        "(the launcher adds every needed flag when fineenvs starts vLLM itself: engine=vllm without engine.url)."
        if any(f != FLAG_TOOLS for f in report.missing_flags)
        else "Use vLLM >= 0.10.2 started by fineenvs (engine=vllm) or the embedded engine (engine=transformers)."
    )
    raise EngineGradeError(
        f"Engine {report.url} ({report.model}) is graded {report.grade.value!r}; training needs 'tokens' "
        f"(exact token IDs and processed logprobs). Found: {'; '.join(report.problems)}. {fix}"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m fineenvs.engine.probe URL [--model NAME]``: print the report; exit 1 below ``tokens``."""
    import argparse
    import json
    from dataclasses import asdict

    parser = argparse.ArgumentParser(prog="python -m fineenvs.engine.probe", description=main.__doc__)
    parser.add_argument("url", help="engine base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the only one listed)")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    args = parser.parse_args(argv)
    report = probe_engine(args.url, args.model)
    print(json.dumps(asdict(report), indent=2) if args.json else report.summary())
    try:
        require_training_grade(report)
    except EngineGradeError as exc:
        print(exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
