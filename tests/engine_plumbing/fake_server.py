"""A stand-in engine process for launcher tests: stdlib only, starts in ~50 ms.

python fake_server.py PORT MODE [PIDFILE]
  MODE serve: answer /health and /v1/models; with PIDFILE, also fork a grandchild (`sleep`) and
              write its pid there, to check that the whole process group is stopped.
  MODE die:   print a recognisable error and exit 3 before serving.
  MODE mute:  never listen (the launcher must time out).
  MODE stubborn: serve, but ignore SIGTERM (the launcher must SIGKILL).
"""

import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    models = ["fake-model"]  # what /v1/models lists (a test may serve others from a subclass)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            body = b""
        elif self.path == "/v1/models":
            data = [{"id": name, "object": "model"} for name in self.models]
            body = json.dumps({"object": "list", "data": data}).encode()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    port, mode = int(sys.argv[1]), sys.argv[2]
    print(f"fake engine starting in mode {mode} pid={os.getpid()}", flush=True)
    if mode == "die":
        print("RuntimeError: CUDA out of memory (fake)", flush=True)
        sys.exit(3)
    if mode == "mute":
        time.sleep(600)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if len(sys.argv) > 3:
        child = subprocess.Popen(["sleep", "600"])
        with open(sys.argv[3], "w") as f:
            f.write(str(child.pid))
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
