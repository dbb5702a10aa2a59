"""The capability probe against fake engines that each lack one capability."""

from __future__ import annotations

import pytest

from fineenvs.engine.probe import (
    EngineGradeError,
    EngineProbeError,
    Grade,
    probe_engine,
    require_training_grade,
)

from .fake_engines import FakeEngine


def probe(engine: FakeEngine, model: str | None = "fake-model"):  # type: ignore[no-untyped-def]
    return probe_engine("http://fake", model, client=engine.client())


def test_full_capability_engine_is_graded_tokens() -> None:
    engine = FakeEngine()
    report = probe(engine)
    assert report.grade is Grade.tokens, report.summary()
    assert report.token_ids and report.prompt_token_ids and report.token_id_strings and report.logprobs_paired
    assert report.logprobs_mode == "processed"
    assert report.gap_t1 == pytest.approx(1.5) and report.gap_t2 == pytest.approx(0.75)
    assert report.tool_calling == "no_tool_call_emitted" and report.weight_version == 3
    assert report.visible_reply and report.max_model_len == 4096 and report.problems == []
    require_training_grade(report)
    main = engine.requests[0]
    assert main["top_logprobs"] == 0 and main["return_token_ids"] is True and main["logprobs"] is True


def test_model_is_discovered_when_not_named() -> None:
    assert probe(FakeEngine(model="served-x"), model=None).model == "served-x"


def test_raw_logprobs_are_graded_logprobs_and_name_the_flag() -> None:
    report = probe(FakeEngine(raw=True))
    assert report.grade is Grade.logprobs and report.logprobs_mode == "raw"
    assert report.gap_t1 == pytest.approx(report.gap_t2)
    with pytest.raises(EngineGradeError, match="--logprobs-mode processed_logprobs"):
        require_training_grade(report)


def test_text_logprob_tokens_name_the_token_id_flag() -> None:
    report = probe(FakeEngine(token_id_strings=False))
    assert report.grade is Grade.logprobs and not report.token_id_strings
    with pytest.raises(EngineGradeError) as info:
        require_training_grade(report)
    assert "--return-tokens-as-token-ids" in str(info.value)
    assert "--logprobs-mode" not in str(info.value)  # the gap test shows these are processed


def test_missing_token_ids_are_graded_logprobs() -> None:
    report = probe(FakeEngine(token_ids=False))
    assert report.grade is Grade.logprobs and not report.token_ids
    with pytest.raises(EngineGradeError, match="return_token_ids"):
        require_training_grade(report)


def test_no_logprobs_is_graded_text() -> None:
    report = probe(FakeEngine(logprobs=False))
    assert report.grade is Grade.text and report.logprobs_mode == "unknown"
    with pytest.raises(EngineGradeError, match="graded 'text'"):
        require_training_grade(report)


def test_tool_calling_is_reported_not_graded() -> None:
    assert probe(FakeEngine(tools="ok")).tool_calling == "ok"
    report = probe(FakeEngine(tools="reject"))
    assert report.tool_calling == "no_tool_calling" and report.grade is Grade.tokens
    assert any("--enable-auto-tool-choice" in flag for flag in report.missing_flags)
    require_training_grade(report)


def test_engine_that_cannot_answer_raises() -> None:
    with pytest.raises(EngineProbeError, match="rejected a plain chat completion"):
        probe(FakeEngine(reject_completions=True))


def test_reply_swallowed_into_reasoning_is_reported() -> None:
    report = probe(FakeEngine(reasoning_parser=True))
    assert not report.visible_reply
    assert any("--reasoning-parser" in problem for problem in report.problems)
