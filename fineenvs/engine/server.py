"""The embedded engine: a Starlette app with the subset of vLLM's OpenAI API fineenvs needs.

Request and response shapes follow vLLM 0.33 started with ``--return-tokens-as-token-ids
--logprobs-mode processed_logprobs``, so the proxy and trainer cannot tell the two apart:
``prompt_token_ids`` at the top level, ``choices[0].token_ids``, logprob entries whose token is
``token_id:<id>``, vLLM's error body ``{"error": {"message", "type", "param", "code"}}``.

One worker thread runs the model. Requests wait in a bounded queue (503 when full); the
requests waiting when the worker frees up run together as one left-padded batch (up to
``max_batch_size``, each row with its own sampling params and RNG). A weight update queues
behind the requests already admitted, so it drains them, and every completion is produced by
exactly one weight version, reported as ``weight_version``. Batches are formed per wave, not
continuously: a request arriving mid-batch waits for the batch to finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fineenvs.engine.generation import DEFAULT_PREFIX_CACHE_BYTES, GenerationResult, Generator, SamplingParams
from fineenvs.engine.router import REPLICA_HEADER
from fineenvs.engine.toolcalls import TOOL_CALL_FORMATS, ToolCallFormat, parse_tool_calls
from fineenvs.jsonl import JsonObject

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs


def error(
    message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    """vLLM's error body."""
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}}, status_code=status
    )


class ChatRequest(BaseModel):
    """The fields of vLLM's ChatCompletionRequest that the engine honours; others are ignored."""

    model_config = ConfigDict(extra="ignore")

    messages: list[JsonObject] = Field(min_length=1)
    model: str | None = None
    tools: list[JsonObject] | None = None
    tool_choice: str | JsonObject | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    return_token_ids: bool = False
    return_weight_versions: bool = False
    n: int = 1
    stream: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    skip_special_tokens: bool = True
    chat_template_kwargs: JsonObject | None = None
    forced_completion_prefix: str | None = None  # test hook, honoured only when enabled
    # Fields that would change the sampled distribution: accepted only at their neutral value,
    # since silently ignoring them would make the returned logprobs lie (see _unsupported).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: JsonObject | None = None
    structured_outputs: JsonObject | None = None
    guided_json: object = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool = False

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[JsonObject]) -> list[JsonObject]:
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] has no string 'role'")
        return messages


def _unsupported(req: ChatRequest) -> str | None:
    """The first distribution-changing option the engine cannot honour, if any."""
    neutral: list[tuple[str, float | int | None, float | int]] = [
        ("presence_penalty", req.presence_penalty, 0.0),
        ("frequency_penalty", req.frequency_penalty, 0.0),
        ("repetition_penalty", req.repetition_penalty, 1.0),
        ("min_tokens", req.min_tokens, 0),
    ]
    for name, value, default in neutral:
        if value is not None and value != default:
            return f"{name}={value!r} is not supported by the embedded engine (only {default!r})"
    for name in ("logit_bias", "allowed_token_ids", "bad_words", "guided_choice"):
        if getattr(req, name):
            return f"{name} is not supported by the embedded engine"
    for name in ("guided_json", "guided_regex", "guided_grammar"):
        if getattr(req, name) is not None:
            return f"{name} was removed from vLLM's API: send response_format or structured_outputs instead"
    if req.use_beam_search:
        return "use_beam_search is not supported by the embedded engine"
    return None


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})"[:300])
    return "Invalid request: " + "; ".join(parts)


def _flatten_content(content: object, where: str) -> object:
    """OpenAI content parts -> one string (vLLM's 'string' content format); text only."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if (
            isinstance(part, dict)
            and part.get("type") in ("text", "input_text")
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}: content part of type {kind!r} is not supported (text-only model)")
    return "\n".join(texts)


def _prepare_messages(messages: list[JsonObject]) -> list[JsonObject]:
    """Normalise OpenAI messages for HF chat templates, as vLLM's chat utils do."""
    out = []
    for i, message in enumerate(messages):
        msg = {k: v for k, v in message.items() if v is not None}
        if "content" in msg:
            msg["content"] = _flatten_content(msg["content"], f"messages[{i}]")
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except json.JSONDecodeError:
                        raise ValueError(
                            f"messages[{i}].tool_calls: arguments of {fn.get('name')!r} are not valid JSON"
                        ) from None
                call["function"] = fn
                fixed.append(call)
            msg["tool_calls"] = fixed
        out.append(msg)
    return out


