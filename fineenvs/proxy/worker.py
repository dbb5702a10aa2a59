"""A proxy worker process: ``python -m fineenvs.proxy.worker`` (started by the pool, never by hand).

The pool (``fineenvs.proxy.workers.WorkerPool``, in the main proxy process) binds this worker's
listening socket, passes it as an inherited file descriptor and puts the settings, the shard and
the parent's pid in ``FINEENVS_PROXY_WORKER``; the worker serves the capture proxy for its shard of
the sessions on that socket until its parent dies or it is told to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

import orjson

from fineenvs.proxy.workers import SPEC_ENV, settings_from_json


def _exit_with_parent(parent: int) -> None:
    """A worker whose main process died (even by SIGKILL) stops too, flushing its store."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="fineenvs-parent-watch", daemon=True).start()


def worker_main() -> int:
    import gc

    import uvicorn

    from fineenvs.proxy.app import create_proxy_app
    from fineenvs.proxy.store import CallStore

    raw = os.environ.pop(SPEC_ENV, None)
    if raw is None:
        print(
            "fineenvs.proxy.worker is started by `python -m fineenvs.proxy serve --workers N`, not by hand.",
            file=sys.stderr,
        )
        return 2
    spec = orjson.loads(raw)
    settings = settings_from_json(spec["settings"])
    logging.basicConfig(
        level=str(spec["log_level"]).upper(),
        format=f"%(asctime)s %(name)s[w{spec['shard']}] %(levelname)s %(message)s",
    )
    _exit_with_parent(int(spec["parent"]))
    sock = socket.socket(fileno=int(spec["fd"]))
    store = CallStore(settings.store_path, fsync=settings.fsync)
    app = create_proxy_app(settings, store=store, shard=(int(spec["shard"]), int(spec["shards"])))
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    config = uvicorn.Config(
        app,
        log_level=str(spec["log_level"]),
        access_log=False,
        timeout_keep_alive=75,
        proxy_headers=False,
        timeout_graceful_shutdown=5,  # as the single-process proxy: never wait on idle agents
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(worker_main())
