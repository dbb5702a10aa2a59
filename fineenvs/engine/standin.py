"""A stand-in for ``vllm serve`` (vLLM 0.33.0) where vLLM cannot run: NOT vLLM.

vLLM from PyPI needs CUDA, so CPU machines (CI, laptops) cannot run the GPU path's launcher,
weight sync and resume against the real server. This executable takes vLLM's place behind the
real launcher (``engine=vllm engine.python=<stand-in>/bin/python``, see ``install``) and honours
the parts of vLLM's contract that fineenvs relies on, read from vLLM 0.33.0's own source:

- **Command line.** ``vllm serve MODEL [flags]`` parsed with vLLM's option table
  (``vllm_options.json``, dumped from vLLM's ``serve`` parser by ``vllm_argv.py options``; a test
  tier with vLLM installed checks it is current): every vLLM flag is accepted, a flag vLLM does
  not know is refused with argparse's message. Refused at start-up as vLLM refuses: a
  ``--chat-template`` that looks like a path and does not exist (``validate_chat_template``'s
  message), ``--enable-auto-tool-choice`` without ``--tool-call-parser``, more ranks than
  ``CUDA_VISIBLE_DEVICES`` names.
- **Serving.** Chat completions through the embedded engine (``fineenvs.engine.server``), with
  the served template (``--chat-template``), ``--default-chat-template-kwargs``,
  ``--override-generation-config`` defaults, ``--return-tokens-as-token-ids`` logprob names,
  ``--tool-call-parser`` (hermes, lfm2, qwen3_xml; a ``--chat-template`` must be a file or a
  template string, vLLM's built-in template names are not looked up), vLLM's response fields (``prompt_token_ids``,
  ``choices[].token_ids``, processed logprobs, ``weight_versions`` spans on
  ``return_weight_versions``) and error bodies.
- **Dev-mode RL routes** (only with ``VLLM_SERVER_DEV_MODE=1``, as vLLM registers them), with
  vLLM's request and response bodies: ``/pause?mode=abort|wait|keep`` (503 for new requests in
  ``abort`` and ``wait``; ``keep`` freezes running requests between two decoding steps and queues
  new ones), ``/resume``, ``/is_paused``, ``/get_world_size``, ``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
  ``/shutdown_weight_transfer_engine``, ``/update_weight_version``, ``/weight_info``,
  ``/collective_rpc`` (``reload_weights`` from a weights directory, which is what vLLM's
  ``reload_weights(weights_path=...)`` needs: a file path would be taken for a Hub id), and a
  small ``/server_info``.

What it does not do: the NCCL data plane. ``/init_weight_transfer_engine`` and ``/update_weights``
check their payloads against ``NCCLWeightTransferInitInfo`` / ``NCCLWeightTransferUpdateInfo``'s
fields and the served model's parameter names, but no tensor arrives (NCCL needs GPUs), so the
weights do not change on that path; ``reload_weights`` does change them. Also not: logprob modes
other than ``processed_logprobs``, streaming from the engine, multiple GPUs, LoRA, the scale-out
routes, and of ``--structured-outputs-config`` only ``disable_any_whitespace`` (structured output
itself is served: ``fineenvs.engine.constrained``, llguidance, vLLM's ``guidance`` backend).

    python -m fineenvs.engine.standin install DIR [--gpus N]   DIR/bin/vllm + DIR/bin/python
    DIR/bin/vllm serve MODEL --port 8000 ...                   what the launcher runs

``--gpus N`` also writes ``DIR/bin/nvidia-smi``, listing N stand-in GPUs, so that with ``DIR/bin``
first on ``PATH`` the launcher's GPU checks and its split of GPUs between vLLM and the trainer
run on a CPU machine (the trainer then runs on the CPU; the stand-in reports the
``CUDA_VISIBLE_DEVICES`` it was given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

OPTIONS_FILE = Path(__file__).with_name("vllm_options.json")
VLLM_VERSION = "0.33.0"
TOOL_PARSERS = {"hermes": "hermes", "lfm2": "lfm2", "qwen3_xml": "qwen3_xml"}
DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
# NCCLWeightTransferInitInfo's fields (vllm/distributed/weight_transfer/nccl_common.py, 0.33.0).
NCCL_INIT_FIELDS = {
    "master_address": False,
    "master_port": False,
    "rank_offset": True,
    "world_size": True,
    "nccl_unique_id_b64": False,
    "packed": False,
    "packed_buffer_size_bytes": False,
    "packed_num_buffers": False,
}
NCCL_UPDATE_FIELDS = ("names", "dtype_names", "shapes")

log = logging.getLogger("fineenvs.engine.standin")


class StartupError(RuntimeError):
    """What vLLM would refuse at start-up; printed and the process exits with 1."""


# --------------------------------------------------------------------------- command line


@cache
def vllm_options() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(OPTIONS_FILE.read_text())
    return data


class _EnableDisable(argparse.Action):
    """vLLM's ``EnableDisableAction``: ``--enable-x`` / ``--disable-x`` (and the hidden
    ``--no-...`` spellings)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        flag = option_string or ""
        value = True
        if flag.startswith("--no-"):
            value, flag = False, "--" + flag[len("--no-") :]
        if flag.startswith("--disable-"):
            value = not value
        setattr(namespace, self.dest, value)