_T = TypeVar("_T")


@dataclasses.dataclass
class _Generation:
    """A generation job: the prompt, its sampling and its cancel flag; the future its result settles."""

    request: tuple[list[int], SamplingParams, threading.Event | None]
    future: asyncio.Future[GenerationResult]


@dataclasses.dataclass
class _Call(Generic[_T]):
    """Anything else the worker runs alone (a weight swap, scoring a prompt)."""

    fn: Callable[[], _T]
    future: asyncio.Future[_T]


class _Worker:
    """The one thread that runs the model: batches of generation jobs and weight swaps, FIFO.

    Consecutive generation jobs at the head of the queue (up to ``max_batch_size``) run as one
    batch; anything else (a weight swap) runs alone, after every job queued before it.
    """

    def __init__(self, generator: Generator, max_batch_size: int) -> None:
        self.generator = generator
        self.max_batch_size = max_batch_size
        self._jobs: deque[_Generation | _Call[Any]] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.batch_sizes: list[int] = []  # of every generation batch run (diagnostics, tests)
        self._thread = threading.Thread(target=self._loop, name="fineenvs-engine", daemon=True)
        self._thread.start()

    def _submit(self, job: _Generation | _Call[Any]) -> None:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify_all()

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event
    ) -> asyncio.Future[GenerationResult]:
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._submit(_Generation((prompt_ids, params, cancel), future))
        return future

    def call(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._submit(_Call(lambda: fn(*args), future))
        return future

    def queued(self) -> int:
        """Jobs waiting for the worker (not counting the batch it is running)."""
        with self._cv:
            return len(self._jobs)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    @staticmethod
    def _settle(future: asyncio.Future[Any], settle: Callable[[], None]) -> None:
        """Run ``settle`` on the future's event loop, unless the future is done (its request gone)."""

        def run() -> None:
            if not future.done():
                settle()

        future.get_loop().call_soon_threadsafe(run)

    def _resolve(self, future: asyncio.Future[_T], result: _T) -> None:
        self._settle(future, lambda: future.set_result(result))

    def _fail(self, future: asyncio.Future[Any], exc: BaseException) -> None:
        self._settle(future, lambda: future.set_exception(exc))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                batch = [self._jobs.popleft()]
                while (
                    isinstance(batch[0], _Generation)
                    and self._jobs
                    and isinstance(self._jobs[0], _Generation)
                    and len(batch) < self.max_batch_size
                ):
                    batch.append(self._jobs.popleft())
            try:
                self._run(batch)
            except Exception as exc:  # reported to each waiting request; the worker lives on
                for job in batch:
                    self._fail(job.future, exc)

    def _run(self, batch: list[_Generation | _Call[Any]]) -> None:
        generations = [job for job in batch if isinstance(job, _Generation)]
        if not generations:
            (call,) = batch
            assert isinstance(call, _Call)
            self._resolve(call.future, call.fn())
            return
        self.batch_sizes.append(len(generations))

        def answer(i: int, result: GenerationResult) -> None:
            self._resolve(generations[i].future, result)

        self.generator.generate_batch([job.request for job in generations], on_finish=answer)


class EngineState:
    def __init__(
        self,
        generator: Generator,
        *,
        served_model_name: str,
        max_queue: int,
        max_model_len: int,
        tool_call_format: ToolCallFormat,
        enable_test_hooks: bool,
        max_batch_size: int,
    ) -> None:
        self.generator = generator
        self.served_model_name = served_model_name
        self.max_queue = max_queue
        self.max_model_len = max_model_len
        self.tool_call_format = tool_call_format
        self.enable_test_hooks = enable_test_hooks
        self.worker = _Worker(generator, max_batch_size)
        self.scripted: ScriptedPolicy | None = None  # None: sample from the model
        self.pending = 0
        self.created = int(time.time())
        self.weights_updated_at: float | None = None
        self.structured_whitespace = "compact"
        """JSON structured output: no whitespace between tokens (vLLM's ``disable_any_whitespace``),
        or ``flexible``; see ``fineenvs.engine.constrained``."""


ScriptedPolicy: TypeAlias = Callable[[list[JsonObject], list[JsonObject] | None, ToolCallFormat], str]
"""A policy whose replies the engine forces instead of sampling: (messages, the offered tools or
None, the served model's tool-call format) -> the assistant's whole reply in that format. The reply
is then decoded through the normal path, so ids, logprobs and parsed tool calls are the served
model's own."""


def load_scripted_policy(name: str) -> ScriptedPolicy:
    """The scripted policy ``name`` of the ``fineenvs.engine_policies`` plugins."""
    from fineenvs.plugins import ENGINE_POLICIES, load_plugin

    policy = load_plugin(ENGINE_POLICIES, name)
    if not callable(policy):
        raise TypeError(
            f"the engine policy {name!r} is a {type(policy).__name__}, not a callable ScriptedPolicy"
        )
    return cast(ScriptedPolicy, policy)


def _infer_tool_call_format(config: PretrainedConfig) -> ToolCallFormat:
    extra = getattr(config, "fineenvs", None)
    if isinstance(extra, dict) and extra.get("tool_call_format") in TOOL_CALL_FORMATS:
        fmt: ToolCallFormat = extra["tool_call_format"]
        return fmt
    model_type = str(getattr(config, "model_type", ""))
    if model_type.startswith("lfm2"):
        return "lfm2"
    if model_type.startswith("qwen3_5") or model_type.startswith("qwen3_next"):
        return "qwen3_xml"
    return "hermes"


def _sampling(req: ChatRequest, state: EngineState, prompt_len: int) -> SamplingParams | JSONResponse:
    limit = state.max_model_len
    if prompt_len >= limit:
        return error(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            param="messages",
        )
    max_tokens = req.max_completion_tokens or req.max_tokens or (limit - prompt_len)
    if prompt_len + max_tokens > limit:
        return error(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    forced: tuple[int, ...] = ()
    if state.enable_test_hooks and req.forced_completion_prefix:
        forced = tuple(state.generator.encode(req.forced_completion_prefix))
    if state.scripted is not None:
        text = state.scripted(
            req.messages, req.tools if req.tool_choice != "none" else None, state.tool_call_format
        )
        # The reply, then end of turn: decoded through the normal path, so ids, logprobs and
        # tool-call parsing are the served model's own.
        forced = (*state.generator.encode(text), state.generator.eos_token_ids[0])
    tools_active = bool(req.tools) and req.tool_choice != "none"
    temperature = req.temperature if req.temperature is not None else 1.0
    top_p = req.top_p if req.top_p is not None else 1.0
    top_k = req.top_k if req.top_k is not None else 0
    min_p = req.min_p if req.min_p is not None else 0.0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=0 if top_k in (None, -1) else int(top_k),
        min_p=float(min_p or 0.0),
        seed=req.seed,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        # Like vLLM's tool parsers: keep special tool markers (e.g. LFM2's) in the text to parse.
        skip_special_tokens=req.skip_special_tokens and not tools_active,
        forced_prefix=forced,
    )


def _logprobs_body(result: GenerationResult, generator: Generator, top_n: int) -> JsonObject:
    def name(token: int) -> str:
        return f"token_id:{token}"  # vLLM's --return-tokens-as-token-ids

    content = []
    for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        tops = result.top_logprobs[i] if top_n else []
        content.append(
            {
                "token": name(token),
                "logprob": max(lp, -9999.0),
                "bytes": generator.token_bytes(token),
                "top_logprobs": [
                    {"token": name(t), "logprob": max(v, -9999.0), "bytes": generator.token_bytes(t)}
                    for t, v in tops
                ],
            }
        )
    return {"content": content}


async def _json_body(request: Request) -> object:
    """The request's parsed JSON body, or the 400 answer saying it is not JSON."""
    try:
        body: object = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error(f"Request body is not valid JSON: {exc}")
    return body


async def chat_completions(request: Request) -> Response:
    state: EngineState = request.app.state.engine
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    if not isinstance(body, dict):
        return error("Request body must be a JSON object")
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as exc:
        return error(_validation_message(exc))
    if req.model and req.model != state.served_model_name:
        return error(f"The model `{req.model}` does not exist.", 404, "NotFoundError", "model")
    if req.stream:
        return error(
            "stream=true is not supported by the embedded engine: send stream=false "
            "(the capture proxy never streams from the engine; it replays finished responses)",
            param="stream",
        )
    if req.n != 1:
        return error(f"n={req.n} is not supported: the engine returns exactly one choice (n=1)", param="n")
    unsupported = _unsupported(req)
    if unsupported:
        return error(unsupported + ": drop the field or send its neutral value")
    if req.top_logprobs and not req.logprobs:
        return error("when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs")
    if req.tool_choice not in (None, "auto", "none"):
        return error(
            f"tool_choice={req.tool_choice!r} needs constrained decoding, which the embedded engine does "
            "not implement: use 'auto' or 'none'",
            param="tool_choice",
        )
    generator = state.generator
    try:
        messages = _prepare_messages(req.messages)
        prompt_ids = generator.render(
            messages,
            req.tools or None,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as exc:  # template errors are the client's: jinja raise_exception, bad roles
        return error(f"Cannot render the chat template for these messages: {exc}", param="messages")
    params = _sampling(req, state, len(prompt_ids))
    if isinstance(params, JSONResponse):
        return params
    from fineenvs.engine.constrained import ConstraintError, grammar_of

    try:
        constrained = grammar_of(
            req.response_format, req.structured_outputs, whitespace=state.structured_whitespace
        )
    except ConstraintError as exc:
        return error(str(exc), param="response_format" if req.response_format else "structured_outputs")
    if constrained is not None:
        params = dataclasses.replace(params, grammar=constrained[0])
    if state.pending >= state.max_queue:
        return error(
            f"The engine queue is full ({state.max_queue} requests waiting or running); retry later "
            "or start the engine with a larger --max-queue",
            503,
            "ServiceUnavailableError",
        )
    state.pending += 1
    cancel = threading.Event()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, cancel))
    try:
        result: GenerationResult = await state.worker.generate(prompt_ids, params, cancel)
    except Exception as exc:  # a failing forward pass must not take the server down
        logger.exception("generation failed")
        return error(f"Generation failed: {type(exc).__name__}: {exc}", 500, "InternalServerError")
    finally:
        state.pending -= 1
        watcher.cancel()
    return JSONResponse(_response_body(req, state, prompt_ids, result))


