"""vLLM 0.33.0's own code checks what fineenvs sends it and what the stand-in answers.

The ``vllm`` tier runs in CI (``make test-vllm``). vLLM cannot serve on a CPU machine (its PyPI
wheel needs CUDA), but it imports there from a throwaway environment (``scripts/vllm-cpu-env.sh``:
CPU torch, ``vllm==0.33.0 --no-deps``, its non-CUDA requirements), which is enough for:

- its ``vllm serve`` argument parser and start-up validation (``vllm_argv.py``; vLLM's parser
  needs a platform for its config defaults, so ``current_platform`` is set to vLLM's
  ``CpuPlatform`` as ``vllm bench`` does; nothing is started);
- its pydantic protocol models (``ChatCompletionRequest``, ``ChatCompletionResponse``);
- its trainer-side NCCL weight-transfer engine (``NCCLTrainerWeightTransferEngine``,
  ``NCCLTrainerInitInfo``) from the trainer's own environment (``install-vllm-client``), with only
  its two CUDA-bound steps replaced: opening the NCCL communicator and the broadcast.

A missing environment fails these tests with the command that builds it; nothing is skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from fineenvs.engine.vllm import build_serve_command, prepare_chat_template

from .vllm_helpers import (
    VLLM_ARGV,
    fake_hub_cache,
    hub_snapshot,
    run_in_vllm_env,
    vllm_parse_many,
    vllm_python,
)

pytestmark = pytest.mark.vllm


def test_option_table_is_vllm_0_33s() -> None:
    """The stand-in parses with vLLM's option table: it must be the installed vLLM's."""
    done = subprocess.run(
        [str(vllm_python()), str(VLLM_ARGV), "options"], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    committed = json.loads((VLLM_ARGV.parent / "vllm_options.json").read_text())
    assert json.loads(done.stdout) == committed, (
        "fineenvs/engine/vllm_options.json is stale: regenerate it with "
        "`<vllm-cpu-env>/bin/python fineenvs/engine/vllm_argv.py options > fineenvs/engine/vllm_options.json`"
    )


def _compose(tmp_path: Path, *overrides: str) -> Any:
    from hydra import compose, initialize_config_dir

    from fineenvs.config import to_run_config
    from fineenvs.paths import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"output_dir={tmp_path}"])
    return to_run_config(cfg)


RECIPES = {
    "rl_multi": ("rl_multi",),
    "rl_multi_nccl": ("rl_multi", "engine.weight_sync=nccl"),
    "qwen_rl_multi": ("qwen_rl_multi",),
    "collect_teacher": ("collect_teacher",),
    "eval_dp2": ("eval", "engine.data_parallel_size=2"),
    "tiny_lfm2_standin": (
        "rl_multi",
        "model=tiny_lfm2",
        "engine.dtype=float32",
        "engine.max_model_len=32768",
    ),
}


def test_launcher_argv_passes_vllms_own_parser(tmp_path: Path) -> None:
    """Every recipe's serve command, parsed and validated by vLLM 0.33.0 itself (one import)."""
    from fineenvs.plan import vllm_args

    cases = []
    for name, (recipe, *extra) in sorted(RECIPES.items()):
        run = _compose(tmp_path / name, f"+experiment={recipe}", *extra)
        cases.append((name, replace(vllm_args(run), port=8123)))
    hub_ids = sorted({args.model for _, args in cases if not Path(args.model).exists()})
    assert "Qwen/Qwen3.8-27B" in hub_ids  # the teacher is served from the Hub
    hub = fake_hub_cache(tmp_path / "hf-cache", hub_ids)
    argvs = []
    for _, args in cases:
        if args.template_path is not None:
            # Blocker 1 of the GPU path, against vLLM's own validator: the command names a
            # template that is not written yet, and vLLM refuses to start.
            argvs.append(build_serve_command(args)[1:])
    unwritten = vllm_parse_many(argvs, hub)
    assert unwritten and all(
        not r["ok"] and "appears path-like, but doesn't exist" in r["error"] for r in unwritten
    ), unwritten
    for _, args in cases:
        prepare_chat_template(args)
    parsed = vllm_parse_many([build_serve_command(args)[1:] for _, args in cases], hub)
    for (name, args), result in zip(cases, parsed, strict=True):
        assert result["ok"], (name, result)
        got = result["args"]
        template = args.template_path
        # Offline, vLLM swaps a Hub id for its cached snapshot folder; a local path stays itself.
        resolved = hub_snapshot(hub, args.model) if args.model in hub_ids else args.model
        assert got["model_tag"] == args.model and got["engine_args.model"] == resolved, name
        assert got["served_model_name"] == [args.name]
        assert got["logprobs_mode"] == "processed_logprobs" == got["engine_args.logprobs_mode"]
        assert got["generation_config"] == "vllm"
        assert got["override_generation_config"] == {"temperature": 0.8, "top_p": 1.0, "top_k": -1}
        assert got["return_tokens_as_token_ids"] is True and got["enable_prefix_caching"] is False
        assert got["port"] == 8123 and got["host"] == "127.0.0.1"
        assert got["data_parallel_size"] == args.data_parallel_size
        assert got["chat_template"] == (None if template is None else str(template)), name
        assert got["enable_auto_tool_choice"] is True and got["tool_call_parser"] == args.tool_call_parser
        expected = {"backend": "nccl"} if args.weight_sync == "nccl" else None
        assert got["weight_transfer_config"] == expected, name
    names = dict(cases)
    assert names["rl_multi"].weight_sync == "reload" and names["rl_multi_nccl"].weight_sync == "nccl"
    assert names["collect_teacher"].weight_sync is None and names["eval_dp2"].data_parallel_size == 2


