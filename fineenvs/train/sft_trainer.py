"""SFT on a teacher's recorded sessions: one example per assistant turn, trained with TRL's SFTTrainer.

Dataset (published SFT baseline): every assistant turn of a kept teacher session is one example,
its context the conversation so far, the loss on that turn only. The proxy recorded each model call's
canonical request (messages, tools) and response message; a call *is* an assistant turn. The
teacher's token ids are not the student's (another tokenizer, another template), so the turn is
rendered again with the **student's** chat template, exactly as the student will meet it when
served: the prompt is the template's rendering of the context with the generation prompt (what the
engine sends the student), the completion is the assistant turn as the template renders it in a
conversation, minus the header the generation prompt already opened, up to and including the
end-of-turn token (glue the template adds after it, such as Qwen's ``\\n``, is not something the
model samples). Every example is marked ``rerendered=True`` with ``RERENDER_REASON``.

Turns that are not examples: retries the agent abandoned (the trajectory graph's ``discarded``
calls), turns cut by the output cap (``finish_reason == "length"``: the teacher never ended them),
empty replies, turns the student's template cannot render, and examples over ``max_length``
tokens (dropped, never truncated: truncation would cut the supervised turn itself). Each is counted
by reason.

Training: ``train_sft`` runs TRL's ``SFTTrainer`` (full fine-tune) on the pre-tokenized
``input_ids`` + ``assistant_masks`` rows and writes an HF-layout checkpoint (model, tokenizer,
generation config) that the embedded engine, vLLM and the evaluation job load as a model.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fineenvs.jsonl import JsonObject
from fineenvs.train.sft_config import SFTSettings
from fineenvs.trajectory.record import CallRecord, calls_to_nodes

if TYPE_CHECKING:
    from transformers import (
        PreTrainedTokenizerBase,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from trl.trainer.sft_config import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

RERENDER_REASON = (
    "teacher tokens are not the student's: the teacher's recorded messages and tools were rendered "
    "with the student's chat template (prompt = context + generation prompt, loss on the assistant "
    "turn through its end-of-turn token)"
)


class SFTDataError(ValueError):
    """The teacher data cannot be turned into SFT examples; the message says why and what to do."""


# --------------------------------------------------------------------------- sessions and examples


@dataclass(frozen=True)
class TeacherSession:
    """One kept teacher rollout: its recorded calls as the proxy store returns them."""

    task_id: str
    harness: str
    session_id: str
    calls: list[CallRecord]
    """``CallStore.read_session(...)["calls"]``: the SFT data are their ``request.messages``,
    ``request.tools`` and ``response`` (the token ids are the teacher's, not the student's)."""


@dataclass
class SFTExample:
    input_ids: list[int]
    assistant_masks: list[int]
    task_id: str
    harness: str
    session_id: str
    call_id: str
    turn: int
    """Position of the call among the session's calls (arrival order)."""
    prompt_tokens: int
    completion_tokens: int
    rerendered: bool = True
    rerender_reason: str = RERENDER_REASON


@dataclass
class DatasetStats:
    sessions: dict[str, int] = field(default_factory=dict)
    """Kept teacher sessions per harness (published: 801 OpenCode, 3,189 over four harnesses)."""
    examples: dict[str, int] = field(default_factory=dict)
    """Examples per harness (published: 4,825 OpenCode, 17,929 over four harnesses)."""
    tokens: dict[str, int] = field(default_factory=dict)
    supervised_tokens: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    """Turns that did not become examples, by reason."""

    def to_json(self) -> JsonObject:
        total = {
            k: sum(getattr(self, k).values()) for k in ("sessions", "examples", "tokens", "supervised_tokens")
        }
        return {**asdict(self), "total": total}


