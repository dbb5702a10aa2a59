"""Property-based fuzz over all four formats: odd bodies never produce a 500 or break the proxy."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_formats import FORMATS, request

# Hostile numbers: beyond 64 bits (orjson reads them as floats, int() makes them Python ints no
# encoder takes), +-1e308, NaN and Infinity literals (not JSON: the encoder writes them anyway),
# negative zero.
hostile_numbers = (
    st.integers(-(2**70), 2**70)
    | st.sampled_from([2**63, 2**64, 2**64 - 1, -(2**63) - 1, 10**30, 1.5e308, -1.5e308, 1e300, -0.0])
    | st.floats(allow_nan=True, allow_infinity=True)
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | hostile_numbers
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
KEYS = st.sampled_from(
    [
        "messages", "input", "contents", "system", "systemInstruction", "tools", "tool_choice", "stream",
        "max_tokens", "max_output_tokens", "generationConfig", "temperature", "n", "content", "role",
        "parts", "instructions", "reasoning", "thinking", "text", "type", "tool_calls", "functionCall",
        "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "top_logprobs", "max_completion_tokens", "maxOutputTokens", "topP", "topK", "candidateCount",
        "presencePenalty", "frequencyPenalty", "budget_tokens", "thinkingBudget",
    ]
)  # fmt: skip


def _encode(body: Any) -> bytes:
    """JSON as a careless client writes it: NaN and Infinity as literals, big ints in full."""
    return json.dumps(body, allow_nan=True).encode()


def _mutate(body: Any, path: list[int], key: str, value: Any) -> Any:
    """Replace or add ``key`` somewhere inside ``body`` (the spot picked by ``path``)."""
    node = body
    for step in path:
        children = [
            v for v in (node.values() if isinstance(node, dict) else node) if isinstance(v, dict | list)
        ]
        if not children:
            break
        node = children[step % len(children)]
    if isinstance(node, dict):
        node[key] = value
    elif isinstance(node, list):
        node.append(value) if not node else node.__setitem__(len(path) % len(node), value)
    return body


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fmt=st.sampled_from(FORMATS),
    stream=st.booleans(),
    mutations=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=4), KEYS, json_values), max_size=3),
    replace_all=st.none() | json_values,
)
def test_fuzzed_requests_never_500(
    make_proxy: Any, fmt: str, stream: bool, mutations: list[Any], replace_all: Any
) -> None:
    # One proxy per test run (the fixture's factory lives as long as the test), shared by examples.
    if not hasattr(make_proxy, "fuzz_target"):
        h = make_proxy(max_model_calls=10**6)
        make_proxy.fuzz_target = (h, h.session())
    h, s = make_proxy.fuzz_target
    path, body, headers = request(fmt, "fuzz", stream=stream, tools=True)
    body = copy.deepcopy(body)
    for where, key, value in mutations:
        body = _mutate(body, where, key, value)
    if replace_all is not None:
        body = replace_all
    headers = {**headers, "content-type": "application/json"}
    r = h.run(h.client.post(f"/s/{s['key']}{path}", content=_encode(body), headers=headers))
    assert r.status_code < 500, (fmt, body, r.status_code, r.text)
    if r.status_code >= 400:
        assert b"fineenvs proxy:" in r.content, r.text
    assert h.run(h.client.get("/health")).status_code == 200


NUMERIC_FIELDS = {
    "openai_chat": ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "top_logprobs"],
    "openai_responses": ["max_output_tokens", "temperature", "top_p"],
    "anthropic_messages": ["max_tokens", "temperature", "top_p", "top_k"],
    "gemini": ["generationConfig.maxOutputTokens", "generationConfig.temperature", "generationConfig.topP",
               "generationConfig.topK", "generationConfig.seed", "generationConfig.candidateCount"],
}  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FORMATS), data=st.data(), value=hostile_numbers, stream=st.booleans())
def test_every_numeric_field_is_range_checked_in_the_callers_format(
    make_proxy: Any, fmt: str, data: Any, value: Any, stream: bool
) -> None:
    """Each format's numeric fields with a hostile value: a 200 or the caller's own 400, never a 5xx."""
    if not hasattr(make_proxy, "numbers_target"):
        h = make_proxy(max_model_calls=10**6)
        make_proxy.numbers_target = (h, h.session())
    h, s = make_proxy.numbers_target
    field = data.draw(st.sampled_from(NUMERIC_FIELDS[fmt]))
    path, body, headers = request(fmt, "numbers", stream=stream)
    body = copy.deepcopy(body)
    node = body
    *parents, leaf = field.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    headers = {**headers, "content-type": "application/json"}
    r = h.run(h.client.post(f"/s/{s['key']}{path}", content=_encode(body), headers=headers))
    assert r.status_code < 500, (fmt, field, value, r.status_code, r.text)
    if r.status_code >= 400:
        assert r.status_code == 400 and b"fineenvs proxy:" in r.content, r.text
        error = r.json()
        text = str(error)
        assert leaf in text or "JSON" in text, text  # names the field (or the unparseable body)