def _convert(kind: str) -> Any:
    def json_value(text: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc}") from None

    def json_or_str(text: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def human_int(text: str) -> int:
        # vLLM's human_readable_int: 1k = 1,000 and 1K = 1,024 (no decimals with binary suffixes).
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
        if not m:
            return int(text)
        number, suffix = str(m.group(1)), str(m.group(2))
        if suffix.islower():
            return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
        return int(number) << (10 * ("KMGT".index(suffix) + 1))

    def human_int_or_auto(text: str) -> int:
        return -1 if text.strip() in ("-1", "auto") else human_int(text)

    converters = {
        "int": int,
        "float": float,
        "json": json_value,
        "json_or_str": json_or_str,
        "human_int": human_int,
        "human_int_or_auto": human_int_or_auto,
    }
    return converters.get(kind, str)


def build_parser() -> argparse.ArgumentParser:
    """``vllm serve``'s flags, from vLLM's own option table."""
    parser = argparse.ArgumentParser(prog="vllm", description="fineenvs' vLLM stand-in (not vLLM)")
    sub = parser.add_subparsers(dest="subparser", required=True)
    serve = sub.add_parser("serve", add_help=True)
    for opt in vllm_options()["serve"]:
        if opt["action"] == "help":
            continue
        if not opt["flags"]:
            serve.add_argument(opt["dest"], nargs=opt["nargs"], default=None)
            continue
        kwargs: dict[str, Any] = {"dest": opt["dest"], "default": None}
        if opt["action"] == "enable_disable":
            flags = list(opt["flags"])
            flags += [f"--no-{f[2:]}" for f in opt["flags"] if not f.startswith("--no-")]
            serve.add_argument(*dict.fromkeys(flags), action=_EnableDisable, nargs=0, **kwargs)
            continue
        if opt["action"] in ("store_true", "store_false"):
            serve.add_argument(*opt["flags"], action=opt["action"], **kwargs)
            continue
        convert = _convert(opt["value"])
        if opt["action"] == "append":
            kwargs["action"] = "append"
        if opt["nargs"] not in (None, 0):
            kwargs["nargs"] = opt["nargs"]
        if opt["choices"] is not None and opt["value"] == "str":
            kwargs["choices"] = opt["choices"]
        serve.add_argument(*opt["flags"], type=convert, **kwargs)
    return parser


def parse_serve_argv(argv: list[str]) -> argparse.Namespace:
    """``argv`` after the program name (``serve MODEL ...``); underscores in flags are accepted,
    as vLLM's FlexibleArgumentParser does."""
    fixed = []
    for arg in argv:
        if arg.startswith("--"):
            key, sep, value = arg.partition("=")
            arg = key.replace("_", "-") + sep + value
        fixed.append(arg)
    return build_parser().parse_args(fixed)


def _template_text(value: str | None) -> str | None:
    """vLLM's ``validate_chat_template`` + ``load_chat_template``: a path-like string must exist."""
    if value is None:
        return None
    if not any(c in value for c in "{}\n") and not Path(value).exists():
        raise StartupError(
            f"vllm.exceptions.VLLMValidationError: The supplied chat template string ({value}) appears "
            f"path-like, but doesn't exist! Tried: {value} (parameter=chat_template)"
        )
    try:
        return Path(value).read_text()
    except OSError as exc:
        if any(c in value for c in "{}\n"):
            return value  # a literal template
        raise StartupError(
            f"vllm.exceptions.VLLMValidationError: The supplied chat template ({value}) looks like a file "
            f"path, but it failed to be opened. Reason: {exc} (parameter=chat_template)"
        ) from exc


def startup_settings(ns: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """What the stand-in serves, or ``StartupError`` for what vLLM would refuse (in vLLM's order:
    ``validate_parsed_serve_args`` first, then the engine's own checks)."""
    template = _template_text(ns.chat_template)
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise StartupError("TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser")
    model = ns.model_tag or ns.model
    if not model:
        raise StartupError("vllm serve needs a model (positional MODEL or --model)")
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise StartupError(
            f"the vLLM stand-in serves local Hugging Face directories only; {model} has no config.json "
            "(nothing is downloaded)"
        )
    if ns.tool_call_parser and ns.tool_call_parser not in TOOL_PARSERS:
        raise StartupError(
            f"--tool-call-parser {ns.tool_call_parser}: the stand-in implements {', '.join(TOOL_PARSERS)} only"
        )
    mode = ns.logprobs_mode or "raw_logprobs"  # vLLM's default
    if mode != "processed_logprobs":
        raise StartupError(
            f"--logprobs-mode {mode}: the stand-in computes processed_logprobs only (what fineenvs trains on)"
        )
    tp = ns.tensor_parallel_size or 1
    dp = ns.data_parallel_size or 1
    pp = ns.pipeline_parallel_size or 1
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = [v for v in visible.split(",") if v.strip()]
        if len(names) < tp * pp * dp:
            raise StartupError(
                f"RuntimeError: {tp * pp * dp} GPUs needed (tensor x pipeline x data parallel) but "
                f"CUDA_VISIBLE_DEVICES={visible!r} names {len(names)}"
            )
    dtype = ns.dtype or "auto"
    if dtype == "auto":
        config = json.loads((path / "config.json").read_text())
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    served = ns.served_model_name[0] if ns.served_model_name else model
    generation: dict[str, Any] = {}
    if (ns.generation_config or "auto") == "auto" and (path / "generation_config.json").is_file():
        model_defaults = json.loads((path / "generation_config.json").read_text())
        generation.update(
            {k: model_defaults[k] for k in ("temperature", "top_p", "top_k") if k in model_defaults}
        )
    generation.update(ns.override_generation_config or {})
    transfer = ns.weight_transfer_config or None
    return {
        "model_dir": path,
        "served_model_name": served,
        "host": ns.host or "127.0.0.1",
        "port": ns.port or 8000,
        "dtype": DTYPES.get(dtype, "float32"),
        "max_model_len": ns.max_model_len if ns.max_model_len not in (None, -1) else None,
        "tool_call_format": TOOL_PARSERS.get(ns.tool_call_parser or "", None),
        "auto_tool_choice": bool(ns.enable_auto_tool_choice),
        "chat_template": template,
        "default_chat_template_kwargs": dict(ns.default_chat_template_kwargs or {}),
        "generation_defaults": generation,
        "token_id_logprobs": bool(ns.return_tokens_as_token_ids),
        "weight_transfer_backend": transfer.get("backend", "nccl") if isinstance(transfer, dict) else None,
        "world_size": tp * pp,
        "world_size_across_dp": tp * pp * dp,
        "dev_mode": env.get("VLLM_SERVER_DEV_MODE") == "1",
        "cuda_visible_devices": visible,
        "seed": ns.seed or 0,
        # vLLM's default lets JSON structured output put whitespace anywhere.
        "structured_whitespace": "compact"
        if isinstance(ns.structured_outputs_config, dict)
        and ns.structured_outputs_config.get("disable_any_whitespace")
        else "flexible",
        # Tests of pause timing slow decoding to a known pace (seconds per decoding step).
        "decode_delay_s": float(env.get("FINEENVS_STANDIN_DECODE_DELAY_S") or 0.0),
        # vLLM caches prefixes unless told --no-enable-prefix-caching (the published command).
        "prefix_caching": ns.enable_prefix_caching is not False,
    }


# --------------------------------------------------------------------------- the app


class _RL:
    """The dev-mode state vLLM keeps in its engine core and workers."""

    def __init__(self, world_size: int, world_size_across_dp: int, backend: str | None) -> None:
        self.world_size = world_size
        self.world_size_across_dp = world_size_across_dp
        self.backend = backend
        self.labels: dict[int, str] = {0: "default"}  # generator version -> vLLM weight version
        self.label = "default"
        self.transfer_init: dict[str, Any] | None = None
        self.update_active = False
        self.last_update: dict[str, Any] | None = None
        self.events: list[dict[str, Any]] = []  # what the trainer drove, for /server_info and tests

    def label_of(self, version: int) -> str:
        return self.labels.get(version, self.label)


def create_standin_app(settings: dict[str, Any]) -> Any:
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from fineenvs.engine.generation import DEFAULT_PREFIX_CACHE_BYTES
    from fineenvs.engine.server import EngineState, create_engine_app, error, swap_weights

    app = create_engine_app(
        settings["model_dir"],
        served_model_name=settings["served_model_name"],
        dtype=settings["dtype"],
        seed=settings["seed"],
        max_model_len=settings["max_model_len"],
        tool_call_format=settings["tool_call_format"],
        max_queue=1024,
        decode_delay_s=settings.get("decode_delay_s", 0.0),
        prefix_cache_mib=(DEFAULT_PREFIX_CACHE_BYTES >> 20) if settings.get("prefix_caching", True) else 0,
    )
    state: EngineState = app.state.engine
    rl = _RL(settings["world_size"], settings["world_size_across_dp"], settings["weight_transfer_backend"])
    state.chat_template = settings["chat_template"]
    state.default_chat_template_kwargs = settings["default_chat_template_kwargs"]
    state.generation_defaults = settings["generation_defaults"]
    state.token_id_logprobs = settings["token_id_logprobs"]
    state.auto_tool_choice = settings["auto_tool_choice"]
    state.structured_whitespace = settings.get("structured_whitespace", "flexible")
    state.version_label = rl.label_of
    state.top_level_weight_version = False
    app.state.rl = rl
    gen = state.generator

    def event(kind: str, **fields: Any) -> None:
        record = {"kind": kind, "label": rl.label, "generator_version": gen.weight_version, **fields}
        rl.events.append(record)
        log.info("dev route %s", json.dumps(record, default=str))  # the log keeps what the trainer drove

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"JSON decode error: {exc}") from None

    def failed(message: str) -> Response:
        # What vLLM answers when a worker raises (its exception handler's InternalServerError body).
        return error(message, 500, "InternalServerError")

    async def embedded(request: Request, field: str) -> tuple[Any, Response | None]:
        """FastAPI's ``Body(embed=True)``: the field of a JSON object, or its 422 when absent."""
        body = await body_of(request)
        value = body.get(field) if isinstance(body, dict) else None
        return value, (missing(field) if value is None else None)

    def missing(field: str, where: str = "body") -> Response:
        # FastAPI's 422 body for a missing embedded Body() field.
        return JSONResponse(
            {"detail": [{"type": "missing", "loc": [where, field], "msg": "Field required", "input": None}]},
            status_code=422,
        )

    async def drain() -> None:
        while state.pending > 0:
            await asyncio.sleep(0.01)

    async def pause(request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return JSONResponse(
                {
                    "detail": [
                        {
                            "type": "literal_error",
                            "loc": ["query", "mode"],
                            "msg": "Input should be 'abort', 'wait' or 'keep'",
                            "input": mode,
                            "ctx": {"expected": "'abort', 'wait' or 'keep'"},
                        }
                    ]
                },
                status_code=422,
            )
        state.pause_mode = mode
        event("pause", mode=mode, inflight=state.pending)
        if mode == "keep":
            try:
                await asyncio.to_thread(state.worker.freeze)
            except TimeoutError as exc:
                state.pause_mode = None  # freeze() thawed the worker: nothing is paused
                # vLLM's /pause answers a failure with {"error": ...} and 500.
                return JSONResponse({"error": f"Failed to pause generation: {exc}"}, status_code=500)
        else:
            if state.worker.frozen:
                state.worker.thaw()  # a keep pause turned into wait/abort: let the running requests drain
            if mode == "abort":
                for cancel in list(getattr(state, "cancels", ())):
                    cancel.set()
            await drain()
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        if state.worker.frozen:  # also after keep followed by another mode
            state.worker.thaw()
        state.pause_mode = None
        event("resume")
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": state.pause_mode is not None})

    async def get_world_size(request: Request) -> Response:
        include_dp = request.query_params.get("include_dp", "true").lower() not in ("false", "0")
        return JSONResponse({"world_size": rl.world_size_across_dp if include_dp else rl.world_size})

    def not_configured() -> Response:
        return failed(
            "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
        )

    async def init_transfer(request: Request) -> Response:
        info, refused = await embedded(request, "init_info")
        if refused is not None:
            return refused
        if not isinstance(info, dict):
            return missing("init_info")
        if rl.backend is None:
            return not_configured()
        unknown = sorted(set(info) - set(NCCL_INIT_FIELDS))
        absent = sorted(k for k, required in NCCL_INIT_FIELDS.items() if required and k not in info)
        if unknown or absent:
            what = f"unexpected {unknown}" if unknown else f"missing required {absent}"
            return failed(
                f"Invalid init_info for NCCLWeightTransferEngine: NCCLWeightTransferInitInfo got {what}"
            )
        if (info.get("master_address") is None) == (info.get("nccl_unique_id_b64") is None):
            return failed(
                "NCCLWeightTransferInitInfo: provide exactly one of master_address+master_port or "
                "nccl_unique_id_b64"
            )
        rl.transfer_init = info
        event("init_weight_transfer_engine", init_info=info)
        log.warning(
            "stand-in: NCCL group not joined (no GPU): the control plane is checked, no tensor arrives"
        )
        return JSONResponse({"message": "Weight transfer initialized"})

    async def start_update(request: Request) -> Response:
        if rl.backend is None:
            return not_configured()
        if rl.update_active:
            return failed(
                "start_weight_update called while a weight update is already active. Call "
                "finish_weight_update first."
            )
        rl.update_active = True
        event("start_weight_update")
        return JSONResponse({"message": "Weight update started"})

    async def update(request: Request) -> Response:
        info, refused = await embedded(request, "update_info")
        if refused is not None:
            return refused
        if rl.backend is None:
            return not_configured()
        if not rl.update_active:
            return failed("start_weight_update must be called before update_weights.")
        if not isinstance(info, dict) or set(info) - set(NCCL_UPDATE_FIELDS):
            rl.update_active = False
            return failed(f"Invalid update_info: {info!r}")
        names = list(info.get("names") or [])
        if not names and rl.last_update is not None:
            info = rl.last_update  # empty lists reuse the previous round's metadata
            names = info["names"]
        lengths = {len(info.get(k) or []) for k in NCCL_UPDATE_FIELDS}
        own = dict(gen.model.state_dict())
        bad = [n for n in names if n not in own]
        if len(lengths) != 1 or bad:
            rl.update_active = False
            why = f"unknown parameters {bad[:3]}" if bad else "names, dtype_names and shapes differ in length"
            return failed(f"update_weights: {why}")
        import torch

        bad_dtypes = [
            d for d in info["dtype_names"] if not isinstance(getattr(torch, str(d), None), torch.dtype)
        ]
        if bad_dtypes:
            rl.update_active = False  # vLLM's receiver does getattr(torch, dtype_name)
            return failed(f"update_weights: unknown dtype names {bad_dtypes[:3]}")
        wrong = [
            n for n, shape in zip(names, info["shapes"], strict=True) if list(own[n].shape) != list(shape)
        ]
        if wrong:
            rl.update_active = False
            return failed(f"update_weights: shape mismatch for {wrong[:3]}")
        rl.last_update = info
        event("update_weights", parameters=len(names))
        return JSONResponse({"message": "Weights updated"})

    async def finish_update(request: Request) -> Response:
        body = await body_of(request)
        if rl.backend is None:
            return not_configured()
        if not rl.update_active:
            return failed("finish_weight_update called without a matching start_weight_update.")
        rl.update_active = False
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None:
            rl.label = str(version)
            rl.labels[gen.weight_version] = rl.label
        event("finish_weight_update", weight_version=version)
        return JSONResponse({"message": "Weight update finished"})

    async def shutdown_transfer(request: Request) -> Response:
        if rl.update_active:
            return failed("Cannot release a trainer connection during a weight update")
        rl.transfer_init = None
        event("shutdown_weight_transfer_engine")
        return JSONResponse({"message": "Weight transfer shut down"})

    async def update_version(request: Request) -> Response:
        new, refused = await embedded(request, "new_version")
        if refused is not None:
            return refused
        if not isinstance(new, str):  # vLLM's Body field is a str: pydantic refuses anything else
            return JSONResponse(
                {
                    "detail": [
                        {
                            "type": "string_type",
                            "loc": ["body", "new_version"],
                            "msg": "Input should be a valid string",
                            "input": new,
                        }
                    ]
                },
                status_code=422,
            )
        rl.label = str(new)
        rl.labels[gen.weight_version] = rl.label
        event("update_weight_version", new_version=rl.label)
        return JSONResponse({"success": True, "new_version": rl.label})

    async def weight_info(request: Request) -> Response:
        return JSONResponse({"weight_version": rl.label})

    async def collective_rpc(request: Request) -> Response:
        try:
            body = await body_of(request)
        except ValueError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"detail": "Request body must be a JSON object"}, status_code=400)
        method = body.get("method")
        if method is None:
            return JSONResponse({"detail": "Missing 'method' in request body"}, status_code=400)
        if method != "reload_weights":
            return failed(f"collective_rpc {method!r}: the stand-in implements reload_weights only")
        kwargs = body.get("kwargs") or {}
        path = kwargs.get("weights_path")
        if path is None:
            target = Path(gen.weights_path or gen.model_dir)
        else:
            target = Path(str(path))
            if not target.is_dir():
                # vLLM sets model_config.model = weights_path and loads from there: anything but a
                # local directory is taken for a Hugging Face repo id.
                return failed(
                    f"reload_weights: {path} is not a local directory, so vLLM would look it up as a "
                    "Hugging Face repo id and fail: pass the directory that holds the *.safetensors files"
                )
        try:
            loaded = await swap_weights(state, gen.load_weights, target, None)
        except (FileNotFoundError, ValueError, RuntimeError, OSError) as exc:
            return failed(f"reload_weights from {target}: {exc}")
        rl.labels[gen.weight_version] = rl.label  # vLLM keeps the label until update_weight_version
        event("reload_weights", path=str(target), tensors=len(loaded), frozen=state.worker.frozen)
        return JSONResponse({"results": [None] * rl.world_size})

    async def server_info(request: Request) -> Response:
        return JSONResponse(
            {
                "vllm_config": {"model_config": {"dtype": f"torch.{gen.dtype}", "model": str(gen.model_dir)}},
                "vllm_env": {"VLLM_SERVER_DEV_MODE": "1"},
                "standin": {
                    "is_standin": True,
                    "vllm_version": VLLM_VERSION,
                    "cuda_visible_devices": settings["cuda_visible_devices"],
                    "weight_label": rl.label,
                    "events": rl.events[-200:],
                },
            }
        )

    if settings["dev_mode"]:
        log.warning(
            "SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!"
        )
        app.router.routes.extend(
            [
                Route("/pause", pause, methods=["POST"]),
                Route("/resume", resume, methods=["POST"]),
                Route("/is_paused", is_paused, methods=["GET"]),
                Route("/get_world_size", get_world_size, methods=["GET"]),
                Route("/init_weight_transfer_engine", init_transfer, methods=["POST"]),
                Route("/start_weight_update", start_update, methods=["POST"]),
                Route("/update_weights", update, methods=["POST"]),
                Route("/finish_weight_update", finish_update, methods=["POST"]),
                Route("/shutdown_weight_transfer_engine", shutdown_transfer, methods=["POST"]),
                Route("/update_weight_version", update_version, methods=["POST"]),
                Route("/weight_info", weight_info, methods=["GET"]),
                Route("/collective_rpc", collective_rpc, methods=["POST"]),
                Route("/server_info", server_info, methods=["GET"]),
            ]
        )
    # vLLM serves neither the embedded engine's own weight route nor its /weight_info shape, and
    # /reset_prefix_cache only in dev mode.
    app.router.routes[:] = [
        r
        for r in app.router.routes
        if getattr(r, "path", None) != "/update_weights_from_path"
        and not (getattr(r, "path", None) == "/reset_prefix_cache" and not settings["dev_mode"])
        and not (
            getattr(r, "path", None) == "/weight_info" and getattr(r, "endpoint", None) is not weight_info
        )
    ]
    return app


