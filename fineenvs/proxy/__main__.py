"""``python -m fineenvs.proxy serve --engine-url URL --served-model NAME [...]``: the proxy on its own.

Put it in front of any OpenAI-compatible engine that returns ``prompt_token_ids``, ``token_ids``
and per-token logprobs (vLLM with ``--return-tokens-as-token-ids``, or ``fineenvs.engine``), then
create sessions with ``POST /sessions`` and point agents at the returned ``base_url``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

from fineenvs.proxy.settings import ProxySettings, SamplingPolicy

# Every default is the settings' own: one source, shared with the run config (fineenvs.config).
_D = ProxySettings()
_S = SamplingPolicy()
# The options that set one number of the settings: flag, type, default, help.
_NUMBERS: tuple[tuple[str, type[int] | type[float], float, str | None], ...] = (
    ("--max-model-calls", int, _D.max_model_calls, "per-session model-call budget"),
    ("--max-output-tokens", int, _D.max_output_tokens, "cap on max_tokens per call"),
    ("--temperature", float, _S.temperature, "sampling temperature enforced upstream"),
    ("--top-p", float, _S.top_p, "enforced top_p (training needs 1.0: full-distribution sampling)"),
    ("--top-k", int, _S.top_k, "enforced top_k (-1: off)"),
    ("--min-p", float, _S.min_p, "enforced min_p"),
    ("--max-body-bytes", int, _D.max_body_bytes, None),
    ("--keepalive-seconds", float, _D.keepalive_seconds, None),
    ("--body-timeout-seconds", float, _D.body_timeout_s, "408 after this long"),
    ("--max-upstream-concurrency", int, _D.max_upstream_concurrency, "engine calls in flight"),
    ("--retries", int, _D.retries, "attempts per call on 408/409/429/5xx"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fineenvs.proxy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the capture proxy (uvicorn)")
    serve.add_argument("--engine-url", required=True, help="engine base URL, e.g. http://127.0.0.1:8000")
    serve.add_argument("--served-model", required=True, help="model id the engine serves")
    serve.add_argument("--host", default=_D.host, help="bind address (non-loopback needs an admin key)")
    serve.add_argument("--port", type=int, default=8100, help="0: a free port")
    serve.add_argument(
        "--admin-key",
        default=os.environ.get("FINEENVS_ADMIN_KEY"),
        help="key for the control routes (default $FINEENVS_ADMIN_KEY); required off loopback",
    )
    serve.add_argument("--store-dir", default=_D.store_dir, help="call records (default outputs/proxy_store)")
    for flag, kind, default, help_text in _NUMBERS:
        serve.add_argument(flag, type=kind, default=default, help=help_text)
    serve.add_argument(
        "--no-fsync", action="store_true", help="flush records without fsync (faster, less safe)"
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=_D.workers,
        help="proxy processes, each owning a shard of the sessions (one per spare core; ports P..P+N-1)",
    )
    serve.add_argument(
        "--replica-url",
        action="append",
        default=[],
        help="a server behind the router --engine-url names (repeat for each): read for its weight version",
    )
    serve.add_argument("--log-level", default="warning")
    return parser


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    return ProxySettings(
        upstream_url=args.engine_url,
        replica_urls=list(args.replica_url),
        served_model=args.served_model,
        host=args.host,
        port=args.port,
        admin_key=args.admin_key or None,
        store_dir=args.store_dir,
        max_model_calls=args.max_model_calls,
        max_output_tokens=args.max_output_tokens,
        sampling=SamplingPolicy(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p
        ),
        max_body_bytes=args.max_body_bytes,
        keepalive_seconds=args.keepalive_seconds,
        body_timeout_s=args.body_timeout_seconds,
        retries=args.retries,
        max_upstream_concurrency=args.max_upstream_concurrency,
        fsync=not args.no_fsync,
        workers=args.workers,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    try:
        settings.validate()
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    import uvicorn

    from fineenvs.proxy.app import create_proxy_app
    from fineenvs.proxy.store import CallStore

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    store = CallStore(settings.store_path, fsync=settings.fsync)
    app = create_proxy_app(settings, store=store, log_level=args.log_level)
    print(
        f"fineenvs proxy on http://{settings.host}:{settings.port} -> {settings.upstream_url} "
        f"(model {settings.served_model}, store {settings.store_path}"
        + (f", {settings.workers} workers" if settings.workers > 1 else "")
        + ")",
        flush=True,
    )
    # Fewer, cheaper collections: the proxy allocates many short-lived dicts per call, and
    # default thresholds run a full collection over every live session object every few
    # thousand allocations (pauses of 100+ ms with 1,000 sessions in flight).
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        access_log=False,
        timeout_keep_alive=75,
        backlog=4096,
        # Stopping must not wait on agents' keep-alive connections (an orphaned agent kept a
        # SIGTERMed proxy alive): in-flight calls get 5 s to finish and be recorded.
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