class StudentRenderer:
    """Renders one recorded assistant turn with the student's chat template, as the engine would.

    ``chat_template`` overrides the tokenizer's own (the patched serving template of a vLLM-served
    family); ``template_kwargs`` are the model's ``chat_template_kwargs``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        eos = set(eos_token_ids or ())
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        if not eos:
            raise SFTDataError(
                "the student tokenizer has no end-of-turn (eos) token: the supervised turn must end with the "
                "token that stops generation. Set eos_token in its tokenizer_config.json or pass eos_token_ids."
            )
        self.eos_token_ids = frozenset(eos)

    def _text(
        self, messages: list[JsonObject], tools: list[JsonObject] | None, *, add_generation_prompt: bool
    ) -> str:
        kwargs: JsonObject = dict(self.template_kwargs)
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=[*tools] if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        # As the engine and vLLM do: the rendered text already holds every special token.
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def render_turn(
        self, context: list[JsonObject], tools: list[JsonObject] | None, response: JsonObject
    ) -> tuple[list[int], list[int]]:
        """``(prompt_ids, completion_ids)`` of one assistant turn; the completion ends at end-of-turn."""
        from fineenvs.engine.server import _prepare_messages

        ctx = _prepare_messages(context)
        reply = _prepare_messages([response])[0]
        prompt = self._text(ctx, tools, add_generation_prompt=True)
        full = self._text([*ctx, reply], tools, add_generation_prompt=False)
        if full.startswith(prompt):
            completion = full[len(prompt) :]
        else:
            # The generation prompt differs from the header of a rendered assistant turn (LFM2.5
            # served with a closed thinking block: the prompt ends in `<think></think>`, history
            # turns do not carry it). The model continues the prompt, so the completion is the
            # rendered turn minus the part of its header the generation prompt already opened.
            base = self._text(ctx, tools, add_generation_prompt=False)
            if not (full.startswith(base) and prompt.startswith(base)):
                raise SFTDataError(
                    "the student's template renders the context differently once the assistant turn is "
                    "appended (the conversation is not a prefix of itself plus one turn), so the turn cannot "
                    "be isolated"
                )
            header, turn = prompt[len(base) :], full[len(base) :]
            shared = 0
            while shared < min(len(header), len(turn)) and header[shared] == turn[shared]:
                shared += 1
            completion = turn[shared:]
        prompt_ids = self.encode(prompt)
        completion_ids = self.encode(completion)
        ends = [i for i, t in enumerate(completion_ids) if t in self.eos_token_ids]
        if not ends:
            raise SFTDataError(
                f"the student's template renders the assistant turn without an end-of-turn token "
                f"{sorted(self.eos_token_ids)}: the student would never learn to stop"
            )
        completion_ids = completion_ids[: ends[-1] + 1]
        if len(completion_ids) < 2:
            raise SFTDataError("the rendered assistant turn is empty (only its end-of-turn token)")
        return prompt_ids, completion_ids


def _discarded_calls(calls: list[CallRecord]) -> set[str]:
    """Retries the agent abandoned, by the trajectory graph's rule (needs recorded prompt ids)."""
    if not calls or any(not c.get("prompt_ids") for c in calls):
        return set()
    from fineenvs.trajectory import TrajectoryGraph

    return TrajectoryGraph(calls_to_nodes(calls)).discarded()


def session_examples(
    session: TeacherSession,
    renderer: StudentRenderer,
    *,
    max_length: int,
    drop_auxiliary: bool = False,
    skipped: Counter[str] | None = None,
) -> list[SFTExample]:
    """One example per assistant turn of ``session`` (see the module docstring for what is left out)."""
    skipped = Counter() if skipped is None else skipped
    discarded = _discarded_calls(session.calls)
    any_tools = any(c.get("has_tools") or c.get("request", {}).get("tools") for c in session.calls)
    out: list[SFTExample] = []
    for turn, call in enumerate(session.calls):
        call_id = str(call.get("call_id", turn))
        request = call.get("request") or {}
        response = call.get("response")
        tools = request.get("tools")
        if call_id in discarded:
            skipped["retry_discarded"] += 1
            continue
        if call.get("finish_reason") == "length":
            skipped["cut_by_output_cap"] += 1
            continue
        if not isinstance(response, dict) or not (response.get("content") or response.get("tool_calls")):
            skipped["empty_reply"] += 1
            continue
        if drop_auxiliary and any_tools and not tools:
            skipped["auxiliary_call"] += 1
            continue
        try:
            prompt_ids, completion_ids = renderer.render_turn(
                list(request.get("messages") or []), tools, response
            )
        except Exception:  # noqa: BLE001 - one unrenderable turn (odd role, bad arguments) is counted, not fatal
            skipped["template_cannot_render"] += 1
            continue
        n = len(prompt_ids) + len(completion_ids)
        if n > max_length:
            skipped["over_max_length"] += 1
            continue
        out.append(
            SFTExample(
                input_ids=prompt_ids + completion_ids,
                assistant_masks=[0] * len(prompt_ids) + [1] * len(completion_ids),
                task_id=session.task_id,
                harness=session.harness,
                session_id=session.session_id,
                call_id=call_id,
                turn=turn,
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(completion_ids),
            )
        )
    return out


