"""The resolved plan of a job (printed by every run, and alone by ``dry_run=true``) and the
machine checks that must pass before anything starts."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fineenvs.config import (
    VLLM_WEIGHT_SYNCS,
    EngineKind,
    EnginePlatform,
    Job,
    ModelSource,
    RunConfig,
    WeightSyncKind,
    serving_profile,
)
from fineenvs.jsonl import JsonObject
from fineenvs.train.grpo_config import GRPOSettings
from fineenvs.train.sft_config import SFTSettings

if TYPE_CHECKING:
    from fineenvs.engine.devices import DevicePlan
    from fineenvs.engine.vllm import VLLMServeArgs


def engine_platform(run: RunConfig) -> str:
    """Where a launched vLLM runs: ``engine.platform``, or for ``auto`` ``cuda`` where an NVIDIA GPU
    is visible and ``cpu`` (vLLM's CPU build) elsewhere."""
    chosen = run.engine.platform
    if chosen is not EnginePlatform.auto:
        return str(chosen.value)
    from fineenvs.engine.launcher import cuda_devices

    gpus, _ = cuda_devices()
    return "cuda" if gpus else "cpu"


def vllm_python(run: RunConfig) -> str | None:
    """``engine.python``, else the serving build ``install-vllm`` made for this platform (None:
    neither; the launcher then looks for ``vllm`` on PATH)."""
    if run.engine.python:
        return run.engine.python
    from fineenvs.engine.install import installed_python

    python = installed_python(engine_platform(run))
    return str(python) if python else None


def effective_weight_sync(run: RunConfig) -> WeightSyncKind:
    """What ``engine.weight_sync=auto`` means for this job (``weight_sync_reason`` says why)."""
    ws = run.engine.weight_sync
    if ws is not WeightSyncKind.auto:
        return ws
    if run.job in (Job.eval, Job.collect_teacher, Job.sft):
        return WeightSyncKind.none
    if run.engine.kind is EngineKind.transformers:
        return WeightSyncKind.http
    return WeightSyncKind.reload


def weight_sync_reason(run: RunConfig) -> str:
    """Why the job pushes weights the way it does (printed in the plan)."""
    sync = effective_weight_sync(run)
    chosen = run.engine.weight_sync is not WeightSyncKind.auto
    if sync is WeightSyncKind.none:
        return "none: " + ("engine.weight_sync=none" if chosen else f"job={run.job.value} trains no policy")
    if sync is WeightSyncKind.http:
        return "http: the embedded engine loads each pushed checkpoint (POST /update_weights_from_path)"
    if sync is WeightSyncKind.reload:
        why = "engine.weight_sync=reload" if chosen else "auto"
        return (
            f"reload ({why}): each push writes the weights (engine dtype) into <output>/engine/weights/ and "
            "vLLM reloads them in place (/pause?mode=keep, /collective_rpc reload_weights, "
            "/update_weight_version, /reset_prefix_cache, /resume); it needs nothing but the vLLM server, so "
            "it works with vLLM in its own venv. engine.weight_sync=file_transfer drives vLLM's "
            "weight-transfer routes instead; nccl broadcasts GPU to GPU (published; needs "
            "`python -m fineenvs.engine install-vllm-client`)"
        )
    if sync is WeightSyncKind.file_transfer:
        return (
            "file_transfer: vLLM's weight-transfer routes as the NCCL backend drives them "
            "(/init_weight_transfer_engine once; /pause?mode=keep, /start_weight_update, /update_weights, "
            "/finish_weight_update with the version, /reset_prefix_cache, /resume per push) with fineenvs' "
            "fineenvs_file backend: the tensors travel in a safetensors file in <output>/engine/weights/"
        )
    return (
        "nccl: vLLM's NCCLTrainerWeightTransferEngine broadcasts the state dict GPU to GPU (the trainer "
        "imports vLLM's trainer-side modules from `python -m fineenvs.engine install-vllm-client`)"
    )


def vllm_command(run: RunConfig) -> list[str]:
    """The exact ``vllm serve`` command this job would launch (``--port 0``: a free port at launch)."""
    from fineenvs.engine.vllm import build_serve_command

    return build_serve_command(vllm_args(run))


def model_serving_path(run: RunConfig) -> str:
    """What vLLM loads: the Hub id or directory; a tiny model's built directory."""
    m = run.model
    if m.source is ModelSource.tiny:
        from fineenvs.models import model_builder

        return str(model_builder().path(m.path, seed=m.seed))
    return m.path


def vllm_args(run: RunConfig) -> VLLMServeArgs:
    """Map the typed config onto the launcher's arguments.

    The profile (tool parser, patched template, extra flags) comes from the model's name when it
    names a published family (LFM2.5, Qwen3.5, Qwen3.8), else from ``model.family``;
    ``model.chat_template=native`` serves the checkpoint's own template. The patched template is
    written into ``<output>/engine/`` at launch, at the path the command names."""
    from fineenvs.engine.vllm import VLLMServeArgs

    m, e, s = run.model, run.engine, run.sampling
    sync = effective_weight_sync(run)
    path = model_serving_path(run)
    served = m.name if m.source is ModelSource.tiny else m.path
    family = serving_profile(m.path, m.family)  # its chat template was checked at compose time
    return VLLMServeArgs(
        model=path,
        served_model_name=served,
        revision=m.revision,
        family=family,
        host=e.host,
        port=e.port,
        dtype=e.dtype or m.dtype,
        platform=engine_platform(run),
        cpu_kvcache_gib=e.cpu_kvcache_gib,
        cpu_threads_bind=e.cpu_threads_bind,
        tensor_parallel_size=e.tensor_parallel_size,
        data_parallel_size=e.data_parallel_size,
        max_model_len=e.max_model_len or m.max_model_len,
        gpu_memory_utilization=e.gpu_memory_utilization,
        tool_call_parser=m.tool_call_parser,
        chat_template_dir=Path(str(run.output_dir)) / "engine",
        family_template=m.chat_template != "native",
        default_chat_template_kwargs=dict(m.chat_template_kwargs) or None,
        temperature=s.temperature if s.temperature > 0 else 1.0,
        top_p=s.top_p,
        top_k=s.top_k,
        enforce_eager=e.enforce_eager,
        enable_prefix_caching=e.enable_prefix_caching,
        weight_sync=sync.value if sync in VLLM_WEIGHT_SYNCS else None,
        extra_args=list(e.extra_args),
        python=vllm_python(run),
        # Each replica is named at launch (start_replicas); the plan shows the first one's command.
        replica="r0" if e.replicas > 1 else None,
    )


def trains(run: RunConfig) -> bool:
    """Whether this job runs a trainer next to the engine (it then needs GPUs of its own)."""
    return run.job is Job.rl


def device_plan(
    run: RunConfig, nvidia_smi: str | None = None, env: dict[str, str] | None = None
) -> DevicePlan | None:
    """How GPUs split between a launched vLLM and the trainer (``fineenvs.engine.devices``);
    None when nothing is launched on a GPU. Raises ``DeviceError`` with the fix."""
    if run.engine.kind is not EngineKind.vllm or run.engine.url or engine_platform(run) != "cuda":
        return None
    import subprocess

    from fineenvs.engine.devices import parse_nvidia_smi, plan_devices, visible_from_env

    smi = nvidia_smi or shutil.which("nvidia-smi")
    listing = ""
    if smi:
        try:
            listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            listing = ""
    e = run.engine
    source = os.environ if env is None else env
    # Processes of this run on this machine (accelerate launch / torchrun set these).
    processes = int(source.get("LOCAL_WORLD_SIZE") or source.get("WORLD_SIZE") or 1)
    return plan_devices(
        parse_nvidia_smi(listing),
        visible=visible_from_env(env),
        engine_devices=[str(d) for d in e.devices],
        needed=e.tensor_parallel_size * e.data_parallel_size * e.replicas,
        training=trains(run),
        trainer_processes=processes,
    )


@dataclass(frozen=True)
class ReplicaPlan:
    """One launched vLLM replica: its name, its GPUs (cuda) or its cores (cpu)."""

    name: str
    devices: tuple[str, ...] | None
    cpus: str


def replica_plans(run: RunConfig) -> list[ReplicaPlan]:
    """The launched servers and what each gets: ``engine.replicas`` of them (one without replicas).
    Raises ``DeviceError`` (a ``ValueError``) with the fix when the machine cannot hold them."""
    from fineenvs.engine.devices import per_replica, split_cores, usable_cores

    e = run.engine
    n = e.replicas
    if engine_platform(run) == "cuda":
        plan = device_plan(run)
        groups: list[tuple[str, ...] | None] = list(per_replica(plan.engine, n)) if plan else [None] * n
        return [ReplicaPlan(f"r{i}", g, e.cpu_threads_bind) for i, g in enumerate(groups)]
    if n == 1:
        return [ReplicaPlan("r0", None, e.cpu_threads_bind)]
    cpus = list(e.replica_cpus) or split_cores(usable_cores(), n)
    return [ReplicaPlan(f"r{i}", None, c) for i, c in enumerate(cpus)]


def _kv(obj: Any, indent: str = "    ") -> list[str]:
    lines = []
    assert is_dataclass(obj)
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):  # a nested settings class (scheduler.ray): its own lines
            lines += [f"{indent}{f.name}:", *_kv(value, indent + "  ")]
            continue
        shown = value.value if hasattr(value, "value") and not isinstance(value, (int, float, str)) else value
        lines.append(f"{indent}{f.name}: {shown}")
    return lines


