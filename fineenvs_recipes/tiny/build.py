"""Tiny, random-initialised, fully offline models in the shape of the seed models.

Nothing can be downloaded from the Hub in CI, so each tiny model is built here: a byte-level BPE
tokenizer trained on a generated corpus (``corpus.py``), the family's real chat template with
tool support (``templates.py``), and a random-initialised transformers model of the family's
architecture. Same name and seed give byte-identical files, so a cached model is as good as a
freshly built one.

- ``tiny_qwen``: Qwen3 architecture (attention only), Qwen2.5's Hermes template
  (``<tool_call>{"name": .., "arguments": ..}</tool_call>``, results in ``<tool_response>``).
- ``tiny_lfm2``: LFM2 hybrid (short-convolution + attention layers), LFM2.5 template
  (pythonic ``<|tool_call_start|>[f(a='x')]<|tool_call_end|>``) with closed thinking.
- ``tiny_qwen3_5``: Qwen3.5 hybrid (gated-delta-net linear attention + full attention),
  Qwen3.5's non-thinking template (XML ``<function=..><parameter=..>`` calls).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fineenvs.engine.toolcalls import ToolCallFormat
from fineenvs.paths import models_cache
from fineenvs_recipes.tiny.corpus import generate_corpus
from fineenvs_recipes.tiny.templates import lfm2_closed_thinking_template, trl_template

# Large enough for real agent system prompts tokenised with a 1k vocabulary (roughly 2.5
# characters per token), small enough that nothing allocates per-position state up front.
MAX_CONTEXT = 32768
VOCAB_SIZE = 1024
AGENT_VOCAB_SIZE = 8192  # tiny_agent's: 3.6-4.4 characters per token on agents' prompts
HIDDEN = 64
# Random init at the usual 0.02 gives near-uniform next-token distributions. Widening the init
# peaks them but inflates activations, and Qwen3.5's gated delta rule then drifts up to 5e-4
# between step-by-step decoding and a full forward pass in float32. So the weights stay small
# and the final norm gets a gain instead: logits are peaked (entropy ~5 nats of 6.9) while the
# decode-vs-forward drift stays ~1e-5, far inside the 1e-4 logprob contract.
INIT_RANGE = 0.1
OUTPUT_GAIN = 3.0
# HF's two gated-delta-rule paths (chunked for prompts and full forward passes, recurrent for
# decoding) disagree by up to 1.4e-4 in logprob at this init (measured over prompts of 20-300
# tokens; 2.5e-5 even in float64). Shrinking the linear-attention input projections 4x brings
# the worst case to 1.3e-5, so the tiny Qwen3.5 meets the 1e-4 contract with margin.
LINEAR_ATTENTION_IN_SCALE = 0.25
# Bump when the build recipe changes, so stale caches are not reused.
BUILD_VERSION = 3


@dataclass(frozen=True)
class TinyModelSpec:
    """What a tiny model is: its family, tool-call format and tokenizer contract."""

    name: str
    family: str
    tool_call_format: ToolCallFormat
    special_tokens: tuple[str, ...]  # control tokens: trained as specials, skipped when decoding
    added_tokens: tuple[str, ...]  # single tokens that decode as text (tool and thinking markers)
    bos_token: str | None
    eos_token: str
    pad_token: str
    stop_tokens: tuple[str, ...]  # generation_config eos ids: end-of-turn and end-of-text
    chat_template: Callable[[], str]
    build_config: Callable[[dict[str, int]], Any]  # token ids -> transformers config
    vocab_size: int = VOCAB_SIZE
    agent_text: bool = False
    """Learn the vocabulary from real agents' prompts too (``agent_corpus.py``), not only from the
    generated corpus: ~4 characters per token on agent prompts instead of ~1.9."""


def _qwen3_config(
    ids: dict[str, int],
    *,
    vocab_size: int = VOCAB_SIZE,
    hidden: int = HIDDEN,
    intermediate: int = 128,
    layers: int = 4,
    heads: int = 4,
    head_dim: int = 16,
) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=MAX_CONTEXT,
        tie_word_embeddings=True,
        initializer_range=INIT_RANGE,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def _lfm2_config(ids: dict[str, int]) -> Any:
    from transformers import Lfm2Config

    return Lfm2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=128,
        block_auto_adjust_ff_dim=False,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        max_position_embeddings=MAX_CONTEXT,
        tie_word_embeddings=True,
        initializer_range=INIT_RANGE,
        bos_token_id=ids["<|startoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|pad|>"],
    )


def _qwen3_5_config(ids: dict[str, int]) -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=MAX_CONTEXT,
        tie_word_embeddings=True,
        initializer_range=INIT_RANGE,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


_THINK = ("<think>", "</think>")
_QWEN_TOOL_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

TINY_MODELS: dict[str, TinyModelSpec] = {
    "tiny_qwen": TinyModelSpec(
        name="tiny_qwen",
        family="qwen3",
        tool_call_format="hermes",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added_tokens=_QWEN_TOOL_MARKERS + _THINK,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        chat_template=lambda: trl_template("qwen2_5"),
        build_config=_qwen3_config,
    ),
    "tiny_lfm2": TinyModelSpec(
        name="tiny_lfm2",
        family="lfm2",
        tool_call_format="lfm2",
        special_tokens=(
            "<|pad|>",
            "<|startoftext|>",
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|tool_list_start|>",
            "<|tool_list_end|>",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            "<|tool_response_start|>",
            "<|tool_response_end|>",
        ),
        added_tokens=_THINK,
        bos_token="<|startoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        chat_template=lfm2_closed_thinking_template,
        build_config=_lfm2_config,
    ),
    "tiny_qwen3_5": TinyModelSpec(
        name="tiny_qwen3_5",
        family="qwen3_5",
        tool_call_format="qwen3_xml",
        special_tokens=(
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|image_pad|>",
            "<|video_pad|>",
        ),
        added_tokens=_QWEN_TOOL_MARKERS + _THINK,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        chat_template=lambda: trl_template("qwen3_5_nothink"),
        build_config=_qwen3_5_config,
    ),
    # The mini-reproduction's student (experiments/mini_repro/): tiny_qwen's architecture and
    # template, wider, with a vocabulary learnt from real agents' prompts so that every agent of
    # the paper's mix fits its context (Claude Code's first request: 44k tokens with tiny_qwen's
    # 1k vocabulary, ~21k with this one).
    "tiny_agent": TinyModelSpec(
        name="tiny_agent",
        family="qwen3",
        tool_call_format="hermes",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added_tokens=_QWEN_TOOL_MARKERS + _THINK,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        chat_template=lambda: trl_template("qwen2_5"),
        build_config=lambda ids: _qwen3_config(
            ids, vocab_size=AGENT_VOCAB_SIZE, hidden=128, intermediate=384, heads=4, head_dim=32
        ),
        vocab_size=AGENT_VOCAB_SIZE,
        agent_text=True,
    ),
}


def _train_tokenizer(spec: TinyModelSpec) -> Any:
    """Train the byte-level BPE; specials first (ids 0..k-1), added markers last."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=True, normalized=False) for t in spec.special_tokens]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(spec.added_tokens),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = list(generate_corpus())
    if spec.agent_text:
        from fineenvs_recipes.tiny.agent_corpus import agent_prompt_texts

        corpus += agent_prompt_texts()
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added_tokens])
    if tok.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(
            f"{spec.name}: tokenizer has {tok.get_vocab_size()} tokens, expected {spec.vocab_size}"
        )
    return tok


