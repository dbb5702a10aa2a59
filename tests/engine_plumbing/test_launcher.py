"""Launcher lifecycle: healthy on entry, the whole process group gone on exit, errors explained."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from fineenvs.engine.handle import launch_vllm
from fineenvs.engine.launcher import (
    EngineStartError,
    EngineUnavailableError,
    cuda_devices,
    free_port,
    launched,
    launched_async,
    require_cuda,
    start_process,
    stop_process,
)
from fineenvs.engine.vllm import VLLMServeArgs

FAKE = str(Path(__file__).with_name("fake_server.py"))
ONE_GPU = lambda: ["GPU 0: NVIDIA H200 (fake)"]  # noqa: E731


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it no longer runs anything
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def fake(mode: str, port: int, pidfile: Path | None = None) -> list[str]:
    return [sys.executable, FAKE, str(port), mode] + ([str(pidfile)] if pidfile else [])


def test_healthy_inside_and_whole_group_stopped_on_exit(tmp_path: Path) -> None:
    port, pidfile = free_port(), tmp_path / "grandchild.pid"
    url = f"http://127.0.0.1:{port}"
    with launched(
        fake("serve", port, pidfile), base_url=url, log_path=tmp_path / "e.log", timeout_s=20
    ) as proc:
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "fake-model"
        grandchild = int(pidfile.read_text())
        assert alive(proc.pid) and alive(grandchild)
    assert proc.returncode is not None
    assert wait_dead(grandchild), "the grandchild survived: the process group was not stopped"
    assert "fake engine starting in mode serve" in (tmp_path / "e.log").read_text()


def test_stopped_when_the_block_raises(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(KeyboardInterrupt):
        with launched(
            fake("serve", port), base_url=f"http://127.0.0.1:{port}", log_path=tmp_path / "e.log"
        ) as proc:
            raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
    assert proc.returncode is not None and not alive(proc.pid)


def test_process_dying_at_start_reports_the_log_tail(tmp_path: Path) -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        with launched(
            fake("die", port), base_url=f"http://127.0.0.1:{port}", log_path=tmp_path / "e.log", timeout_s=60
        ):
            pytest.fail("must not enter the block")
    assert time.monotonic() - started < 10, "did not fail fast"
    assert "exited with code 3" in str(info.value)
    assert "CUDA out of memory (fake)" in str(info.value)


def test_timeout_kills_the_silent_process(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "e.log"
    with pytest.raises(EngineStartError, match="did not answer /health, /v1/models") as info:
        with launched(fake("mute", port), base_url=f"http://127.0.0.1:{port}", log_path=log, timeout_s=1.0):
            pass
    assert "mode mute" in str(info.value)  # the log tail
    pid = int(log.read_text().split("pid=")[1].split()[0])
    assert wait_dead(pid), "the process that never became healthy was left running"


def test_sigterm_ignored_then_sigkill(tmp_path: Path) -> None:
    port = free_port()
    proc = start_process(fake("stubborn", port), log_path=tmp_path / "e.log")
    time.sleep(0.5)
    started = time.monotonic()
    stop_process(proc, grace_s=0.5)
    assert proc.returncode is not None and time.monotonic() - started < 5


def test_missing_executable_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="Cannot start '/nonexistent/vllm'"):
        start_process(["/nonexistent/vllm", "serve"], log_path=tmp_path / "e.log")


def test_async_context_manager(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def main() -> int:
        async with launched_async(fake("serve", port), base_url=url, log_path=tmp_path / "e.log") as proc:
            async with httpx.AsyncClient() as client:
                assert (await client.get(url + "/health")).status_code == 200
            return proc.pid

    pid = asyncio.run(main())
    assert wait_dead(pid)


def test_gpu_detection_reasons() -> None:
    assert cuda_devices(env={"CUDA_VISIBLE_DEVICES": ""})[1].startswith("CUDA_VISIBLE_DEVICES")
    gpus, reason = cuda_devices(
        nvidia_smi="", device_glob="/nonexistent/nvidia[0-9]*", env={"PATH": "/nonexistent"}
    )
    assert gpus == [] and "no /dev/nvidia" in reason
    assert require_cuda(devices=(["GPU 0: NVIDIA H200"], "")) == ["GPU 0: NVIDIA H200"]


def test_vllm_refused_without_gpu_before_anything_starts(tmp_path: Path) -> None:
    def no_gpu() -> list[str]:
        return require_cuda(devices=([], "nvidia-smi is not on PATH and there is no /dev/nvidia* device"))

    with pytest.raises(EngineUnavailableError) as info:
        launch_vllm(VLLMServeArgs(model="Qwen/Qwen3.5-2B"), tmp_path / "run", check_gpu=no_gpu)
    message = str(info.value)
    for hint in (
        "NVIDIA GPU",
        "no /dev/nvidia",
        "engine=transformers",
        "engine.url=",
        "engine.platform=cpu",
        "install-vllm",
    ):
        assert hint in message
    assert not (tmp_path / "run").exists(), "nothing may be written or started before the GPU check"


@pytest.mark.skipif(bool(cuda_devices()[0]), reason="this machine has a GPU")
def test_vllm_refused_on_this_cpu_machine(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailableError, match="engine=transformers"):
        launch_vllm(VLLMServeArgs(model="Qwen/Qwen3.5-2B"), tmp_path)


def fake_vllm_venv(root: Path) -> Path:
    """A venv-shaped folder whose `bin/vllm` records its argv and env, then serves like a fake engine."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "vllm"
    script.write_text(
        "#!/bin/sh\n"
        'echo "argv: $*"\n'
        'echo "dev_mode=$VLLM_SERVER_DEV_MODE virtual_env=$VIRTUAL_ENV"\n'
        'port=$(echo "$*" | sed -e "s/.*--port \\([0-9]*\\).*/\\1/")\n'
        f'exec {sys.executable} {FAKE} "$port" serve\n'
    )
    script.chmod(0o755)
    return bin_dir / "python"


