"""``python -m benchmarks <name> [args]``: benchmarks that print their figures (names: ``BENCHES``)."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "engine": "benchmarks.engine",
    "proxy": "benchmarks.proxy",
    "tree": "benchmarks.tree",
    "gpu": "benchmarks.gpu",
    "trainer": "benchmarks.trainer",
    "agent-start": "benchmarks.agent_start",
    "replicas": "benchmarks.replicas",
    "cache-after-push": "benchmarks.cache_after_push",
    "sandbox-start": "benchmarks.sandbox_start",
    "ray-hop": "benchmarks.ray_hop",
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in BENCHES:
        print(f"usage: python -m benchmarks {{{'|'.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHES[args[0]])
    return int(module.main(args[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