def _set_output_gain(model: Any, gain: float) -> None:
    """Scale the final norm (the last op before the tied output head) by ``gain``."""
    import torch

    names = ("model.norm.weight", "model.embedding_norm.weight")
    params = dict(model.named_parameters())
    weight = next(params[n] for n in names if n in params)
    with torch.no_grad():
        if bool((weight == 0).all()):  # zero-centred RMSNorm (Qwen3.5): scale is 1 + weight
            weight.fill_(gain - 1.0)
        else:
            weight.fill_(gain)


def _scale_linear_attention_inputs(model: Any, scale: float) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".linear_attn.in_proj" in name:
                param.mul_(scale)


def _build(spec: TinyModelSpec, seed: int, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    raw = _train_tokenizer(spec)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        model_max_length=MAX_CONTEXT,
    )
    tokenizer.chat_template = spec.chat_template()
    ids = {t: raw.token_to_id(t) for t in (*spec.special_tokens, *spec.added_tokens)}

    config = spec.build_config(ids)
    config.dtype = "float32"
    # Read by the engine and the trainer: the dtype the logprob contract was measured in, the
    # context limit, the tool-call parser to use, and where the model came from.
    config.fineenvs = {
        "tiny_model": spec.name,
        "seed": seed,
        "build_version": BUILD_VERSION,
        "dtype": "float32",
        "max_context": MAX_CONTEXT,
        "tool_call_format": spec.tool_call_format,
    }
    if spec.agent_text:
        config.fineenvs["corpus"] = _corpus_digest(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _set_output_gain(model, OUTPUT_GAIN)
    _scale_linear_attention_inputs(model, LINEAR_ATTENTION_IN_SCALE)
    model.generation_config = GenerationConfig(
        bos_token_id=ids.get(spec.bos_token) if spec.bos_token else None,
        eos_token_id=[ids[t] for t in spec.stop_tokens],
        pad_token_id=ids[spec.pad_token],
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "fineenvs_tiny.json").write_text(json.dumps(config.fineenvs, indent=2, sort_keys=True) + "\n")


def _corpus_digest(spec: TinyModelSpec) -> str | None:
    """What the vocabulary was learnt from, beyond the code: the shipped agent text's digest."""
    if not spec.agent_text:
        return None
    from fineenvs_recipes.tiny.agent_corpus import AGENT_PROMPTS

    return hashlib.sha256(AGENT_PROMPTS.read_bytes()).hexdigest()[:16]


def tiny_model_config(name: str) -> dict[str, Any]:
    """A tiny model's ``config.json`` content, without building it (token ids are placeholders)."""
    spec = TINY_MODELS[name]
    ids: dict[str, int] = {token: i for i, token in enumerate(spec.special_tokens + spec.added_tokens)}
    config: dict[str, Any] = spec.build_config(ids).to_dict()
    return config


def tiny_model_path(name: str, seed: int = 0, root: Path | None = None) -> Path:
    """Where ``ensure_tiny_model(name, seed)`` puts the model (nothing is built)."""
    return (root if root is not None else models_cache()) / f"{name}-s{seed}"


def ensure_tiny_model(name: str, seed: int = 0, root: Path | None = None) -> Path:
    """Build (once) and return the directory of tiny model ``name`` with weights from ``seed``.

    The directory loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``. It is built in a temporary sibling and renamed into place,
    so concurrent callers never see a half-written model.
    """
    spec = TINY_MODELS.get(name)
    if spec is None:
        raise KeyError(f"unknown tiny model {name!r}: choose one of {sorted(TINY_MODELS)}")
    final = tiny_model_path(name, seed, root)
    base = final.parent
    base.mkdir(parents=True, exist_ok=True)
    marker = final / "fineenvs_tiny.json"
    if marker.is_file():
        built = json.loads(marker.read_text())
        if built.get("build_version") == BUILD_VERSION and built.get("corpus") == _corpus_digest(spec):
            return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-s{seed}.", dir=base))
    try:
        _build(spec, seed, tmp)
        # mkdtemp and safetensors create owner-only files; the cache is shared by users and CI.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        if final.exists():  # stale build version, or a leftover without its marker
            stale = Path(tempfile.mkdtemp(prefix=f".{name}-s{seed}.stale.", dir=base))
            try:
                os.rename(final, stale / "old")
            except OSError:
                pass  # someone else replaced it meanwhile
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost a race with another builder: its copy is byte-identical, keep it.
            if not marker.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
