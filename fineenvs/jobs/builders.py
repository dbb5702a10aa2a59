"""``RunConfig`` -> the settings and processes of a job's components: the one place that reads it.

Components (engine launchers, the proxy, the attempt runner, the trajectory rows, the reward) take
flat typed settings; these builders derive them from the run's config. Those that start a process
take an ``ExitStack`` that stops it, in reverse order, on any exit; ``fineenvs.jobs.runtime``
strings them together.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack, ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fineenvs.config import VLLM_WEIGHT_SYNCS, EngineKind, ModelSource, RunConfig, engine_dtype
from fineenvs.rollout.attempt import AttemptSettings
from fineenvs.trajectory import RowOptions

if TYPE_CHECKING:
    from fineenvs.engine.handle import EngineHandle, EngineLaunch
    from fineenvs.engine.replicas import Replica
    from fineenvs.engine.vllm import VLLMServeArgs
    from fineenvs.engine.weights import StagedVLLMWeightSync, WeightSync
    from fineenvs.rewards import RewardResult


def resolve_model_dir(run: RunConfig) -> Path:
    """Where the trainer (and the embedded engine) load the policy from."""
    m = run.model
    if m.source is ModelSource.tiny:
        from fineenvs.models import model_builder

        return model_builder().ensure(m.path, seed=m.seed)
    return Path(m.path)


def start_engine(
    run: RunConfig,
    model_dir: Path,
    out: Path,
    stack: ExitStack | AsyncExitStack,
    *,
    served_model_name: str | None = None,
) -> EngineHandle:
    """Launch (or attach to) the engine. ``served_model_name``
    overrides the name clients use (evaluation serves a checkpoint under the base model's name)."""
    from fineenvs.engine import attach, launch_transformers_engine, launch_vllm

    e = run.engine
    if e.url:
        return attach(e.url, weight_sync=attached_weight_sync(run, e.url, out))
    if e.replicas > 1 or e.urls:
        return start_replicas(run, out, stack, served_model_name=served_model_name)
    if e.kind is EngineKind.transformers:
        # The directory the trainer loads (a tiny model is built for model.seed), so engine and
        # trainer always hold the same weights.
        launch = launch_transformers_engine(
            str(model_dir),
            log_dir=out / "engine",
            host=e.host,
            port=e.port,
            served_model_name=served_model_name or run.model.name,
            seed=run.seed,
            dtype=engine_dtype(run),
            max_queue=e.max_queue,
            max_model_len=e.max_model_len or run.model.max_model_len,
            tool_call_parser=run.model.tool_call_parser,
            policy=None if e.policy == "model" else e.policy,
            prefix_cache_mib=e.prefix_cache_mib,
            timeout_s=e.health_timeout_seconds,
        )
        return stack.enter_context(launch)
    from fineenvs.engine.vllm import prepare_chat_template
    from fineenvs.plan import device_plan, vllm_args

    args = vllm_args(run)
    if served_model_name:
        args = replace(args, served_model_name=served_model_name)
    devices = device_plan(run)
    args = replace(args, devices=devices.engine if devices else None, chat_template_dir=out / "engine")
    if devices is not None:
        print(f"vLLM GPUs: {devices.reason}", flush=True)
    else:
        print(f"vLLM on the CPU (its CPU build, {args.python or 'vllm from PATH'})", flush=True)
    args = prepare_chat_template(args)  # vLLM refuses to start on a template it cannot open
    return stack.enter_context(launch_vllm(args, out / "engine", timeout_s=e.health_timeout_seconds))


def start_replicas(
    run: RunConfig, out: Path, stack: ExitStack | AsyncExitStack, *, served_model_name: str | None = None
) -> EngineHandle:
    """``engine.replicas`` vLLM servers launched side by side (or ``engine.urls`` attached) behind
    vLLM's router; the handle's URL is the router's and its weight sync the replica set."""
    from fineenvs.engine import EngineHandle
    from fineenvs.engine.replicas import Replica, ReplicaSet
    from fineenvs.engine.router import attach_router, launch_router
    from fineenvs.engine.vllm import prepare_chat_template
    from fineenvs.engine.weights import StagedVLLMWeightSync, VLLMReloadWeightSync, vllm_weight_sync
    from fineenvs.plan import effective_weight_sync, vllm_args

    e = run.engine
    mode = effective_weight_sync(run).value if effective_weight_sync(run) in VLLM_WEIGHT_SYNCS else None
    staging = out / "engine" / "weights"
    args = vllm_args(run)
    if served_model_name:
        args = replace(args, served_model_name=served_model_name)
    args = prepare_chat_template(replace(args, chat_template_dir=out / "engine"))

    def sync_for(url: str, log: Path | None) -> StagedVLLMWeightSync:
        # Without pushes (evaluation) the replicas still get a sync: a restart labels its version.
        sync = vllm_weight_sync(mode, url, staging, log) if mode else VLLMReloadWeightSync(url, staging)
        assert isinstance(sync, StagedVLLMWeightSync), "nccl with replicas is refused at compose time"
        return sync

    if e.urls:
        bases = [url.rstrip("/").removesuffix("/v1") for url in e.urls]
        replicas = [Replica(f"r{i}", base, sync_for(base, None)) for i, base in enumerate(bases)]
    else:
        replicas = _launched_replicas(run, args, out, sync_for)
    try:
        urls = [r.url for r in replicas]
        router = (
            attach_router(e.router.url)
            if e.router.url
            else stack.enter_context(
                launch_router(e.router, urls, out / "engine", timeout_s=e.health_timeout_seconds)
            )
        )
    except BaseException:
        for replica in replicas:  # no router: stop what was launched
            replica.sync.close()
            if replica.launch is not None:
                replica.launch.__exit__(None, None, None)
        raise
    replica_set = ReplicaSet(replicas, router)
    stack.callback(replica_set.close)  # before the router stops (the stack unwinds in reverse)
    replica_set.watch()
    print(
        f"vLLM: {len(replicas)} replicas ({', '.join(f'{r.name} {r.url}' for r in replicas)}) behind "
        f"vllm-router {router.url} (policy {e.router.policy})",
        flush=True,
    )
    return EngineHandle(
        url=router.url,
        served_model_name=args.name,
        kind="vllm" if not e.urls else "attached",
        weight_sync=replica_set if mode else None,
        log_path=out / "engine" / "router.log",
        replicas=replica_set,
    )


def _launched_replicas(
    run: RunConfig,
    args: VLLMServeArgs,
    out: Path,
    sync_for: Callable[[str, Path | None], StagedVLLMWeightSync],
) -> list[Replica]:
    """One server per ``replica_plans`` entry, each on a port of its own that a restart keeps (the
    router knows it by that URL), all started side by side."""
    from fineenvs.engine import launch_vllm
    from fineenvs.engine.launcher import free_port
    from fineenvs.engine.replicas import Replica
    from fineenvs.plan import replica_plans

    e = run.engine
    replicas, launches = [], []
    for plan in replica_plans(run):
        served = replace(
            args, port=free_port(e.host), devices=plan.devices, cpu_threads_bind=plan.cpus, replica=plan.name
        )

        def relaunch(served: VLLMServeArgs = served) -> tuple[EngineLaunch, StagedVLLMWeightSync]:
            log_dir = out / "engine" / (served.replica or "r")
            launch = launch_vllm(served, log_dir, timeout_s=e.health_timeout_seconds)
            return launch, sync_for(served.url, log_dir / "vllm.log")

        launch, sync = relaunch()
        launches.append(launch)
        replicas.append(Replica(plan.name, served.url, sync, launch=launch, relaunch=relaunch))
    _start_together(launches)
    return replicas


def _start_together(launches: list[EngineLaunch]) -> None:
    """Start every replica's server on this thread, then wait for all of them at once (each loads
    its model meanwhile); any failure stops them all."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        for launch in launches:
            launch.start()
        with ThreadPoolExecutor(max_workers=len(launches)) as pool:
            for future in [pool.submit(launch.wait) for launch in launches]:
                future.result()
    except BaseException:
        for launch in launches:
            if launch.process is not None and launch.process.poll() is None:
                launch.__exit__(None, None, None)
        raise


def attached_weight_sync(run: RunConfig, url: str, out: Path) -> WeightSync | None:
    """How the trainer pushes into a server someone else started (``engine.url``)."""
    from fineenvs.config import WeightSyncKind
    from fineenvs.engine.weights import EmbeddedWeightSync, vllm_weight_sync
    from fineenvs.plan import effective_weight_sync

    base = url.rstrip("/").removesuffix("/v1")
    sync = effective_weight_sync(run)
    if sync is WeightSyncKind.http:
        return EmbeddedWeightSync(base, out / "engine" / "weights")
    if sync is WeightSyncKind.none:
        return None
    return vllm_weight_sync(sync.value, base, out / "engine" / "weights")


def apply_trainer_devices(run: RunConfig) -> str | None:
    """Give this process (the trainer) the GPUs a launched vLLM does not get, before anything
    starts CUDA; returns the ``CUDA_VISIBLE_DEVICES`` set (None: left as it was)."""
    from fineenvs.plan import device_plan, trains

    if not trains(run):
        return None
    plan = device_plan(run)
    if plan is None or plan.trainer is None:
        return None
    value = ",".join(plan.trainer)
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the indices are nvidia-smi's
    return value


def start_proxy(run: RunConfig, engine: EngineHandle, out: Path, stack: ExitStack | AsyncExitStack) -> str:
    """The capture proxy as a child process on loopback; returns its base URL."""
    from fineenvs.engine.launcher import free_port, launched

    p = run.proxy
    port = p.port or free_port(p.host)
    store = Path(p.store_dir) if p.store_dir else out / "records"
    cmd = [
        sys.executable, "-m", "fineenvs.proxy", "serve",
        "--engine-url", engine.url,
        "--served-model", engine.served_model_name,
        "--host", p.host, "--port", str(port),
        "--store-dir", str(store),
        "--max-model-calls", str(p.max_model_calls),
        "--max-output-tokens", str(run.sampling.max_tokens),
        "--temperature", str(run.sampling.temperature),
        "--top-p", str(run.sampling.top_p),
        "--top-k", str(run.sampling.top_k),
        "--min-p", str(run.sampling.min_p),
        "--max-body-bytes", str(p.max_body_bytes),
        "--keepalive-seconds", str(p.keepalive_seconds),
        "--body-timeout-seconds", str(p.body_timeout_s),
        "--max-upstream-concurrency", str(p.max_upstream_concurrency),
        "--retries", str(p.retries),
        "--workers", str(p.workers),
        *[arg for r in (engine.replicas.replicas if engine.replicas else []) for arg in ("--replica-url", r.url)],
        *([] if p.fsync else ["--no-fsync"]),
    ]  # fmt: skip
    env = dict(os.environ, FINEENVS_ADMIN_KEY=p.admin_key) if p.admin_key else None
    url = f"http://{p.host}:{port}"
    stack.enter_context(
        launched(
            cmd, base_url=url, log_path=out / "proxy.log", env=env, health_paths=("/health",), name="proxy"
        )
    )
    return url


def reward_function(run: RunConfig) -> Callable[[float | None, int | None, bool], RewardResult]:
    """``(correct, tool_calls, verified) -> RewardResult`` for the run's validated reward config.

    ``reward.require_verified_tool_count=false`` trusts any tool count (the proxy's count of the
    tool calls the model emitted, when the agent keeps no log of its own)."""
    from fineenvs.rewards import build_reward_weights, compute_reward

    spec = build_reward_weights(dict(run.reward.terms), tool_budget=run.reward.tool_budget)
    trust_any = not run.reward.require_verified_tool_count

    def reward(correct: float | None, tool_calls: int | None, verified: bool) -> RewardResult:
        return compute_reward(correct, tool_calls, verified or (trust_any and tool_calls is not None), spec)

    return reward


def attempt_settings(
    run: RunConfig, *, proxy_url: str, served_model: str, attempts_dir: Path
) -> AttemptSettings:
    """What every job's attempt runner (RL, teacher collection, evaluation) needs from the config."""
    s = run.scheduler
    return AttemptSettings(
        proxy_url=proxy_url,
        admin_key=run.proxy.admin_key,
        served_model=served_model,
        attempts_dir=attempts_dir,
        timeout_seconds=s.attempt_timeout_seconds,
        max_model_calls=s.max_model_calls,
        api_formats={n: h.api_format.value for n, h in run.harness.items()},
        step_limits={n: h.step_limit for n, h in run.harness.items()},
        use_bwrap=s.sandbox.value == "bwrap",
        docker=s.docker if s.sandbox.value == "docker" else None,
    )


def row_options(run: RunConfig, max_tokens: int) -> RowOptions:
    """How recorded calls become training rows: ``rows.*``, with the trainer's ``max_tokens`` per row
    where ``rows.max_tokens`` is null."""
    return replace(run.rows, max_tokens=run.rows.max_tokens or max_tokens)
