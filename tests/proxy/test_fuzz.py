"""Property-based fuzz over all four formats: odd bodies never produce a 500 or break the proxy."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_formats import FORMATS, request

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
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
    ]
)  # fmt: skip


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


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
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
    r = h.run(h.client.post(f"/s/{s['key']}{path}", json=body, headers=headers))
    assert r.status_code < 500, (fmt, body, r.status_code, r.text)
    if r.status_code >= 400:
        assert b"fineenvs proxy:" in r.content, r.text
    assert h.run(h.client.get("/health")).status_code == 200
