"""The vLLM stand-in honours the parts of vLLM 0.33's contract the GPU path relies on: its command
line, its start-up refusals, its response fields, and the dev-mode RL routes with vLLM's bodies
and pause semantics (503 in ``wait``/``abort``, frozen-and-queued in ``keep``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fineenvs.engine.standin import (
    StartupError,
    create_standin_app,
    parse_serve_argv,
    startup_settings,
)
from fineenvs.engine.vllm import ModelFamily, VLLMServeArgs, build_serve_command, published_serve_args

DEV = {"VLLM_SERVER_DEV_MODE": "1"}


def argv(model: str, *extra: str) -> list[str]:
    return ["serve", model, "--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids", *extra]


def test_every_launcher_command_parses_with_vllms_option_table(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    commands = [
        published_serve_args("lfm", training=True, chat_template=template),
        published_serve_args("qwen", training=True, chat_template=template),
        published_serve_args("teacher", training=False, chat_template=template, checkpoint="/ckpt"),
        VLLMServeArgs(
            model="/m", weight_sync="reload", enable_prefix_caching=True, extra_args=["--seed", "3"]
        ),
    ]
    for args in commands:
        ns = parse_serve_argv(build_serve_command(args)[1:])
        assert ns.logprobs_mode == "processed_logprobs" and ns.return_tokens_as_token_ids is True
        assert ns.override_generation_config == {"temperature": 0.8, "top_p": 1.0, "top_k": -1}
        assert ns.enable_prefix_caching is args.enable_prefix_caching  # --no-enable-... parses as vLLM's
    nccl = parse_serve_argv(build_serve_command(commands[0])[1:])
    assert nccl.weight_transfer_config == {"backend": "nccl"}
    assert nccl.default_chat_template_kwargs == {"enable_thinking": False, "preserve_thinking": True}
    qwen = parse_serve_argv(build_serve_command(commands[1])[1:])
    assert qwen.limit_mm_per_prompt == {"image": 0, "video": 0} and qwen.gdn_prefill_backend == "triton"
    assert parse_serve_argv(["serve", "/m", "--max-model-len", "32k"]).max_model_len == 32000
    assert parse_serve_argv(["serve", "/m", "--max_model_len", "1K"]).max_model_len == 1024
    with pytest.raises(SystemExit):
        parse_serve_argv(["serve", "/m", "--no-such-vllm-flag"])
    with pytest.raises(SystemExit):
        parse_serve_argv(["serve", "/m", "--dtype", "float8"])  # vLLM's choices


def test_startup_refusals_match_vllms(tiny_qwen_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "engine" / "lfm2_5_nothink.jinja"
    with pytest.raises(StartupError, match="appears path-like, but doesn't exist"):
        startup_settings(parse_serve_argv(argv(str(tiny_qwen_dir), "--chat-template", str(missing))), {})
    with pytest.raises(StartupError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        startup_settings(parse_serve_argv(argv(str(tiny_qwen_dir), "--enable-auto-tool-choice")), {})
    with pytest.raises(StartupError, match="2 GPUs needed"):
        ns = parse_serve_argv(argv(str(tiny_qwen_dir), "--data-parallel-size", "2"))
        startup_settings(ns, {"CUDA_VISIBLE_DEVICES": "1"})
    with pytest.raises(StartupError, match="processed_logprobs"):
        startup_settings(parse_serve_argv(["serve", str(tiny_qwen_dir)]), {})  # vLLM defaults to raw
    ok = startup_settings(parse_serve_argv(argv(str(tiny_qwen_dir), "--data-parallel-size", "2")), {})
    assert (ok["world_size"], ok["world_size_across_dp"], ok["dev_mode"]) == (1, 2, False)


def _serve(settings: dict[str, Any]) -> Iterator[str]:
    from fineenvs.engine.server import serve_in_thread

    app = create_standin_app(settings)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def standin(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    from fineenvs.engine.vllm import write_chat_template

    template = write_chat_template(ModelFamily.qwen3_5, tmp_path_factory.mktemp("tpl"))
    ns = parse_serve_argv(
        argv(
            str(tiny_qwen_dir), "--served-model-name", "tiny_qwen", "--chat-template", str(template),
            "--override-generation-config", '{"temperature": 0.8, "top_p": 1.0, "top_k": -1}',
            "--weight-transfer-config", '{"backend": "nccl"}',
        )
    )  # fmt: skip
    settings = startup_settings(ns, {**DEV, "FINEENVS_STANDIN_DECODE_DELAY_S": "0.005"})
    assert settings["decode_delay_s"] == 0.005  # a known pace: 400 tokens take >= 2 s
    yield from ((url, settings) for url in _serve(settings))


def chat(url: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    body = {
        "model": "tiny_qwen",
        "messages": [{"role": "user", "content": "Sum the column."}],
        "max_tokens": max_tokens,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
        "return_weight_versions": True,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_serves_vllm_response_fields_with_the_served_template(standin: tuple[str, Any]) -> None:
    url, settings = standin
    reply = chat(url).json()
    choice = reply["choices"][0]
    assert len(choice["token_ids"]) == 8 and len(choice["logprobs"]["content"]) == 8
    assert all(
        e["token"] == f"token_id:{t}"
        for e, t in zip(choice["logprobs"]["content"], choice["token_ids"], strict=True)
    )
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]  # vLLM's initial label
    assert "weight_version" not in reply  # an embedded-engine field vLLM does not have
    # --chat-template is what renders: the patched Qwen template opens no thinking block.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(settings["model_dir"])
    text = tok.decode(reply["prompt_token_ids"])
    assert text == tok.apply_chat_template(
        [{"role": "user", "content": "Sum the column."}],
        chat_template=settings["chat_template"],
        tokenize=False,
        add_generation_prompt=True,
    )


def test_dev_routes_exist_only_in_dev_mode(tiny_qwen_dir: Path) -> None:
    settings = startup_settings(parse_serve_argv(argv(str(tiny_qwen_dir))), {})
    for url in _serve(settings):
        assert httpx.post(url + "/pause").status_code == 404
        assert httpx.get(url + "/get_world_size").status_code == 404
        assert httpx.post(url + "/update_weights_from_path", json={}).status_code in (404, 405)


def test_pause_wait_answers_new_requests_503_until_resume(standin: tuple[str, Any]) -> None:
    url, _ = standin
    assert httpx.post(url + "/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    assert httpx.get(url + "/is_paused").json() == {"is_paused": True}
    refused = chat(url)
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "ServiceUnavailableError"
    assert httpx.post(url + "/resume").json() == {"status": "resumed"}
    assert chat(url).status_code == 200
    bad = httpx.post(url + "/pause", params={"mode": "later"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "mode"]


def test_pause_keep_freezes_mid_generation_and_the_spans_show_both_versions(
    standin: tuple[str, Any], tiny_model_factory: Any
) -> None:
    url, _ = standin
    other = tiny_model_factory("tiny_qwen", seed=1)  # same shapes, different weights
    assert httpx.post(url + "/update_weight_version", json={"new_version": "0"}).json()["new_version"] == "0"
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(reply=chat(url, max_tokens=400).json()))
    thread.start()
    time.sleep(0.3)  # let it decode a few tokens
    assert httpx.post(url + "/pause", params={"mode": "keep"}, timeout=60).json() == {"status": "paused"}
    queued: dict[str, Any] = {}
    late = threading.Thread(target=lambda: queued.update(reply=chat(url, max_tokens=4)))
    late.start()  # keep: accepted and queued, not refused
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(other)}}
    assert httpx.post(url + "/collective_rpc", json=rpc, timeout=60).json() == {"results": [None]}
    httpx.post(url + "/update_weight_version", json={"new_version": "1"})
    time.sleep(0.2)
    assert thread.is_alive() and late.is_alive(), "frozen requests wait for /resume"
    httpx.post(url + "/resume")
    thread.join(120)
    late.join(120)
    spans = box["reply"]["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 400
    assert queued["reply"].status_code == 200
    assert queued["reply"].json()["choices"][0]["weight_versions"] == [{"version": "1", "start": 0, "end": 4}]
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "1"}


def test_pause_abort_ends_running_requests_and_refuses_new_ones(standin: tuple[str, Any]) -> None:
    url, _ = standin
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(reply=chat(url, max_tokens=400).json()))
    thread.start()
    time.sleep(1.0)
    assert httpx.post(url + "/pause", params={"mode": "abort"}, timeout=60).json() == {"status": "paused"}
    thread.join(60)
    choice = box["reply"]["choices"][0]
    # Cut short: on a loaded machine the abort can land before the first token (then none came).
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 400
    assert chat(url).status_code == 503
    httpx.post(url + "/resume")
    assert chat(url).status_code == 200


def test_a_swap_racing_a_thaw_never_hangs() -> None:
    from fineenvs.engine.server import NotFrozen, _Worker

    worker = _Worker(None, 1)  # type: ignore[arg-type]  # no generation: only pause points
    try:
        for _ in range(200):
            worker.freeze(timeout_s=5)
            done: list[Any] = []

            def swap(done: list[Any] = done) -> None:
                try:
                    done.append(worker.run_frozen(lambda: 42))
                except NotFrozen:
                    done.append("thawed first")

            thread = threading.Thread(target=swap)
            thread.start()
            worker.thaw()
            thread.join(5)
            assert not thread.is_alive() and done in ([42], ["thawed first"])
    finally:
        worker.stop()


def test_reload_weights_needs_a_directory(standin: tuple[str, Any], tiny_qwen_dir: Path) -> None:
    url, _ = standin
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_qwen_dir / "model.safetensors")}}
    answer = httpx.post(url + "/collective_rpc", json=rpc, timeout=60)
    assert answer.status_code == 500 and "repo id" in answer.json()["error"]["message"]
    assert httpx.post(url + "/collective_rpc", json={"kwargs": {}}).status_code == 400


def test_nccl_control_routes_check_vllms_payloads(standin: tuple[str, Any], tiny_qwen_dir: Path) -> None:
    url, settings = standin
    assert httpx.get(url + "/get_world_size").json() == {"world_size": 1}
    bad = httpx.post(url + "/init_weight_transfer_engine", json={"init_info": {"master_address": "x"}})
    assert bad.status_code == 500 and "rank_offset" in bad.json()["error"]["message"]
    info = {
        "master_address": "127.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 2,
        "packed": True,
    }
    assert httpx.post(url + "/init_weight_transfer_engine", json={"init_info": info}).status_code == 200
    early = httpx.post(url + "/update_weights", json={"update_info": {}})
    assert early.status_code == 500 and "start_weight_update" in early.json()["error"]["message"]
    assert httpx.post(url + "/start_weight_update").status_code == 200
    unknown = {"names": ["nope"], "dtype_names": ["float32"], "shapes": [[1]]}
    assert httpx.post(url + "/update_weights", json={"update_info": unknown}).status_code == 500
    assert httpx.post(url + "/start_weight_update").status_code == 200
    from safetensors.torch import load_file

    weights = load_file(str(tiny_qwen_dir / "model.safetensors"))
    meta = {
        "names": list(weights),
        "dtype_names": [str(t.dtype).split(".")[-1] for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
    }
    assert httpx.post(url + "/update_weights", json={"update_info": meta}).json() == {
        "message": "Weights updated"
    }
    done = httpx.post(url + "/finish_weight_update", json={"weight_version": "7"})
    assert done.json() == {"message": "Weight update finished"}
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "7"}
    kinds = [e["kind"] for e in httpx.get(url + "/server_info").json()["standin"]["events"]]
    assert kinds[-4:] == [
        "start_weight_update",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ]
