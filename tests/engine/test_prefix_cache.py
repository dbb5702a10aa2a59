"""The embedded engine's prefix cache: reused states give the logprobs of an uncached forward.

Every test compares an engine with the cache against one without it, on the same weights and
seeds, for the three tiny architectures (attention-only Qwen3, LFM2 with short convolutions,
Qwen3.5 with linear attention): same sampled tokens, logprobs within the engine's 1e-4 contract,
and fewer prompt tokens forwarded.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from fineenvs.engine.generation import GenerationResult, Generator, SamplingParams
from fineenvs.engine.prefix_cache import PrefixCache
from fineenvs.engine.server import create_engine_app
from fineenvs_recipes.tiny import ensure_tiny_model

TOL = 1e-4


def _pair(name: str, seed: int = 0, cache_bytes: int = 1 << 30) -> tuple[Generator, Generator]:
    path = ensure_tiny_model(name, seed)
    return Generator(path, prefix_cache_bytes=cache_bytes), Generator(path, prefix_cache_bytes=0)


def _fed(gen: Generator) -> list[int]:
    """Record how many tokens each forward pass feeds (prefills and decoding steps)."""
    fed: list[int] = []
    forward = gen._forward

    def counted(ids: torch.Tensor, *args: Any) -> Any:
        fed.append(int(ids.shape[0] * ids.shape[1]))
        return forward(ids, *args)

    gen._forward = counted  # type: ignore[method-assign]
    return fed


def _same(a: GenerationResult, b: GenerationResult) -> None:
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    worst = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
    assert worst < TOL, f"cached logprobs differ from uncached ones by {worst}"


def _params(seed: int, n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=1.0, seed=seed, logprobs=True, ignore_eos=True)


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_lfm2", "tiny_qwen3_5"])
def test_growing_session_reuses_each_previous_call(name: str) -> None:
    """An agent's calls: each resends the history, the last reply as sampled, and a tool result."""
    cached, plain = _pair(name)
    fed = _fed(cached)
    rng = random.Random(0)
    history = [rng.randrange(20, 900) for _ in range(200)]
    for turn in range(4):
        fed.clear()
        a, b = cached.generate(history, _params(turn)), plain.generate(history, _params(turn))
        _same(a, b)
        if turn == 0:
            assert fed[0] == len(history)
        else:  # only the last token of the previous reply and the new tool result are prefilled
            assert fed[0] == 1 + 40, fed[:3]
        history = history + a.token_ids + [rng.randrange(20, 900) for _ in range(40)]


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_lfm2", "tiny_qwen3_5"])
def test_rerendered_reply_reuses_what_the_state_allows(name: str) -> None:
    """The next prompt renders the reply differently from how it was sampled (a template that
    re-serialises tool calls): attention states are cut back to the common prefix; convolution
    and recurrent states fall back to the previous prompt's state."""
    cached, plain = _pair(name)
    fed = _fed(cached)
    rng = random.Random(1)
    prompt = [rng.randrange(20, 900) for _ in range(150)]
    first = cached.generate(prompt, _params(0))
    rerendered = prompt + first.token_ids[:4] + [7, 8, 9] + [rng.randrange(20, 900) for _ in range(30)]
    fed.clear()
    _same(cached.generate(rerendered, _params(1)), plain.generate(rerendered, _params(1)))
    reused = 150 + 4 if name == "tiny_qwen" else 150
    assert fed[0] == len(rerendered) - reused


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_lfm2", "tiny_qwen3_5"])
def test_a_group_shares_its_prompt_in_one_batch(name: str) -> None:
    """Four attempts with one prompt, decoded together: one prefill, each row as if alone."""
    cached, plain = _pair(name)
    fed = _fed(cached)
    rng = random.Random(2)
    prompt = [rng.randrange(20, 900) for _ in range(120)]
    other = prompt[:60] + [rng.randrange(20, 900) for _ in range(30)]
    jobs = [(prompt, _params(10 + i), None) for i in range(4)] + [(other, _params(20), None)]
    together = cached.generate_batch(jobs)
    # Two prefills (the repeats cost no forward; `other` shares 60 tokens, reusable by attention
    # alone), then decoding steps of all five rows.
    assert fed[:3] == [120, 30 if name == "tiny_qwen" else 90, 5]
    for result, (p, params, _) in zip(together, jobs, strict=True):
        _same(result, plain.generate(p, params))
    assert len({tuple(r.token_ids) for r in together[:4]}) > 1  # the rows did sample apart


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_lfm2", "tiny_qwen3_5"])
def test_rows_finishing_apart_in_a_batch_cache_their_own_state(name: str) -> None:
    """A row that stops early is cached as it stood then, not after the padding fed later."""
    cached, plain = _pair(name)
    rng = random.Random(3)
    a = [rng.randrange(20, 900) for _ in range(80)]
    b = [rng.randrange(20, 900) for _ in range(50)]
    short, long = _params(1, n=3), _params(2, n=12)
    ra, _ = cached.generate_batch([(a, short, None), (b, long, None)])
    follow = a + ra.token_ids + [rng.randrange(20, 900) for _ in range(20)]
    fed = _fed(cached)
    _same(cached.generate(follow, _params(5)), plain.generate(follow, _params(5)))
    assert fed[0] == 1 + 20


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_qwen3_5"])
def test_a_weight_push_invalidates_the_cache(name: str) -> None:
    cached, plain = _pair(name)
    rng = random.Random(4)
    prompt = [rng.randrange(20, 900) for _ in range(100)]
    cached.generate(prompt, _params(0))
    assert len(cached.prefix_cache) > 0
    new_weights = ensure_tiny_model(name, 1) / "model.safetensors"
    cached.load_weights(new_weights)
    plain.load_weights(new_weights)
    assert len(cached.prefix_cache) == 0
    fed = _fed(cached)
    _same(cached.generate(prompt, _params(1)), plain.generate(prompt, _params(1)))
    assert fed[0] == len(prompt)


