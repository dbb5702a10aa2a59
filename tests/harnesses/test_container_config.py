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
