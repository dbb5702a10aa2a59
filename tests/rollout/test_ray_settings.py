"""``scheduler.backend=ray`` settings and outcomes, without Ray: config errors at compose time (so
``dry_run=true`` shows them), the dry-run line, and an infrastructure failure as a value."""

from __future__ import annotations

import pytest

from fineenvs.config import ConfigError
from fineenvs.plan import describe_plan
from fineenvs.rollout.schedule import PlannedGroup
from fineenvs.rollout.scheduler import AttemptOutcome, InfrastructureFailure
from tests.test_config import load


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load("+experiment=smoke", "output_dir=/tmp/fineenvs-x", *overrides)
    return err.value.problems


def test_ray_settings_are_checked_at_compose_time() -> None:
    problems = _problems(
        "scheduler.backend=ray",
        "scheduler.ray.sandbox_per_attempt=0",
        "scheduler.ray.local_sandbox_nodes=0",
        "scheduler.ray.local_object_store_mib=10",
    )
    assert len(problems) == 3, problems
    assert any("scheduler.ray.sandbox_per_attempt=1" in p for p in problems)
    assert any("scheduler.ray.local_sandbox_nodes=1" in p for p in problems)
    assert any("78 MiB" in p for p in problems)


def test_a_remote_proxy_address_needs_a_reachable_bind() -> None:
    (problem,) = _problems("scheduler.backend=ray", "scheduler.ray.proxy_url=http://10.0.0.5:8100")
    assert "proxy.host=0.0.0.0" in problem and "admin_key" in problem


def test_a_sandbox_bridge_cannot_reach_a_remote_proxy() -> None:
    for sandbox in ("bwrap", "docker"):
        problems = _problems(
            "scheduler.backend=ray",
            f"scheduler.sandbox={sandbox}",
            "scheduler.ray.proxy_url=http://10.0.0.5:8100",
            "proxy.host=0.0.0.0",
            "proxy.admin_key=k",
        )
        assert (
            len(problems) == 1 and f"scheduler.sandbox={sandbox} with scheduler.ray.proxy_url" in problems[0]
        )
        assert "loopback only" in problems[0] and "Fix:" in problems[0]
    load(
        "+experiment=smoke", "output_dir=/tmp/fineenvs-x", "scheduler.backend=ray", "scheduler.sandbox=docker",
        "scheduler.ray.proxy_url=http://127.0.0.1:8100",
    )  # fmt: skip


def test_ray_settings_ignored_with_the_local_backend() -> None:
    run = load("+experiment=smoke", "output_dir=/tmp/fineenvs-x", "scheduler.ray.local_sandbox_nodes=0")
    assert run.scheduler.backend.value == "local"


def test_dry_run_names_where_attempts_run() -> None:
    plan = describe_plan(load("+experiment=smoke", "output_dir=/tmp/fineenvs-x", "scheduler.backend=ray"))
    assert "attempts: ray on a local cluster the run starts (head + 1 rollout nodes x 4 slots" in plan
    assert "    ray:\n      address: None" in plan
    local = describe_plan(load("+experiment=smoke", "output_dir=/tmp/fineenvs-x"))
    assert "attempts: local (threads of this process, sandbox=plain)" in local


def test_an_infrastructure_failure_is_ungraded_and_counted_apart() -> None:
    group = PlannedGroup(0, "g", 0, 0, "t", "opencode", ("g-a0",))
    lost = AttemptOutcome.crashed(group, 0, 3, InfrastructureFailure("attempt g-a0 lost to a Ray fault"))
    assert lost.reward is None and lost.exit_reason == "infra_failure" and "Ray fault" in (lost.error or "")
    crashed = AttemptOutcome.crashed(group, 0, 3, ValueError("a bug"))
    assert crashed.exit_reason == "crashed"