def describe_plan(run: RunConfig) -> str:
    """Human-readable resolved plan: what would start, with which settings, and where outputs go."""
    title = run.experiment or "(no experiment)"
    out = [f"fineenvs plan: job={run.job.value} experiment={title}", f"  output dir: {run.output_dir}"]
    m = run.model
    out.append(f"  model: {m.name} ({m.source.value}: {m.path}{'@' + m.revision if m.revision else ''})")
    out.append(
        f"    family={m.family.value} tool_call_parser={m.tool_call_parser} chat_template={m.chat_template}"
    )
    out += _engine_lines(run)
    out += _rollout_lines(run)
    out += _training_lines(run)
    if run.job is Job.eval:
        ev = run.eval
        out.append(
            f"  eval: split={ev.split} checkpoints={ev.checkpoints or [m.path]} concurrency={ev.concurrency}"
        )
    if run.recipe is not None:
        out.append(f"  recipe: {type(run.recipe).__name__}")
        out += _kv(run.recipe)
    return "\n".join(out)


def _engine_lines(run: RunConfig) -> list[str]:
    """What serves: the engine attached to or launched, its command and the weight sync."""
    e = run.engine
    sync = effective_weight_sync(run).value
    if e.url:
        out = [f"  engine: {e.kind.value}, attach to {e.url} (weight sync: {sync})"]
    elif e.urls:
        out = [f"  engine: vllm, attach to {len(e.urls)} replicas (weight sync: {sync}): {', '.join(e.urls)}"]
        out += _attached_replica_lines(run)
        out += _router_lines(run, list(e.urls))
    elif e.kind is EngineKind.vllm and e.replicas > 1:
        out = [
            f"  engine: vllm, {e.replicas} replicas launched (weight sync: {sync}); each one's serve command:"
        ]
        out += [*_vllm_lines(run), *_replica_lines(run)]
    elif e.kind is EngineKind.vllm:
        out = [f"  engine: vllm, launched (weight sync: {sync}); serve command:", *_vllm_lines(run)]
    else:
        dtype = e.dtype or run.model.dtype
        return [
            f"  engine: transformers (embedded), launched as a child process on {e.host}, "
            f"dtype={dtype}, weight sync: {sync}"
        ]
    out.append(f"    weight sync: {weight_sync_reason(run)}")
    return out


