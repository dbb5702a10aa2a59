"""Gemini ``generateContent`` (``POST /v1beta/models/{model}:generateContent``,
``:streamGenerateContent?alt=sse``, the same under ``/v1/models/...``): gemini-cli (its only option),
opencode, pi, qwen-code.

What is covered:
- ``contents`` (roles user / model / function), ``systemInstruction`` (Content or string); parts
  ``text``, ``thought: true`` text (-> ``reasoning_content``), ``inlineData`` / ``fileData`` images,
  ``functionCall`` (with or without ``id``) -> ``tool_calls``, ``functionResponse`` -> ``role: tool``
  messages (``response.output`` / ``response.content`` strings unwrapped, ``response.error`` ->
  ``[Tool Error] ``, other objects JSON-encoded); ``thoughtSignature`` ignored unless it is ours
  (then it carries the reasoning text back, for clients that drop thought parts);
- call ids: Gemini history often has none, so canonical ids derive from position
  (``call_<content index>_<call index>``): the same history gives the same canonical messages every
  turn; responses pair with calls by ``id`` when present, else by name in order;
- ``tools[].functionDeclarations`` with ``parametersJsonSchema`` or OpenAPI-style ``parameters``
  (upper-case types lowered); ``googleSearch`` / ``codeExecution`` / ``urlContext`` dropped with a
  note; ``toolConfig.functionCallingConfig`` AUTO / ANY (-> required or the one allowed function) /
  NONE; ``generationConfig`` temperature, topP, topK, maxOutputTokens, stopSequences, seed,
  penalties, JSON output (``responseMimeType`` + ``responseJsonSchema`` / ``responseSchema``),
  ``candidateCount`` > 1 refused; camelCase and snake_case keys;
- replies: thought part (only with ``thinkingConfig.includeThoughts``), text part, ``functionCall`` parts (with position-derived ids), a synthetic
  ``thoughtSignature`` (base64 of ``fe:`` + reasoning), ``usageMetadata`` without nulls; streams as
  ``data:`` chunks (``alt=sse``) or as one JSON array (no ``alt``), finishReason on the last chunk.

What is not covered: ``cachedContent`` (refused), video/audio/PDF parts (refused),
``executableCode`` / ``codeExecutionResult`` parts (dropped with a note), safety settings (ignored).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator

from fineenvs.api_formats import ApiFormat
from fineenvs.dialects import canonical
from fineenvs.dialects._common import (
    INT64_MAX,
    RANGES,
    SIG_PREFIX,
    Range,
    as_dict,
    as_str,
    check_n,
    fail,
    nonempty_list,
    optional_int,
    optional_number,
    require_dict,
    require_list,
    require_objects,
    require_str,
    stable_id,
    string_list,
    unsupported,
)
from fineenvs.dialects.base import JSON, CanonicalRequest
from fineenvs.dialects.reply import DialectBase, Reply, read_completion, sse_data

FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP", "content_filter": "SAFETY"}
STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_MODEL_IN_PATH = re.compile(r"/models/([^/:]+):", re.IGNORECASE)

# Gemini's documented ranges where they differ from the chat fields' (topK is a count >= 1).
_GEMINI_RANGES = {"topK": Range(1, INT64_MAX, True, "it keeps the k most likely tokens")}


def _get(d: JSON, camel: str) -> object:
    """A field by its camelCase name or its snake_case twin (REST takes both)."""
    if camel in d:
        return d[camel]
    return d.get(re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower())


def _lower_types(schema: object) -> object:
    """OpenAPI-style Gemini schemas use upper-case type names; JSON Schema wants lower case."""
    if isinstance(schema, dict):
        return {
            k: (v.lower() if k == "type" and isinstance(v, str) else _lower_types(v))
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_lower_types(v) for v in schema]
    return schema


def signature_for(reasoning: str) -> str:
    """A ``thoughtSignature`` (base64 bytes, as the API sends) that carries the reasoning back to us."""
    return base64.b64encode((SIG_PREFIX + reasoning).encode()).decode()


def reasoning_from_signature(sig: object) -> str | None:
    if not isinstance(sig, str):
        return None
    try:
        raw = base64.b64decode(sig, validate=True).decode()
    except ValueError:
        return None
    return raw[len(SIG_PREFIX) :] if raw.startswith(SIG_PREFIX) else None


def _media(part: JSON, where: str) -> JSON:
    inline = _get(part, "inlineData")
    if isinstance(inline, dict):
        mime = require_str(_get(inline, "mimeType"), f"{where}.inlineData.mimeType")
        url = f"data:{mime};base64,{require_str(inline.get('data'), f'{where}.inlineData.data')}"
    else:
        data = require_dict(_get(part, "fileData"), f"{where}.fileData")
        mime = as_str(_get(data, "mimeType"), "image/*")
        url = require_str(_get(data, "fileUri"), f"{where}.fileData.fileUri")
    if not mime.startswith("image/"):
        raise fail(
            f"{where} has media of type {mime!r}",
            "the engine takes text and images only",
            "Send the content as text (or an image).",
            param=where,
        )
    return canonical.image_part(url)


def _tool_text(response: object) -> str:
    if isinstance(response, dict):
        # Unwrap the one text field (opencode adds the tool's name beside it); keep anything richer.
        for key in ("output", "content", "result"):
            if isinstance(response.get(key), str) and set(response) - {"name"} == {key}:
                return str(response[key])
        if "error" in response and len(response) == 1:
            err = response["error"]
            return "[Tool Error] " + (err if isinstance(err, str) else json.dumps(err, ensure_ascii=False))
    return response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)


class _History:
    def __init__(self, notes: list[str]) -> None:
        self.notes = notes
        self.messages: list[JSON] = []
        self.open_calls: list[tuple[str, str, str | None]] = []  # (canonical id, name, client id)

    def model_turn(self, parts: list[object], c: int) -> None:
        texts: list[str] = []
        thoughts: list[str] = []
        signed: str | None = None
        calls: list[JSON] = []
        self.open_calls = []
        for _, where, part in require_objects(parts, f"contents[{c}].parts"):
            signed = signed or reasoning_from_signature(_get(part, "thoughtSignature"))
            fc = _get(part, "functionCall")
            if isinstance(part.get("text"), str):
                (thoughts if part.get("thought") is True else texts).append(part["text"])
            elif isinstance(fc, dict):
                name = require_str(fc.get("name"), f"{where}.functionCall.name")
                cid = f"call_{c}_{len(calls)}"
                calls.append(canonical.tool_call(cid, name, canonical.dumps_args(fc.get("args"))))
                self.open_calls.append((cid, name, fc.get("id") if isinstance(fc.get("id"), str) else None))
            elif _get(part, "executableCode") is not None or _get(part, "codeExecutionResult") is not None:
                self.notes.append(
                    f"{where} code-execution part dropped: server-side tools do not run on the engine"
                )
            elif _get(part, "thoughtSignature") is None:
                raise fail(
                    f"{where} has no text or functionCall",
                    "model turns carry text, thoughts and calls",
                    "Send text or functionCall parts.",
                    param=where,
                )
        msg: JSON = {
            "role": "assistant",
            "content": canonical.join_text(texts) if texts or not calls else None,
        }
        reasoning = canonical.join_text(thoughts) if thoughts else signed
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        self.messages.append(msg)

    def user_turn(self, parts: list[object], c: int) -> None:
        content: list[JSON] = []
        for p, where, part in require_objects(parts, f"contents[{c}].parts"):
            fr = _get(part, "functionResponse")
            if isinstance(part.get("text"), str):
                content.append(canonical.text_part(part["text"]))
            elif isinstance(fr, dict):
                name = require_str(fr.get("name"), f"{where}.functionResponse.name")
                cid = self._pair(fr.get("id"), name, c, p)
                self.messages.append(
                    {"role": "tool", "tool_call_id": cid, "content": _tool_text(fr.get("response"))}
                )
            elif _get(part, "inlineData") is not None or _get(part, "fileData") is not None:
                content.append(_media(part, where))
            else:
                raise fail(
                    f"{where} has no text, functionResponse or image",
                    "user turns carry those parts",
                    "Send text, inlineData images or functionResponse parts.",
                    param=where,
                )
        if content:
            self.messages.append({"role": "user", "content": canonical.text_or_parts(content)})

    def _pair(self, client_id: object, name: str, c: int, p: int) -> str:
        for k, (cid, _name, cl_id) in enumerate(self.open_calls):
            if isinstance(client_id, str) and client_id and client_id in (cl_id, cid):
                return self.open_calls.pop(k)[0]
        for k, (_cid, call_name, _) in enumerate(self.open_calls):
            if call_name == name:
                return self.open_calls.pop(k)[0]
        self.notes.append(f"contents[{c}].parts[{p}] functionResponse {name!r} matches no open functionCall")
        return f"call_{c}_r{p}"


def _tools(raw: object, notes: list[str]) -> list[JSON]:
    tools: list[JSON] = []
    if raw is None:
        return tools
    for k, _, tool in require_objects(raw, "tools"):
        decls = _get(tool, "functionDeclarations")
        if decls is None:
            notes.append(
                f"tools[{k}] ({', '.join(sorted(tool)) or 'empty'}) dropped: server-side tools do not "
                "run on the engine"
            )
            continue
        for _, where, decl in require_objects(decls, f"tools[{k}].functionDeclarations"):
            name = require_str(decl.get("name"), f"{where}.name")
            schema = _get(decl, "parametersJsonSchema")
            if schema is None and _get(decl, "parameters") is not None:
                schema = _lower_types(_get(decl, "parameters"))
            tools.append(canonical.function_tool(name, decl.get("description"), schema))
    return tools


def _tool_choice(config: JSON) -> object:
    fcc = as_dict(_get(config, "functionCallingConfig"))
    mode = as_str(fcc.get("mode"), "AUTO").upper()
    allowed = _get(fcc, "allowedFunctionNames")
    if mode == "ANY":
        if isinstance(allowed, list) and len(allowed) == 1 and isinstance(allowed[0], str):
            return {"type": "function", "function": {"name": allowed[0]}}
        return "required"
    return "none" if mode == "NONE" else "auto"


# generationConfig's sampling fields and their chat names.
SAMPLING = (
    ("temperature", "temperature"),
    ("topP", "top_p"),
    ("topK", "top_k"),
    ("seed", "seed"),
    ("presencePenalty", "presence_penalty"),
    ("frequencyPenalty", "frequency_penalty"),
)


def _system(raw: object) -> JSON | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return {"role": "system", "content": raw}
    parts = require_objects(require_dict(raw, "systemInstruction").get("parts"), "systemInstruction.parts")
    return {"role": "system", "content": canonical.join_text([as_str(x.get("text")) for _, _, x in parts])}


def _messages(body: JSON, notes: list[str]) -> tuple[list[JSON], int]:
    """The canonical messages, and how many contents the history has (the reply's position)."""
    history = _History(notes)
    system = _system(_get(body, "systemInstruction"))
    if system is not None:
        history.messages.append(system)
    contents = nonempty_list(
        body.get("contents"), "contents", "a model call needs at least one user turn", "Send a user content."
    )
    for c, raw in enumerate(contents):
        content = require_dict(raw, f"contents[{c}]")
        role = content.get("role", "user")
        parts = require_list(content.get("parts"), f"contents[{c}].parts")
        if role == "model":
            history.model_turn(parts, c)
        elif role in ("user", "function", "tool"):
            history.user_turn(parts, c)
        else:
            raise unsupported(
                f"contents[{c}]",
                role,
                "Gemini roles are user and model",
                "Use role user or model.",
                field="role",
            )
    return canonical.normalise_messages(history.messages, notes), len(contents)


def _generation(gen: JSON) -> JSON:
    """The chat fields ``generationConfig`` sets: sampling, the token limit, stops, JSON output."""
    check_n(_get(gen, "candidateCount"), "generationConfig.candidateCount")
    out: JSON = {}
    for src, dst in SAMPLING:
        value = _get(gen, src)
        if value is not None:
            rule = _GEMINI_RANGES.get(src) or RANGES[dst]
            out[dst] = optional_number({src: value}, src, f"generationConfig.{src}", rule)
    max_tokens = optional_int({"m": _get(gen, "maxOutputTokens")}, "m", "generationConfig.maxOutputTokens")
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    stops = _get(gen, "stopSequences")
    if stops is not None:
        out["stop"] = string_list(stops, "generationConfig.stopSequences")
    schema = _get(gen, "responseJsonSchema") or _get(gen, "responseSchema")
    if _get(gen, "responseMimeType") == "application/json":
        out["response_format"] = (
            canonical.json_schema_format("output", _lower_types(schema))
            if isinstance(schema, dict)
            else {"type": "json_object"}
        )
    return out


class Gemini(DialectBase):
    name = ApiFormat.gemini.value
    samples_field = None  # generationConfig.candidateCount
    error_names = STATUS
    server_error_name = "INTERNAL"
    client_error_name = "INVALID_ARGUMENT"

    def convert(self, body: JSON, notes: list[str], path: str, query: dict[str, str]) -> CanonicalRequest:
        if _get(body, "cachedContent"):
            raise fail(
                "cachedContent is not supported",
                "the proxy keeps no server-side caches",
                "Send the full contents instead.",
                param="cachedContent",
            )
        messages, next_content = _messages(body, notes)
        gen = as_dict(_get(body, "generationConfig"))
        out: JSON = {"messages": messages, **_generation(gen)}
        if _get(body, "toolConfig") is not None:
            out["tool_choice"] = _tool_choice(require_dict(_get(body, "toolConfig"), "toolConfig"))
        canonical.finish_tools(out, _tools(body.get("tools"), notes), notes)
        stream = "streamgeneratecontent" in path.lower() or query.get("alt") == "sse"
        match = _MODEL_IN_PATH.search(path)
        thinking = as_dict(_get(gen, "thinkingConfig"))
        return CanonicalRequest(
            body=out,
            stream=stream,
            model=match.group(1) if match else None,
            notes=notes,
            state={
                "sse": query.get("alt") == "sse" or not stream,
                "next_content": next_content,
                "include_thoughts": _get(thinking, "includeThoughts") is True,
            },
        )

    def _parts(self, completion: JSON, request: CanonicalRequest) -> tuple[Reply, list[list[JSON]]]:
        reply = read_completion(completion)
        c = request.state.get("next_content", 0)
        groups: list[list[JSON]] = []
        if reply.reasoning and request.state.get("include_thoughts"):
            # Like Gemini, thought parts only when asked; the signature below carries them anyway.
            groups.append([{"text": reply.reasoning, "thought": True}])
        if reply.content:
            groups.append([{"text": reply.content}])
        if reply.tool_calls:
            groups.append(
                [
                    {
                        "functionCall": {
                            "id": f"call_{c}_{k}",
                            "name": call.name,
                            "args": canonical.loads_args(call.arguments),
                        }
                    }
                    for k, call in enumerate(reply.tool_calls)
                ]
            )
        if not groups or groups[-1][0].get("thought"):
            groups.append([{"text": reply.content}])
        if reply.reasoning:
            # Gemini puts the signature on the first call (or the answer); ours carries the thought.
            target = (
                groups[-1][0] if reply.tool_calls else next(g[0] for g in groups if not g[0].get("thought"))
            )
            target["thoughtSignature"] = signature_for(reply.reasoning)
        return reply, groups

    def _chunk(self, reply: Reply, parts: list[JSON], model: str, last: bool) -> JSON:
        candidate: JSON = {"content": {"role": "model", "parts": parts}, "index": 0}
        out: JSON = {"candidates": [candidate], "modelVersion": model, "responseId": stable_id("", reply.id)}
        if last:
            candidate["finishReason"] = FINISH.get(reply.finish_reason, "STOP")
            u = reply.usage
            out["usageMetadata"] = {
                "promptTokenCount": u.prompt,
                "candidatesTokenCount": u.completion - u.reasoning,
                "thoughtsTokenCount": u.reasoning,
                "cachedContentTokenCount": u.cached,
                "totalTokenCount": u.total,
            }
        return out

    def from_chat_completion(self, completion: JSON, request: CanonicalRequest, *, model: str) -> JSON:
        reply, groups = self._parts(completion, request)
        return self._chunk(reply, [p for g in groups for p in g], model, last=True)

    def stream_events(self, completion: JSON, request: CanonicalRequest, *, model: str) -> Iterator[bytes]:
        reply, groups = self._parts(completion, request)
        chunks = [self._chunk(reply, g, model, last=i == len(groups) - 1) for i, g in enumerate(groups)]
        if request.state.get("sse", True):
            for chunk in chunks:
                yield sse_data(chunk, end=b"\r\n\r\n")
            return
        # streamGenerateContent without alt=sse answers one JSON array, element by element.
        for i, chunk in enumerate(chunks):
            yield (b"[" if i == 0 else b",\r\n") + json.dumps(chunk, ensure_ascii=False).encode()
        yield b"]"

    def error_object(self, status: int, message: str, kind: str) -> JSON:
        return {"error": {"code": status, "message": message, "status": kind}}


DIALECT = Gemini()