# --------------------------------------------------------------------------- entry points


def install(directory: Path, python: str | None = None, gpus: int = 0) -> Path:
    """Make ``directory`` look like a vLLM venv to the launcher: ``bin/vllm`` (this stand-in) and
    ``bin/python``; then ``engine.python=<directory>/bin/python``. ``gpus`` > 0 adds a
    ``bin/nvidia-smi`` that lists that many stand-in GPUs. Returns the python."""
    bin_dir = Path(directory).resolve() / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    if gpus > 0:
        listing = "\n".join(
            f'echo "GPU {i}: fineenvs stand-in GPU, not a GPU (UUID: GPU-{i:08d}-0000-0000-0000-000000000000)"'
            for i in range(gpus)
        )
        smi = bin_dir / "nvidia-smi"
        smi.write_text(
            f"#!/bin/sh\n# fineenvs' vLLM stand-in: lists {gpus} pretend GPUs (nvidia-smi -L)\n{listing}\n"
        )
        smi.chmod(0o755)
    exe = python or sys.executable
    script = bin_dir / "vllm"
    script.write_text(
        f"#!{exe}\n"
        "# fineenvs' vLLM stand-in (NOT vLLM): python -m fineenvs.engine.standin --help\n"
        "import sys\n\nfrom fineenvs.engine.standin import main\n\nsys.exit(main(sys.argv[1:]))\n"
    )
    script.chmod(0o755)
    link = bin_dir / "python"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(exe)
    return link


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["install"]:
        parser = argparse.ArgumentParser(prog="python -m fineenvs.engine.standin install")
        parser.add_argument("dir", type=Path)
        parser.add_argument(
            "--gpus", type=int, default=0, help="also write bin/nvidia-smi listing N stand-in GPUs"
        )
        opts = parser.parse_args(argv[1:])
        print(install(opts.dir, gpus=opts.gpus))
        return 0
    if argv[:1] in (["--version"], ["-v"]):
        print(f"{VLLM_VERSION} (fineenvs stand-in)")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = parse_serve_argv(argv)
    try:
        settings = startup_settings(ns, dict(os.environ))
    except StartupError as exc:
        print(f"ERROR fineenvs vLLM stand-in refused to start: {exc}", file=sys.stderr, flush=True)
        return 1
    print(
        f"fineenvs vLLM stand-in (not vLLM {VLLM_VERSION}): serving {settings['served_model_name']} from "
        f"{settings['model_dir']} on http://{settings['host']}:{settings['port']} "
        f"(CUDA_VISIBLE_DEVICES={settings['cuda_visible_devices']}, dev mode {settings['dev_mode']})",
        flush=True,
    )
    import torch
    import uvicorn

    torch.set_num_threads(1)  # tiny models: extra intra-op threads only spin (see engine.__main__)
    app = create_standin_app(settings)
    uvicorn.run(
        app, host=settings["host"], port=settings["port"], log_level="warning", timeout_graceful_shutdown=5
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
