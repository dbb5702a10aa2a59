"""The docker sandbox against a real Docker daemon (``make test-containers`` starts one).

Every test runs real containers from images built here (no registry): the default image assembled
from this machine's runtime, and a task image built from a Harbor-style ``environment/Dockerfile``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import HTTPServer
from pathlib import Path
from typing import Any

import pytest

from fineenvs.harnesses import container as ct
from fineenvs.harnesses.container import DockerSettings
from tests.harnesses.test_sandbox import HelloHandler, run_script

pytestmark = [
    pytest.mark.containers,
    # Not skipped without a daemon: the tier that selects this marker starts one, so its absence
    # is a failure there (make test-containers).
    pytest.mark.usefixtures("docker_daemon"),
]

PYTHON = f"{Path(sys.base_prefix).resolve()}/bin/python3"  # mounted in every container


def _proxy() -> tuple[HTTPServer, int]:
    server = HTTPServer(("127.0.0.1", 0), HelloHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _run(tmp_path: Path, script: str, settings: DockerSettings | None = None, **kw: Any) -> Any:
    docker = settings or DockerSettings(memory="512m", pids=128, cpus=1.0)
    return run_script(tmp_path, script, **{"timeout_seconds": 60, "docker": docker, **kw})


def _host_address() -> str:
    """This machine's address on its default route (not loopback)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: only picks the route's source address
        return str(probe.getsockname()[0])
    finally:
        probe.close()


def test_attempt_reaches_only_the_proxy_and_sees_no_host_secret_or_gold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, port = _proxy()
    other = socket.socket()
    other.bind(("0.0.0.0", 0))
    other.listen()
    other_port = other.getsockname()[1]
    monkeypatch.setenv("FINEENVS_TEST_USER_SECRET", "sk-user-secret-123")
    gold = tmp_path / "task" / "tests" / "gold_answer.txt"  # where a Harbor task keeps its verifier side
    gold.parent.mkdir(parents=True)
    gold.write_text("the-gold-answer-42")
    connect = (
        f'{PYTHON} -c "import socket,sys; s=socket.socket(); s.settimeout(2); '
        f's.connect((sys.argv[1], {other_port}))" {{}} 2>/dev/null && echo reachable || echo blocked'
    )
    script = "; ".join(
        [
            "echo home=$HOME pwd=$(pwd) host=$(hostname 2>/dev/null || cat /etc/hostname)",
            f"{PYTHON} -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/').read().decode())\"",
            "echo loopback-other=$(" + connect.format("127.0.0.1") + ")",
            "echo host-other=$(" + connect.format(_host_address()) + ")",
            "env > work-env.txt",
            f"(cat {gold} 2>/dev/null || echo no-gold)",
            "(grep -rl the-gold-answer /tmp /opt 2>/dev/null || echo gold-not-found)",
            "(echo x > /usr/probe) 2>/dev/null && echo root-writable || echo root-readonly",
            "echo 42 > answer.txt",
        ]
    )
    try:
        result = _run(tmp_path, script, base_url=f"http://127.0.0.1:{port}/s/k")
    finally:
        server.shutdown()
        other.close()
    attempt = tmp_path / "attempt"
    out = (attempt / "stdout.txt").read_text().split("\n")
    assert result.exit_reason == "finished", (attempt / "stderr.txt").read_text()
    assert out[:8] == [
        "home=/tmp/home pwd=/tmp/work host=fineenvs",
        "hello-from-proxy",
        "loopback-other=blocked",
        "host-other=blocked",
        "no-gold",
        "gold-not-found",
        "root-readonly",
        "",
    ]
    env = dict(line.split("=", 1) for line in (attempt / "work" / "work-env.txt").read_text().splitlines())
    assert env["AGENT_KEY"] == "k-session"
    assert "FINEENVS_TEST_USER_SECRET" not in env
    assert "sk-user-secret-123" not in (attempt / "work" / "work-env.txt").read_text()
    assert result.answer == "42"
    record = json.loads((attempt / "attempt.json").read_text())
    argv = record["argv"]
    assert argv[1] == "run" and argv[argv.index("--network") + 1] == "none"
    assert f"{ct.RUN_LABEL}={ct.run_id()}" in argv
    assert "sk-user-secret-123" not in json.dumps(record)  # values never on the command line
    names = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
    assert record["container"].startswith("fineenvs-") and record["container"] not in names.stdout.split()