def _vllm_lines(run: RunConfig) -> list[str]:
    """A launched vLLM: its command line, template, environment and devices."""
    e = run.engine
    try:
        args = vllm_args(run)
        out = ["    " + shlex.join(vllm_command(run))]
    except (ImportError, ValueError) as err:
        return [f"    (serve command unavailable: {err})"]
    if e.port == 0:
        out.append("    (--port 0: a free port is picked at launch)")
    if args.template_path is not None and args.chat_template is None:
        out.append(
            f"    chat template: {args.template_path}, written at launch (the "
            f"{args.resolved_family.value} template from TRL, patched to not think)"
        )
    out.append(f"    vLLM: {args.python or 'vllm from PATH'}")
    if args.platform == "cpu":
        why = "engine.platform=cpu" if e.platform.value == "cpu" else "no NVIDIA GPU visible"
        out.append(
            f"    platform: cpu (vLLM's CPU build; {why}): "
            f"VLLM_CPU_KVCACHE_SPACE={args.cpu_kvcache_gib} GiB, VLLM_CPU_OMP_THREADS_BIND={args.cpu_threads_bind}, "
            f"{'eager' if args.eager else 'compiled (torch.compile, cached across runs)'}"
        )
        return out
    try:
        devices = device_plan(run)
    except ValueError as err:
        out.append(f"    platform: cuda; GPUs: cannot split them: {err}")
    else:
        out.append(f"    platform: cuda; GPUs: {devices.reason if devices else 'none launched'}")
    return out


