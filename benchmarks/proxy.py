"""``python -m benchmarks proxy`` (or ``python -m benchmarks.proxy``): the capture proxy's costs.

One run, loopback only, bounded in count and time, against an instant engine stand-in in its own
process (``benchmarks.servers``). The proxy runs as its real command
(``python -m fineenvs.proxy serve``) in its own process; the load generator is the minimal raw
HTTP/1.1 client of ``benchmarks.common``, so that it costs little CPU next to what it measures.

Figures:
- latency p50/p99, direct to the stand-in vs through the proxy, for small chat requests and for
  ~200 KB Claude-Code-shaped Anthropic requests (17-call attempts that grow turn by turn);
- proxy CPU milliseconds per call (utime + stime of the proxy process, /proc) for both sizes;
- capacity: N concurrent sessions (1,000 by default) each making K calls on its own connection, with
  ``/health`` polled throughout: calls completed, errors, ``/health`` p99, throughput vs direct;
- memory: peak RSS of the proxy while 320 sessions send 200 KB requests at once;
- record bytes per 17-call attempt on disk vs storing every prompt and request in full.

Median of ``--repeats`` runs where a figure is a latency; the bars the issue sets are printed next
to each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from benchmarks.common import (
    HOST,
    RawConn,
    as_engine_body,
    child_pids,
    claude_code_request,
    cpu_ms_exact,
    cpu_seconds,
    cpu_split,
    free_port,
    free_ports,
    pct,
    rss_mb,
    small_chat,
    wait_http,
)
from benchmarks.servers import HealthPoller


@dataclass
class Stack:
    standin_port: int
    proxy_port: int
    store_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def proxy_pid(self) -> int:
        return self.procs[1].pid

    def proxy_pids(self) -> list[int]:
        """The proxy's main process and its worker processes (``--workers``)."""
        return [self.proxy_pid, *child_pids(self.proxy_pid)]

    def proxy_cpu(self) -> tuple[float, float]:
        """User and system CPU seconds of every proxy process together."""
        user = system = 0.0
        for pid in self.proxy_pids():
            try:
                u, k = cpu_split(pid)
            except OSError:
                continue
            user, system = user + u, system + k
        return user, system

    def proxy_cpu_ms(self) -> float | None:
        """Exact on-CPU milliseconds of every proxy process (None where the kernel hides it)."""
        total = 0.0
        for pid in self.proxy_pids():
            ms = cpu_ms_exact(pid)
            if ms is None:
                return None
            total += ms
        return total

    def proxy_rss_mb(self) -> float:
        total = 0.0
        for pid in self.proxy_pids():
            try:
                total += rss_mb(pid)
            except OSError:
                continue
        return total

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def start_stack(
    store_dir: Path, *, fsync: bool, workers: int = 1, engine_delay_ms: float = 0.0
) -> Stack:
    stack = Stack(free_port(), free_ports(workers), store_dir)
    try:
        return await _start_stack(stack, fsync=fsync, workers=workers, engine_delay_ms=engine_delay_ms)
    except BaseException:
        stack.stop()
        raise


async def _start_stack(stack: Stack, *, fsync: bool, workers: int, engine_delay_ms: float) -> Stack:
    store_dir = stack.store_dir
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stack.procs.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.servers",
                "standin",
                "--port",
                str(stack.standin_port),
                "--delay-ms",
                str(engine_delay_ms),
            ],
            env=env,
        )  # fmt: skip
    )
    cmd = [
        sys.executable, "-m", "fineenvs.proxy", "serve",
        "--engine-url", f"http://{HOST}:{stack.standin_port}", "--served-model", "standin",
        "--port", str(stack.proxy_port), "--store-dir", str(store_dir), "--max-model-calls", "1000000",
        "--keepalive-seconds", "30", "--workers", str(workers),
        # As many engine connections as the direct path opens (the default, 256, is vLLM's batch).
        "--max-upstream-concurrency", "1024",
    ]  # fmt: skip
    if not fsync:
        cmd.append("--no-fsync")
    stack.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    await wait_http(stack.standin_port, "/health")
    await wait_http(stack.proxy_port, "/health")
    return stack


async def new_session(port: int) -> tuple[int, str]:
    """A fresh session: the port and path prefix of its ``base_url`` (a worker's, with --workers)."""
    conn = RawConn(port)
    try:
        status, body = await conn.request("POST", "/sessions", b"{}")
    finally:
        conn.close()
    if status != 201:
        raise RuntimeError(f"POST /sessions answered {status}: {body[:200]!r}")
    parts = urlsplit(str(orjson.loads(body)["base_url"]))
    return int(parts.port or port), parts.path