def test_container_killed_for_memory_is_the_attempts_failure(tmp_path: Path) -> None:
    script = f'{PYTHON} -c "b = bytearray(400 * 1024 * 1024); print(len(b))"; echo after-python; exit 0'
    result = _run(tmp_path, script, settings=DockerSettings(memory="96m", pids=64, cpus=1.0))
    assert result.exit_reason == "crashed", result
    assert "out of memory" in result.detail and "scheduler.docker.memory=96m" in result.detail
    # The kernel killed the largest process (python), the agent's shell went on and exited 0: docker
    # still flags the container, and the attempt is a failure all the same.
    assert "after-python" in (tmp_path / "attempt" / "stdout.txt").read_text()


def test_task_dockerfile_is_built_once_and_the_attempt_runs_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fineenvs.tasks.harbor import read_harbor_task

    task_dir = tmp_path / "tasks" / "t1"
    (task_dir / "environment").mkdir(parents=True)
    (task_dir / "tests").mkdir()
    (task_dir / "tests" / "test.sh").write_text("#!/bin/sh\necho gold\n")
    (task_dir / "task.toml").write_text(
        '[metadata]\nquestion = "q"\nanswer = "7"\ndifficulty_tier = "easy"\n'
    )
    nonce = os.urandom(4).hex()  # a fresh build every test run: the RUN step must really execute
    (task_dir / "environment" / "Dockerfile").write_text(
        f"FROM {ct.default_image()}\nRUN mkdir -p /opt/task && echo from-task-image-{nonce} > /opt/task/marker\n"
    )
    task = read_harbor_task(task_dir)
    assert task.environment == task_dir / "environment"
    script = "cat /opt/task/marker; ls /tmp/work; echo 7 > answer.txt"
    result = _run(tmp_path, script, environment=task.environment, task_id=task.task_id)
    assert result.exit_reason == "finished", (tmp_path / "attempt" / "stderr.txt").read_text()
    assert (tmp_path / "attempt" / "stdout.txt").read_text().split()[0] == f"from-task-image-{nonce}"
    tag = ct.task_image(task_dir / "environment")
    assert tag.startswith(f"{ct.TASK_REPO}:")

    # Cached by content, also for a later run (this process's memo cleared): no second build.
    def no_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the task image was built a second time")

    monkeypatch.setattr(ct, "_build", no_build)
    monkeypatch.setattr(ct, "_BUILT", {})
    assert ct.task_image(task_dir / "environment") == tag
    (task_dir / "environment" / "Dockerfile").write_text("FROM scratch\n")  # new content: a new image
    with pytest.raises(AssertionError, match="built a second time"):
        ct.task_image(task_dir / "environment")
    # The build context is the environment folder only: the verifier never reaches the image.
    done = subprocess.run(
        ["docker", "run", "--rm", tag, "/bin/sh", "-c", "find / -xdev -name test.sh 2>/dev/null; echo done"],
        capture_output=True,
        text=True,
    )
    assert done.stdout.split() == ["done"], done.stdout
    subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


def test_failed_task_build_says_why_and_how_to_fix(tmp_path: Path) -> None:
    env_dir = tmp_path / "environment"
    env_dir.mkdir()
    (env_dir / "Dockerfile").write_text(f"FROM {ct.default_image()}\nRUN exit 3\n")
    before = subprocess.run(["docker", "ps", "-aq"], capture_output=True, text=True).stdout.split()
    result = _run(tmp_path, "echo never", environment=env_dir)
    assert result.exit_reason == "infra_failure"  # the image, not the agent, failed
    assert "building the task image" in result.detail and "FINEENVS_BASE_IMAGE" in result.detail
    assert "building the task image" in (tmp_path / "attempt" / "stderr.txt").read_text()
    after = subprocess.run(["docker", "ps", "-aq"], capture_output=True, text=True).stdout.split()
    assert set(after) <= set(before), "the failed build left its step's container behind"