def _replica_lines(run: RunConfig) -> list[str]:
    """Each launched replica's devices, then the router in front of them."""
    try:
        plans = replica_plans(run)
    except ValueError as err:
        return [f"    replicas: cannot place them: {err}"]
    out = []
    for plan in plans:
        where = f"GPUs {','.join(plan.devices)}" if plan.devices else f"cores {plan.cpus}"
        out.append(
            f"    replica {plan.name}: {where}, its own free port, --middleware (names it in x-fineenvs-replica)"
        )
    return out + _router_lines(run, [f"http://{run.engine.host}:<{p.name} port>" for p in plans])


def _attached_replica_lines(run: RunConfig) -> list[str]:
    """How to start the servers ``engine.urls`` names: what fineenvs would launch, one per URL, with
    the replica's name (its middleware stamps it on every reply) and the URL's port."""
    from urllib.parse import urlsplit

    from fineenvs.engine.vllm import build_serve_command, build_serve_env

    try:
        args = vllm_args(run)
    except (ImportError, ValueError) as err:
        return [f"    (serve commands unavailable: {err})"]
    out = [
        "    start each server as below (on its own devices; vLLM's environment with fineenvs' plugin: "
        "`python -m fineenvs.engine install-vllm`), then run this command:"
    ]
    for i, url in enumerate(run.engine.urls):
        parts = urlsplit(url)
        served = replace(args, replica=f"r{i}", host=parts.hostname or args.host, port=parts.port or 80)
        env = build_serve_env(served, base={})
        shown = {k: v for k, v in sorted(env.items()) if k.startswith(("VLLM_", "FINEENVS_", "CUDA_"))}
        out.append(
            "    "
            + " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items())
            + " "
            + shlex.join(build_serve_command(served))
        )
    return out


def _router_lines(run: RunConfig, worker_urls: list[str]) -> list[str]:
    """The router the replicas sit behind: attached, or launched with its command line."""
    from fineenvs.engine.router import ROUTER_VERSION, SESSION_HEADER, router_command

    r = run.engine.router
    policy = f"policy {r.policy}" + (
        f" on the {SESSION_HEADER} header the proxy sends" if r.policy == "consistent_hash" else ""
    )
    if r.url:
        return [f"  router: attach to {r.url} ({policy}; it must route to the replicas above)"]
    command = router_command(r, worker_urls, port=r.port, prometheus_port=0)
    return [
        f"  router: vllm-router {ROUTER_VERSION}, launched ({policy}); control calls go to each replica directly:",
        "    " + shlex.join(command),
        "    (port 0: free ports at launch)",
    ]


