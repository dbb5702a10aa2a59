"""One SFTTrainer step on tiny_qwen: the loss is the assistant turn's only, parameters move, checkpoint loads."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fineenvs.train.sft_config import SFTSettings
from fineenvs.train.sft_trainer import SFTExample, StudentRenderer, train_sft
from fineenvs_recipes.tiny import ensure_tiny_model
from tests.sft.sessions import SYSTEM, TOOL_RESULT, TOOLS, TURN1, TURN2, USER


def _masked_nll(model: torch.nn.Module, example: SFTExample) -> float:
    """Mean next-token NLL over the supervised tokens only (what SFT's loss must be)."""
    ids = torch.tensor([example.input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    targets = ids[0, 1:]
    mask = torch.tensor(example.assistant_masks[1:], dtype=torch.bool)
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return float(nll[mask].mean())


def test_one_step_trains_on_the_assistant_turn_only(tmp_path: Path) -> None:
    model_dir = ensure_tiny_model("tiny_qwen")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt, completion = StudentRenderer(tok).render_turn([SYSTEM, USER, TURN1, TOOL_RESULT], TOOLS, TURN2)
    example = SFTExample(
        input_ids=prompt + completion,
        assistant_masks=[0] * len(prompt) + [1] * len(completion),
        task_id="t",
        harness="opencode",
        session_id="s",
        call_id="c2",
        turn=2,
        prompt_tokens=len(prompt),
        completion_tokens=len(completion),
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = _masked_nll(base, example)
    with torch.no_grad():
        full_logits = base(input_ids=torch.tensor([example.input_ids])).logits[0, :-1].float()
    full_sequence = float(torch.nn.functional.cross_entropy(full_logits, torch.tensor(example.input_ids[1:])))
    logs: list[dict[str, float]] = []
    result = train_sft(
        model_dir,
        [example],
        SFTSettings(
            learning_rate=1e-2,
            num_train_epochs=1,
            max_steps=1,
            per_device_batch_size=1,
            gradient_accumulation_steps=1,
            max_length=4096,
            dtype="bfloat16",  # ignored on CPU: the tiny model trains in float32
            gradient_checkpointing=False,
            save_steps=1000,
        ),
        tmp_path,
        on_log=lambda m, step: logs.append(m),
    )
    assert result.global_step == 1 and result.examples == 1
    first = next(m["train/loss"] for m in logs if "train/loss" in m)
    assert math.isfinite(first) and math.isfinite(result.train_loss)
    # The step's loss is the NLL of the supervised turn, not of the whole sequence.
    assert abs(first - expected) < 1e-3, (first, expected, full_sequence)
    assert abs(full_sequence - expected) > 1e-2
    assert (result.checkpoint / "COMPLETE").exists()
    trained = AutoModelForCausalLM.from_pretrained(result.checkpoint, dtype=torch.float32)
    before = dict(base.named_parameters())
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) >= len(before) // 2, moved
    assert _masked_nll(trained.eval(), example) < expected
    reloaded = AutoTokenizer.from_pretrained(result.checkpoint)
    assert reloaded.chat_template == tok.chat_template
