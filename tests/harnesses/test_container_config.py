"""The docker sandbox's settings and command line, without a daemon (default tier): bad values fail
at compose time with the key and the fix, the preflight names a missing daemon, and the
``docker run`` line carries the isolation the sandbox promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from fineenvs.config import ConfigError
from fineenvs.harnesses import container as ct
from fineenvs.harnesses.container import DockerSettings
from fineenvs.jobs.builders import attempt_settings
from fineenvs.plan import preflight
from tests.test_config import load


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("scheduler.docker.memory=4x", "scheduler.docker.memory='4x' is not a size"),
        ("scheduler.docker.pids=4", "scheduler.docker.pids=4 leaves an agent no room"),
        ("scheduler.docker.cpus=0", "scheduler.docker.cpus=0.0 must be > 0"),
    ],
)
def test_bad_docker_settings_fail_at_compose_time(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load("+experiment=smoke", "scheduler.sandbox=docker", override)
    [problem] = err.value.problems
    assert expected in problem and "Fix: e.g. scheduler.docker." in problem


def test_docker_settings_reach_the_attempt_runner() -> None:
    run = load("+experiment=smoke", "scheduler.sandbox=docker", "scheduler.docker.memory=512m")
    settings = attempt_settings(
        run, proxy_url="http://127.0.0.1:1", served_model="m", attempts_dir=Path("/x")
    )
    assert settings.docker == DockerSettings(memory="512m", build_task_images=False)
    assert not settings.use_bwrap
    plain = attempt_settings(
        load("+experiment=smoke"), proxy_url="u", served_model="m", attempts_dir=Path("/x")
    )
    assert plain.docker is None


def test_preflight_names_a_missing_daemon_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/fineenvs-test.sock")
    problems = [p for p in preflight(load("+experiment=smoke", "scheduler.sandbox=docker")) if "docker" in p]
    assert len(problems) == 1
    assert "scheduler.sandbox=docker needs" in problems[0]
    assert "dockerd" in problems[0] or "apt-get install docker.io" in problems[0]


def test_a_system_python_would_hide_task_images_and_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ct, "python_prefixes", lambda: [Path("/usr")])  # a Debian system Python
    problem = ct.runtime_problem(DockerSettings())
    assert problem is not None and "(/usr)" in problem and "build_task_images=false" in problem
    # Every attempt in the default image (built from this machine's files): nothing to hide.
    assert ct.runtime_problem(DockerSettings(build_task_images=False)) is None
    monkeypatch.setattr(ct, "python_prefixes", lambda: [Path("/root/.pyenv/versions/3.11.7")])
    assert ct.runtime_problem(DockerSettings()) is None


def test_docker_run_line_isolates_the_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FINEENVS_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(ct, "docker_binary", lambda: "/usr/bin/docker")
    driver = str(Path(ct.__file__).with_name("openhands_driver.py"))
    grader = str(Path(ct.__file__).parents[1] / "tasks" / "grader.py")
    argv = ct.docker_argv(
        ["agent", "--flag", driver, grader],
        settings=DockerSettings(memory="1g", pids=100, cpus=0.5),
        image="img:1",
        name="fineenvs-abc",
        attempt_id="abc",
        home=tmp_path / "home",
        workdir=tmp_path / "work",
        sock_dir=tmp_path / "sock",
        sock_name="proxy.sock",
        port=4321,
        env_names=["AGENT_KEY", "PATH"],
        sandbox_home=Path("/tmp/home"),
        sandbox_work=Path("/tmp/work"),
        sandbox_bridge=Path("/tmp/.fineenvs-bridge"),
    )

    def after(flag: str) -> list[str]:
        return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]

    assert argv[:2] == ["/usr/bin/docker", "run"]
    assert after("--network") == ["none"] and "--read-only" in argv
    assert after("--label") == [f"fineenvs.run={ct.run_id(str(tmp_path / 'run'))}", "fineenvs.attempt=abc"]
    assert (after("--memory"), after("--memory-swap"), after("--pids-limit"), after("--cpus")) == (
        ["1g"],
        ["1g"],
        ["100"],
        ["0.5"],
    )
    assert after("--cap-drop") == ["ALL"]
    assert after("-e") == ["AGENT_KEY", "PATH"]  # names only: the values come from the client's env
    volumes = after("-v")
    assert f"{tmp_path / 'home'}:/tmp/home" in volumes and f"{tmp_path / 'work'}:/tmp/work" in volumes
    assert all(v.endswith(":ro") for v in volumes if not v.startswith(str(tmp_path)))
    assert f"{driver}:{driver}:ro" in volumes  # a harness's driver script, and nothing else of ours
    assert not [
        v for v in volumes if "fineenvs/tasks" in v or v.startswith(str(Path(ct.__file__).parents[1]) + ":")
    ]
    assert after("-w") == ["/tmp/work"]
    image_at = argv.index("img:1")
    assert argv[image_at + 2 :] == [
        "-I",
        ct.BRIDGE_IN_CONTAINER,
        "4321",
        "/tmp/.fineenvs-bridge/proxy.sock",
        "--",
        "agent",
        "--flag",
        driver,
        grader,
    ]
    assert ct.run_id(str(tmp_path / "run")) != ct.run_id(str(tmp_path / "other"))


def test_preflight_with_ray_leaves_the_daemon_to_the_rollout_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/fineenvs-test.sock")
    run = load("+experiment=smoke", "scheduler.sandbox=docker", "scheduler.backend=ray")
    assert [p for p in preflight(run) if "docker" in p.lower()] == []


def test_an_attempt_where_no_daemon_answers_is_an_infra_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check a rollout node makes (the driver with backend=ray does not): no daemon there.
    from tests.harnesses.test_sandbox import run_script

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/fineenvs-test.sock")
    monkeypatch.setattr(ct, "_DAEMON_ANSWERED", False)
    result = run_script(tmp_path, "echo 1 > answer.txt", docker=DockerSettings(build_task_images=False))
    assert result.exit_reason == "infra_failure", result
    assert "scheduler.sandbox=docker needs" in result.detail
    assert "scheduler.sandbox=docker needs" in (tmp_path / "attempt" / "stderr.txt").read_text()
    assert not (tmp_path / "attempt" / "work" / "answer.txt").exists()  # the agent never ran


def _ended(started: bool, code: int = 125, error: str = "") -> ct.ContainerEnd:
    return ct.ContainerEnd(oom=False, code=code, started=started, error=error)


def test_docker_runs_own_failure_is_told_from_the_agents_exit() -> None:
    stderr = (
        "Unable to find image 'nope:1' locally\n"
        "docker: Error response from daemon: pull access denied for nope, repository does not exist.\n"
        "See 'docker run --help'.\n"
    )
    said = ct.startup_failure(125, _ended(False), stderr)
    assert said is not None and "docker run exited 125" in said and "pull access denied for nope" in said
    oci = "exec: /opt/py/bin/python3: no such file or directory"
    assert oci in (ct.startup_failure(127, _ended(False, 127, oci), "docker: Error response ...") or "")
    # The agent's own 125/126/127, once its container ran, and any other code: the agent's.
    assert ct.startup_failure(127, _ended(True, 127), "sh: 1: frobnicate: not found\n") is None
    assert (
        ct.startup_failure(125, _ended(True, 125), "docker: looks like docker's but is the agent's\n") is None
    )
    assert ct.startup_failure(1, _ended(False, 1), "docker: x\n") is None


_FAKE_DOCKER = """#!/bin/sh
# A docker client for the guard: the attempt's container is created only after the guard's first
# look (the run was killed while the daemon was still creating it).
echo "$@" >> {log}
case "$1" in
  ps) n=$(cat {count} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {count}
      if [ $n -ge 2 ] && [ ! -e {removed} ]; then echo cid-created-late; fi ;;
  rm) touch {removed} ;;
