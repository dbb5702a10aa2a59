"""``python -m benchmarks ray-hop [--runs N] [--repeats R] [--calls C]``: what the Ray hop adds to
one attempt (``scheduler.backend=ray``).

A trivial attempt (write the answer file, return an ``AttemptResult`` and a proxy rollout of
``--calls`` recorded calls of 4,096 prompt + 256 sampled token ids, the size a published attempt
brings back) runs ``--repeats`` times in a worker thread (the local runner's path) and as a Ray task
on a rollout node of a local two-node cluster through ``RayAttempts.run`` (the backend's path:
dispatch, placement by the ``sandbox`` resource, the reply through the object store, the placement
file). Printed: the median per attempt of each, and their difference, per run, then the median
over ``--runs`` runs; the first Ray call (a worker started cold) separately.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _trivial_attempt(
    harness: str, kwargs: dict[str, Any], rollout_url: str, admin_key: object, marker: object
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The remote attempt's signature and reply, without an agent."""
    from fineenvs.harnesses.sandbox import AttemptResult

    attempt_dir = Path(kwargs["attempt_dir"])
    (attempt_dir / "work").mkdir(parents=True, exist_ok=True)
    (attempt_dir / "work" / "answer.txt").write_text("42\n")
    calls = [
        {"prompt_token_ids": list(range(4096)), "token_ids": list(range(256)), "logprobs": [-0.5] * 256}
        for _ in range(int(kwargs["calls"]))
    ]
    result = AttemptResult(
        harness=harness,
        exit_reason="finished",
        returncode=0,
        duration_s=0.0,
        answer="42",
        final_text=None,
        proxy_model_calls=len(calls),
        proxy_tool_calls=0,
        native_tool_calls=0,
        tool_calls_disagree=False,
        attempt_dir=str(attempt_dir),
    )
    return result, {"calls": calls}, {"node_id": "local"}


async def _bench(runs: int, repeats: int, calls: int, base: Path) -> list[tuple[float, float]]:
    import ray

    from fineenvs.rollout.ray_backend import RaySettings, ray_attempts

    # Pickled by value: the workers need not import this module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    settings = RaySettings(local_sandbox_nodes=1)
    results = []
    async with ray_attempts(settings, proxy_url="http://127.0.0.1:9", admin_key=None, out=base) as attempts:
        attempts._task = ray.remote(_trivial_attempt).options(
            resources={settings.sandbox_resource: 1}, num_cpus=0, max_retries=0
        )

        def kwargs(i: int) -> dict[str, Any]:
            d = base / f"a{i}"
            d.mkdir(exist_ok=True)
            return {
                "base_url": "http://127.0.0.1:9/s/k",
                "attempt_dir": str(d),
                "timeout_seconds": 60,
                "calls": calls,
            }

        t = time.perf_counter()
        await attempts.run("trivial", kwargs(0), "/sessions/x/rollout")
        print(f"first Ray call (worker started cold): {1000 * (time.perf_counter() - t):.1f} ms", flush=True)
        for run in range(runs):
            local, remote = [], []
            for i in range(repeats):
                t = time.perf_counter()
                await asyncio.to_thread(_trivial_attempt, "trivial", kwargs(i), "", None, None)
                local.append(time.perf_counter() - t)
                t = time.perf_counter()
                await attempts.run("trivial", kwargs(i), "/sessions/x/rollout")
                remote.append(time.perf_counter() - t)
            lm, rm = statistics.median(local), statistics.median(remote)
            results.append((lm, rm))
            print(
                f"run {run + 1}: local {1000 * lm:.2f} ms, ray {1000 * rm:.2f} ms, "
                f"hop {1000 * (rm - lm):.2f} ms per attempt (median of {repeats})",
                flush=True,
            )
    return results


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks ray-hop")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--calls", type=int, default=17, help="recorded calls in the returned rollout")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fineenvs-ray-hop-") as tmp:
        results = asyncio.run(_bench(args.runs, args.repeats, args.calls, Path(tmp)))
    hops = [rm - lm for lm, rm in results]
    print(
        f"ray-hop: median over {args.runs} runs: local {1000 * statistics.median(r[0] for r in results):.2f} ms, "
        f"ray {1000 * statistics.median(r[1] for r in results):.2f} ms, "
        f"hop {1000 * statistics.median(hops):.2f} ms per attempt ({args.calls} calls returned)"
    )
    return 0
