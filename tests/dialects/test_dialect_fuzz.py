"""Property-based fuzzing: random and mutated bodies for every format convert to a
CanonicalRequest or raise DialectError(400), never another exception; accepted requests always
yield a reply and a full stream; broken engine completions raise DialectError(502) or convert."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest
from dialect_helpers import SERVED, completion, first_tool, fixture_names, load_fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fineenvs.dialects import DIALECTS, DialectError, detect

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(
        [
            "user",
            "assistant",
            "system",
            "model",
            "tool",
            "function",
            "text",
            "tool_use",
            "tool_result",
            "message",
            "function_call",
            "reasoning",
            "image",
        ]
    ),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
# Derandomised so the default tier is reproducible; FINEENVS_FUZZ_RANDOM=1 FINEENVS_FUZZ_EXAMPLES=2000
# explores further.
FUZZ = settings(
    max_examples=int(os.environ.get("FINEENVS_FUZZ_EXAMPLES", "60")),
    deadline=None,
    derandomize="FINEENVS_FUZZ_RANDOM" not in os.environ,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

SEEDS = {f: [load_fixture(f, n)["body"] for n in fixture_names(f)] for f in DIALECTS}
PATHS = {"gemini": "/v1beta/models/g:streamGenerateContent"}


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(_paths(v, (*prefix, i)))
    return out


@st.composite
def mutated(draw: st.DrawFn, api_format: str) -> Any:
    """A real harness body with a few leaves replaced, deleted or retyped."""
    body = copy.deepcopy(draw(st.sampled_from(SEEDS[api_format])))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        path = draw(st.sampled_from(paths))
        if not path:
            body = draw(JSON_VALUES)
            continue
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    return body


def _check(api_format: str, body: Any) -> None:
    dialect = DIALECTS[api_format]
    path = PATHS.get(api_format, "")
    try:
        req = dialect.to_canonical(body, path=path, query={"alt": "sse"})
    except DialectError as err:
        assert err.status == 400 and str(err)
        return
    json.dumps(req.body)
    json.dumps(req.state)
    assert isinstance(req.body["messages"], list) and req.body["messages"]
    for tool in {None, first_tool(req)}:
        done = completion(tool=tool)
        assert dialect.from_chat_completion(done, req, model=SERVED)
        assert b"".join(dialect.stream_events(done, req, model=SERVED))


@pytest.mark.parametrize("api_format", list(DIALECTS))
@FUZZ
@given(data=st.data())
def test_fuzz_mutated_harness_bodies(api_format: str, data: st.DataObject) -> None:
    _check(api_format, data.draw(mutated(api_format)))


@pytest.mark.parametrize("api_format", list(DIALECTS))
@FUZZ
@given(body=JSON_VALUES)
def test_fuzz_random_bodies(api_format: str, body: Any) -> None:
    _check(api_format, body)


@FUZZ
@given(path=st.text(max_size=40), body=JSON_VALUES, header=st.booleans())
def test_fuzz_detect_never_raises(path: str, body: Any, header: bool) -> None:
    headers = {"anthropic-version": "2023-06-01"} if header else {}
    assert detect(path, headers, body if isinstance(body, dict) else None) in DIALECTS


@pytest.mark.parametrize("api_format", list(DIALECTS))
@FUZZ
@given(data=st.data())
def test_fuzz_engine_completions(api_format: str, data: st.DataObject) -> None:
    dialect = DIALECTS[api_format]
    seed = completion(tool="bash")
    paths = _paths(seed)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        if not path:
            continue
        parent: Any = seed
        try:
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = data.draw(JSON_VALUES)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this path
    body = SEEDS[api_format][0]
    req = dialect.to_canonical(copy.deepcopy(body), path=PATHS.get(api_format, ""), query={})
    try:
        reply = dialect.from_chat_completion(seed, req, model=SERVED)
        stream = b"".join(dialect.stream_events(seed, req, model=SERVED))
    except DialectError as err:
        assert err.status == 502
        return
    assert json.dumps(reply) and stream
