"""tiny_agent's vocabulary: learnt from real agents' prompts, so every agent of the paper's mix fits.

The shipped text (fineenvs_recipes/tiny/agent_prompts.json) must be what the recorded fixtures say (no
drift after a re-recording), must not hold any mini task, and the tokenizer must compress agent
prompts like a real one — also an agent's prompt it never saw (leave-one-out), so the vocabulary
is English, JSON and shell, not one agent's prompt learnt by heart.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from urllib.parse import parse_qsl

import pytest
from transformers import AutoTokenizer

from fineenvs.dialects import DIALECTS
from fineenvs_recipes.tiny.agent_corpus import (
    AGENT_PROMPTS,
    agent_prompt_texts,
    build_agent_prompts,
    record_text,
)
from fineenvs_recipes.tiny.build import MAX_CONTEXT, ensure_tiny_model
from fineenvs_recipes.tiny.corpus import generate_corpus

RECORDS = Path(__file__).resolve().parents[1] / "fixtures" / "harness_records"
PAPER_MIX = ("claude_code", "codex", "opencode", "mini_swe_agent")


def _first_request(harness: str) -> tuple[list[dict], list[dict] | None]:
    data = json.loads((RECORDS / f"{harness}.json").read_text())
    req = data["request"]
    path = "/" + req["path"].split("/", 3)[3] if req["path"].startswith("/s/") else req["path"]
    path, _, query = path.partition("?")
    body = (
        DIALECTS[data["api_format"]]
        .to_canonical(copy.deepcopy(req["body"]), path=path, query=dict(parse_qsl(query)))
        .body
    )
    return body["messages"], body.get("tools")


def test_shipped_text_is_the_recorded_fixtures() -> None:
    shipped = json.loads(AGENT_PROMPTS.read_text())
    # Frozen: a newly recorded agent does not change tiny_agent's vocabulary, but a re-recorded one
    # must be shipped again (python -m fineenvs_recipes.tiny.agent_corpus).
    recorded = {e["harness"]: e for e in build_agent_prompts(RECORDS)}
    for entry in shipped:
        assert recorded[entry["harness"]] == entry, (
            f"{entry['harness']}: re-run python -m fineenvs_recipes.tiny.agent_corpus"
        )
    assert set(PAPER_MIX) | {"pi"} <= {e["harness"] for e in shipped}
    text = "\n".join(e["text"] for e in shipped)
    assert "mini-train-" not in text and "mini-eval-" not in text
    # the text is the agents' own: the system prompt of each is in it
    claude = next(e for e in shipped if e["harness"] == "claude_code")
    assert record_text(json.loads((RECORDS / "claude_code.json").read_text())) == claude["text"]
    assert len(claude["text"]) > 50_000


@pytest.mark.parametrize("harness", [*PAPER_MIX, "pi", "qwen_code", "gemini_cli"])
def test_every_agent_fits_tiny_agent_at_real_tokenizer_density(harness: str) -> None:
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny_agent"))
    small = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny_qwen"))
    messages, tools = _first_request(harness)
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    n_small = len(small(text, add_special_tokens=False)["input_ids"])
    assert len(text) / n >= 3.5, f"{harness}: {len(text) / n:.2f} characters per token"
    assert n < MAX_CONTEXT // 1.5, f"{harness}: first request {n} tokens leaves no room in {MAX_CONTEXT}"
    assert n_small > 1.8 * n  # tiny_qwen's generated-corpus vocabulary: ~1.9 characters per token


def test_leave_one_out_vocabulary_still_compresses_an_unseen_agent() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=8192, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(
        list(generate_corpus()) + agent_prompt_texts(exclude=("claude_code",)), trainer=trainer
    )
    text = record_text(json.loads((RECORDS / "claude_code.json").read_text()))
    assert len(text) / len(tok.encode(text).ids) >= 3.3  # measured 3.6 (3.9 with Claude Code's own text)
