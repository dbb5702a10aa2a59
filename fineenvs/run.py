"""The entry point: ``python -m fineenvs.run +experiment=<name> [overrides] [dry_run=true]``.

Compose (Hydra) → convert and validate (all problems at once) → check the machine (GPU for vLLM,
installed harness CLIs) → run the job, or with ``dry_run=true`` print the resolved plan and start
nothing. Jobs start components in order (engine, proxy, agents, trainer) and stop them in reverse.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fineenvs.config import ConfigError, RunConfig, to_run_config
from fineenvs.plan import describe_plan, preflight

log = logging.getLogger("fineenvs.run")


def _output_dir(run: RunConfig) -> Path:
    if run.output_dir:
        return Path(run.output_dir)
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # composed outside @hydra.main (tests)
        return Path("outputs") / "adhoc"


def _run_name(run: RunConfig) -> str:
    """The experiment, plus the job's own overrides in a multirun (one W&B run per sweep job)."""
    base = run.experiment or run.job.value
    try:
        hc = HydraConfig.get()
    except ValueError:
        return base
    if hc.mode is not None and hc.mode.name == "MULTIRUN" and hc.job.override_dirname:
        return f"{base}:{hc.job.override_dirname}"
    return base


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    try:
        run = to_run_config(cfg)
    except ConfigError as err:
        print(f"fineenvs: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    run.output_dir = str(_output_dir(run))
    if run.logger.name is None:
        run.logger.name = _run_name(run)
    # One line per HTTP call from the control-plane client would drown the progress lines.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    print(describe_plan(run))
    problems = preflight(run)
    if run.dry_run:
        if problems:
            print("\nBefore a real run, this machine needs:\n" + "\n".join(f"  - {p}" for p in problems))
        print("\ndry_run=true: nothing was started.")
        return None
    if problems:
        print(
            "fineenvs: cannot start this job on this machine:\n" + "\n".join(f"  - {p}" for p in problems),
            file=sys.stderr,
        )
        raise SystemExit(3)
    from fineenvs.jobs import run_job
    from fineenvs.lifecycle import (
        mark_run,
        reap_leftovers,
        remove_run_containers,
        stop_on_signals,
        stopped_by,
    )

    out = Path(run.output_dir)
    reaped = reap_leftovers(out)
    if reaped:
        print(f"stopped {len(reaped)} process(es) an earlier run on {out} left behind: {reaped}", flush=True)
    containers = run.scheduler.sandbox.value == "docker"
    if containers and (removed := remove_run_containers(out)):
        print(f"removed {len(removed)} container(s) an earlier run on {out} left behind", flush=True)
    mark_run(out)
    stop_on_signals(out)
    try:
        return run_job(run)
    except KeyboardInterrupt:
        name, signum = stopped_by() or ("SIGINT", 2)
        print(
            f"fineenvs: stopped by {name}; every component was stopped (see {out / 'stopped.json'}). "
            "Rerun the same command to resume.",
            file=sys.stderr,
        )
        raise SystemExit(128 + signum) from None
    finally:
        if containers:  # what a guard could not remove (the daemon was slow): the run's label finds it
            try:
                remove_run_containers(out)
            except Exception as exc:  # noqa: BLE001 - the run's own exit (or error) comes first
                print(
                    f"could not remove the run's containers ({exc}); the next run on {out} will", flush=True
                )


def main() -> None:
    hydra_main()


if __name__ == "__main__":
    main()
