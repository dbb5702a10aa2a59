from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fineenvs_recipes.tiny import TINY_MODELS, ensure_tiny_model
from fineenvs_recipes.tiny.templates import trl_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "thanks"},
]

# What each format must render for the conversation above: the tool list, the call, the result.
EXPECTED = {
    "hermes": [
        '"name": "get_weather"',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>",
    ],
    "lfm2": [
        'List of tools: [{"type": "function"',
        "<|im_start|>assistant\n<|tool_call_start|>[get_weather(city='Paris', days=3)]<|tool_call_end|><|im_end|>",
        "<|im_start|>tool\nsunny, 21C<|im_end|>",
    ],
    "qwen3_xml": [
        "<tools>\n{",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>",
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>",
    ],
}
GENERATION_PROMPT = {
    "hermes": "<|im_start|>assistant\n",
    "lfm2": "<|im_start|>assistant\n<think></think>",
    "qwen3_xml": "<|im_start|>assistant\n<think>\n\n</think>\n\n",
}
MARKERS = {
    "hermes": [
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ],
    "lfm2": [
        "<|startoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|tool_call_start|>",
        "<|tool_call_end|>",
        "<think>",
        "</think>",
    ],
    "qwen3_xml": [
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "<think>",
        "</think>",
    ],
}


def test_forward_and_generate_on_cpu(tiny_model_name: str, tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    vocab = TINY_MODELS[tiny_model_name].vocab_size
    # Tiny enough to train on a CPU in minutes; tiny_agent's 8k vocabulary is most of its weights.
    assert 100_000 <= n_params <= (500_000 if vocab == 1024 else 4_000_000)
    assert model.config.max_position_embeddings >= 4096
    assert model.dtype == torch.float32
    assert len(tok) == model.config.vocab_size == vocab
    assert model.config.fineenvs["tool_call_format"] == TINY_MODELS[tiny_model_name].tool_call_format
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], vocab)
    assert torch.isfinite(logits).all()
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=8, do_sample=True, top_k=0, top_p=1.0)
    new = out[0, enc["input_ids"].shape[1] :]
    assert 1 <= len(new) <= 8
    assert all(0 <= int(t) < vocab for t in new)


def test_chat_template_renders_tools_calls_and_results(tiny_model_name: str, tiny_model_dir: Path) -> None:
    fmt = TINY_MODELS[tiny_model_name].tool_call_format
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    for fragment in EXPECTED[fmt]:
        assert fragment in text, f"{fragment!r} missing from:\n{text}"
    assert text.endswith(GENERATION_PROMPT[fmt])
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids) == text  # byte-level BPE round-trips the whole prompt
    for marker in MARKERS[fmt]:
        marker_ids = tok.encode(marker, add_special_tokens=False)
        assert len(marker_ids) == 1, f"{marker!r} is not a single token: {marker_ids}"
        assert marker_ids[0] in ids


def test_templates_are_trls(tiny_qwen_dir: Path, tiny_qwen3_5_dir: Path, tiny_lfm2_dir: Path) -> None:
    assert AutoTokenizer.from_pretrained(tiny_qwen_dir).chat_template == trl_template("qwen2_5")
    assert AutoTokenizer.from_pretrained(tiny_qwen3_5_dir).chat_template == trl_template("qwen3_5_nothink")
    lfm2 = AutoTokenizer.from_pretrained(tiny_lfm2_dir).chat_template
    assert lfm2 != trl_template("lfm2_2_5") and "<think></think>" in lfm2


def test_lfm2_thinking_can_be_reopened(tiny_lfm2_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_lfm2_dir)
    msgs = [{"role": "user", "content": "hi"}]
    thinking = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert thinking.endswith("<|im_start|>assistant\n")


def test_control_tokens_are_skipped_but_tool_markers_decode(tiny_qwen_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen_dir)
    ids = tok.encode("<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_same_seed_gives_byte_identical_files(name: str, tmp_path: Path) -> None:
    first = ensure_tiny_model(name, seed=3, root=tmp_path / "a")
    second = ensure_tiny_model(name, seed=3, root=tmp_path / "b")
    files = sorted(p.name for p in first.iterdir())
    assert {"model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"} <= set(files)
    assert files == sorted(p.name for p in second.iterdir())
    for file in files:
        assert (first / file).read_bytes() == (second / file).read_bytes(), file
    other = ensure_tiny_model(name, seed=4, root=tmp_path / "a")
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_cached_build_is_reused(tmp_path: Path) -> None:
    first = ensure_tiny_model("tiny_qwen", root=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model("tiny_qwen", root=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="tiny_qwen"):
        ensure_tiny_model("tiny_gpt")
