"""The resolved plan of a job (printed by every run, and alone by ``dry_run=true``) and the
machine checks that must pass before anything starts."""

from __future__ import annotations

import shlex
import shutil
from dataclasses import fields, is_dataclass
from typing import Any

from fineenvs.config import (
    EngineKind,
    GRPOSpec,
    Job,
    ModelSource,
    RunConfig,
    SFTSpec,
    WeightSyncKind,
)


def effective_weight_sync(run: RunConfig) -> WeightSyncKind:
    """What ``engine.weight_sync=auto`` means for this job."""
    ws = run.engine.weight_sync
    if ws is not WeightSyncKind.auto:
        return ws
    if run.job in (Job.eval, Job.collect_teacher):
        return WeightSyncKind.none
    if run.engine.kind is EngineKind.transformers:
        return WeightSyncKind.http
    return WeightSyncKind.reload if run.engine.url else WeightSyncKind.nccl


def vllm_command(run: RunConfig) -> list[str]:
    """The exact ``vllm serve`` command this job would launch."""
    from fineenvs.engine.vllm import build_serve_command

    return build_serve_command(vllm_args(run))


def vllm_args(run: RunConfig) -> Any:
    """Map the typed config onto the launcher's arguments (family, parser and template by model)."""
    from pathlib import Path

    from fineenvs.engine.vllm import PROFILES, VLLMServeArgs

    m, e, s = run.model, run.engine, run.sampling
    sync = effective_weight_sync(run)
    args = VLLMServeArgs(
        model=m.path,
        served_model_name=m.path,
        revision=m.revision,
        host=e.host,
        port=e.port or 8000,
        dtype=e.dtype or m.dtype,
        tensor_parallel_size=e.tensor_parallel_size,
        data_parallel_size=e.data_parallel_size,
        max_model_len=e.max_model_len or m.max_model_len,
        gpu_memory_utilization=e.gpu_memory_utilization,
        tool_call_parser=m.tool_call_parser,
        default_chat_template_kwargs=dict(m.chat_template_kwargs) or None,
        temperature=s.temperature if s.temperature > 0 else 1.0,
        top_p=s.top_p,
        top_k=s.top_k,
        enforce_eager=e.enforce_eager,
        enable_prefix_caching=e.enable_prefix_caching,
        weight_sync=sync.value if sync in (WeightSyncKind.nccl, WeightSyncKind.reload) else None,
        extra_args=list(e.extra_args),
        python=e.python,
    )
    profile = PROFILES[args.resolved_family]
    if profile.trl_template is not None:
        # The patched template is written into the run directory at launch (engine.vllm.prepare_chat_template).
        name = f"{args.resolved_family.value}_nothink.jinja"
        args.chat_template = Path(str(run.output_dir)) / "engine" / name
    return args


def _kv(obj: Any, indent: str = "    ") -> list[str]:
    lines = []
    assert is_dataclass(obj)
    for f in fields(obj):
        value = getattr(obj, f.name)
        shown = value.value if hasattr(value, "value") and not isinstance(value, (int, float, str)) else value
        lines.append(f"{indent}{f.name}: {shown}")
    return lines


def describe_plan(run: RunConfig) -> str:
    """Human-readable resolved plan: what would start, with which settings, and where outputs go."""
    out: list[str] = []
    title = run.experiment or "(no experiment)"
    out.append(f"fineenvs plan: job={run.job.value} experiment={title}")
    out.append(f"  output dir: {run.output_dir}")
    m = run.model
    out.append(f"  model: {m.name} ({m.source.value}: {m.path}{'@' + m.revision if m.revision else ''})")
    out.append(
        f"    family={m.family.value} tool_call_parser={m.tool_call_parser} chat_template={m.chat_template}"
    )
    e = run.engine
    sync = effective_weight_sync(run).value
    if e.url:
        out.append(f"  engine: {e.kind.value}, attach to {e.url} (weight sync: {sync})")
    elif e.kind is EngineKind.vllm:
        out.append(f"  engine: vllm, launched (weight sync: {sync}); serve command:")
        try:
            out.append("    " + shlex.join(vllm_command(run)))
        except ImportError as err:  # pragma: no cover - only while the launcher is missing
            out.append(f"    (serve command unavailable: {err})")
    else:
        dtype = e.dtype or m.dtype
        out.append(
            f"  engine: transformers (embedded), launched as a child process on {e.host}, "
            f"dtype={dtype}, weight sync: {sync}"
        )
    p = run.proxy
    out.append(
        f"  proxy: {p.host}:{p.port or 'free port'} admin_key={'set' if p.admin_key else 'unset'} "
        f"max_model_calls={p.max_model_calls} max_output_tokens={p.max_output_tokens} workers={p.workers} "
        f"store={p.store_dir or str(run.output_dir) + '/records'}"
    )
    out.append(f"  harnesses ({len(run.harness)}):")
    for name, h in run.harness.items():
        step = f" step_limit={h.step_limit}" if h.step_limit else ""
        out.append(
            f"    {name}: {h.package}@{h.version} ({h.registry.value}) format={h.api_format.value} "
            f"weight={h.weight}{step}"
        )
    t = run.tasks
    extra = [f"subset={t.subset}"] if t.subset else []
    if t.limit:
        extra.append(f"limit={t.limit}")
    if t.path:
        extra.append(f"path={t.path}")
    out.append(f"  tasks: {t.name} split={t.split} {' '.join(extra)}".rstrip())
    s = run.sampling
    out.append(
        f"  sampling ({s.purpose.value}): temperature={s.temperature} top_p={s.top_p} "
        f"top_k={'off' if s.top_k <= 0 else s.top_k} min_p={s.min_p} max_tokens={s.max_tokens}"
    )
    r = run.reward
    terms = ", ".join(f"{k}={v}" for k, v in r.terms.items())
    out.append(
        f"  reward: {terms} tool_budget={r.tool_budget} verified_tool_count={r.require_verified_tool_count}"
    )
    tr = run.trainer
    kind = "grpo" if isinstance(tr, GRPOSpec) else "sft" if isinstance(tr, SFTSpec) else type(tr).__name__
    out.append(f"  trainer: {kind}")
    out += _kv(tr)
    out.append("  scheduler:")
    out += _kv(run.scheduler)
    out.append("  rows:")
    out += _kv(run.rows)
    lg = run.logger
    out.append(
        f"  logger: {lg.kind.value}"
        + (f" mode={lg.mode.value} project={lg.project}" if lg.kind.value == "wandb" else "")
    )
    if run.job is Job.eval:
        ev = run.eval
        out.append(
            f"  eval: split={ev.split} checkpoints={ev.checkpoints or [m.path]} concurrency={ev.concurrency}"
        )
    return "\n".join(out)


def preflight(run: RunConfig) -> list[str]:
    """What this machine lacks for the job, each with how to get it; empty when ready."""
    problems: list[str] = []
    if run.engine.kind is EngineKind.vllm and not run.engine.url:
        if not _cuda_available():
            problems.append(
                "engine=vllm launches vLLM, which needs an NVIDIA GPU with CUDA; none is visible here. "
                "Run on a GPU machine, attach to a running server with engine.url=http://HOST:PORT, or use "
                "the embedded engine on this machine: engine=transformers with a model it can run "
                "(model=tiny_qwen for the CPU smoke run)."
            )
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
    problems += _harness_problems(run)
    return problems


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - any import problem means no usable GPU
        return False


def _harness_problems(run: RunConfig) -> list[str]:
    try:
        from fineenvs.harnesses import check_installed
    except ImportError:
        return []
    return list(check_installed({name: h.version for name, h in run.harness.items()}))
