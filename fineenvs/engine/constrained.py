"""Structured output for the embedded engine: JSON-schema and JSON-object decoding with llguidance.

vLLM serves ``response_format`` (``json_object``, ``json_schema``) and ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``) with a grammar mask; agents rely on it (Claude
Code's title call, Gemini CLI's side checks), so the embedded engine must too.

Library: llguidance (``llguidance>=1.7,<1.8``: the version range vLLM 0.33 pins for its
``guidance`` structured-output backend). It is a Rust core with CPU wheels and no Python
dependencies; xgrammar, vLLM's default backend, needs torch, triton and tvm-ffi, and
outlines-core lacks llguidance's JSON-schema coverage (``$ref``, ``anyOf``, string lengths). The
grammar is compiled the way vLLM's ``serialize_guidance_grammar`` compiles it
(``grammar_from_json_schema`` with ``whitespace_flexible``; ``json_object`` is the schema
``{"type": "object"}``).

What the logprobs are. vLLM 0.33 applies the grammar bitmask to the logits before its sampler
(``gpu_model_runner.sample_tokens`` -> ``apply_grammar_bitmask``), so ``processed_logprobs`` is
the log-softmax of the temperature-scaled logits *with the disallowed tokens at -inf*: the
renormalised, masked distribution, not the policy's. This engine does exactly the same. That is
why the proxy records such calls as ``constrained`` and the rows keep them as context only.

Whitespace: ``whitespace="compact"`` (the engine's default, vLLM's
``--structured-outputs-config '{"disable_any_whitespace": true}'``) allows no whitespace between
JSON tokens: a random tiny model would otherwise wander in whitespace until ``max_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fineenvs.jsonl import JsonObject

if TYPE_CHECKING:
    from llguidance import GrammarFormat, LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase

WHITESPACE = ("compact", "flexible")


class ConstraintError(ValueError):
    """The request's structured-output spec cannot be compiled; the message says why (a 400)."""


def grammar_of(
    response_format: JsonObject | None,
    structured_outputs: JsonObject | None,
    *,
    whitespace: str = "compact",
) -> tuple[str, JsonObject] | None:
    """The llguidance grammar for a request, and what was asked (for the record); None: free text."""
    import llguidance

    defaults: JsonCompileOptions = {"whitespace_flexible": whitespace == "flexible"}
    spec = structured_outputs or {}
    if response_format is not None:
        kind = response_format.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults), {
                "type": "json_object"
            }
        if kind == "json_schema":
            wrapper = response_format.get("json_schema")
            if not isinstance(wrapper, dict) or not isinstance(wrapper.get("schema"), dict):
                raise ConstraintError(
                    "response_format.json_schema.schema must be a JSON object (a JSON Schema); got "
                    f"{type(wrapper.get('schema') if isinstance(wrapper, dict) else wrapper).__name__}"
                )
            return _schema(wrapper["schema"], defaults), {"type": "json_schema", "name": wrapper.get("name")}
        raise ConstraintError(f"response_format.type={kind!r} is not one of text, json_object, json_schema")
    if spec:
        if "json" in spec:
            schema = spec["json"]
            schema = json.loads(schema) if isinstance(schema, str) else schema
            if not isinstance(schema, dict):
                raise ConstraintError("structured_outputs.json must be a JSON Schema object")
            return _schema(schema, defaults), {"type": "json_schema"}
        if spec.get("json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults), {
                "type": "json_object"
            }
        kinds: tuple[tuple[str, GrammarFormat], ...] = (
            ("regex", "regex"),
            ("choice", "choice"),
            ("grammar", "grammar"),
        )
        for key, kind in kinds:
            if key in spec:
                value = spec[key]
                try:
                    return llguidance.grammar_from(kind, value), {"type": key}
                except (ValueError, TypeError) as exc:
                    raise ConstraintError(f"structured_outputs.{key}: {exc}") from None
        raise ConstraintError(
            f"structured_outputs has none of json, json_object, regex, choice, grammar: {sorted(spec)}"
        )
    return None


def _schema(schema: JsonObject, defaults: JsonCompileOptions) -> str:
    import llguidance

    try:
        grammar: str = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"the JSON schema cannot be compiled into a grammar: {exc}") from None
    ok, problem = _validate(grammar)
    if not ok:
        raise ConstraintError(f"the JSON schema cannot be compiled into a grammar: {problem}")
    return grammar


def _validate(grammar: str) -> tuple[bool, str]:
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, AttributeError) as exc:
        return False, str(exc)
    return not is_error, "; ".join(messages)


@dataclass
class Constraint:
    """One request's grammar state: masks logits before sampling, advances on each token."""

    matcher: LLMatcher
    vocab: int
    bitmask: torch.Tensor
    requested: JsonObject

    @classmethod
    def compile(cls, grammar: str, tokenizer: LLTokenizer, requested: JsonObject) -> Constraint:
        import llguidance
        import llguidance.torch as lt

        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=1)
        if matcher.is_error():
            raise ConstraintError(f"the grammar does not load: {matcher.get_error()}")
        return cls(
            matcher, int(tokenizer.vocab_size), lt.allocate_token_bitmask(1, tokenizer.vocab_size), requested
        )

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (1-D, float32) with every token the grammar forbids at -inf."""
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        head = logits[: self.vocab].clone().unsqueeze(0)
        lt.apply_token_bitmask_inplace(head, self.bitmask)
        if logits.numel() > self.vocab:  # padded vocabulary rows the tokenizer never emits
            return torch.cat([head[0], torch.full_like(logits[self.vocab :], float("-inf"))])
        return head[0]

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(
                f"the grammar refused token {token} it had allowed: {self.matcher.get_error()}"
            )

    @property
    def finished(self) -> bool:
        """The grammar admits nothing more (a complete JSON value)."""
        return bool(self.matcher.is_stopped())


def llg_tokenizer(hf_tokenizer: PreTrainedTokenizerBase) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (vLLM builds it the same way)."""
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):  # llguidance reads the Rust tokenizer
        raise ValueError(
            f"structured outputs need a fast (tokenizers) tokenizer; {type(hf_tokenizer).__name__} is not "
            "one. Fix: give the model a tokenizer.json"
        )
    return llguidance.hf.from_tokenizer(hf_tokenizer)
