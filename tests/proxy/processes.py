"""Child processes in the proxy's process-level tests: wait until a URL answers, stop cleanly."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx


def wait_ok(url: str, timeout: float = 60.0) -> httpx.Response:
    """GET ``url`` until it answers 200; the reply, or RuntimeError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout} s")
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
