"""A deterministic text corpus for training the tiny models' tokenizers.

The tiny models never see the Hub, so their BPE vocabularies are learnt here from generated text
that looks like what coding agents exchange: prose, Python, shell sessions, CSV, JSON, tool
schemas and the three tool-call syntaxes the engine parses (Hermes JSON, Qwen3 XML, LFM2
pythonic). The corpus depends only on the code below (a fixed ``random.Random`` seed), never on
the model seed, so every tiny model of a family shares one tokenizer.
"""

from __future__ import annotations

import json
import random

_WORDS = (
    "the a an of to in for on with by from and or not is are was be this that it file files "
    "data row rows column columns value values count total mean sum max min sort filter group "
    "read write open close print return error test tests pass fail run runs script program "
    "python shell command output input path directory list dict string number int float json "
    "csv table header line lines first last next previous answer question task user assistant "
    "tool call result results weather city days name arguments function parameter query search "
    "install build check fix bug issue change update commit branch merge diff patch log"
).split()

_NAMES = ("read_file", "write_file", "bash", "run_python", "list_dir", "grep", "get_weather", "search")
_CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Austin")
_PATHS = (
    "data/input.csv",
    "src/main.py",
    "README.md",
    "/home/user/input/sales.csv",
    "out.json",
    "tests/test_app.py",
)
_COMMANDS = (
    "ls -la",
    "cat data/input.csv | head -n 5",
    "python3 solve.py",
    "grep -rn 'def ' src/",
    "wc -l *.csv",
    "cd /home/user && pip install pandas",
    "git status && git diff",
    "echo $HOME",
    "sed -n 1,20p main.py",
    "awk -F, '{print $2}' data.csv | sort | uniq -c",
)

_PYTHON = (
    "import csv\nimport json\n\n\ndef main() -> None:\n    with open('data/input.csv') as f:\n"
    "        rows = list(csv.DictReader(f))\n    total = sum(float(r['amount']) for r in rows)\n"
    "    print(round(total, 2))\n\n\nif __name__ == '__main__':\n    main()\n",
    "def add(a: int, b: int) -> int:\n    return a + b\n\n\nassert add(2, 3) == 5\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, i ** 2)\n    else:\n        continue\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n"
    "        self.counts[key] = self.counts.get(key, 0) + 1\n",
    "try:\n    value = int(text)\nexcept ValueError as exc:\n    raise SystemExit(f'bad value: {exc}')\n",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    return " ".join(words).capitalize() + rng.choice((".", "?", "!", ":"))


def _arguments(rng: random.Random) -> dict[str, object]:
    choice = rng.randrange(4)
    if choice == 0:
        return {"city": rng.choice(_CITIES), "days": rng.randint(1, 7)}
    if choice == 1:
        return {"path": rng.choice(_PATHS)}
    if choice == 2:
        return {"command": rng.choice(_COMMANDS)}
    return {"query": " ".join(rng.choice(_WORDS) for _ in range(3)), "limit": rng.randint(1, 50)}


def _csv(rng: random.Random) -> str:
    lines = ["id,name,amount,date"]
    for i in range(rng.randint(3, 8)):
        lines.append(
            f"{i},{rng.choice(_CITIES)},{rng.uniform(0, 999):.2f},2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        )
    return "\n".join(lines)


def _tool_schema(name: str) -> str:
    return json.dumps(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"Run {name} and return its output.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "A file path."}},
                    "required": ["path"],
                },
            },
        }
    )


def _hermes_call(name: str, args: dict[str, object]) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + "}\n</tool_call>"


def _xml_call(name: str, args: dict[str, object]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _lfm2_call(name: str, args: dict[str, object]) -> str:
    rendered = ", ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in args.items())
    return f"<|tool_call_start|>[{name}({rendered})]<|tool_call_end|>"


def _chunk(rng: random.Random) -> str:
    kind = rng.randrange(9)
    name = rng.choice(_NAMES)
    args = _arguments(rng)
    if kind == 0:
        return " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
    if kind == 1:
        return rng.choice(_PYTHON)
    if kind == 2:
        cmd = rng.choice(_COMMANDS)
        return f"$ {cmd}\n{_sentence(rng)}\nexit code: {rng.choice((0, 0, 1, 2, 127))}"
    if kind == 3:
        return _csv(rng)
    if kind == 4:
        return json.dumps(
            {"name": name, "arguments": args, "ok": rng.random() < 0.5, "items": [1, 2.5, None]}
        )
    if kind == 5:
        return _tool_schema(name)
    if kind == 6:
        return _hermes_call(name, args) + "\n<tool_response>\n" + _sentence(rng) + "\n</tool_response>"
    if kind == 7:
        return _xml_call(name, args)
    return _lfm2_call(name, args) + "\n" + _sentence(rng)


def generate_corpus(n_chunks: int = 3000) -> list[str]:
    """Return the tokenizer-training corpus: ``n_chunks`` generated documents, always the same."""
    rng = random.Random(20260101)
    return [_chunk(rng) for _ in range(n_chunks)]
