"""Token generation for the embedded engine: KV-cached decoding with a manual sampling loop.

``transformers.generate`` does not expose the exact distribution each token was drawn from, and
the trainer's importance ratios need precisely that: vLLM's ``processed_logprobs``. So each step
here processes the logits the way vLLM's V1 sampler does (temperature, then min-p, then top-k,
then top-p, masked entries at -inf), takes ``log_softmax`` of the result, and samples from it.
The logprob returned for a token is its entry in that same tensor. Temperature 0 is greedy: the
argmax of the raw logits, reported with the raw ``log_softmax`` (as vLLM does).
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from fineenvs.jsonl import JsonObject

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from transformers.cache_utils import Cache

    from fineenvs.engine.constrained import Constraint

FinishReason = Literal["stop", "length", "abort"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # Test hook: emit these tokens first instead of sampling (their processed logprobs are still
    # reported), then sample on. Lets tests drive the server path with outputs, such as tool
    # calls, that a random model never samples. Only set when the app enables test hooks.
    forced_prefix: tuple[int, ...] = ()
    grammar: str | None = None
    """An llguidance grammar (``fineenvs.engine.constrained``): tokens it forbids are masked to
    -inf before processing, as vLLM's grammar bitmask is, and the reply ends when it completes."""


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: int | str | None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    weight_version: int = 0
    """The version that sampled the first token (the current one if none was sampled)."""
    weight_versions: list[tuple[int, int, int]] = field(default_factory=list)
    """``(version, start, end)``: output tokens ``[start, end)`` were sampled by ``version``. More
    than one span when weights changed while the request was frozen (vLLM's ``/pause?mode=keep``)."""


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Return the processed log-probabilities (1-D, float32) that the next token is sampled from."""
    logits = logits.float()
    if params.temperature <= 0.0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0 or params.top_p < 1.0:
        # vLLM's apply_top_k_top_p: ascending sort; ties with the k-th value survive; top-p
        # drops the low tail whose cumulative mass is <= 1 - p, always keeping the argmax.
        sorted_logits, order = logits.sort(descending=False)
        if 0 < params.top_k < sorted_logits.numel():
            kth = sorted_logits[sorted_logits.numel() - params.top_k]
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if params.top_p < 1.0:
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1.0 - params.top_p
            drop[-1] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return torch.log_softmax(logits, dim=-1)


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class _Row:
    """One request's decoding state inside a (possibly batched) generation."""

    def __init__(
        self, gen: Generator, prompt: list[int], params: SamplingParams, cancel: threading.Event | None
    ) -> None:
        self.gen = gen
        self.prompt = prompt
        self.params = params
        self.cancel = cancel
        self.rng = gen._rng if params.seed is None else torch.Generator().manual_seed(params.seed)
        eos = set() if params.ignore_eos else set(gen.eos_token_ids)
        self.stop_ids = set(params.stop_token_ids) | eos
        self.window = max((len(s) for s in params.stop), default=0) + 8
        self.tokens: list[int] = []
        self.versions: list[int] = []  # weight version that sampled each token
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.finish: FinishReason = "length"
        self.stop_reason: int | str | None = None
        self.on_token = False  # stopped on a stop token, whose text is not part of the content
        self.done = params.max_tokens <= 0
        self.constraint: Constraint | None = None
        if params.grammar is not None:
            from fineenvs.engine.constrained import Constraint

            self.constraint = Constraint.compile(params.grammar, gen.llg_tokenizer, {})
        if self.cancelled():
            self.finish, self.done = "abort", True

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def step(self, logits: torch.Tensor, index: int) -> int | None:
        """Sample this row's next token from ``logits``; None once the row has finished."""
        if self.done:
            return None
        if self.cancelled():
            self.finish, self.done = "abort", True
            return None
        params = self.params
        if self.constraint is not None:
            logits = self.constraint.mask(logits.float())
        processed = process_logits(logits, params)
        if index < len(params.forced_prefix):
            token = params.forced_prefix[index]
        elif params.temperature <= 0.0:
            token = int(torch.argmax(logits))
        else:
            token = int(torch.multinomial(processed.exp(), 1, generator=self.rng))
        if self.constraint is not None:
            self.constraint.advance(token)
        self.tokens.append(token)
        self.versions.append(self.gen.weight_version)
        if params.logprobs:
            self.logprobs.append(float(processed[token]))
            if params.top_logprobs > 0:
                values, ids = processed.topk(params.top_logprobs)
                self.tops.append([(int(i), float(v)) for v, i in zip(values, ids, strict=True)])
        if token in self.stop_ids:
            self.finish, self.on_token, self.done = "stop", True, True
            self.stop_reason = token if token in params.stop_token_ids else None
        elif params.stop:
            tail = self.gen.decode(self.tokens[-self.window :], params.skip_special_tokens)
            hit = next((s for s in params.stop if s in tail), None)
            if hit is not None:
                self.finish, self.stop_reason, self.done = "stop", hit, True
        if self.constraint is not None and self.constraint.finished and not self.done:
            self.finish, self.done = "stop", True
        if len(self.tokens) >= params.max_tokens:
            self.done = True
        return token

    def result(self, version: int) -> GenerationResult:
        ids = self.tokens[:-1] if self.on_token else self.tokens
        text = self.gen.decode(ids, self.params.skip_special_tokens)
        if isinstance(self.stop_reason, str) and self.stop_reason in text:
            text = text[: text.find(self.stop_reason)]
        spans: list[tuple[int, int, int]] = []
        for i, v in enumerate(self.versions):
            if spans and spans[-1][0] == v:
                spans[-1] = (v, spans[-1][1], i + 1)
            else:
                spans.append((v, i, i + 1))
        first = self.versions[0] if self.versions else version
        return GenerationResult(
            self.tokens, text, self.finish, self.stop_reason, self.logprobs, self.tops, first, spans
        )


