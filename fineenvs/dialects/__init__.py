"""The four agent-facing API formats, format detection and the auxiliary routes.

What is covered: ``DIALECTS`` (one converter per format), ``detect`` (path, then the
``anthropic-version`` header, then the body), ``aux_route`` / ``aux_response`` for the routes the
proxy answers itself and never records (token counting, model listings, hermes' probes, claude's
``HEAD /``). What is not covered: HTTP itself (``fineenvs.proxy``), the Responses WebSocket
transport (codex falls back to HTTP), Gemini's other methods (``embedContent``, caching).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from fineenvs.api_formats import ApiFormat
from fineenvs.dialects import anthropic_messages, gemini, openai_chat, openai_responses
from fineenvs.dialects.base import JSON, CanonicalRequest, Dialect, DialectError
from fineenvs.dialects.reply import stop_completion

__all__ = [
    "DIALECTS",
    "CanonicalRequest",
    "Dialect",
    "DialectError",
    "aux_response",
    "aux_route",
    "detect",
    "stop_completion",
]

DIALECTS: dict[str, Dialect] = {
    ApiFormat.openai_chat.value: openai_chat.DIALECT,
    ApiFormat.openai_responses.value: openai_responses.DIALECT,
    ApiFormat.anthropic_messages.value: anthropic_messages.DIALECT,
    ApiFormat.gemini.value: gemini.DIALECT,
}

_GEMINI_PATH = re.compile(r"/v1(?:beta\d*|alpha)?/models/[^/]+:(?:stream)?generatecontent$", re.IGNORECASE)


def _bare(path: str) -> str:
    return path.split("?", 1)[0].rstrip("/")


def detect(path: str, headers: Mapping[str, str], body: JSON | None) -> str:
    """The format of one model call: path first, then the header, then the body; chat by default.

    ``path`` may carry a session prefix (``/s/<key>/v1/...``) and a query string.
    """
    bare = _bare(path)
    if bare.endswith("/v1/chat/completions") or bare.endswith("/chat/completions"):
        return ApiFormat.openai_chat.value
    if bare.endswith("/v1/responses") or bare.endswith("/responses"):
        return ApiFormat.openai_responses.value
    if bare.endswith("/v1/messages") or bare.endswith("/messages"):
        return ApiFormat.anthropic_messages.value
    if _GEMINI_PATH.search(bare) or "generatecontent" in bare.lower():
        return ApiFormat.gemini.value
    if any(k.lower() == "anthropic-version" for k in headers):
        return ApiFormat.anthropic_messages.value
    if isinstance(body, dict):
        if "contents" in body:
            return ApiFormat.gemini.value
        if "input" in body:
            return ApiFormat.openai_responses.value
    return ApiFormat.openai_chat.value


_AUX = (
    ("POST", re.compile(r"/v1/messages/count_tokens$"), "anthropic_count_tokens"),
    ("POST", re.compile(r"/models/[^/]+:counttokens$", re.IGNORECASE), "gemini_count_tokens"),
    ("GET", re.compile(r"/api/v1/models$"), "lmstudio_models"),
    ("POST", re.compile(r"/api/show$"), "ollama_show"),
    ("GET", re.compile(r"/v1(?:beta\d*|alpha)/models$"), "gemini_models"),
    ("GET", re.compile(r"/v1(?:beta\d*|alpha)/models/[^/:]+$"), "gemini_model"),
    ("GET", re.compile(r"/v1/models$"), "models"),
    ("GET", re.compile(r"/v1/models/[^/:]+$"), "model"),
)


def aux_route(path: str, method: str) -> str | None:
    """The kind of auxiliary route ``method path`` is (answered by the proxy, never recorded), or None."""
    method = method.upper()
    bare = _bare(path)
    if method == "HEAD" and (bare == "" or re.fullmatch(r"/s/[^/]+", bare)):
        return "head_root"
    for want, pattern, kind in _AUX:
        if (method == want or (want == "GET" and method == "HEAD")) and pattern.search(bare):
            return kind
    return None


def estimate_tokens(body: object) -> int:
    """~4 characters per token over the JSON text (the proxy has no tokenizer); at least 1."""
    return max(1, len(json.dumps(body, ensure_ascii=False)) // 4)


def aux_response(kind: str, body: JSON | None, model: str, *, context_length: int = 131072) -> JSON:
    """The body that answers an auxiliary route of ``kind`` (see ``aux_route``)."""
    if kind == "anthropic_count_tokens":
        return {"input_tokens": estimate_tokens(body or {})}
    if kind == "gemini_count_tokens":
        return {"totalTokens": estimate_tokens(body or {}), "cachedContentTokenCount": 0}
    if kind in ("models", "lmstudio_models"):
        # One listing that reads as OpenAI's, Anthropic's and LM Studio's shape at once.
        entry = _model_entry(model, context_length)
        return {"object": "list", "data": [entry], "has_more": False, "first_id": model, "last_id": model}
    if kind == "model":
        return _model_entry(model, context_length)
    if kind == "gemini_models":
        return {"models": [_gemini_model(model, context_length)]}
    if kind == "gemini_model":
        return _gemini_model(model, context_length)
    if kind == "ollama_show":
        return {
            "model_info": {"general.architecture": "fineenvs", "fineenvs.context_length": context_length},
            "details": {"format": "fineenvs"},
            "parameters": f"num_ctx {context_length}",
            "capabilities": ["tools"],
        }
    if kind == "head_root":
        return {}
    raise ValueError(
        f"unknown auxiliary route kind {kind!r}; known: anthropic_count_tokens, gemini_count_tokens, "
        "models, model, lmstudio_models, gemini_models, gemini_model, ollama_show, head_root"
    )


def _model_entry(model: str, context_length: int) -> JSON:
    return {
        "id": model,
        "object": "model",
        "type": "model",
        "created": 0,
        "created_at": "1970-01-01T00:00:00Z",
        "owned_by": "fineenvs",
        "display_name": model,
        "lifecycle": "active",
        "max_input_tokens": context_length,
        "max_context_length": context_length,
        "context_length": context_length,
    }


def _gemini_model(model: str, context_length: int) -> JSON:
    return {
        "name": f"models/{model}",
        "displayName": model,
        "inputTokenLimit": context_length,
        "outputTokenLimit": context_length,
        "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"],
    }