def test_launch_vllm_end_to_end_with_a_fake_binary(tmp_path: Path) -> None:
    python = fake_vllm_venv(tmp_path / "venv")
    args = VLLMServeArgs(
        model="Qwen/Qwen3.5-2B",
        port=0,
        weight_sync="reload",
        python=str(python),
        served_model_name="fake-model",
    )
    run = tmp_path / "run"
    with launch_vllm(args, run, check_gpu=ONE_GPU, timeout_s=20) as engine:
        assert engine.kind == "vllm" and engine.served_model_name == "fake-model"
        assert httpx.get(engine.url + "/health").status_code == 200
        assert type(engine.weight_sync).__name__ == "VLLMReloadWeightSync"
        pid = engine.pid
    assert pid is not None and wait_dead(pid)
    log = (run / "vllm.log").read_text()
    assert "dev_mode=1" in log and f"virtual_env={tmp_path / 'venv'}" in log
    template = run / "qwen3_5_nothink.jinja"
    assert template.read_text().startswith("{%- set enable_thinking = false -%}")
    assert f"--chat-template {template}" in log and "--tool-call-parser qwen3_xml" in log


def test_launch_vllm_without_a_vllm_binary_explains_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FileNotFoundError, match="no vLLM console script at /nonexistent/venv/bin/vllm"):
        launch_vllm(
            VLLMServeArgs(model="m", python="/nonexistent/venv/bin/python"), tmp_path, check_gpu=ONE_GPU
        )
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="`python -m fineenvs.engine install-vllm`"):
        launch_vllm(VLLMServeArgs(model="m"), tmp_path, check_gpu=ONE_GPU)
    # On the CPU platform no GPU is asked for, and the fix names the CPU build.
    with pytest.raises(FileNotFoundError, match="install-vllm --build cpu"):
        launch_vllm(VLLMServeArgs(model="m", platform="cpu"), tmp_path, check_gpu=lambda: [])


def test_launch_vllm_as_an_async_context_manager(tmp_path: Path) -> None:
    python = fake_vllm_venv(tmp_path / "venv")
    args = VLLMServeArgs(
        model="LiquidAI/LFM2.5-2.6B", port=0, python=str(python), served_model_name="fake-model"
    )

    async def main() -> int | None:
        async with launch_vllm(args, tmp_path / "run", check_gpu=ONE_GPU, timeout_s=20) as engine:
            async with httpx.AsyncClient() as client:
                assert (await client.get(engine.url + "/v1/models")).status_code == 200
            assert engine.weight_sync is None  # no weight sync asked for: no dev routes either
            return engine.pid

    pid = asyncio.run(main())
    assert pid is not None and wait_dead(pid)
    log = (tmp_path / "run" / "vllm.log").read_text()
    assert "dev_mode= " in log and "--tool-call-parser lfm2" in log