def _rollout_lines(run: RunConfig) -> list[str]:
    """Where the agents run: the proxy, each harness's pinned CLI and format, the tasks, sampling
    and the reward."""
    from fineenvs.harnesses import HARNESSES

    p = run.proxy
    out = [
        f"  proxy: {p.host}:{p.port or 'free port'} admin_key={'set' if p.admin_key else 'unset'} "
        f"max_model_calls={p.max_model_calls} workers={p.workers} "
        f"store={p.store_dir or str(run.output_dir) + '/records'}",
        f"  harnesses ({len(run.harness)}):",
    ]
    for name, h in run.harness.items():
        step = f" step_limit={h.step_limit}" if h.step_limit else ""
        adapter = HARNESSES.get(name)
        pin = f"{adapter.package}@{adapter.version} ({adapter.registry})" if adapter else "(no adapter)"
        out.append(f"    {name}: {pin} format={h.api_format.value} weight={h.weight}{step}")
    out.append(_sandbox_line(run))
    out.append(f"  attempts: {_attempts_where(run)}")
    t = run.tasks
    extra = [f"subset={t.subset}"] if t.subset else []
    if t.limit:
        extra.append(f"limit={t.limit}")
    if t.path:
        extra.append(f"path={t.path}")
    out.append(f"  tasks: {t.name} split={t.split} {' '.join(extra)}".rstrip())
    s = run.sampling
    out.append(
        f"  sampling ({'training: full distribution' if run.job is Job.rl else 'no training'}): temperature={s.temperature} top_p={s.top_p} "
        f"top_k={'off' if s.top_k <= 0 else s.top_k} min_p={s.min_p} max_tokens={s.max_tokens}"
    )
    r = run.reward
    terms = ", ".join(f"{k}={v}" for k, v in r.terms.items())
    out.append(
        f"  reward: {terms} tool_budget={r.tool_budget} verified_tool_count={r.require_verified_tool_count}"
    )
    return out


def _sandbox_line(run: RunConfig) -> str:
    sandbox = run.scheduler.sandbox.value
    if sandbox != "docker":
        return f"  sandbox: {sandbox}"
    d = run.scheduler.docker
    image = d.image or "fineenvs-base (built here from this machine's runtime)"
    tasks = (
        "built from each task's environment/Dockerfile" if d.build_task_images else "not built (image above)"
    )
    prebuilt = f", {len(d.task_images)} prebuilt" if d.task_images else ""
    return (
        f"  sandbox: docker image={image} task images: {tasks}{prebuilt}; memory={d.memory} pids={d.pids} "
        f"cpus={d.cpus} network=none (the proxy through a Unix-socket bridge)"
    )


def _attempts_where(run: RunConfig) -> str:
    """Where attempts run (``scheduler.backend``)."""
    if run.scheduler.backend.value == "local":
        return f"local (threads of this process, sandbox={run.scheduler.sandbox.value})"
    r = run.scheduler.ray
    cluster = (
        f"cluster {r.address}"
        if r.address
        else f"a local cluster the run starts (head + {r.local_sandbox_nodes} rollout nodes x "
        f"{r.local_sandbox_slots} slots, {r.local_object_store_mib} MiB object store each)"
    )
    return (
        f"ray on {cluster}; {r.sandbox_per_attempt:g} '{r.sandbox_resource}' per attempt, "
        f"sandbox={run.scheduler.sandbox.value}; rollout nodes reach the proxy at {r.proxy_url or 'its own address'}"
    )


