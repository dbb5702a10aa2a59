"""SFT dataset builder on hand-made recorded sessions: one example per assistant turn, masks = that turn."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from fineenvs.engine.generation import Generator
from fineenvs.engine.server import _prepare_messages
from fineenvs.train.sft_trainer import (
    RERENDER_REASON,
    SFTDataError,
    StudentRenderer,
    TeacherSession,
    build_sft_examples,
    read_examples,
    session_examples,
    write_examples,
)
from fineenvs_recipes.tiny import ensure_tiny_model
from tests.sft.sessions import EXPECTED, agent_session_calls

MODELS = ("tiny_qwen", "tiny_lfm2", "tiny_qwen3_5")


@pytest.fixture(scope="module", params=MODELS)
def student(request: pytest.FixtureRequest) -> tuple[str, Any]:
    name = str(request.param)
    return name, AutoTokenizer.from_pretrained(ensure_tiny_model(name))


@pytest.fixture(scope="module")
def teacher_tok() -> Any:
    # The teacher's tokens come from another model than the student's (tiny_lfm2 vs the rest).
    return AutoTokenizer.from_pretrained(ensure_tiny_model("tiny_lfm2"))


def _session(teacher_tok: Any, harness: str = "opencode", sid: str = "s1") -> TeacherSession:
    return TeacherSession("task-1", harness, sid, agent_session_calls(teacher_tok))


def _mask_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_one_example_per_assistant_turn_mask_is_exactly_that_turn(
    student: tuple[str, Any], teacher_tok: Any
) -> None:
    name, tok = student
    session = _session(teacher_tok)
    skipped: Counter[str] = Counter()
    examples = session_examples(session, StudentRenderer(tok), max_length=100_000, skipped=skipped)
    # c0 was abandoned (its sibling re-sent the prompt and continued), c4 was cut by the output cap.
    assert [e.call_id for e in examples] == ["c1", "c2", "c3"]
    assert dict(skipped) == {"retry_discarded": 1, "cut_by_output_cap": 1}
    generator = Generator(ensure_tiny_model(name))
    calls = {c["call_id"]: c for c in session.calls}
    for e in examples:
        call = calls[e.call_id]
        assert e.rerendered is True and e.rerender_reason == RERENDER_REASON
        assert len(e.input_ids) == len(e.assistant_masks) == e.prompt_tokens + e.completion_tokens
        # Loss on this turn only: one span, at the end, covering the whole completion.
        assert _mask_spans(e.assistant_masks) == [(e.prompt_tokens, len(e.input_ids))]
        masked = [t for t, b in zip(e.input_ids, e.assistant_masks, strict=True) if b]
        assert tok.decode(masked, skip_special_tokens=False) == EXPECTED[name][e.call_id]
        assert masked[-1] == tok.eos_token_id
        # Context: exactly what the embedded engine renders for the student when serving this request.
        served = generator.render(
            _prepare_messages(call["request"]["messages"]),
            call["request"]["tools"],
            add_generation_prompt=True,
        )
        assert e.input_ids[: e.prompt_tokens] == served
        # The supervised text is the template's own rendering of that assistant message.
        full = tok.apply_chat_template(
            _prepare_messages([*call["request"]["messages"], call["response"]]),
            tools=call["request"]["tools"],
            tokenize=False,
        )
        assert EXPECTED[name][e.call_id] in full
        # Re-rendered, not copied: the teacher's ids are another tokenizer's.
        if name != "tiny_lfm2":
            assert e.input_ids[: e.prompt_tokens] != call["prompt_ids"]


def test_auxiliary_calls_dropped_when_asked(teacher_tok: Any) -> None:
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny_qwen"))
    examples = session_examples(
        _session(teacher_tok), StudentRenderer(tok), max_length=100_000, drop_auxiliary=True
    )
    assert [e.call_id for e in examples] == ["c1", "c2"]


def test_per_harness_subsets_and_union(teacher_tok: Any, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny_qwen"))
    renderer = StudentRenderer(tok)
    sessions = [
        _session(teacher_tok, "opencode", "s1"),
        _session(teacher_tok, "codex", "s2"),
        _session(teacher_tok, "opencode", "s3"),
    ]
    only, stats = build_sft_examples(sessions, renderer, harnesses=["opencode"], max_length=100_000)
    assert {e.session_id for e in only} == {"s1", "s3"} and len(only) == 6
    assert stats.sessions == {"opencode": 2} and stats.examples == {"opencode": 6}
    union, ustats = build_sft_examples(
        sessions, renderer, harnesses=["opencode", "codex"], max_length=100_000
    )
    assert len(union) == 9 and ustats.examples == {"opencode": 6, "codex": 3}
    assert ustats.supervised_tokens["codex"] == sum(
        e.completion_tokens for e in union if e.harness == "codex"
    )
    assert ustats.to_json()["total"]["examples"] == 9
    assert ustats.skipped == {"retry_discarded": 3, "cut_by_output_cap": 3}
    everything, _ = build_sft_examples(sessions, renderer, harnesses=None, max_length=100_000)
    assert [(e.session_id, e.call_id) for e in everything] == [(e.session_id, e.call_id) for e in union]
    write_examples(tmp_path / "ex.jsonl", union)
    assert read_examples(tmp_path / "ex.jsonl") == union


def test_over_long_and_empty_turns_are_counted_not_truncated(teacher_tok: Any) -> None:
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny_qwen"))
    session = _session(teacher_tok)
    session.calls[2]["response"] = {"role": "assistant", "content": None}
    skipped: Counter[str] = Counter()
    first = session_examples(session, StudentRenderer(tok), max_length=100_000)
    limit = max(len(e.input_ids) for e in first)
    got = session_examples(session, StudentRenderer(tok), max_length=limit - 1, skipped=skipped)
    assert skipped["empty_reply"] == 1 and skipped["over_max_length"] == 1
    assert all(len(e.input_ids) < limit for e in got)


def test_template_without_end_of_turn_token_is_refused() -> None:
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny_qwen"))
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(SFTDataError, match="end-of-turn"):
        StudentRenderer(tok).render_turn(
            [{"role": "user", "content": "hi"}], None, {"role": "assistant", "content": "yo"}
        )


def test_student_is_rendered_with_its_serving_template() -> None:
    from hydra import compose, initialize_config_dir

    from fineenvs.config import to_run_config
    from fineenvs.jobs.sft import student_chat_template
    from fineenvs.paths import REPO_ROOT
    from tests.sft.sessions import SYSTEM, TOOL_RESULT, TOOLS, TURN1, TURN2, USER

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base=None):
        multi = to_run_config(
            compose(
                "config",
                overrides=[
                    "+experiment=sft_multi",
                    "output_dir=/tmp/unused",
                    "trainer.teacher_dir=/tmp/unused",
                ],
            )
        )
        tiny = to_run_config(
            compose(
                "config",
                overrides=[
                    "+experiment=sft_multi",
                    "model=tiny_lfm2",
                    "engine=transformers",
                    "output_dir=/tmp/unused",
                    "trainer.teacher_dir=/tmp/unused",
                ],
            )
        )
    assert student_chat_template(tiny) is None  # the tiny tokenizer's template is the one it is served with
    # LFM2.5 under vLLM: the published closed-thinking generation prompt, so SFT prompts end as served.
    template = student_chat_template(multi)
    assert template is not None
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny_lfm2"))
    renderer = StudentRenderer(tok, chat_template=template, template_kwargs=multi.model.chat_template_kwargs)
    prompt, completion = renderer.render_turn([SYSTEM, USER, TURN1, TOOL_RESULT], TOOLS, TURN2)
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think></think>")
    assert tok.decode(completion, skip_special_tokens=False) == "The highest age is 64.<|im_end|>"


def test_merged_turns_supervise_the_same_tokens_in_the_same_contexts(
    student: tuple[str, Any], teacher_tok: Any
) -> None:
    """merge_turns: each chain of extending contexts becomes one example whose supervised tokens,
    with their contexts, are exactly those of the per-turn examples; a break starts a new one."""
    from fineenvs.train.sft_trainer import merge_turns

    name, tok = student
    per_turn = session_examples(_session(teacher_tok), StudentRenderer(tok), max_length=100_000)
    other = session_examples(_session(teacher_tok, sid="s2"), StudentRenderer(tok), max_length=100_000)
    merged = merge_turns([*per_turn, *other])
    if name == "tiny_qwen":
        assert len(merged) < len(per_turn) + len(other)
        assert sum(len(e.input_ids) for e in merged) < sum(len(e.input_ids) for e in per_turn + other)
    else:
        # LFM2.5's generation prompt opens a closed think block that history turns do not carry, and
        # Qwen3.5 drops past turns' thinking: a turn's context never extends the previous example.
        assert len(merged) == len(per_turn) + len(other)
    assert {e.session_id for e in merged} == {"s1", "s2"}  # never across sessions

    def supervised(examples: list[Any]) -> set[tuple[int, ...]]:
        # each supervised token with its whole context: (position, context ids..., token)
        return {
            (i, *e.input_ids[: i + 1]) for e in examples for i, bit in enumerate(e.assistant_masks) if bit
        }

    assert supervised(merged) == supervised([*per_turn, *other])
    assert sum(e.completion_tokens for e in merged) == sum(e.completion_tokens for e in per_turn + other)
    # a context that does not extend the previous example's tokens is not merged into it
    broken = [
        per_turn[0],
        type(per_turn[1])(**{**per_turn[1].__dict__, "input_ids": [0, *per_turn[1].input_ids[1:]]}),
    ]
    assert len(merge_turns(broken)) == 2
