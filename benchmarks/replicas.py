"""``python -m benchmarks replicas``: the proxy in front of vLLM's router and several replicas.

Loopback only, against instant engine stand-ins (``benchmarks.servers standin --replica-name``),
one process each, so that what is measured is the proxy's path and the router's, not model compute.
The router is the real ``vllm-router`` as ``fineenvs.engine.router.launch_router`` starts it (install
it with ``python -m fineenvs.engine install-router``); the proxy is its real command. Two proxies run
side by side: one whose engine is the router (``--replica-url`` each replica, as a run with
``engine.replicas`` starts it), and the baseline, one whose engine is replica r0 directly.

Figures (each the median of ``--repeats`` interleaved runs, against the baseline of the same run):
- latency p50/p99 one call at a time: stand-in direct, router alone, proxy -> replica,
  proxy -> router -> replica; the router hop's added latency;
- ``--sessions`` concurrent sessions, each on its own connection, making ``--calls`` calls per run,
  through the proxy to one replica and through the proxy and the router to ``--replicas``:
  calls/s, latency p50/p99 under that load, CPU per call of the proxy and of the router;
- session affinity: the fraction of sessions whose calls (over all runs) were all answered by one
  replica, from the ``replica`` field of the proxy's call records, and the calls each replica got;
- one weight push (``ReplicaSet.push`` with ``VLLMReloadWeightSync``) across all replicas vs
  across one: the control plane alone (weights already staged), a whole push of a tiny state dict,
  and, apart, the time to stage ``--stage-mb`` of weights (written once whatever the replica count).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from benchmarks.common import (
    HOST,
    RawConn,
    child_pids,
    cpu_ms_exact,
    cpu_seconds,
    free_port,
    pct,
    small_chat,
    wait_http,
)
from benchmarks.proxy import new_session


def _cpu_ms(pid: int) -> float:
    """On-CPU milliseconds of ``pid`` and its children (10 ms ticks where the kernel hides more)."""
    total = 0.0
    for p in (pid, *child_pids(pid)):
        exact = cpu_ms_exact(p)
        if exact is None:
            try:
                exact = cpu_seconds(p) * 1000
            except OSError:
                continue
        total += exact
    return total


@dataclass
class Fleet:
    """Everything this benchmark started; ``stop`` ends each process it holds."""

    replica_urls: list[str]
    router_url: str = ""
    router_pid: int = 0
    proxy_router_port: int = 0
    proxy_direct_port: int = 0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _proxy_cmd(
    port: int, engine_url: str, replica_urls: list[str], store: Path, args: argparse.Namespace
) -> list[str]:
    cmd = [
        sys.executable, "-m", "fineenvs.proxy", "serve",
        "--engine-url", engine_url, "--served-model", "standin",
        "--port", str(port), "--store-dir", str(store), "--max-model-calls", "1000000",
        "--keepalive-seconds", "30", "--workers", str(args.workers),
        # As many engine connections as there are sessions (the default, 256, is vLLM's batch).
        "--max-upstream-concurrency", "1024",
    ]  # fmt: skip
    for url in replica_urls:
        cmd += ["--replica-url", url]
    return cmd + (["--no-fsync"] if args.no_fsync else [])


@contextlib.asynccontextmanager
async def fleet(tmp: Path, args: argparse.Namespace) -> AsyncIterator[Fleet]:
    from fineenvs.engine.router import RouterOptions, launch_router, router_problem

    options = RouterOptions()
    problem = router_problem(options)
    if problem is not None:
        raise SystemExit(f"benchmarks replicas: {problem}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ports = [free_port() for _ in range(args.replicas)]
    out = Fleet([f"http://{HOST}:{p}" for p in ports])
    try:
        for i, port in enumerate(ports):
            out.procs[f"r{i}"] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.servers", "standin", "--port", str(port), "--replica-name", f"r{i}"],
                env=env,
            )  # fmt: skip
        for port in ports:
            await wait_http(port, "/health")
        async with launch_router(options, out.replica_urls, tmp / "router") as router:
            out.router_url, out.router_pid = router.url, router.pid or 0
            out.proxy_router_port, out.proxy_direct_port = free_port(), free_port()
            out.procs["proxy-router"] = subprocess.Popen(
                _proxy_cmd(out.proxy_router_port, router.url, out.replica_urls, tmp / "store-router", args),
                env=env,
                stdout=subprocess.DEVNULL,
            )
            out.procs["proxy-direct"] = subprocess.Popen(
                _proxy_cmd(out.proxy_direct_port, out.replica_urls[0], [], tmp / "store-direct", args),
                env=env,
                stdout=subprocess.DEVNULL,
            )
            await wait_http(out.proxy_router_port, "/health")
            await wait_http(out.proxy_direct_port, "/health")
            yield out
            out.stop()  # the proxies first: they hold connections to the router
    finally:
        out.stop()


# ---------------------------------------------------------------------------------------------
# Generation: latency one at a time, and under load


Route = tuple[Callable[[int], int], Callable[[int, int], tuple[str, bytes, dict[str, str]]]]


async def one_at_a_time(routes: dict[str, Route], calls: int) -> dict[str, list[float]]:
    """Each route's latencies, one call in flight, routes interleaved call by call so that the
    machine's drift touches them alike."""
    conns = {name: RawConn(port(0)) for name, (port, _) in routes.items()}
    times: dict[str, list[float]] = {name: [] for name in routes}
    try:
        for k in range(-10, calls):  # the first ten warm connections and caches
            for name, (_, make) in routes.items():
                path, body, headers = make(0, k)
                t0 = time.perf_counter()
                status, reply = await conns[name].request("POST", path, body, headers)
                if status != 200:
                    raise RuntimeError(f"{name}: {path} answered {status}: {reply[:300]!r}")
                if k >= 0:
                    times[name].append((time.perf_counter() - t0) * 1000)
    finally:
        for conn in conns.values():
            conn.close()
    return times