_CHILD = """
import sys, os
from pathlib import Path
sys.path.insert(0, {repo!r})
from fineenvs.harnesses.container import DockerSettings
from fineenvs.harnesses.sandbox import run_attempt
from tests.harnesses.test_sandbox import ScriptHarness
run_attempt(ScriptHarness("echo started > started.txt; sleep 120"), task_prompt="p", input_files={{}},
    attempt_dir=Path({attempt!r}), base_url="http://127.0.0.1:9/s/k", session_key="k", model="m",
    timeout_seconds=300, docker=DockerSettings(memory="256m", pids=64, cpus=0.5))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_run_leaves_no_container_and_no_client(tmp_path: Path, sig: signal.Signals) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rid = ct.run_id(str(run_dir))
    repo = str(Path(__file__).resolve().parents[2])
    code = textwrap.dedent(_CHILD.format(repo=repo, attempt=str(tmp_path / "attempt")))
    env = {**os.environ, "FINEENVS_RUN_DIR": str(run_dir), "PYTHONPATH": repo}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _running(rid):
            assert child.poll() is None, "the attempt's process ended before its container started"
            time.sleep(0.2)
        assert _running(rid), "no container of the run came up"
        os.kill(child.pid, sig)
        child.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ct.run_containers(rid):
            time.sleep(0.2)
        assert ct.run_containers(rid) == []
        clients = subprocess.run(
            ["pgrep", "-f", f"label={ct.RUN_LABEL}={rid}"], capture_output=True, text=True
        )
        assert clients.stdout.split() == []
    finally:
        if child.poll() is None:
            child.kill()
        ct.remove_run_containers(rid)


def _running(rid: str) -> bool:
    done = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label={ct.RUN_LABEL}={rid}"], capture_output=True, text=True
    )
    return bool(done.stdout.split())


def test_restart_removes_exactly_that_runs_containers(tmp_path: Path) -> None:
    from fineenvs.lifecycle import remove_run_containers

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    image = ct.default_image()
    started = []
    for out in (ours, ours, theirs):
        done = subprocess.run(
            [
                "docker",
                "run",
                "-d",
                "--label",
                f"{ct.RUN_LABEL}={ct.run_id(str(out))}",
                image,
                "sleep",
                "300",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        started.append(done.stdout.strip())
    unlabelled = subprocess.run(
        ["docker", "run", "-d", image, "sleep", "300"], capture_output=True, text=True, check=True
    )
    try:
        removed = remove_run_containers(ours)
        assert sorted(removed) == sorted(started[:2])
        assert ct.run_containers(ct.run_id(str(ours))) == []
        assert ct.run_containers(ct.run_id(str(theirs))) == [started[2]]
        alive = subprocess.run(["docker", "ps", "-q", "--no-trunc"], capture_output=True, text=True).stdout
        assert unlabelled.stdout.strip() in alive
    finally:
        subprocess.run(["docker", "rm", "-f", started[2], unlabelled.stdout.strip()], capture_output=True)


def test_docker_run_failing_before_the_agent_is_an_infra_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An image no daemon has (pulling it fails: docker run exits 125 with docker's own error).
    missing = f"fineenvs-test-missing-{os.getpid()}:1"
    result = _run(tmp_path, "echo 1 > answer.txt", DockerSettings(image=missing), attempt_dir=tmp_path / "a1")
    assert result.exit_reason == "infra_failure", result
    assert "the container did not start (docker run exited 125)" in result.detail
    assert missing in (tmp_path / "a1" / "stderr.txt").read_text() and result.answer is None
    # The daemon gone after it had answered once (DOCKER_HOST at a dead socket): the same.
    monkeypatch.setattr(ct, "_DAEMON_ANSWERED", True)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/dead.sock")
    gone = _run(
        tmp_path,
        "echo 1 > answer.txt",
        DockerSettings(image=ct.BASE_REPO + ":x"),
        attempt_dir=tmp_path / "a2",
    )
    assert gone.exit_reason == "infra_failure", gone
    assert "Cannot connect to the Docker daemon" in gone.detail


@pytest.mark.parametrize("code", [1, 125, 127])
def test_an_agent_exiting_with_docker_run_codes_in_its_container_stays_the_agents(
    tmp_path: Path, code: int
) -> None:
    result = _run(tmp_path, f"echo 'docker: my own words' >&2; exit {code}")
    assert result.exit_reason == "crashed" and result.returncode == code, result


def test_old_default_images_no_container_uses_are_pruned(tmp_path: Path) -> None:
    # A repository of this test's own, so that no other run's images on this daemon are touched;
    # the logic is the one default_image() runs on fineenvs-base after each build.
    repo = f"fineenvs-prune-test-{os.getpid()}"
    source = ct.default_image()
    old, used, current = f"{repo}:old", f"{repo}:used", f"{repo}:current"
    for tag in (old, used, current):
        subprocess.run(["docker", "tag", source, tag], check=True, capture_output=True)
    holder = subprocess.run(["docker", "create", used, "true"], capture_output=True, text=True, check=True)
    try:
        assert ct.prune_base_images(keep={current}, repo=repo) == [old]
        left = subprocess.run(
            ["docker", "images", repo, "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True, text=True
        ).stdout.split()
        assert sorted(left) == sorted([used, current])
        assert ct.image_exists(source)  # the tags went, not the image they shared
    finally:
        subprocess.run(["docker", "rm", "-f", holder.stdout.strip()], capture_output=True)
        subprocess.run(["docker", "rmi", old, used, current], capture_output=True)