def build_sft_examples(
    sessions: Iterable[TeacherSession],
    renderer: StudentRenderer,
    *,
    harnesses: Sequence[str] | None = None,
    max_length: int,
    drop_auxiliary: bool = False,
) -> tuple[list[SFTExample], DatasetStats]:
    """Examples of the sessions whose harness is in ``harnesses`` (None: all): a per-harness subset
    or the union."""
    wanted = set(harnesses) if harnesses is not None else None
    stats = DatasetStats()
    skipped: Counter[str] = Counter()
    examples: list[SFTExample] = []
    for session in sessions:
        if wanted is not None and session.harness not in wanted:
            continue
        got = session_examples(
            session, renderer, max_length=max_length, drop_auxiliary=drop_auxiliary, skipped=skipped
        )
        h = session.harness
        stats.sessions[h] = stats.sessions.get(h, 0) + 1
        stats.examples[h] = stats.examples.get(h, 0) + len(got)
        stats.tokens[h] = stats.tokens.get(h, 0) + sum(len(e.input_ids) for e in got)
        stats.supervised_tokens[h] = stats.supervised_tokens.get(h, 0) + sum(e.completion_tokens for e in got)
        examples += got
    stats.skipped = dict(skipped)
    return examples, stats


def merge_turns(examples: Sequence[SFTExample]) -> list[SFTExample]:
    """One example per chain of turns whose contexts extend each other (the same supervised tokens
    in the same contexts, each context forwarded once instead of once per later turn).

    A turn joins the previous example of its session when that example's tokens (prompt and
    supervised turn) are exactly a prefix of the turn's own; the merged example is the longer one
    with every earlier turn's supervised positions kept. A session whose agent rewrote its history
    (Claude Code) keeps a new example where the prefix breaks. What changes is the weighting: TRL
    averages the loss over the supervised tokens of a micro-batch, so a merged rollout's turns share
    one mean instead of one mean each.
    """
    out: list[SFTExample] = []
    for e in examples:
        last = out[-1] if out else None
        if (
            last is not None
            and last.session_id == e.session_id
            and len(e.input_ids) > len(last.input_ids)
            and e.input_ids[: len(last.input_ids)] == last.input_ids
        ):
            masks = list(last.assistant_masks) + e.assistant_masks[len(last.assistant_masks) :]
            out[-1] = dataclasses.replace(
                e,
                assistant_masks=masks,
                call_id=f"{last.call_id}+{e.call_id}",
                turn=last.turn,
                completion_tokens=last.completion_tokens + e.completion_tokens,
            )
        else:
            out.append(e)
    return out


