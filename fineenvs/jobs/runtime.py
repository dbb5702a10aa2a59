"""One job runtime: harness check → engine → probe → proxy → attempt runner, torn down in reverse.

Every job that runs agents (RL, teacher collection, evaluation) enters the same context manager::

    async with job_runtime(run, out, model_dir=..., probe=Probe.require) as rt:
        runner = rt.attempt_runner(tasks, row_options=..., attempts_dir=out / "attempts")
        ...

It checks the run's harness CLIs are installed, launches (or attaches to) the engine, probes it,
starts the capture proxy in front of it and builds attempt runners against that proxy. On leaving
— normally, on an error, on Ctrl-C or on SIGTERM (``fineenvs.lifecycle`` turns it into the same
``KeyboardInterrupt``) — everything it started stops in reverse order: runners' HTTP clients,
the proxy, then the engine.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fineenvs.config import RunConfig
from fineenvs.jobs.builders import attempt_settings, reward_function, start_engine, start_proxy
from fineenvs.jobs.errors import RunAborted
from fineenvs.rollout.attempt import ProxyAttemptRunner
from fineenvs.rollout.ray_backend import SchedulerBackend
from fineenvs.trajectory import RowOptions

if TYPE_CHECKING:
    from fineenvs.engine.handle import EngineHandle
    from fineenvs.engine.probe import ProbeReport
    from fineenvs.rollout.ray_backend import RayAttempts
    from fineenvs.tasks.model import Task


class Probe(enum.Enum):
    """What the job needs from the engine probe (``fineenvs.engine.probe``)."""

    require = "require"
    """Training: the engine must return token ids and logprobs (grade ``tokens``), or the run stops."""
    inform = "inform"
    """Teacher collection: any grade will do (SFT re-renders the messages); a failed probe is printed."""
    skip = "skip"
    """Evaluation: only graded answers matter."""


def check_harnesses(run: RunConfig, error: type[Exception] = RunAborted) -> None:
    """Raise ``error`` naming every harness CLI of the run that is not installed, and how to install it."""
    from fineenvs.harnesses import check_installed

    problems = check_installed(list(run.harness))
    if problems:
        raise error(
            "harness CLIs missing:\n  "
            + "\n  ".join(problems)
            + "\nInstall them with `python -m fineenvs.harnesses install <name>` or drop them from `harness`."
        )


@dataclass
class JobRuntime:
    """The running engine and proxy of one job; ``attempt_runner`` builds runners against them."""

    run: RunConfig
    engine: EngineHandle
    proxy_url: str
    probe: ProbeReport | None
    """None when the probe was skipped or failed."""
    _stack: AsyncExitStack
    remote: RayAttempts | None = None
    """``scheduler.backend=ray``: the cluster attempts run on."""

    def attempt_runner(
        self,
        tasks: list[Task],
        *,
        attempts_dir: Path,
        row_options: RowOptions,
        runner_class: type[ProxyAttemptRunner] = ProxyAttemptRunner,
    ) -> ProxyAttemptRunner:
        """A runner for ``tasks`` through this proxy; its HTTP client closes before the proxy stops."""
        runner = attempt_runner(
            self.run,
            tasks,
            proxy_url=self.proxy_url,
            served_model=self.engine.served_model_name,
            attempts_dir=attempts_dir,
            row_options=row_options,
            runner_class=runner_class,
        )
        if self.remote is not None:
            runner.settings.remote = self.remote
        self._stack.push_async_callback(runner.aclose)
        return runner


def attempt_runner(
    run: RunConfig,
    tasks: list[Task],
    *,
    proxy_url: str,
    served_model: str,
    attempts_dir: Path,
    row_options: RowOptions,
    runner_class: type[ProxyAttemptRunner] = ProxyAttemptRunner,
) -> ProxyAttemptRunner:
    """An attempt runner for ``tasks`` through the proxy at ``proxy_url`` (the caller closes it):
    every job's runner is built here, also against a proxy another job runs (in-training eval)."""
    return runner_class(
        attempt_settings(run, proxy_url=proxy_url, served_model=served_model, attempts_dir=attempts_dir),
        tasks={task.task_id: task for task in tasks},
        reward_fn=reward_function(run),
        row_options=row_options,
    )


@asynccontextmanager
async def job_runtime(
    run: RunConfig,
    out: Path,
    *,
    model_dir: Path | None = None,
    probe: Probe = Probe.skip,
    served_model_name: str | None = None,
    engine_url: str | None = None,
    label: str = "",
    check: bool = True,
) -> AsyncIterator[JobRuntime]:
    """Check harnesses, start (or attach to) the engine, probe it, start the proxy; stop in reverse.

    ``model_dir``: what an embedded engine or a launched vLLM loads (``engine.url`` set: attached
    to instead). ``engine_url`` attaches to a server the caller runs (the in-training evaluation
    uses the RL run's engine). ``served_model_name`` overrides the name clients use (evaluation
    serves a checkpoint under the base model's name); ``label`` prefixes the lines printed about
    what started; ``check=False`` skips the harness check for a caller that made it already."""
    from fineenvs.engine import attach, probe_engine, require_training_grade

    if check:
        check_harnesses(run)
    prefix = f"{label}: " if label else ""
    async with AsyncExitStack() as stack:
        if engine_url is not None:
            engine = attach(engine_url)
        else:
            engine = start_engine(
                run, model_dir or Path(run.model.path), out, stack, served_model_name=served_model_name
            )
            print(
                f"{prefix}Built engine {engine.kind} on {engine.url} serving {engine.served_model_name}",
                flush=True,
            )
        report = None
        if probe is not Probe.skip:
            try:
                report = await asyncio.to_thread(probe_engine, engine.url, engine.served_model_name)
                print(f"{prefix}Engine probe: grade={report.grade.value}", flush=True)
            except Exception as err:
                if probe is Probe.require:
                    raise
                print(f"{prefix}Engine probe failed ({type(err).__name__}: {err}); going on", flush=True)
            if report is not None and probe is Probe.require:
                require_training_grade(report)
        proxy_url = start_proxy(run, engine, out, stack)
        print(f"{prefix}Built proxy on {proxy_url} -> engine {engine.url}", flush=True)
        remote = None
        if run.scheduler.backend is SchedulerBackend.ray:
            from fineenvs.rollout.ray_backend import ray_attempts

            # Entered after the proxy, so it stops first: no attempt outlives the proxy it talks to.
            remote = await stack.enter_async_context(
                ray_attempts(run.scheduler.ray, proxy_url=proxy_url, admin_key=run.proxy.admin_key, out=out)
            )
        yield JobRuntime(run, engine, proxy_url, report, stack, remote)