def test_vllm_refuses_what_the_standin_refuses(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    from fineenvs.engine.standin import StartupError, parse_serve_argv, startup_settings

    cases = [
        ["serve", str(tiny_qwen_dir), "--chat-template", str(tmp_path / "missing.jinja")],
        ["serve", str(tiny_qwen_dir), "--enable-auto-tool-choice"],
        ["serve", str(tiny_qwen_dir), "--no-such-flag"],
    ]
    for argv, result in zip(cases, vllm_parse_many(cases), strict=True):
        assert not result["ok"], argv
        with pytest.raises((StartupError, SystemExit)):
            startup_settings(parse_serve_argv(argv), {})


CHECK_REQUESTS = r"""
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
out = []
for body in json.load(sys.stdin):
    req = ChatCompletionRequest.model_validate(body)
    sp = req.to_sampling_params(body["max_tokens"], {})
    so = sp.structured_outputs
    out.append({"structured": None if so is None else {"json": so.json is not None, "json_object": bool(so.json_object)},
                "return_token_ids": req.return_token_ids, "return_weight_versions": req.return_weight_versions,
                "include_reasoning": req.include_reasoning, "logprobs": sp.logprobs, "temperature": sp.temperature,
                "top_p": sp.top_p, "top_k": sp.top_k, "min_p": sp.min_p, "n": sp.n, "max_tokens": sp.max_tokens})
print(json.dumps(out))
"""


def test_proxy_engine_requests_are_valid_vllm_chat_requests() -> None:
    from fineenvs.proxy.settings import ProxySettings, SamplingPolicy
    from fineenvs.proxy.upstream import build_engine_request

    settings = ProxySettings(
        served_model="m", sampling=SamplingPolicy(temperature=0.8), max_output_tokens=512
    )
    tools = [
        {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}}
    ]
    canonical = [
        {"messages": [{"role": "user", "content": "x"}]},
        {
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}],
            "tools": tools,
            "tool_choice": "auto",
            "temperature": 0.2,
            "top_p": 0.5,
            "top_k": 20,
            "include_reasoning": False,
            "max_tokens": 9000,
            "stream_options": {"include_usage": True},
        },
        {
            "messages": [{"role": "user", "content": "Title?"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": {"type": "object"}},
            },
        },
        {"messages": [{"role": "user", "content": "Title?"}], "response_format": {"type": "json_object"}},
    ]
    bodies = [build_engine_request(c, settings).body for c in canonical]
    checked = run_in_vllm_env(CHECK_REQUESTS, bodies)
    for got in checked:
        # Full-distribution sampling reaches vLLM's SamplingParams whatever the agent asked for,
        # with token ids, one logprob per token, the weight versions and the reasoning kept.
        assert got["return_token_ids"] and got["return_weight_versions"] and got["include_reasoning"]
        assert (got["temperature"], got["top_p"], got["top_k"], got["min_p"]) == (0.8, 1.0, -1, 0.0)
        assert got["logprobs"] == 0 and got["n"] == 1
    assert [g["max_tokens"] for g in checked] == [512] * 4
    # Structured output reaches vLLM's SamplingParams as the grammar it decodes under.
    assert [g["structured"] for g in checked] == [
        None,
        None,
        {"json": True, "json_object": False},
        {"json": False, "json_object": True},
    ]


CHECK_RESPONSE = r"""
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
reply = json.load(sys.stdin)
parsed = ChatCompletionResponse.model_validate(reply)
choice = parsed.choices[0]
print(json.dumps({"token_ids": choice.token_ids, "prompt_token_ids": parsed.prompt_token_ids,
                  "weight_versions": [{"version": s.version, "start": s.start, "end": s.end} for s in choice.weight_versions],
                  "tokens": [c.token for c in choice.logprobs.content], "finish": choice.finish_reason}))
"""


