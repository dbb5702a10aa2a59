"""The vLLM serve command, flag for flag against the published runs (published-system.md §2)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fineenvs.engine.vllm import (
    ServingProfile,
    VLLMServeArgs,
    build_serve_command,
    build_serve_env,
    check_generation_prompt_closed,
    generation_prompt,
    patch_template,
    prepare_chat_template,
    published_serve_args,
    serving_profile_of,
    trl_chat_template,
    write_chat_template,
)

TEMPLATE = Path("/run/out/chat_template.jinja")
NO_THINKING = '{"enable_thinking":false,"preserve_thinking":true}'
SAMPLING = '{"temperature":0.8,"top_p":1.0,"top_k":-1}'
QWEN_FLAGS = ["--limit-mm-per-prompt", '{"image":0,"video":0}', "--gdn-prefill-backend", "triton"]


def published(model: str, served: str, parser: str, dp: str) -> list[str]:
    """The published `serving_command` (FineEnvs runtime/models.py), transcribed."""
    return [
        "vllm", "serve", model, "--host", "127.0.0.1", "--port", "8000",
        "--served-model-name", served, "--dtype", "bfloat16", "--tensor-parallel-size", "1",
        "--data-parallel-size", dp, "--max-model-len", "131072", "--gpu-memory-utilization", "0.85",
        "--enable-auto-tool-choice", "--tool-call-parser", parser, "--chat-template", str(TEMPLATE),
        "--default-chat-template-kwargs", NO_THINKING, "--generation-config", "vllm",
        "--override-generation-config", SAMPLING, "--logprobs-mode", "processed_logprobs",
        "--return-tokens-as-token-ids", "--enforce-eager", "--no-enable-prefix-caching",
    ]  # fmt: skip


def test_lfm_training_command_is_the_published_one() -> None:
    args = published_serve_args("lfm", training=True, chat_template=TEMPLATE)
    expected = published("LiquidAI/LFM2.5-2.6B", "LiquidAI/LFM2.5-2.6B", "lfm2", "1")
    expected += ["--weight-transfer-config", '{"backend":"nccl"}']
    assert build_serve_command(args) == expected
    assert build_serve_env(args, base={})["VLLM_SERVER_DEV_MODE"] == "1"


def test_qwen_training_command_is_the_published_one() -> None:
    args = published_serve_args("qwen", training=True, chat_template=TEMPLATE)
    expected = published("Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-2B", "qwen3_xml", "1")
    expected += ["--weight-transfer-config", '{"backend":"nccl"}'] + QWEN_FLAGS
    assert build_serve_command(args) == expected


def test_checkpoint_eval_keeps_the_base_name_and_loads_eagerly() -> None:
    args = published_serve_args("lfm", training=False, chat_template=TEMPLATE, checkpoint="/ckpt/step-700")
    expected = published("/ckpt/step-700", "LiquidAI/LFM2.5-2.6B", "lfm2", "2")
    expected += ["--safetensors-load-strategy", "eager"]
    assert build_serve_command(args) == expected
    assert "VLLM_SERVER_DEV_MODE" not in build_serve_env(args, base={"VLLM_SERVER_DEV_MODE": "1"})


def test_teacher_command_uses_the_qwen_family_flags_without_weight_sync() -> None:
    args = published_serve_args("teacher", training=False, chat_template=TEMPLATE)
    assert (
        build_serve_command(args)
        == published("Qwen/Qwen3.8-27B", "Qwen/Qwen3.8-27B", "qwen3_xml", "2") + QWEN_FLAGS
    )
    with pytest.raises(ValueError, match="never trained"):
        published_serve_args("teacher", training=True)


def test_sampling_overrides_and_switches_reach_the_command() -> None:
    args = VLLMServeArgs(
        model="/models/lfm",
        served_model_name="LiquidAI/LFM2.5-2.6B",
        temperature=1.0,
        top_k=0,
        enforce_eager=False,
        enable_prefix_caching=True,
        tensor_parallel_size=2,
        extra_args=["--seed", "7"],
    )
    cmd = build_serve_command(args)
    assert json.loads(cmd[cmd.index("--override-generation-config") + 1]) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
    }
    assert "--enforce-eager" not in cmd and "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[-2:] == ["--seed", "7"]
    assert "--chat-template" not in cmd  # only prepare_chat_template supplies one
    assert cmd[cmd.index("--tool-call-parser") + 1] == "lfm2"  # family from the served name


def test_generic_model_gets_no_tool_parser_and_reload_sync_needs_dev_mode() -> None:
    args = VLLMServeArgs(model="meta-llama/Llama-3.2-1B-Instruct", weight_sync="reload")
    cmd = build_serve_command(args)
    assert "--tool-call-parser" not in cmd and "--weight-transfer-config" not in cmd
    assert build_serve_env(args, base={})["VLLM_SERVER_DEV_MODE"] == "1"
    forced = VLLMServeArgs(model="x", tool_call_parser="hermes")
    assert (
        build_serve_command(forced)[build_serve_command(forced).index("--tool-call-parser") + 1] == "hermes"
    )


def test_separate_vllm_venv() -> None:
    args = VLLMServeArgs(model="Qwen/Qwen3.5-2B", python="/opt/vllm-venv/bin/python")
    assert build_serve_command(args)[:3] == ["/opt/vllm-venv/bin/vllm", "serve", "Qwen/Qwen3.5-2B"]
    env = build_serve_env(args, base={"PATH": "/usr/bin", "PYTHONPATH": "/trainer/site", "HOME": "/h"})
    assert env["PATH"] == "/opt/vllm-venv/bin:/usr/bin"
    assert env["VIRTUAL_ENV"] == "/opt/vllm-venv"
    assert "PYTHONPATH" not in env and env["HOME"] == "/h"


def test_bad_arguments_are_all_reported() -> None:
    with pytest.raises(ValueError) as info:
        VLLMServeArgs(model="m", port=70000, temperature=0.0, weight_sync="ipc", gpu_memory_utilization=1.5)
    message = str(info.value)
    for key in ("engine.port", "sampling.temperature", "engine.weight_sync", "engine.gpu_memory_utilization"):
        assert key in message


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("LiquidAI/LFM2.5-2.6B", ServingProfile.lfm2_5),
        ("/ckpt/LFM2_5-2.6B-step-50", ServingProfile.lfm2_5),
        ("Qwen/Qwen3.5-2B", ServingProfile.qwen3_5),
        ("Qwen/Qwen3.8-27B", ServingProfile.qwen3_8),
        ("Qwen/Qwen3-8B", ServingProfile.generic),
    ],
)
def test_serving_profile_of(name: str, family: ServingProfile) -> None:
    assert serving_profile_of(name) is family


@pytest.mark.parametrize(
    ("family", "tail"),
    [
        (ServingProfile.lfm2_5, "<|im_start|>assistant\n<think></think>"),
        (ServingProfile.qwen3_5, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        (ServingProfile.qwen3_8, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ],
)
def test_patched_templates_do_not_open_a_thinking_block(
    family: ServingProfile, tail: str, tmp_path: Path
) -> None:
    path = write_chat_template(family, tmp_path)
    # generation_prompt asks for thinking (enable_thinking=True): the patch must override the caller
    assert generation_prompt(path.read_text()).endswith(tail)
    check_generation_prompt_closed(path.read_text())


def test_unpatched_templates_are_caught() -> None:
    with pytest.raises(ValueError, match="still opens a thinking block"):
        check_generation_prompt_closed(trl_chat_template("qwen3_8.jinja"))
    with pytest.raises(ValueError, match="template changed"):
        patch_template(ServingProfile.lfm2_5, "{{ messages }}")


def test_hub_lfm_generation_prompt_is_closed_too() -> None:
    hub_style = trl_chat_template("lfm2_2_5.jinja").replace(
        '{{- "<|im_start|>assistant\\n" -}}', '{{- "<|im_start|>assistant\\n<think>" -}}'
    )
    assert generation_prompt(patch_template(ServingProfile.lfm2_5, hub_style)).endswith(
        "assistant\n<think></think>"
    )


def test_prepare_chat_template_writes_into_the_run_dir(tmp_path: Path) -> None:
    args = prepare_chat_template(published_serve_args("qwen", training=True), tmp_path)
    assert args.chat_template is not None and args.chat_template.parent == tmp_path
    cmd = build_serve_command(args)
    assert cmd[cmd.index("--chat-template") + 1] == str(args.chat_template)
    assert prepare_chat_template(VLLMServeArgs(model="Qwen/Qwen3-8B"), tmp_path).chat_template is None


def test_revision_is_passed_through_when_given() -> None:
    args = replace(published_serve_args("lfm", training=False, chat_template=TEMPLATE), revision="abc123")
    cmd = build_serve_command(args)
    assert cmd[cmd.index("--revision") + 1] == "abc123"


def test_cpu_platform_command_and_environment() -> None:
    """vLLM's CPU build: the same argv but the GPU memory fraction, compiled instead of eager (an
    eager CPU worker died on tiny first requests), the CPU knobs in the environment."""
    args = VLLMServeArgs(
        model="/models/tiny",
        platform="cpu",
        cpu_kvcache_gib=3,
        cpu_threads_bind="0-1",
        weight_sync="file_transfer",
    )
    cmd = build_serve_command(args)
    assert "--gpu-memory-utilization" not in cmd and "--enforce-eager" not in cmd
    # Whole prefills: the CPU build dies on a seeded request whose prefill is split.
    assert "--no-enable-chunked-prefill" in cmd and cmd[cmd.index("--max-num-batched-tokens") + 1] == "131072"
    short = build_serve_command(VLLMServeArgs(model="m", platform="cpu", max_model_len=512))
    # Short sequences keep vLLM's default batch.
    assert short[short.index("--max-num-batched-tokens") + 1] == "2048"
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend":"fineenvs_file"}'
    env = build_serve_env(args, base={"VLLM_CACHE_ROOT": "/cache/vllm"})
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("3", "0-1")
    assert env["VLLM_CACHE_ROOT"] == "/cache/vllm" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1"
    assert build_serve_env(VLLMServeArgs(model="m", platform="cpu"), base={})["VLLM_CACHE_ROOT"].endswith(
        "vllm/runtime-cache"
    )  # torch.compile's cache survives the run: a warm start takes ~30 s, not 50-90
    gpu = build_serve_command(VLLMServeArgs(model="m"))
    assert "--enforce-eager" in gpu and "--gpu-memory-utilization" in gpu  # the published command
    assert "--no-enable-chunked-prefill" not in gpu and "--max-num-batched-tokens" not in gpu
    eager_cpu = VLLMServeArgs(model="m", platform="cpu", enforce_eager=True)
    assert "--enforce-eager" in build_serve_command(eager_cpu)
    with pytest.raises(ValueError, match="engine.weight_sync=nccl broadcasts GPU to GPU"):
        VLLMServeArgs(model="m", platform="cpu", weight_sync="nccl")
    with pytest.raises(ValueError, match="engine.platform must be one of cuda, cpu"):
        VLLMServeArgs(model="m", platform="tpu")