def test_memory_bound_evicts_least_recently_used(tiny_qwen_dir: Path) -> None:
    gen = Generator(tiny_qwen_dir, prefix_cache_bytes=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(20, 900) for _ in range(100)] for _ in range(3)]
    with torch.inference_mode():
        states = []
        for p in prompts:
            logits, state = gen._forward(torch.tensor([p]), None)
            states.append((p, state, logits[0]))
        cache = PrefixCache(1 << 30)
        cache.insert(prompts[0], states[0][1], 0, states[0][2], copy_state=True)
        one = cache.bytes
        bounded = PrefixCache(int(one * 2.5))
        for p, state, logits in states[:2]:
            bounded.insert(p, state, 0, logits, copy_state=True)
        assert bounded.lookup(prompts[0] + [5], 0) is not None  # touches the first entry
        bounded.insert(prompts[2], states[2][1], 0, states[2][2], copy_state=True)
        assert len(bounded) == 2 and bounded.bytes <= bounded.max_bytes
        assert bounded.lookup(prompts[1] + [5], 0) is None  # evicted: least recently used
        assert bounded.lookup(prompts[0] + [5], 0) is not None
        assert bounded.lookup(prompts[0] + [5], 1) is None  # another weight version
    with pytest.raises(ValueError, match=">= 0"):
        PrefixCache(-1)


def test_server_reset_route_and_bad_setting(tiny_qwen_dir: Path) -> None:
    app = create_engine_app(tiny_qwen_dir, served_model_name="t")
    body = {"model": "t", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with TestClient(app) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        cache = app.state.engine.generator.prefix_cache
        assert len(cache) > 0
        reply = c.post("/reset_prefix_cache")
        assert reply.status_code == 200 and reply.json() == {"success": True}
        assert len(cache) == 0
    with pytest.raises(ValueError, match="prefix_cache_mib must be >= 0"):
        create_engine_app(tiny_qwen_dir, served_model_name="t", prefix_cache_mib=-1)
    off = create_engine_app(tiny_qwen_dir, served_model_name="t", prefix_cache_mib=0)
    with TestClient(off) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert len(off.state.engine.generator.prefix_cache) == 0
