"""Record whole proxy sessions of real harness CLIs into tests/trajectory/recorded/<harness>.json.

Each installed harness (default format) runs one attempt against the scripted engine through the
real proxy; the session's recorded calls (full prompt ids, sampled ids, logprobs, as stored by the
proxy) are written in the proxy's rollout shape, which the trajectory tests build into graphs and
rows and round-trip through the exports. Keys never reach the records (the proxy scrubs them).

    python -m tests.harnesses.record_sessions [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from fineenvs.harnesses import HARNESSES, check_installed
from fineenvs.harnesses.sandbox import run_attempt
from tests.harnesses.scripted_engine import ScriptedEngine
from tests.harnesses.stack import start_proxy

OUT_DIR = Path(__file__).resolve().parents[1] / "trajectory" / "recorded"
KEEP = ("call_id", "index", "prompt_ids", "sampled_ids", "logprobs", "logprobs_aligned", "finish_reason",
        "has_tools", "weight_version", "dialect", "notes")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    names = args.names or ["claude_code", "codex", "opencode", "mini_swe_agent"]
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    engine = ScriptedEngine().start()
    work = Path(tempfile.mkdtemp(prefix="fineenvs-sessions-"))
    proxy = start_proxy(engine.url, "tiny_qwen", work / "store")
    failed = 0
    try:
        for name in names:
            if problems := check_installed([name]):
                print(f"skip {name}: {problems[0]}")
                failed += 1
                continue
            h = HARNESSES[name]
            session = proxy.new_session(harness=name)
            result = run_attempt(
                h,
                task_prompt="Compute 6*7 and write the number to answer.txt using the shell.",
                input_files={},
                attempt_dir=work / name,
                base_url=session["base_url"],
                session_key=session["key"],
                model="tiny_qwen",
                timeout_seconds=240,
                step_limit=8,
            )
            calls = proxy.rollout(session["session_id"])["calls"]
            doc = {
                "metadata": {"harness": name, "version": h.version, "exit_reason": result.exit_reason},
                "calls": [{k: c.get(k) for k in KEEP} for c in calls],
            }
            text = json.dumps(doc, separators=(",", ":"))
            assert session["key"] not in text
            (OUT_DIR / f"{name}.json").write_text(text)
            print(f"{name}: {len(calls)} calls, {result.exit_reason}")
    finally:
        proxy.stop()
        engine.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