async def _cancel_on_disconnect(request: Request, cancel: threading.Event) -> None:
    """Abort the request's generation when its client disconnects (as vLLM aborts it)."""
    while not cancel.is_set():
        if await request.is_disconnected():
            logger.info("client disconnected: aborting its generation")
            cancel.set()
            return
        await asyncio.sleep(0.05)


def _response_body(
    req: ChatRequest, state: EngineState, prompt_ids: list[int], result: GenerationResult
) -> JsonObject:
    finish: str = result.finish_reason
    content: str | None = result.text
    tool_calls: list[JsonObject] = []
    if req.tools and req.tool_choice != "none":
        parsed = parse_tool_calls(result.text, state.tool_call_format, req.tools)
        content, tool_calls = parsed.content, parsed.tool_calls
        if tool_calls and finish == "stop":
            finish = "tool_calls"
    choice: JsonObject = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": tool_calls,
            "reasoning": None,
        },
        "logprobs": _logprobs_body(result, state.generator, req.top_logprobs or 0) if req.logprobs else None,
        "finish_reason": finish,
        "stop_reason": result.stop_reason,
        "token_ids": result.token_ids if req.return_token_ids else None,
    }
    if req.return_weight_versions:
        # vLLM's WeightVersionSpan list: which weight version sampled output tokens [start, end).
        spans: list[JsonObject] = []
        for version, start, end in result.weight_versions or [(result.weight_version, 0, 0)]:
            label = str(version)
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = end
            else:
                spans.append({"version": label, "start": start, "end": end})
        choice["weight_versions"] = spans
    n_out = len(result.token_ids)
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.served_model_name,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "total_tokens": len(prompt_ids) + n_out,
            "completion_tokens": n_out,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids if req.return_token_ids else None,
        "kv_transfer_params": None,
    }
    body["weight_version"] = result.weight_version  # the embedded engine's own field (vLLM has spans only)
    return body