def _training_lines(run: RunConfig) -> list[str]:
    """The trainer, the scheduler, the rows and the logger, setting by setting."""
    tr = run.trainer
    kind = (
        "grpo"
        if isinstance(tr, GRPOSettings)
        else "sft"
        if isinstance(tr, SFTSettings)
        else type(tr).__name__
    )
    out = [f"  trainer: {kind}", *_kv(tr), "  scheduler:", *_kv(run.scheduler), "  rows:", *_kv(run.rows)]
    lg = run.logger
    out.append(
        f"  logger: {lg.kind.value}"
        + (f" mode={lg.mode.value} project={lg.project}" if lg.kind.value == "wandb" else "")
    )
    return out


def preflight(run: RunConfig) -> list[str]:
    """What this machine lacks for the job, each with how to get it; empty when ready."""
    problems: list[str] = []
    if run.engine.kind is EngineKind.vllm and not run.engine.url:
        if engine_platform(run) == "cuda":
            problems += _gpu_problems(run)
        else:
            problems += _cpu_model_problems(run)
        problems += _vllm_executable_problems(run)
    if effective_weight_sync(run) is WeightSyncKind.nccl:
        from fineenvs.engine.vllm_client import client_problem

        problem = client_problem()
        if problem:
            problems.append(problem)
    if run.model.source is ModelSource.hub and run.engine.kind is EngineKind.transformers:
        problems.append(
            f"model={run.model.name} loads {run.model.path} from the Hugging Face Hub, which this machine may "
            "not reach; set model.source=local model.path=<dir> for a local copy, or use model=tiny_qwen."
        )
    if run.scheduler.sandbox.value == "bwrap" and shutil.which("bwrap") is None:
        problems.append(
            "scheduler.sandbox=bwrap needs bubblewrap, which is not installed: apt-get install bubblewrap "
            "(or scheduler.sandbox=plain)."
        )
    # With backend=ray the containers run on the rollout nodes, which check for themselves (an
    # attempt there without a daemon is an infra failure that says why): the driver needs no daemon.
    if run.scheduler.sandbox.value == "docker" and run.scheduler.backend.value != "ray":
        from fineenvs.harnesses.container import daemon_problem, runtime_problem

        problems += [p for p in (daemon_problem(), runtime_problem(run.scheduler.docker)) if p]
    if run.scheduler.backend.value == "ray" and importlib.util.find_spec("ray") is None:
        problems.append(
            "scheduler.backend=ray needs Ray, which is not installed: pip install 'fineenvs[ray]' "
            "(ray==2.60.0), or scheduler.backend=local."
        )
    problems += _harness_problems(run)
    problems += _teacher_collection_problems(run)
    problems += _attached_engine_problems(run)
    problems += _task_selection_problems(run)
    problems += _replica_problems(run)
    return problems


def _replica_problems(run: RunConfig) -> list[str]:
    """Several servers: the pinned router installed (unless attached), the replicas placeable."""
    e = run.engine
    if e.replicas == 1 and not e.urls:
        return []
    from fineenvs.engine.router import router_problem

    problems = []
    if not e.router.url:
        problem = router_problem(e.router)
        if problem:
            problems.append(problem)
    if e.replicas > 1:
        try:
            replica_plans(run)
        except ValueError as err:
            problems.append(str(err))
    return problems


def _task_selection_problems(run: RunConfig) -> list[str]:
    """The task settings against the tasks themselves, where they can be read without the Hub:
    the generated sets (made in the cache on first use, in about a second) and a local path."""
    from fineenvs.tasks import TaskError
    from fineenvs.tasks.selection import select_tasks

    if run.tasks.path is None and run.tasks.name not in ("demo", "mini"):
        return []  # the Hub set: checked when the job has downloaded it
    if run.job not in (Job.rl, Job.collect_teacher, Job.eval):
        return []
    try:
        if run.job is Job.eval:
            select_tasks(replace(run.tasks, limit=run.eval.limit), run.eval.split)
        else:
            select_tasks(run.tasks)
    except TaskError as err:
        return [str(err)]
    except OSError as err:
        return [f"tasks.path={run.tasks.path} cannot be read ({err}); point it at a task set directory"]
    return []