# ---------------------------------------------------------------------------------------------
# Phases


async def latency(stack: Stack, n_small: int, attempts: int) -> dict[str, Any]:
    """Sequential calls (one in flight): direct vs proxy latency, and proxy CPU per call."""
    out: dict[str, Any] = {}
    direct = RawConn(stack.standin_port)
    port, prefix = await new_session(stack.proxy_port)
    proxied = RawConn(port)
    small = [orjson.dumps(small_chat(i)) for i in range(n_small)]
    for body in small[:10]:  # warm both paths
        await direct.request("POST", "/v1/chat/completions", body)
        await proxied.request("POST", f"{prefix}/v1/chat/completions", body)

    async def timed(
        conn: RawConn, path: str, bodies: list[bytes], headers: dict[str, str] | None = None
    ) -> list[float]:
        times = []
        for body in bodies:
            t0 = time.perf_counter()
            status, reply = await conn.request("POST", path, body, headers)
            times.append((time.perf_counter() - t0) * 1000)
            if status != 200:
                raise RuntimeError(f"{path} answered {status}: {reply[:300]!r}")
        return times

    d_small = await timed(direct, "/v1/chat/completions", small)
    u0, s0 = stack.proxy_cpu()
    e0 = stack.proxy_cpu_ms()
    p_small = await timed(proxied, f"{prefix}/v1/chat/completions", small)
    e1 = stack.proxy_cpu_ms()
    u1, s1 = stack.proxy_cpu()
    out["small"] = {
        "direct": d_small,
        "proxy": p_small,
        "cpu_ms": _per_call(e0, e1, (u1 - u0 + s1 - s0) * 1000, len(small)),
        "user_ms": (u1 - u0) * 1000 / len(small),
        "bytes": len(small[0]),
    }

    anthropic = [[orjson.dumps(claude_code_request(t)) for t in range(17)] for _ in range(attempts)]
    engine = [orjson.dumps(as_engine_body(claude_code_request(t))) for t in range(17)]
    d_large = await timed(direct, "/v1/chat/completions", engine)
    p_large: list[float] = []
    sessions = [await new_session(stack.proxy_port) for _ in anthropic]
    conns = {p: RawConn(p) for p, _ in sessions}
    # Measured over all attempts at once (the user/kernel split comes in 10 ms ticks).
    u0, s0 = stack.proxy_cpu()
    e0 = stack.proxy_cpu_ms()
    for (port, prefix), bodies in zip(sessions, anthropic, strict=True):
        p_large += await timed(
            conns[port], f"{prefix}/v1/messages", bodies, {"anthropic-version": "2023-06-01"}
        )
    e1 = stack.proxy_cpu_ms()
    u1, s1 = stack.proxy_cpu()
    for conn in conns.values():
        conn.close()
    out["large"] = {
        "direct": d_large,
        "proxy": p_large,
        "cpu_ms": _per_call(e0, e1, (u1 - u0 + s1 - s0) * 1000, len(p_large)),
        "user_ms": (u1 - u0) * 1000 / len(p_large),
        "bytes": statistics.mean(len(b) for b in anthropic[0]),
    }
    direct.close()
    proxied.close()
    out["record"] = record_sizes(stack.store_dir)
    return out


def _per_call(exact0: float | None, exact1: float | None, ticks_ms: float, calls: int) -> float:
    if exact0 is not None and exact1 is not None:
        return (exact1 - exact0) / calls
    return ticks_ms / calls


def record_sizes(store_dir: Path) -> dict[str, float]:
    """Bytes on disk per 17-call attempt vs the same records with every prompt/request stored in full."""
    from fineenvs.proxy.store import CallStore

    store = CallStore(store_dir)
    stored, full = [], []
    for log in sorted(store.sessions_dir.glob("*/calls.jsonl")):
        data = store.read_session(log.parent.name)
        calls = data["calls"]
        if len(calls) != 17:
            continue
        stored.append(log.stat().st_size)
        full.append(sum(len(orjson.dumps(c)) + 1 for c in calls))
    store.close()
    if not stored:
        return {"stored_bytes": float("nan"), "full_bytes": float("nan"), "ratio": float("nan")}
    s, f = statistics.median(stored), statistics.median(full)
    return {"stored_bytes": s, "full_bytes": f, "ratio": f / s}