class ScoreRequest(BaseModel):
    """vLLM's completions request, as far as scoring a token sequence goes."""

    model_config = ConfigDict(extra="ignore")

    prompt: list[int] = Field(min_length=2)
    model: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=0)
    max_tokens: int | None = Field(default=1, ge=1, le=1)


async def completions(request: Request) -> Response:
    """``/v1/completions`` for scoring only: a token-id prompt with ``prompt_logprobs=0`` gets
    vLLM's ``choices[0].prompt_logprobs`` (None, then ``{"<id>": {"logprob", "rank",
    "decoded_token"}}`` per token, at temperature 1 as vLLM's). The engine-trainer parity gate
    (``fineenvs.engine.parity``) uses it; text completions are not served."""
    state: EngineState = request.app.state.engine
    try:
        req = ScoreRequest.model_validate(await request.json())
    except (ValidationError, ValueError) as exc:
        message = _validation_message(exc) if isinstance(exc, ValidationError) else "body is not JSON"
        return error(
            f"{message}. The embedded engine's /v1/completions only scores a token-id prompt: send "
            '{"prompt": [ids...], "max_tokens": 1, "prompt_logprobs": 0}.'
        )
    if req.prompt_logprobs is None:
        return error(
            "The embedded engine serves /v1/completions for scoring only: set prompt_logprobs=0 "
            "(chat completions generate).",
            param="prompt_logprobs",
        )
    gen = state.generator
    if (
        len(req.prompt) > state.max_model_len
        or max(req.prompt) >= gen.config.vocab_size
        or min(req.prompt) < 0
    ):
        return error(
            "prompt holds token ids outside the vocabulary or is longer than the context", param="prompt"
        )
    scored = await state.worker.call(gen.prompt_logprobs, req.prompt)
    entries: list[JsonObject | None] = [None]
    for token, logprob in zip(req.prompt[1:], scored, strict=True):
        entries.append({str(token): {"logprob": logprob, "rank": None, "decoded_token": f"token_id:{token}"}})
    return JSONResponse(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.served_model_name,
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "logprobs": None,
                    "finish_reason": "length",
                    "prompt_logprobs": entries,
                }
            ],
            "usage": {
                "prompt_tokens": len(req.prompt),
                "completion_tokens": 0,
                "total_tokens": len(req.prompt),
            },
        }
    )