esac
"""


def test_guard_removes_a_late_container_by_label_with_the_clients_absolute_path(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from fineenvs.harnesses import guard

    bin_dir = tmp_path / "client-bin"  # on no PATH the guard has
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    log, count, removed = tmp_path / "calls.log", tmp_path / "count", tmp_path / "removed"
    docker.write_text(_FAKE_DOCKER.format(log=log, count=count, removed=removed))
    docker.chmod(0o755)
    marker = "a" * 32
    env = {
        "PATH": "/usr/bin:/bin",  # the agent's, without the client's folder
        guard.MARKER_ENV: marker,
        guard.CONTAINER_ENV: f"fineenvs-{marker[:16]}",
        guard.DOCKER_CLIENT_ENV: str(docker),
    }
    proc = subprocess.Popen(
        [sys.executable, "-I", str(Path(guard.__file__)), str(os.getpid()), marker, "--", "sleep", "60"],
        env=env,
        start_new_session=True,
    )
    time.sleep(0.5)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    calls = log.read_text().splitlines()
    query = f"ps -aq --no-trunc --filter label=fineenvs.attempt={marker}"
    assert calls[0] == query and calls[1] == query  # nothing yet, then the late container
    assert "rm -f cid-created-late" in calls
    assert calls[-1] == query and len(calls) >= 4  # looked again after removing, found none
    assert time.monotonic() - started < guard.REMOVE_DEADLINE_SECONDS


def test_default_image_skips_the_ldd_walk_when_the_runtime_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.setenv("FINEENVS_CACHE", str(tmp_path / "cache"))
    walks: list[str] = []
    key = ["runtime-1"]
    pruned: list[set[str]] = []
    monkeypatch.setattr(ct, "_runtime_key", lambda: key[0])
    existing = {"fineenvs-base:runtime-3"}  # the daemon has it already: found, not built

    def build() -> tuple[str, bool]:
        walks.append(key[0])
        tag = f"fineenvs-base:{key[0]}"
        return tag, tag not in existing

    monkeypatch.setattr(ct, "_build_default_image", build)
    monkeypatch.setattr(ct, "image_exists", lambda tag: True)
    monkeypatch.setattr(ct, "prune_base_images", lambda keep: pruned.append(keep) or [])
    monkeypatch.setattr(ct, "_BUILT", {})
    assert ct.default_image() == "fineenvs-base:runtime-1" and walks == ["runtime-1"]
    monkeypatch.setattr(ct, "_BUILT", {})  # another process: the cache file, no walk
    assert ct.default_image() == "fineenvs-base:runtime-1" and walks == ["runtime-1"]
    key[0] = "runtime-2"  # an agent installed, Python upgraded, ...: walk and build again
    monkeypatch.setattr(ct, "_BUILT", {})
    assert ct.default_image() == "fineenvs-base:runtime-2" and walks == ["runtime-1", "runtime-2"]
    entry = json.loads((tmp_path / "cache" / "docker" / "default-image.json").read_text())
    assert entry == {ct._runtime_name(): {"key": "runtime-2", "tag": "fineenvs-base:runtime-2"}}
    # Each build pruned the runtime's older images, keeping only what is current.
    assert pruned == [{"fineenvs-base:runtime-1"}, {"fineenvs-base:runtime-2"}]
    key[0] = "runtime-3"  # a walk that finds its image present builds nothing and prunes nothing
    monkeypatch.setattr(ct, "_BUILT", {})
    assert ct.default_image() == "fineenvs-base:runtime-3" and len(pruned) == 2


def test_runtime_key_changes_when_an_agent_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fineenvs.paths import MARKER_FILE

    monkeypatch.setenv("FINEENVS_CACHE", str(tmp_path / "cache"))
    before = ct._runtime_key()
    assert ct._runtime_key() == before
    agent = tmp_path / "cache" / "harnesses" / "some_agent-1.0"
    agent.mkdir(parents=True)
    (agent / MARKER_FILE).write_text("{}")
    assert ct._runtime_key() != before