async def concurrent_load(
    port: int | Callable[[int], int],
    n_sessions: int,
    calls_each: int,
    make_call: Callable[[int, int], tuple[str, bytes, dict[str, str]]],
    *,
    on_tick: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """``n_sessions`` clients, each on its own connection, each making ``calls_each`` calls."""
    errors: list[str] = []
    done = 0
    start_gate = asyncio.Event()

    async def client(i: int) -> None:
        nonlocal done
        conn = RawConn(port if isinstance(port, int) else port(i))
        try:
            await start_gate.wait()
            for k in range(calls_each):
                path, body, headers = make_call(i, k)
                try:
                    status, reply = await conn.request("POST", path, body, headers)
                except (OSError, asyncio.IncompleteReadError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    conn.close()
                    continue
                if status != 200:
                    errors.append(f"HTTP {status}: {reply[:200]!r}")
                else:
                    done += 1
        finally:
            conn.close()

    tasks = [asyncio.create_task(client(i)) for i in range(n_sessions)]
    await asyncio.sleep(0.2)
    t0 = time.perf_counter()
    start_gate.set()
    ticker = None
    if on_tick is not None:

        async def tick() -> None:
            while True:
                on_tick()
                await asyncio.sleep(0.02)

        ticker = asyncio.create_task(tick())
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    if ticker is not None:
        ticker.cancel()
    return {"done": done, "errors": errors, "wall_s": wall, "throughput": done / wall}


async def capacity(
    stack: Stack, n_sessions: int, calls_each: int, repeats: int = 3, *, relay: bool = True
) -> dict[str, Any]:
    """Direct, through the proxy, and through a null relay, interleaved ``repeats`` times.

    A run of 1,000 sessions lasts well under a second direct, so one run is at the mercy of the
    machine's noise: each path's throughput is the median of its runs.
    """
    sessions = [await new_session(stack.proxy_port) for _ in range(n_sessions)]
    bodies = [orjson.dumps(small_chat(i)) for i in range(n_sessions)]
    # The ceiling: a relay that does nothing but copy bytes, under the same load.
    relay_port = free_port()
    relay_proc = (
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.servers",
                "relay",
                "--port",
                str(relay_port),
                "--upstream",
                str(stack.standin_port),
            ],
        )  # fmt: skip
        if relay
        else None
    )
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "proxy": [], "relay": []}
    health: list[float] = []
    cpu_s = relay_cpu_s = 0.0
    try:
        if relay_proc is not None:
            await wait_http(relay_port, "/health")
        for _ in range(repeats):
            runs["direct"].append(
                await concurrent_load(
                    stack.standin_port,
                    n_sessions,
                    calls_each,
                    lambda i, k: ("/v1/chat/completions", bodies[i], {}),
                )
            )
            poller = HealthPoller(stack.proxy_port)
            await asyncio.sleep(0.3)
            c0 = sum(stack.proxy_cpu())
            runs["proxy"].append(
                await concurrent_load(
                    lambda i: sessions[i][0],
                    n_sessions,
                    calls_each,
                    lambda i, k: (f"{sessions[i][1]}/v1/chat/completions", bodies[i], {}),
                )
            )
            cpu_s += sum(stack.proxy_cpu()) - c0
            health += poller.finish()
            if relay_proc is None:
                continue
            r0 = cpu_seconds(relay_proc.pid)
            runs["relay"].append(
                await concurrent_load(
                    relay_port, n_sessions, calls_each, lambda i, k: ("/v1/chat/completions", bodies[i], {})
                )
            )
            relay_cpu_s += cpu_seconds(relay_proc.pid) - r0
    finally:
        if relay_proc is not None:
            relay_proc.terminate()
            relay_proc.wait(20)

    def merged(results: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "done": sum(r["done"] for r in results),
            "errors": [e for r in results for e in r["errors"]],
            "throughput": statistics.median(r["throughput"] for r in results),
            "runs": [r["throughput"] for r in results],
        }

    out = {name: merged(results) for name, results in runs.items() if results}
    return {
        **out,
        "relay_cpu_ms": relay_cpu_s * 1000 / max(1, out["relay"]["done"]) if "relay" in out else None,
        "health_ms": health,
        "cpu_ms": cpu_s * 1000 / max(1, out["proxy"]["done"]),
        "expected": n_sessions * calls_each * repeats,
        "repeats": repeats,
    }


