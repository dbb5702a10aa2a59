"""Which host names does a harness try to reach? One attempt in a network namespace that has only loopback.

The script re-executes itself under ``unshare --net --mount`` (root, or a user namespace), brings
loopback up, bind-mounts a ``resolv.conf`` naming 127.0.0.1, and answers every DNS query there
with NXDOMAIN while logging the name. The scripted engine and the capture proxy run inside the same
namespace, so the agent reaches its model and nothing else: a phone-home attempt shows up as a
logged name and fails at once. Connections to literal non-loopback addresses fail with "network
unreachable" and are not logged (no agent we run uses one).

    python -m tests.harnesses.phone_home NAME [--format FMT] [--drop VAR ...] [--keep]

``--drop VAR`` removes a variable the adapter sets (e.g. a telemetry switch), to see what the
switch prevents.

Prints the exit reason, the model calls the proxy recorded, and the sorted names with counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INNER_FLAG = "--inside-namespace"


def _qname(packet: bytes) -> str:
    labels: list[str] = []
    i = 12
    while i < len(packet) and packet[i]:
        n = packet[i]
        labels.append(packet[i + 1 : i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    return ".".join(labels)


def _nxdomain(packet: bytes) -> bytes:
    """The query echoed back as a response with rcode 3 (no such name) and no answers."""
    if len(packet) < 12:
        return b""
    ident, flags = struct.unpack("!HH", packet[:4])
    flags = 0x8000 | (flags & 0x7900) | 0x0080 | 3  # QR, opcode+RD kept, RA, NXDOMAIN
    end = 12
    while end < len(packet) and packet[end]:
        end += 1 + packet[end]
    question = packet[12 : end + 5]
    return struct.pack("!HHHHHH", ident, flags, 1, 0, 0, 0) + question


class DnsLogger:
    """UDP and TCP DNS on 127.0.0.1:53 answering NXDOMAIN; ``names`` counts every queried name."""

    def __init__(self) -> None:
        self.names: Counter[str] = Counter()
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 53))
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind(("127.0.0.1", 53))
        self.tcp.listen(16)
        threading.Thread(target=self._serve_udp, daemon=True).start()
        threading.Thread(target=self._serve_tcp, daemon=True).start()

    def _serve_udp(self) -> None:
        while True:
            data, addr = self.udp.recvfrom(4096)
            self.names[_qname(data)] += 1
            self.udp.sendto(_nxdomain(data), addr)

    def _serve_tcp(self) -> None:
        while True:
            conn, _ = self.tcp.accept()
            with conn:
                head = conn.recv(2)
                if len(head) < 2:
                    continue
                data = conn.recv(struct.unpack("!H", head)[0])
                self.names[_qname(data)] += 1
                reply = _nxdomain(data)
                conn.sendall(struct.pack("!H", len(reply)) + reply)


def _inside(args: argparse.Namespace) -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="fineenvs-phone-home-"))
    resolv = tmp / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions attempts:1 timeout:1\n")
    subprocess.run(["mount", "--bind", str(resolv), "/etc/resolv.conf"], check=True)
    dns = DnsLogger()

    from fineenvs.harnesses import HARNESSES
    from fineenvs.harnesses.base import Launch
    from fineenvs.harnesses.sandbox import run_attempt
    from tests.harnesses.scripted_engine import ScriptedEngine
    from tests.harnesses.stack import start_proxy

    h = HARNESSES[args.name]
    fmt = args.format or h.default_format
    if args.drop:
        adapter_env = h.env

        def env_without(launch: Launch) -> dict[str, str]:
            return {k: v for k, v in adapter_env(launch).items() if k not in args.drop}

        h.env = env_without  # type: ignore[method-assign]
    engine = ScriptedEngine().start()
    proxy = start_proxy(engine.url, "tiny_qwen", tmp / "store")
    try:
        session = proxy.new_session(harness=h.name)
        result = run_attempt(
            h,
            task_prompt="Compute 6*7 and write only the number to a file named answer.txt using the shell.",
            input_files={},
            attempt_dir=tmp / "attempt",
            base_url=session["base_url"],
            session_key=session["key"],
            model="tiny_qwen",
            api_format=fmt,
            timeout_seconds=args.timeout,
            step_limit=8,
        )
        calls = proxy.rollout(session["session_id"])["calls"]
    finally:
        proxy.stop()
        engine.stop()
    report = {
        "harness": h.name,
        "version": h.version,
        "api_format": fmt,
        "dropped": args.drop,
        "exit_reason": result.exit_reason,
        "answer": result.answer,
        "model_calls": len(calls),
        "transports": dict(Counter(str(c.get("transport", "http")) for c in calls)),
        "duration_s": result.duration_s,
        "dns_names": dict(sorted(dns.names.items())),
        "attempt_dir": str(tmp / "attempt") if args.keep else None,
    }
    print(json.dumps(report, indent=1))
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name")
    parser.add_argument("--format", default=None)
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--drop", action="append", default=[], metavar="VAR", help="leave VAR out of the env")
    parser.add_argument("--keep", action="store_true", help="keep the attempt folder and print its path")
    parser.add_argument(INNER_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside_namespace:
        return _inside(args)
    unshare = ["unshare", "--net", "--mount", "--fork"]
    if os.geteuid() != 0:
        unshare.insert(1, "--map-root-user")
    cmd = [*unshare, sys.executable, "-m", "tests.harnesses.phone_home", *sys.argv[1:], INNER_FLAG]
    return subprocess.run(cmd, cwd=REPO, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
