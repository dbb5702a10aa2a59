"""Attach mode (engine.url=...) against fake servers; the embedded-engine variant is in
test_embedded_engine.py (slow)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fineenvs.engine.handle import attach
from fineenvs.engine.launcher import free_port

from .fake_engines import FakeEngine


def models_client(*names: str) -> httpx.Client:
    data = {"object": "list", "data": [{"id": n, "object": "model"} for n in names]}
    return httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, json=data)))


def test_attach_learns_the_only_served_name_and_strips_v1() -> None:
    handle = attach("http://host:8000/v1/", client=FakeEngine(model="LiquidAI/LFM2.5-2.6B").client())
    assert handle.url == "http://host:8000" and handle.openai_base_url == "http://host:8000/v1"
    assert handle.served_model_name == "LiquidAI/LFM2.5-2.6B" and handle.kind == "attached"
    assert handle.weight_sync is None


def test_attach_checks_a_given_name() -> None:
    assert attach("http://h", "b", client=models_client("a", "b")).served_model_name == "b"
    with pytest.raises(ValueError, match=r"'c' is not served by http://h \(it serves: a, b\)"):
        attach("http://h", "c", client=models_client("a", "b"))


def test_attach_needs_a_name_when_several_models_are_served() -> None:
    with pytest.raises(
        ValueError,
        match=r"serves 2 models \(a, b\); a run attaches to a server of one model.*served_model_name=",
    ):
        attach("http://h", client=models_client("a", "b"))


def test_attach_to_nothing_says_what_to_do() -> None:
    with pytest.raises(ConnectionError, match="Start the server first, or drop engine.url"):
        attach(f"http://127.0.0.1:{free_port()}")


def test_attached_handle_is_a_context_manager_sync_and_async() -> None:
    closed: list[int] = []

    class Sync:
        def push(self, weights: object, version: int) -> int:
            return version

        def close(self) -> None:
            closed.append(1)

    with attach("http://h", client=models_client("m"), weight_sync=Sync()) as handle:
        assert handle.served_model_name == "m"

    async def use() -> None:
        async with attach("http://h", client=models_client("m"), weight_sync=Sync()) as handle:
            assert handle.kind == "attached"

    asyncio.run(use())
    assert closed == [1, 1]