@pytest.fixture(scope="module")
def standin_url(tiny_qwen_dir: Path) -> Iterator[str]:
    from fineenvs.engine.server import serve_in_thread
    from fineenvs.engine.standin import create_standin_app, parse_serve_argv, startup_settings

    ns = parse_serve_argv(
        ["serve", str(tiny_qwen_dir), "--served-model-name", "tiny_qwen", "--logprobs-mode", "processed_logprobs",
         "--return-tokens-as-token-ids", "--weight-transfer-config", '{"backend":"nccl"}']
    )  # fmt: skip
    with serve_in_thread(create_standin_app(startup_settings(ns, {"VLLM_SERVER_DEV_MODE": "1"}))) as url:
        yield url


def test_standin_replies_parse_as_vllms_chat_response(standin_url: str) -> None:
    body = {
        "model": "tiny_qwen",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
        "return_weight_versions": True,
        "ignore_eos": True,
    }
    reply = httpx.post(standin_url + "/v1/chat/completions", json=body, timeout=60).json()
    got = run_in_vllm_env(CHECK_RESPONSE, reply)
    assert got["token_ids"] == reply["choices"][0]["token_ids"] and len(got["token_ids"]) == 6
    assert got["prompt_token_ids"] == reply["prompt_token_ids"]
    assert got["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert got["tokens"] == [f"token_id:{t}" for t in got["token_ids"]]


PUSH_WITH_VLLMS_TRAINER_ENGINE = r"""
import json, sys
from safetensors.torch import load_file
from fineenvs.engine.vllm_client import import_client

nccl = import_client()  # vLLM 0.33's trainer side, from the client folder
calls = []

class Group:  # stands in for vLLM's PyNcclCommunicator
    def destroy(self):
        calls.append({"destroy": True})

def open_endpoint(self, init_info):  # CUDA: PyNcclCommunicator over a TCPStore rendezvous
    calls.append({"open": {"rank": init_info.rank, "world_size": init_info.world_size, "packed": init_info.packed}})
    self.model_update_group = Group()

def broadcast(self, source, meta):  # CUDA: packed NCCL broadcast; vLLM's own metadata check runs
    calls.append({"broadcast": [name for name, _ in self._checked_iter(source, meta)]})

nccl.NCCLTrainerWeightTransferEngine._open_trainer_endpoint = open_endpoint
nccl.NCCLTrainerWeightTransferEngine._broadcast = broadcast
from fineenvs.engine.weights import VLLMNcclWeightSync

url, weights_file = sys.argv[1], sys.argv[2]
weights = load_file(weights_file)
sync = VLLMNcclWeightSync(url)
assert sync.push(weights, 1) == 1
assert sync.push(weights, 2) == 2
sync.close()
print(json.dumps(calls))
"""


def test_vllms_nccl_trainer_engine_drives_the_control_plane(
    standin_url: str, tiny_qwen_dir: Path, tmp_path: Path
) -> None:
    from fineenvs.engine.vllm_client import client_problem

    problem = client_problem()
    if problem:
        pytest.fail(problem)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            PUSH_WITH_VLLMS_TRAINER_ENGINE,
            standin_url,
            str(tiny_qwen_dir / "model.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    calls = json.loads(done.stdout.strip().splitlines()[-1])
    from safetensors.torch import load_file

    names = list(load_file(str(tiny_qwen_dir / "model.safetensors")))
    # vLLM's NCCLTrainerInitInfo needs rank= (the trainer is the sender, rank 0); world = 1 worker + trainer.
    assert calls[0] == {"open": {"rank": 0, "world_size": 2, "packed": True}}
    assert calls[1:] == [{"broadcast": names}, {"broadcast": names}, {"destroy": True}]
    events = httpx.get(standin_url + "/server_info").json()["standin"]["events"]
    kinds = [e["kind"] for e in events]
    round_ = ["pause", "start_weight_update", "update_weights", "finish_weight_update", "resume"]
    assert kinds == ["init_weight_transfer_engine", *round_, *round_, "shutdown_weight_transfer_engine"], (
        kinds
    )
    init = events[0]["init_info"]
    # What vLLM's build_worker_init_payload sends the workers (rank_offset 1: after the trainer).
    assert (init["rank_offset"], init["world_size"], init["packed"]) == (1, 2, True)
    assert [e["mode"] for e in events if e["kind"] == "pause"] == ["keep", "keep"]
    assert [e["parameters"] for e in events if e["kind"] == "update_weights"] == [len(names), len(names)]
    assert [e["weight_version"] for e in events if e["kind"] == "finish_weight_update"] == ["1", "2"]