def write_examples(path: Path, examples: Sequence[SFTExample]) -> None:
    """The dataset as JSON lines (token ids, masks, provenance, the re-render mark)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps(asdict(e)) + "\n")


def read_examples(path: Path) -> list[SFTExample]:
    with path.open(encoding="utf-8") as f:
        return [SFTExample(**json.loads(line)) for line in f if line.strip()]


# --------------------------------------------------------------------------- training


@dataclass
class SFTResult:
    checkpoint: Path
    global_step: int
    train_loss: float
    examples: int
    metrics: dict[str, float]


def train_sft(
    model_dir: Path,
    examples: Sequence[SFTExample],
    settings: SFTSettings,
    output_dir: Path,
    *,
    on_log: Callable[[dict[str, float], int], None] | None = None,
) -> SFTResult:
    """Full fine-tune of ``model_dir`` on ``examples``; returns the final checkpoint (HF layout).

    TRL's intermediate checkpoints go to ``output_dir/trainer`` every ``save_steps`` and a rerun
    resumes from the newest one; the final model goes to ``output_dir/checkpoints/step-<N>``
    (``COMPLETE`` written last).
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.sft_trainer import SFTTrainer

    _check_examples(examples)
    settings.check()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_dict(
        {
            "input_ids": [e.input_ids for e in examples],
            "assistant_masks": [e.assistant_masks for e in examples],
        }
    )
    trainer_dir = output_dir / "trainer"
    trainer = SFTTrainer(
        model=model,
        args=_sft_config(settings, trainer_dir, on_gpu=torch.cuda.is_available()),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[_log_forwarder(on_log)],
    )
    resume = _latest_trainer_checkpoint(trainer_dir)
    result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    step = int(trainer.state.global_step)
    final = _save_final(trainer, tokenizer, output_dir / "checkpoints" / f"step-{step}")
    metrics = {k: float(v) for k, v in result.metrics.items() if isinstance(v, int | float)}
    return SFTResult(final, step, float(result.training_loss), len(examples), metrics)


def _check_examples(examples: Sequence[SFTExample]) -> None:
    if not examples:
        raise SFTDataError(
            "no SFT examples: the teacher collection kept no usable turn for the selected harnesses. Check "
            "the teacher summary (kept rollouts per harness) and that run.harness names harnesses it ran."
        )
    for e in examples:
        if len(e.input_ids) != len(e.assistant_masks) or 1 not in e.assistant_masks:
            raise SFTDataError(
                f"example {e.session_id}/{e.call_id}: input_ids and assistant_masks differ in length or nothing is "
                "supervised; rebuild the dataset with build_sft_examples"
            )


def _sft_config(settings: SFTSettings, trainer_dir: Path, *, on_gpu: bool) -> SFTConfig:
    """TRL's configuration for ``settings``; on CPU everything runs in float32."""
    from trl.trainer.sft_config import SFTConfig

    dtype = settings.dtype if on_gpu else "float32"
    return SFTConfig(
        output_dir=str(trainer_dir),
        learning_rate=settings.learning_rate,
        lr_scheduler_type=settings.lr_scheduler_type,
        warmup_steps=settings.warmup_steps,
        num_train_epochs=settings.num_train_epochs,
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.per_device_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        max_length=settings.max_length,
        gradient_checkpointing=settings.gradient_checkpointing,
        bf16=on_gpu and dtype == "bfloat16",
        fp16=on_gpu and dtype == "float16",
        use_cpu=not on_gpu,
        seed=settings.seed,
        save_strategy="steps",
        save_steps=settings.save_steps,
        save_total_limit=2,  # resumable without keeping every full-model + optimizer state
        logging_steps=1,
        report_to="none",
        dataset_num_proc=None,
        disable_tqdm=True,
    )


def _log_forwarder(on_log: Callable[[dict[str, float], int], None] | None) -> TrainerCallback:
    """A callback handing each of TRL's numeric logs to ``on_log`` as ``train/<name>``."""
    from transformers import TrainerCallback

    class _Forward(TrainerCallback):
        def on_log(
            self,
            args: TrainingArguments,
            state: TrainerState,
            control: TrainerControl,
            logs: dict[str, object] | None = None,
            **kw: object,
        ) -> None:
            plain = {f"train/{k}": float(v) for k, v in (logs or {}).items() if isinstance(v, int | float)}
            if plain and on_log is not None:
                on_log(plain, int(state.global_step))

    return _Forward()


def _save_final(trainer: SFTTrainer, tokenizer: PreTrainedTokenizerBase, final: Path) -> Path:
    """Save the trained model to ``final`` through a ``.partial`` folder, ``COMPLETE`` written last."""
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    trainer.save_model(str(partial))
    tokenizer.save_pretrained(str(partial))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    (final / "COMPLETE").write_text("ok\n")
    return final


def _latest_trainer_checkpoint(trainer_dir: Path) -> Path | None:
    found = sorted(
        (p for p in trainer_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    return found[-1] if found else None