async def paced(store_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Supplementary: the capacity load against an engine that takes ``--engine-delay-ms`` per call.

    Not the issue's bar (that one is against the instant stand-in); it shows what a real engine
    turns the comparison into: whether 1,000 agents lose throughput to the proxy when CPU is not
    the limit.
    """
    stack = await start_stack(
        store_dir, fsync=not args.no_fsync, workers=args.workers, engine_delay_ms=args.engine_delay_ms
    )
    try:
        return await capacity(stack, args.sessions, args.calls_each, repeats=1, relay=False)
    finally:
        stack.stop()


async def memory(stack: Stack, n_sessions: int, calls_each: int) -> dict[str, Any]:
    sessions = [await new_session(stack.proxy_port) for _ in range(n_sessions)]
    bodies = [orjson.dumps(claude_code_request(k)) for k in range(calls_each)]
    headers = {"anthropic-version": "2023-06-01"}
    before = stack.proxy_rss_mb()
    peak = [before]
    result = await concurrent_load(
        lambda i: sessions[i][0],
        n_sessions,
        calls_each,
        lambda i, k: (f"{sessions[i][1]}/v1/messages", bodies[k], headers),
        on_tick=lambda: peak.append(stack.proxy_rss_mb()),
    )
    return {**result, "rss_before_mb": before, "rss_peak_mb": max(peak), "expected": n_sessions * calls_each}


# ---------------------------------------------------------------------------------------------
# Report


def _fmt(values: list[float]) -> str:
    return f"p50 {pct(values, 0.5):7.2f} ms  p99 {pct(values, 0.99):7.2f} ms"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fineenvs-bench-proxy-") as tmp:
        stack = await start_stack(Path(tmp) / "store", fsync=not args.no_fsync, workers=args.workers)
        try:
            phases = set(args.phases.split(","))
            if "latency" in phases:
                results["latency"] = [
                    await latency(stack, args.small_calls, args.attempts) for _ in range(args.repeats)
                ]
            if "capacity" in phases:
                results["capacity"] = await capacity(stack, args.sessions, args.calls_each, args.repeats)
            if "memory" in phases:
                results["memory"] = await memory(stack, args.memory_sessions, args.memory_calls)
        finally:
            stack.stop()
        if "paced" in phases and args.engine_delay_ms > 0:
            results["paced"] = await paced(Path(tmp) / "store-paced", args)
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [
        f"fineenvs proxy benchmark ({'full' if args.full else 'quick'} mode, fsync {'off' if args.no_fsync else 'on'}, "
        f"{args.workers} proxy process{'es' if args.workers > 1 else ''}, {os.cpu_count()} cores)"
    ]
    runs = results.get("latency", [])
    sync = " (no fsync)" if args.no_fsync else " (fsync each)"
    for size in ("small", "large") if runs else ():
        d = [statistics.median([pct(r[size]["direct"], q) for r in runs]) for q in (0.5, 0.99)]
        p = [statistics.median([pct(r[size]["proxy"], q) for r in runs]) for q in (0.5, 0.99)]
        cpu = statistics.median([r[size]["cpu_ms"] for r in runs])
        user = statistics.median([r[size]["user_ms"] for r in runs])
        bar = 1.0 if size == "small" else 4.0
        kb = statistics.median([r[size]["bytes"] for r in runs]) / 1000
        lines.append(
            f"latency {size:5s} ({kb:6.1f} KB)  direct p50 {d[0]:6.2f} p99 {d[1]:6.2f} ms | "
            f"proxy p50 {p[0]:6.2f} p99 {p[1]:6.2f} ms | added p50 {p[0] - d[0]:6.2f} ms"
        )
        lines.append(
            f"proxy CPU per {size} call, one at a time{sync}: {cpu:.2f} ms user + kernel, all threads "
            f"(user ~{user:.2f} in 10 ms ticks) (bar <= {bar:.0f} ms) {'OK' if cpu <= bar else 'OVER'}"
        )
    if runs:
        rec = runs[-1]["record"]
        lines.append(
            f"records per 17-call attempt: {rec['stored_bytes'] / 1e6:.2f} MB on disk vs "
            f"{rec['full_bytes'] / 1e6:.2f} MB with full prompts+requests ({rec['ratio']:.1f}x smaller)"
        )
    cap = results.get("capacity")
    if cap is None:
        return lines + _memory_lines(results, args)
    ratio = cap["proxy"]["throughput"] / cap["direct"]["throughput"]
    h99 = pct(cap["health_ms"], 0.99)
    ok = cap["proxy"]["done"] == cap["expected"] and not cap["proxy"]["errors"]
    lines.append(
        f"capacity {args.sessions} sessions x {args.calls_each} calls, {cap['repeats']} runs (median): "
        f"{cap['proxy']['done']}/{cap['expected']} done, "
        f"{len(cap['proxy']['errors'])} errors {'OK' if ok else 'FAIL'}; direct {cap['direct']['throughput']:.0f} calls/s, "
        f"proxy {cap['proxy']['throughput']:.0f} calls/s (ratio {ratio:.2f}, bar >= 0.70 {'OK' if ratio >= 0.7 else 'UNDER'}); "
        f"CPU {cap['cpu_ms']:.2f} ms/call (user + kernel, group-committed fsync)"
    )
    relay = cap.get("relay")
    if relay is not None:
        r_ratio = relay["throughput"] / cap["direct"]["throughput"]
        lines.append(
            f"ceiling on this machine: a null relay (copies bytes, parses and records nothing) reaches "
            f"{relay['throughput']:.0f} calls/s (ratio {r_ratio:.2f}) at {cap['relay_cpu_ms']:.3f} ms CPU/call; "
            f"{os.cpu_count()} cores shared by load generator, stand-in and proxy, so a proxy spending "
            f"{cap['cpu_ms']:.2f} ms/call is bounded by CPU, not by concurrency"
        )
    lines.append(
        f"/health under load: {len(cap['health_ms'])} polls, p50 {pct(cap['health_ms'], 0.5):.1f} ms, "
        f"p99 {h99:.1f} ms (bar < 100 ms) {'OK' if h99 < 100 else 'OVER'}"
    )
    if cap["proxy"]["errors"]:
        lines.append(f"  first error: {cap['proxy']['errors'][0]}")
    return lines + _memory_lines(results, args)


def _paced_lines(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    paced_run = results.get("paced")
    if paced_run is None:
        return []
    ratio = paced_run["proxy"]["throughput"] / paced_run["direct"]["throughput"]
    ok = paced_run["proxy"]["done"] == paced_run["expected"] and not paced_run["proxy"]["errors"]
    return [
        f"supplementary, engine taking {args.engine_delay_ms:.0f} ms per call (not the bar, which is against the "
        f"instant stand-in): {paced_run['proxy']['done']}/{paced_run['expected']} done, "
        f"{len(paced_run['proxy']['errors'])} errors {'OK' if ok else 'FAIL'}; direct "
        f"{paced_run['direct']['throughput']:.0f} calls/s, proxy {paced_run['proxy']['throughput']:.0f} calls/s "
        f"(ratio {ratio:.2f}); /health p99 {pct(paced_run['health_ms'], 0.99):.1f} ms"
    ]


def _memory_lines(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    mem = results.get("memory")
    if mem is None:
        return _paced_lines(results, args)
    lines = []
    lines.append(
        f"memory {args.memory_sessions} sessions x {args.memory_calls} x 200 KB: {mem['done']}/{mem['expected']} done, "
        f"{len(mem['errors'])} errors; proxy RSS {mem['rss_before_mb']:.0f} MB -> peak {mem['rss_peak_mb']:.0f} MB "
        f"(bar < 500 MB) {'OK' if mem['rss_peak_mb'] < 500 else 'OVER'}; {mem['throughput']:.0f} calls/s"
    )
    if mem["errors"]:
        lines.append(f"  first error: {mem['errors'][0]}")
    return lines + _paced_lines(results, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks proxy", description=__doc__)
    parser.add_argument("--full", action="store_true", help="more calls per phase (several minutes)")
    parser.add_argument("--no-fsync", action="store_true", help="run the proxy without fsync")
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--memory-sessions", type=int, default=320)
    parser.add_argument(
        "--workers", type=int, default=1, help="proxy processes (serve --workers); CPU and RSS are summed"
    )
    parser.add_argument(
        "--phases",
        default="latency,capacity,memory,paced",
        help="comma-separated subset of latency,capacity,memory,paced",
    )
    parser.add_argument(
        "--engine-delay-ms",
        type=float,
        default=1000.0,
        help="paced phase: engine time per call (a real agent turn takes seconds; 0 skips the phase)",
    )
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.small_calls, args.attempts, args.repeats = (500, 4, 3) if args.full else (200, 2, 3)
    args.calls_each, args.memory_calls = (5, 3) if args.full else (2, 2)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 16384)), hard))
    results = asyncio.run(run(args))
    lines = report(results, args)
    print("\n".join(lines), flush=True)
    if args.json:
        args.json.write_bytes(orjson.dumps({"lines": lines, "results": results}, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