async def load(route: Route, sessions: int, calls: int) -> dict[str, Any]:
    """``sessions`` clients on their own connections, released together, ``calls`` calls each."""
    port, make = route
    errors: list[str] = []
    times: list[float] = []
    gate = asyncio.Event()

    async def client(i: int) -> None:
        conn = RawConn(port(i))
        try:
            await gate.wait()
            for k in range(calls):
                path, body, headers = make(i, k)
                t0 = time.perf_counter()
                try:
                    status, reply = await conn.request("POST", path, body, headers)
                except (OSError, asyncio.IncompleteReadError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    conn.close()
                    continue
                if status == 200:
                    times.append((time.perf_counter() - t0) * 1000)
                else:
                    errors.append(f"HTTP {status}: {reply[:200]!r}")
        finally:
            conn.close()

    tasks = [asyncio.create_task(client(i)) for i in range(sessions)]
    await asyncio.sleep(0.2)
    t0 = time.perf_counter()
    gate.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    return {
        "done": len(times),
        "errors": errors,
        "wall_s": wall,
        "throughput": len(times) / wall,
        "ms": times,
    }


def records(store: Path) -> list[list[tuple[str | None, float]]]:
    """Per session, each recorded call's replica and upstream milliseconds (the raw call lines:
    nothing rebuilt)."""
    out = []
    for log in sorted((store / "sessions").glob("*/calls.jsonl")):
        calls = []
        for line in log.read_bytes().splitlines():
            rec = orjson.loads(line)
            if rec.get("type") != "event":
                calls.append((rec.get("replica"), float(rec["timings"]["upstream_s"]) * 1000))
        if calls:
            out.append(calls)
    return out


def affinity(sessions: list[list[tuple[str | None, float]]]) -> dict[str, Any]:
    """The fraction of sessions whose calls all name one replica, and the calls each replica got."""
    per_session = [{replica for replica, _ in calls} for calls in sessions]
    counts = Counter(str(replica) for calls in sessions for replica, _ in calls)
    one = sum(1 for s in per_session if len(s) == 1 and None not in s)
    return {
        "sessions": len(per_session),
        "one_replica": one,
        "hit_rate": one / len(per_session) if per_session else float("nan"),
        "calls": dict(sorted(counts.items())),
    }


async def generation(f: Fleet, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    # The one-at-a-time calls get sessions of their own, told apart later by their call count.
    routed = [await new_session(f.proxy_router_port) for _ in range(args.sessions)]
    direct = [await new_session(f.proxy_direct_port) for _ in range(args.sessions)]
    lat_routed, lat_direct = await new_session(f.proxy_router_port), await new_session(f.proxy_direct_port)
    bodies = [orjson.dumps(small_chat(i)) for i in range(args.sessions)]
    replica_port = int(f.replica_urls[0].rsplit(":", 1)[1])
    router_port = int(f.router_url.rsplit(":", 1)[1])
    chat = "/v1/chat/completions"

    def via(sessions: list[tuple[int, str]]) -> Route:
        return (
            lambda i: sessions[i][0],
            lambda i, k: (f"{sessions[i][1]}{chat}", bodies[i], {}),
        )

    lat_routes: dict[str, Route] = {
        "replica": (lambda i: replica_port, lambda i, k: (chat, bodies[0], {})),
        "router": (lambda i: router_port, lambda i, k: (chat, bodies[0], {"x-session-id": f"lat-{k}"})),
        "proxy->replica": via([lat_direct]),
        "proxy->router": via([lat_routed]),
    }

    routes = {"proxy->replica": via(direct), "proxy->router": via(routed)}
    latency = [await one_at_a_time(lat_routes, args.latency_calls) for _ in range(args.repeats)]

    runs: dict[str, list[dict[str, Any]]] = {"proxy->replica": [], "proxy->router": []}
    cpu = {"proxy->replica": 0.0, "proxy->router": 0.0, "router": 0.0}
    proxy_pid = {"proxy->replica": f.procs["proxy-direct"].pid, "proxy->router": f.procs["proxy-router"].pid}
    for _ in range(args.repeats):
        for name in runs:
            c0, r0 = _cpu_ms(proxy_pid[name]), _cpu_ms(f.router_pid)
            runs[name].append(await load(routes[name], args.sessions, args.calls))
            cpu[name] += _cpu_ms(proxy_pid[name]) - c0
            if name == "proxy->router":
                cpu["router"] += _cpu_ms(f.router_pid) - r0
    await asyncio.sleep(0.5)  # the last records reach the files
    done = {name: sum(r["done"] for r in rs) for name, rs in runs.items()}
    # The proxy's own timing of its upstream hop: the router's cost without the record's fsync.
    upstream: dict[str, list[float]] = {}
    loaded: list[list[tuple[str | None, float]]] = []
    for name, store in (("proxy->replica", "store-direct"), ("proxy->router", "store-router")):
        sessions = sorted(records(tmp / store), key=len)
        upstream[name] = [ms for _, ms in sessions[-1]]
        if name == "proxy->router":
            loaded = sessions[:-1]
    return {
        "latency": latency,
        "upstream_ms": upstream,
        "load": runs,
        "cpu_ms_per_call": {
            "proxy->replica": cpu["proxy->replica"] / max(1, done["proxy->replica"]),
            "proxy->router": cpu["proxy->router"] / max(1, done["proxy->router"]),
            "router": cpu["router"] / max(1, done["proxy->router"]),
        },
        "affinity": affinity(loaded),
    }


# ---------------------------------------------------------------------------------------------
# One weight push across the replicas


def pushes(f: Fleet, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    from fineenvs.engine.replicas import Replica, ReplicaSet
    from fineenvs.engine.router import RouterHandle
    from fineenvs.engine.weights import VLLMReloadWeightSync, save_safetensors

    router = RouterHandle(f.router_url, f.replica_urls, f.router_pid)
    tiny = {"w": torch.zeros(16, 16)}
    staged = tmp / "prestaged"
    save_safetensors(tiny, staged)

    def replica_set(n: int) -> ReplicaSet:
        replicas = [
            Replica(f"r{i}", url, VLLMReloadWeightSync(url, tmp / f"staging-{n}"))
            for i, url in enumerate(f.replica_urls[:n])
        ]
        return ReplicaSet(replicas, router, log=lambda _line: None)

    sizes = sorted({1, args.replicas})
    out: dict[str, Any] = {"control_ms": {}, "tiny_push_ms": {}}
    sets = {n: replica_set(n) for n in sizes}
    version = 0
    try:
        for n in sizes:  # connections and thread pools warm before anything is timed
            version += 1
            sets[n].push(staged, version)
        control: dict[int, list[float]] = {n: [] for n in sizes}
        whole: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(args.pushes):
            for n in sizes:
                # A pushed folder is loaded as it is: nothing is written, so this is the control plane.
                version += 1
                t0 = time.perf_counter()
                sets[n].push(staged, version)
                control[n].append((time.perf_counter() - t0) * 1000)
                version += 1
                t0 = time.perf_counter()
                sets[n].push(tiny, version)
                whole[n].append((time.perf_counter() - t0) * 1000)
        out["control_ms"], out["tiny_push_ms"] = control, whole
    finally:
        for s in sets.values():
            s.close()

    # Staging is written once per push whatever the replica count; bf16, as a trainer pushes.
    elements = args.stage_mb * 1_000_000 // 2
    big = {f"layer{i}.weight": torch.ones(elements // 8, dtype=torch.bfloat16) for i in range(8)}
    stage_s = []
    for k in range(args.stage_repeats):
        directory = tmp / f"stage-{k}"
        t0 = time.perf_counter()
        save_safetensors(big, directory)
        stage_s.append(time.perf_counter() - t0)
        for p in directory.iterdir():
            p.unlink()
        directory.rmdir()
    out["stage_s"] = stage_s
    out["stage_mb"] = args.stage_mb
    return out


# ---------------------------------------------------------------------------------------------
# Report


def report(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    gen, push = results["generation"], results.get("push")
    lines = [
        f"fineenvs replicas benchmark: proxy -> vllm-router 0.1.17 (consistent_hash) -> {args.replicas} instant "
        f"stand-in replicas vs proxy -> one replica; {os.cpu_count()} cores shared by everything, "
        f"fsync {'off' if args.no_fsync else 'on'}, {args.workers} proxy process{'es' if args.workers > 1 else ''}, "
        f"median of {args.repeats} runs"
    ]
    lat = gen["latency"]

    def med(name: str, q: float) -> float:
        return statistics.median(pct(run[name], q) for run in lat)

    for name in ("replica", "router", "proxy->replica", "proxy->router"):
        lines.append(
            f"one at a time, {name:15s} p50 {med(name, 0.5):6.2f} ms  p99 {med(name, 0.99):6.2f} ms "
            f"({args.latency_calls} calls a run)"
        )
    lines.append(
        f"router hop added, one at a time: p50 {med('proxy->router', 0.5) - med('proxy->replica', 0.5):+.2f} ms "
        f"through the proxy ({med('router', 0.5) - med('replica', 0.5):+.2f} ms without it), "
        f"p99 {med('proxy->router', 0.99) - med('proxy->replica', 0.99):+.2f} ms"
    )
    up = gen["upstream_ms"]
    lines.append(
        "the proxy's own upstream timing (its records' upstream_s, same calls): "
        f"to the replica p50 {pct(up['proxy->replica'], 0.5):.2f} p99 {pct(up['proxy->replica'], 0.99):.2f} ms, "
        f"through the router p50 {pct(up['proxy->router'], 0.5):.2f} p99 {pct(up['proxy->router'], 0.99):.2f} ms "
        f"(router hop p50 {pct(up['proxy->router'], 0.5) - pct(up['proxy->replica'], 0.5):+.2f} ms)"
    )
    runs = gen["load"]
    tp = {name: statistics.median(r["throughput"] for r in rs) for name, rs in runs.items()}
    p50 = {name: statistics.median(pct(r["ms"], 0.5) for r in rs) for name, rs in runs.items()}
    p99 = {name: statistics.median(pct(r["ms"], 0.99) for r in rs) for name, rs in runs.items()}
    expected = args.sessions * args.calls * args.repeats
    for name, rs in runs.items():
        errs = [e for r in rs for e in r["errors"]]
        lines.append(
            f"{args.sessions} sessions x {args.calls} calls, {name:15s} {tp[name]:6.0f} calls/s, "
            f"p50 {p50[name]:7.1f} ms p99 {p99[name]:7.1f} ms under load; "
            f"{sum(r['done'] for r in rs)}/{expected} done, {len(errs)} errors"
            + (f" (first: {errs[0]})" if errs else "")
        )
    cpu = gen["cpu_ms_per_call"]
    lines.append(
        f"through the router: {tp['proxy->router'] / tp['proxy->replica']:.2f}x the calls/s of going to one "
        f"replica direct, p50 {p50['proxy->router'] / p50['proxy->replica']:.2f}x; CPU per call: proxy "
        f"{cpu['proxy->router']:.2f} ms (direct {cpu['proxy->replica']:.2f} ms), router {cpu['router']:.2f} ms"
    )
    aff = gen["affinity"]
    lines.append(
        f"session affinity: {aff['one_replica']}/{aff['sessions']} sessions had every call on one replica "
        f"({aff['hit_rate']:.1%}, {args.calls * args.repeats} calls each); calls per replica "
        + ", ".join(f"{k} {v}" for k, v in aff["calls"].items())
    )
    if push is not None:
        ctl, whole = push["control_ms"], push["tiny_push_ms"]
        one, many = min(ctl), max(ctl)
        lines.append(
            f"one weight push, control plane only (pause, reload rpc, version, prefix reset, resume, read back; "
            f"staged already), {args.pushes} pushes: {many} replicas p50 {statistics.median(ctl[many]):.1f} ms "
            f"max {max(ctl[many]):.1f} ms vs 1 replica p50 {statistics.median(ctl[one]):.1f} ms "
            f"({statistics.median(ctl[many]) / statistics.median(ctl[one]):.2f}x)"
        )
        lines.append(
            f"one whole push of a tiny state dict (stage + control): {many} replicas p50 "
            f"{statistics.median(whole[many]):.1f} ms vs 1 replica {statistics.median(whole[one]):.1f} ms"
        )
        mb = push["stage_mb"]
        lines.append(
            f"staging {mb} MB (bf16 safetensors, fsynced, checked; written once for any replica count): "
            f"median {statistics.median(push['stage_s']):.2f} s = {mb / statistics.median(push['stage_s']):.0f} MB/s "
            f"over {len(push['stage_s'])} writes"
        )
    return lines


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fineenvs-bench-replicas-") as name:
        tmp = Path(name)
        async with fleet(tmp, args) as f:
            results: dict[str, Any] = {"generation": await generation(f, args, tmp)}
            if args.pushes > 0:
                results["push"] = await asyncio.to_thread(pushes, f, args, tmp)
        return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks replicas", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--sessions", type=int, default=1000, help="concurrent sessions under load")
    parser.add_argument("--calls", type=int, default=3, help="calls per session in each run")
    parser.add_argument("--replicas", type=int, default=4, help="stand-in replicas behind the router")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure; the median is printed")
    parser.add_argument("--latency-calls", type=int, default=200, help="one-at-a-time calls per route a run")
    parser.add_argument("--pushes", type=int, default=10, help="weight pushes per replica count (0: none)")
    parser.add_argument("--stage-mb", type=int, default=100, help="size of the staged weights to time")
    parser.add_argument("--stage-repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="proxy processes (serve --workers)")
    parser.add_argument("--no-fsync", action="store_true", help="run the proxies without fsync")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.replicas < 1 or args.sessions < 1 or args.calls < 1 or args.repeats < 1:
        print(
            "benchmarks replicas: --replicas, --sessions, --calls and --repeats must be >= 1", file=sys.stderr
        )
        return 2
    # Every session holds a connection to the proxy, and the proxy one to the router: 1,000 of
    # each is past the usual 1,024 descriptors (the router inherits this limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 16384)), hard))
    results = asyncio.run(run(args))
    lines = report(results, args)
    print("\n".join(lines), flush=True)
    if args.json:
        args.json.write_bytes(
            orjson.dumps(
                {"lines": lines, "results": results}, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
