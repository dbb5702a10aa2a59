"""``python -m fineenvs.harnesses install [NAME ...|all] [--force] [--jobs N]`` and ``... list``."""

from __future__ import annotations

import argparse
import json
import sys

from fineenvs.harnesses import HARNESSES, HarnessConfigError, resolve_names
from fineenvs.harnesses.installer import install_many


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineenvs.harnesses", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_install = sub.add_parser("install", help="install pinned harness CLIs into the cache")
    p_install.add_argument(
        "names", nargs="*", default=["all"], help=f"'all' or any of: {', '.join(HARNESSES)}"
    )
    p_install.add_argument("--force", action="store_true", help="reinstall even if the marker says installed")
    p_install.add_argument("--jobs", type=int, default=3, help="parallel installs (default 3)")
    p_list = sub.add_parser("list", help="show pinned versions and what is installed")
    p_list.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    if args.cmd == "list":
        rows = [h.describe() for h in HARNESSES.values()]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"{'name':16} {'version':10} {'installed':9} {'formats':60} path")
        for r in rows:
            fmts = ",".join(r["formats"])
            print(
                f"{r['name']:16} {r['version']:10} {'yes' if r['installed'] else 'no':9} {fmts:60} {r['path']}"
            )
        return 0

    try:
        harnesses = resolve_names(args.names or ["all"])
    except HarnessConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = install_many(harnesses, force=args.force, jobs=args.jobs)
    failed = {name: err for name, err in results.items() if err}
    for name, err in failed.items():
        print(f"FAILED {name}: {err}", file=sys.stderr)
    ok = [name for name, err in results.items() if not err]
    print(f"installed: {', '.join(ok) or 'none'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