PARENT = """
import signal, sys, time
from pathlib import Path
# Ctrl-C's default: a shell's background job (nohup make test &) starts with SIGINT ignored, and the
# parent would inherit that and sleep through the signal.
signal.signal(signal.SIGINT, signal.default_int_handler)
from fineenvs.engine.launcher import launched
port, log = int(sys.argv[1]), Path(sys.argv[2])
cmd = [sys.executable, {fake!r}, str(port), "serve"]
with launched(cmd, base_url=f"http://127.0.0.1:{{port}}", log_path=log, timeout_s=20) as proc:
    print(proc.pid, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGKILL"])
def test_engine_dies_with_its_parent(signal_name: str, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) runs the cleanup; a SIGKILLed parent takes the engine down via PDEATHSIG."""
    import signal
    import subprocess

    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(fake=FAKE), str(free_port()), str(tmp_path / "e.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    engine_pid = int(parent.stdout.readline())
    assert alive(engine_pid)
    parent.send_signal(getattr(signal, signal_name))
    parent.wait(timeout=60)  # the clean-up's grace periods, on a loaded 2-core machine
    assert wait_dead(engine_pid, timeout_s=10), f"engine survived its parent's {signal_name}"


def test_vllm_refused_when_tp_times_dp_exceeds_the_visible_gpus(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailableError, match="= 4 GPUs, but 1 visible"):
        launch_vllm(
            VLLMServeArgs(model="m", tensor_parallel_size=2, data_parallel_size=2),
            tmp_path,
            check_gpu=ONE_GPU,
        )


def test_cuda_visible_devices_filters_nvidia_smi(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: H100 (UUID: GPU-aaa)'\necho 'GPU 1: H200 (UUID: GPU-bbb)'\n")
    smi.chmod(0o755)
    assert len(cuda_devices(nvidia_smi=str(smi), env={})[0]) == 2
    assert cuda_devices(nvidia_smi=str(smi), env={"CUDA_VISIBLE_DEVICES": "1"})[0] == [
        "GPU 1: H200 (UUID: GPU-bbb)"
    ]
    assert cuda_devices(nvidia_smi=str(smi), env={"CUDA_VISIBLE_DEVICES": "GPU-aaa"})[0] == [
        "GPU 0: H100 (UUID: GPU-aaa)"
    ]


def test_auto_port_taken_by_someone_else_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import fineenvs.engine.handle as handle_module

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    second = free_port()
    picks = iter([busy.getsockname()[1], second])
    monkeypatch.setattr(handle_module, "free_port", lambda host="127.0.0.1": next(picks))
    args = VLLMServeArgs(model="m", port=0, python=str(fake_vllm_venv(tmp_path / "venv")))
    try:
        with launch_vllm(args, tmp_path / "run", check_gpu=ONE_GPU, timeout_s=20) as engine:
            assert engine.url == f"http://127.0.0.1:{second}"
            assert httpx.get(engine.url + "/health").status_code == 200
    finally:
        busy.close()
    log = (tmp_path / "run" / "vllm.log").read_text()
    assert "Address already in use" in log and log.count("fake engine starting") == 2


def test_fixed_port_taken_is_not_retried(tmp_path: Path) -> None:
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    args = VLLMServeArgs(model="m", port=busy.getsockname()[1], python=str(fake_vllm_venv(tmp_path / "venv")))
    try:
        with pytest.raises(EngineStartError, match="Address already in use"):
            with launch_vllm(args, tmp_path / "run", check_gpu=ONE_GPU, timeout_s=20):
                pass
    finally:
        busy.close()


def test_install_errors_name_the_cpu_torch_index_and_hide_index_passwords(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fineenvs.engine import install

    # A pip that fails: the error says where the +cpu wheel lives (not on PyPI).
    monkeypatch.delenv("FINEENVS_TORCH_INDEX", raising=False)
    with pytest.raises(
        install.VllmInstallError, match="FINEENVS_TORCH_INDEX=https://download.pytorch.org/whl/cpu"
    ):
        install._torch_cpu(Path("/bin/false"))
    # A failing command whose output carries an index URL with credentials: they are not repeated.
    with pytest.raises(install.VllmInstallError) as err:
        install._run(
            ["sh", "-c", "echo 'no wheel at https://ci:s3cret@mirror.example/simple' >&2; exit 1"], "x", "y"
        )
    assert "s3cret" not in str(err.value) and "https://ci:***@mirror.example/simple" in str(err.value)