def _attached_engine_problems(run: RunConfig) -> list[str]:
    """``engine.url``: the server answers and serves the model the run names (asked now, as the
    job will when it attaches)."""
    import httpx

    from fineenvs.engine.handle import served_model_problem, served_models, unreachable_problem

    url = run.engine.url
    if not url:
        return []
    url = url.rstrip("/").removesuffix("/v1")
    try:
        names = served_models(url, timeout_s=5.0)
    except httpx.HTTPError as err:
        return [unreachable_problem(url, err)]
    problem = served_model_problem(url, None, names)
    return [problem] if problem else []


TEACHER_MANIFEST = "teacher_manifest.json"
"""What a teacher collection (``job=collect_teacher``) writes in its output folder: its kept sessions."""


def teacher_manifest_problem(path: Path) -> str | None:
    if path.is_file():
        return None
    return (
        f"{path} does not exist: trainer.teacher_dir must be the output directory of a finished "
        "job=collect_teacher run (python -m fineenvs.run +experiment=collect_teacher)."
    )


def _teacher_collection_problems(run: RunConfig) -> list[str]:
    """``job=sft`` trains on a collection that must exist and hold what ``trainer.rollout_slices``
    asks of it (the job checks the same when it reads the sessions)."""
    t = run.trainer
    if run.job is not Job.sft or not isinstance(t, SFTSettings) or not t.teacher_dir:
        return []
    path = Path(t.teacher_dir) / TEACHER_MANIFEST
    problem = teacher_manifest_problem(path)
    if problem:
        return [problem]
    import json
    from collections import Counter

    kept = Counter(str(s.get("harness")) for s in json.loads(path.read_text()).get("sessions", []))
    return t.collection_problems(dict(kept))


def _gpu_problems(run: RunConfig) -> list[str]:
    from fineenvs.engine.devices import DeviceError
    from fineenvs.engine.launcher import cuda_devices

    gpus, why = cuda_devices()
    if not gpus:
        return [
            f"engine.platform=cuda launches vLLM on an NVIDIA GPU; none is usable here ({why}). Run on a GPU "
            "machine, use vLLM's CPU build (engine.platform=cpu or auto), attach to a running server with "
            "engine.url=http://HOST:PORT, or use the embedded engine: engine=transformers."
        ]
    try:
        device_plan(run)
    except DeviceError as err:
        return [str(err)]
    return []


def _cpu_model_problems(run: RunConfig) -> list[str]:
    """What vLLM's CPU build cannot serve of this model (``fineenvs.engine.vllm.cpu_serving_problems``)."""
    from fineenvs.engine.vllm import cpu_serving_problems

    config = model_config_dict(run)
    return [] if config is None else cpu_serving_problems(config, run.model.name)


def model_config_dict(run: RunConfig) -> JsonObject | None:
    """The model's ``config.json`` as a dict: a tiny model's (from its spec, without building it) or
    a local directory's; None for a Hub id (nothing is downloaded to look)."""
    m = run.model
    if m.source is ModelSource.tiny:
        from fineenvs.models import model_builder

        return model_builder().config(m.path)
    path = Path(m.path).expanduser() / "config.json"
    if path.is_file():
        import json

        data: JsonObject = json.loads(path.read_text())
        return data
    return None


def _vllm_executable_problems(run: RunConfig) -> list[str]:
    from fineenvs.engine.vllm import VLLMServeArgs, vllm_executable_problem

    args = VLLMServeArgs(model=run.model.path, python=vllm_python(run), platform=engine_platform(run))
    problem = vllm_executable_problem(args)
    return [problem] if problem else []


def _harness_problems(run: RunConfig) -> list[str]:
    try:
        from fineenvs.harnesses import check_installed
    except ImportError:
        return []
    return list(check_installed(list(run.harness)))
