"""Chat templates of the tiny models: TRL's byte-identical copies of the real families' templates.

TRL's wheel ships the original Qwen2.5, LFM2.5 and Qwen3.5 templates (``trl/chat_templates``).
Using them unchanged (Qwen2.5, Qwen3.5) means TRL recognises the tiny tokenizers exactly as it
recognises the real ones (response schemas, ``{% generation %}`` training templates).
"""

from __future__ import annotations

from pathlib import Path

import trl

_TRL_TEMPLATES = Path(trl.__file__).resolve().parent / "chat_templates"

# The published LFM2.5 runs served a generation prompt that ends in an empty, closed thinking
# block (FineEnvs `runtime/models.py`: `<|im_start|>assistant\n<think>` rewritten to
# `...<think></think>`), so the model answers visibly instead of inside a reasoning block that
# vLLM's parser would swallow. TRL's copy of the template emits a bare `<|im_start|>assistant\n`;
# we apply the same end state: the prompt ends with `<think></think>` unless the caller asks for
# thinking (`chat_template_kwargs={"enable_thinking": true}`).
_LFM2_GEN_PROMPT = '{{- "<|im_start|>assistant\\n" -}}'
_LFM2_CLOSED_GEN_PROMPT = (
    '{{- "<|im_start|>assistant\\n" -}}\n'
    "    {%- if not (enable_thinking is defined and enable_thinking) -%}\n"
    '        {{- "<think></think>" -}}\n'
    "    {%- endif -%}"
)


def trl_template(name: str) -> str:
    """Return TRL's shipped template ``<name>.jinja`` (e.g. ``qwen2_5``, ``lfm2_2_5``)."""
    path = _TRL_TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        raise FileNotFoundError(
            f"TRL chat template {path} does not exist: fineenvs expects trl==1.16.0, which ships it. "
            "Reinstall with `pip install trl==1.16.0`."
        )
    return path.read_text(encoding="utf-8")


def lfm2_closed_thinking_template() -> str:
    """TRL's LFM2.5 template with the published closed-thinking generation prompt."""
    template = trl_template("lfm2_2_5")
    if template.count(_LFM2_GEN_PROMPT) != 1:
        raise RuntimeError(
            "TRL's lfm2_2_5.jinja no longer has the generation prompt fineenvs patches "
            f"({_LFM2_GEN_PROMPT!r}); the installed trl differs from the pinned 1.16.0."
        )
    return template.replace(_LFM2_GEN_PROMPT, _LFM2_CLOSED_GEN_PROMPT)