class Generator:
    """A causal LM and its tokenizer, generating one request at a time (callers serialise)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: str = "float32",
        seed: int = 0,
        device: str | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from fineenvs.engine.prefix_cache import PrefixCache

        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported: choose one of {sorted(DTYPES)}")
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        # CPU unless asked: on CUDA, TF32 convolutions alone move logprobs by ~1e-3.
        self.device = torch.device(device or "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model: Any = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=DTYPES[dtype])
        self.model = model.to(self.device).eval()
        self.config = self.model.config
        self.eos_token_ids = self._eos_ids()
        self.weight_version = 0
        self.weights_path: str | None = None
        self._rng = torch.Generator().manual_seed(seed)
        pad = self.tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else (self.eos_token_ids or (0,))[0]
        self._byte_map = _byte_decoder()
        self._token_bytes: dict[int, list[int]] = {}
        self._special_ids = set(self.tokenizer.all_special_ids)
        self._added = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items()}
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Held for every forward pass and weight swap. Re-entrant: a weight swap while requests are
        # frozen mid-batch (vLLM's pause mode "keep") runs on the worker thread inside the batch.
        self.lock = threading.RLock()
        # Fast tokenizers raise "Already borrowed" when two threads use one at once; the event
        # loop renders prompts while the worker decodes completions.
        self.tokenizer_lock = threading.Lock()
        self.prefix_cache = PrefixCache(prefix_cache_bytes)

    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        for value in (gen_eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.append(value)
            elif isinstance(value, list):
                ids.extend(int(v) for v in value)
        return tuple(dict.fromkeys(ids))

    @property
    def max_position_embeddings(self) -> int:
        extra = getattr(self.config, "fineenvs", None)
        if isinstance(extra, dict) and isinstance(extra.get("max_context"), int):
            return int(extra["max_context"])
        return int(getattr(self.config, "max_position_embeddings", 4096))

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes of one token (OpenAI's ``bytes`` field)."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            if token_id in self._added:
                cached = list(self._added[token_id].encode("utf-8"))
            else:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(c in self._byte_map for c in piece):
                    cached = [self._byte_map[c] for c in piece]
                else:
                    cached = list(self.decode([token_id], False).encode("utf-8", errors="replace"))
            self._token_bytes[token_id] = cached
        return cached

    @property
    def llg_tokenizer(self) -> LLTokenizer:
        """llguidance's tokenizer for constrained decoding (built on first use)."""
        cached = getattr(self, "_llg_tokenizer", None)
        if cached is None:
            from fineenvs.engine.constrained import llg_tokenizer

            with self.tokenizer_lock:
                cached = self._llg_tokenizer = llg_tokenizer(self.tokenizer)
        return cached

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self.tokenizer_lock:
            return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(
        self, messages: list[JsonObject], tools: list[JsonObject] | None, **template_kwargs: Any
    ) -> list[int]:
        """Apply the chat template and tokenise the text (as vLLM: no extra special tokens)."""
        with self.tokenizer_lock:
            text = self.tokenizer.apply_chat_template(
                messages, tools=None if tools is None else [*tools], tokenize=False, **template_kwargs
            )
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _forward(
        self,
        input_ids: torch.Tensor,
        cache: Cache | None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Cache]:
        kwargs: dict[str, object] = {self._cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(self.device)
        out = self.model(input_ids=input_ids.to(self.device), **kwargs)
        new_cache = out.get("cache", None)
        if new_cache is None:
            new_cache = out.get("past_key_values", None)
        # Sampling runs on the CPU in float32: per-request CPU generators, exact processed logprobs.
        return out.logits[:, -1].float().cpu(), new_cache

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token i | tokens before i) for i >= 1 at temperature 1 (vLLM's ``prompt_logprobs``
        are raw logprobs too), from one forward pass without the prefix cache."""
        with self.lock:
            ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        return [float(logprobs[i, t]) for i, t in enumerate(token_ids[1:])]

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event | None = None
    ) -> GenerationResult:
        """Sample up to ``params.max_tokens`` tokens after ``prompt_ids``.

        Setting ``cancel`` (the client went away) ends generation at the next step with
        ``finish_reason="abort"``, so an abandoned request stops holding the queue.
        """
        return self.generate_batch([(prompt_ids, params, cancel)])[0]

    def generate_batch(
        self,
        jobs: list[tuple[list[int], SamplingParams, threading.Event | None]],
        on_finish: Callable[[int, GenerationResult], None] | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for several requests decoded together as one batch, each with its own params.

        Each prompt is prefilled alone, from the longest prefix the prefix cache holds
        (``fineenvs.engine.prefix_cache``); the rows' states are then stacked, left-padded, for
        decoding. Every row is sampled from its own processed distribution with its own RNG,
        exactly as alone; the padding only changes float rounding (measured ~1e-5 in logprob on
        the tiny models, whose padded positions are masked in attention; the convolution and
        linear-attention states are per row). A batch of one takes no padding at all.
        ``on_finish(index, result)`` is called as soon as a row finishes, so a short request is
        answered without waiting for the longest row of its batch. ``between_steps()`` runs
        between two decoding steps (the engine's pause point); the tokens after it are sampled
        with whatever weights are loaded then, and each token records its weight version.
        """
        rows = [_Row(self, prompt, params, cancel) for prompt, params, cancel in jobs]
        results: dict[int, GenerationResult] = {}

        def report(version: int) -> None:
            for i, row in enumerate(rows):
                if row.done and i not in results:
                    results[i] = row.result(version)
                    if on_finish is not None:
                        on_finish(i, results[i])

        with self.lock, torch.inference_mode():
            version = start_version = self.weight_version
            batch = [i for i, r in enumerate(rows) if not r.done]
            states, firsts = [], []
            for i in batch:
                state, first = self._prefill(rows[i].prompt, start_version)
                states.append(state)
                firsts.append(first)
            report(version)
            if not batch:
                return [results[i] for i in range(len(rows))]
            lengths = [len(rows[i].prompt) for i in batch]
            width = max(lengths)
            mask: torch.Tensor | None = None
            positions: torch.Tensor | None = None
            if len(batch) == 1:
                cache = states[0]
            else:
                from fineenvs.engine.prefix_cache import stack_rows

                cache = stack_rows(states, lengths)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for j, n in enumerate(lengths):
                    mask[j, width - n :] = 1
                positions = torch.tensor([[n - 1] for n in lengths], dtype=torch.long)
            logits = torch.stack(firsts)
            pads = [width - n for n in lengths]
            step = 0
            while True:
                next_ids = [rows[i].step(logits[j], step) for j, i in enumerate(batch)]
                step += 1
                if self.weight_version == start_version:
                    self._keep_finished(rows, batch, cache, pads, step, start_version)
                report(version)
                if all(rows[i].done for i in batch):
                    break
                if between_steps is not None:
                    between_steps()
                    version = self.weight_version
                feed = torch.tensor([[t if t is not None else self._pad_id] for t in next_ids])
                if mask is not None and positions is not None:
                    mask = torch.cat([mask, torch.ones((len(batch), 1), dtype=torch.long)], dim=1)
                    positions = positions[:, -1:] + 1
                logits, cache = self._forward(feed, cache, mask, positions)
        return [results[i] for i in range(len(rows))]

    def _prefill(self, prompt: list[int], version: int) -> tuple[Cache, torch.Tensor]:
        """The model state after ``prompt`` and its next-token logits, computed from the longest
        cached prefix; the state after the prompt is cached in turn."""
        hit = self.prefix_cache.lookup(prompt, version)
        if hit is not None and hit.logits is not None:
            return hit.state, hit.logits
        start = 0 if hit is None else hit.length
        ids = torch.tensor([prompt[start:]], dtype=torch.long)
        positions = torch.arange(start, len(prompt), dtype=torch.long)[None] if start else None
        logits, state = self._forward(ids, None if hit is None else hit.state, None, positions)
        self.prefix_cache.insert(prompt, state, version, logits[0], copy_state=True)
        return state, logits[0]

    def _keep_finished(
        self, rows: list[_Row], batch: list[int], cache: Cache, pads: list[int], step: int, version: int
    ) -> None:
        """Cache the state of each row that finished at this step: its prompt and every sampled
        token but the last (the one never fed), as the agent's next call will start with them."""
        if not self.prefix_cache.enabled:
            return
        from fineenvs.engine.prefix_cache import select_row

        for j, i in enumerate(batch):
            row = rows[i]
            if not row.done or len(row.tokens) != step or row.finish == "abort" or step < 2:
                continue
            tokens = row.prompt + row.tokens[:-1]
            if len(batch) == 1:
                self.prefix_cache.insert(tokens, cache, version, copy_state=False)
            else:
                self.prefix_cache.insert(tokens, select_row(cache, j, pads[j]), version, copy_state=False)

    def load_weights(self, path: Path, version: int | None = None) -> list[str]:
        """Load a safetensors file or checkpoint directory into the model; return loaded names.

        Runs under the generation lock, so it waits for the request in flight and the next
        request sees only the new weights. ``version`` defaults to the current one plus 1.
        """
        from safetensors.torch import load_file

        path = Path(path)
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.is_file():
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                files = [path / s for s in shards]
            elif (path / "model.safetensors").is_file():
                files = [path / "model.safetensors"]
            else:
                raise FileNotFoundError(
                    f"{path} holds neither model.safetensors nor model.safetensors.index.json: "
                    "pass a directory written by save_pretrained or a .safetensors file"
                )
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"{path} does not exist")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        own = self.model.state_dict()
        unexpected = sorted(set(state) - set(own))
        tied = set(getattr(self.model, "_tied_weights_keys", None) or {})
        if self.config.tie_word_embeddings if hasattr(self.config, "tie_word_embeddings") else False:
            tied |= {"lm_head.weight"}
        missing = sorted(set(own) - set(state) - tied)
        if unexpected or missing:
            raise ValueError(
                f"checkpoint {path} does not match the served model {self.model_dir}: "
                f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}, "
                f"missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}"
            )
        bad = [k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
        if bad:
            raise ValueError(
                f"checkpoint {path} has tensors of the wrong shape for {bad[:5]}: "
                f"e.g. {bad[0]} is {tuple(state[bad[0]].shape)}, the model has {tuple(own[bad[0]].shape)}"
            )
        with self.lock, torch.no_grad():
            self.model.load_state_dict(state, strict=False)
            if "lm_head.weight" not in state and hasattr(self.model, "tie_weights"):
                self.model.tie_weights()
            self.weight_version = self.weight_version + 1 if version is None else version
            self.weights_path = str(path)
            self.prefix_cache.clear()  # states computed by the old weights
        return sorted(state)
