from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from fineenvs.engine.__main__ import _hydra_style


def test_hydra_style_arguments_become_flags() -> None:
    assert _hydra_style(["serve", "model=tiny_qwen", "max_queue=8", "--port", "9"]) == [
        "serve",
        "--model",
        "tiny_qwen",
        "--max-queue",
        "8",
        "--port",
        "9",
    ]


@pytest.mark.slow
def test_serve_as_a_child_process(tiny_lfm2_dir: object) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "fineenvs.engine",
        "serve",
        "model=tiny_lfm2",
        f"--port={port}",
        "--max-queue",
        "4",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "engine did not become healthy"
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny_lfm2"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "return_token_ids": True}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        assert 1 <= len(reply["choices"][0]["token_ids"]) <= 4 and reply["weight_version"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