async def models(request: Request) -> Response:
    state: EngineState = request.app.state.engine
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "fineenvs",
        "root": str(state.generator.model_dir),
        "parent": None,
        "max_model_len": state.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    return Response(status_code=200)


def _weight_info(state: EngineState) -> JsonObject:
    gen = state.generator
    return {
        "weight_version": gen.weight_version,
        "model": state.served_model_name,
        "model_dir": str(gen.model_dir),
        "loaded_from": gen.weights_path,
        "updated_at": state.weights_updated_at,
        "dtype": gen.dtype,
        "device": str(gen.device),
        "pending_requests": state.pending,
    }


async def weight_info(request: Request) -> Response:
    return JSONResponse(_weight_info(request.app.state.engine))


async def reset_prefix_cache(request: Request) -> Response:
    """vLLM's dev route: drop every cached prefix state (``{"success": true}``)."""
    request.app.state.engine.generator.prefix_cache.clear()
    return JSONResponse({"success": True})


async def swap_weights(state: EngineState, fn: Callable[..., _T], *args: object) -> _T:
    """Run a weight swap on the worker, queued behind every request admitted before it."""
    return await state.worker.call(fn, *args)


async def update_weights_from_path(request: Request) -> Response:
    state: EngineState = request.app.state.engine
    body = await _json_body(request)
    if isinstance(body, Response):
        return body
    path = body.get("path") if isinstance(body, dict) else None
    if not isinstance(body, dict) or not isinstance(path, str) or not path:
        return error(
            'Body must be {"path": "<safetensors file or checkpoint dir>", "weight_version": <int, optional>}',
            param="path",
        )
    version = body.get("weight_version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        return error(f"weight_version must be an integer, got {version!r}", param="weight_version")
    try:
        loaded = await swap_weights(state, state.generator.load_weights, Path(path), version)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as exc:
        return error(f"Cannot load weights from {path}: {exc}", param="path")
    state.weights_updated_at = time.time()
    return JSONResponse({**_weight_info(state), "loaded_tensors": len(loaded)})


def create_engine_app(
    model_dir: Path,
    *,
    served_model_name: str,
    dtype: str = "float32",
    max_queue: int = 64,
    seed: int = 0,
    max_model_len: int | None = None,
    tool_call_format: ToolCallFormat | None = None,
    enable_test_hooks: bool = False,
    max_batch_size: int = 8,
    device: str | None = None,
    policy: str = "model",
    prefix_cache_mib: int = DEFAULT_PREFIX_CACHE_BYTES >> 20,
    replica_name: str | None = None,
) -> Starlette:
    """Build the engine app around the causal LM in ``model_dir`` (loaded now, on this thread).

    ``tool_call_format`` defaults to the model's (tiny models record it; otherwise inferred
    from the architecture). ``max_batch_size=1`` serialises generation completely. ``device``
    defaults to the CPU (``"cuda"`` serves a single GPU). ``enable_test_hooks`` honours the
    request field ``forced_completion_prefix`` (tests only; never in production). ``policy`` other
    than ``"model"`` names a ``ScriptedPolicy`` of the ``fineenvs.engine_policies`` plugins whose
    replies are forced instead of sampled (``expert``: the mini-reproduction's teacher).
    ``replica_name`` is stamped on every response in ``REPLICA_HEADER`` (behind vLLM's router).
    """
    scripted = None if policy == "model" else load_scripted_policy(policy)
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if prefix_cache_mib < 0:
        raise ValueError(
            f"prefix_cache_mib must be >= 0 (0 turns the prefix cache off), got {prefix_cache_mib}"
        )
    generator = Generator(
        Path(model_dir), dtype=dtype, seed=seed, device=device, prefix_cache_bytes=prefix_cache_mib << 20
    )
    limit = max_model_len or generator.max_position_embeddings
    if limit > generator.max_position_embeddings:
        raise ValueError(
            f"max_model_len={limit} exceeds the model's max_position_embeddings "
            f"({generator.max_position_embeddings}); lower it or leave it unset"
        )
    fmt = tool_call_format or _infer_tool_call_format(generator.config)
    state = EngineState(
        generator,
        served_model_name=served_model_name,
        max_queue=max_queue,
        max_model_len=limit,
        tool_call_format=fmt,
        enable_test_hooks=enable_test_hooks,
        max_batch_size=max_batch_size,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        state.worker.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/update_weights_from_path", update_weights_from_path, methods=["POST"]),
            Route("/weight_info", weight_info, methods=["GET"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        ],
        lifespan=lifespan,
        middleware=[Middleware(ReplicaHeader, name=replica_name)] if replica_name else [],
    )
    state.scripted = scripted
    app.state.engine = state
    return app


class ReplicaHeader:
    """Pure ASGI: ``REPLICA_HEADER: name`` on every HTTP response, streamed ones too (the header
    goes out with the status, before the first chunk), so a caller behind the router sees which
    replica answered."""

    def __init__(self, app: Any, name: str) -> None:
        if not name or any(c in name for c in "\r\n\0"):
            raise ValueError(f"replica name {name!r} must be a non-empty one-line header value")
        self.app, self.value = app, name.encode("latin-1")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != REPLICA_HEADER.encode()]
                message = {**message, "headers": [*headers, (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, stamped)


@contextmanager
def serve_in_thread(app: Starlette, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run ``app`` under uvicorn on a background thread; yield its base URL, stop on exit.

    ``port=0`` picks a free port. For tests, benchmarks and in-process attach-mode use.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the engine server did not start on {host}:{bound}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
