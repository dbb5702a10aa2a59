"""The mini task set: three CSV question templates a tiny model can learn, with held-out splits.

The learning mini-reproduction (``+experiment=mini_repro``) needs tasks that a tiny student can
solve after a short warm start and that test generalisation, not memorisation. Every task is one
small CSV file (an ``id`` column and one value column) and one question from three templates:

- ``rows``: "How many data rows does <file> have?"
- ``sum``: "What is the sum of the <column> column (column <n>) in <file>?"
- ``max``: "What is the largest value in the <column> column (column <n>) of <file>?"

What the student has to learn is which command a question asks for (the three differ from their
first word); the value column is always column 2. Version 1 put the asked-for column among three
value columns, and a 4-layer student never learnt to copy its number from the question 2k tokens
back: it wrote ``$3`` for every question, confidently, so RL had nothing to choose between.

Splits share the templates and nothing else: file names, column names and every value are drawn
from disjoint pools per split (train, test, eval), so an answer, a file or a column seen in
training never appears in evaluation. Gold answers are integers computed from the generated rows
(``tests/tasks/test_mini.py`` recomputes them from the CSV text). Generation is pure; the set is
generated once into the cache like the demo set, under ``tasks=mini``. Sizes: 216 train, 24 test,
216 eval (six blocks of 36; the first is the eval split of the runs before blocks were added, the
first two the 72 tasks of the learning test until 2026-12-03).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from fineenvs.jsonl import JsonObject
from fineenvs.tasks.demo import MANIFEST, ensure_generated, file_digests
from fineenvs.tasks.harbor import write_harbor_task
from fineenvs.tasks.row_layout import build_instruction

MINI_SEED = 20261201
MINI_VERSION = 2
VALUE_COLUMN = 2  # the CSV column every sum/max question is about
TEMPLATES = ("rows", "sum", "max")
# The eval split in blocks: block 0 is the 36 tasks every run up to 2026-12-02 was evaluated on
# (unchanged: same random stream, same pools); each later block adds 36 from pools of its own, so
# that a paired comparison of two checkpoints has more held-out tasks (the learning test's criterion:
# 72 tasks until a run with a real but smaller gain, 0.39 -> 0.50, missed p < 0.05; now 216).
_BLOCKS = {"train": (216,), "test": (24,), "eval": (36,) * 6}
SPLIT_SIZES = {split: sum(sizes) for split, sizes in _BLOCKS.items()}

# Disjoint per split: what the student sees in training is never what it is evaluated on.
# Per split, one pool per block.
_STEMS = {
    "train": [
        "orders trips plants books cars songs games birds boats cakes coins dogs farms films hills lamps".split()
    ],
    "test": ["maps pens rocks shoes tools trees".split()],
    "eval": [
        "vans wines clocks ships bikes kites ropes tents".split(),
        "jars mugs bells drums forks harps nets vases".split(),
        "cups bowls chairs desks doors gates flags rings".split(),
        "hats coats socks belts gloves boots masks scarves".split(),
        "apples pears plums limes melons grapes beans seeds".split(),
        "rivers lakes ponds roads towns ports docks camps".split(),
    ],
}
_COLUMNS = {
    "train": ["price weight score height width depth speed count age size rank level".split()],
    "test": ["power value cost length".split()],
    "eval": [
        "volume rating budget distance mass grade".split(),
        "energy margin duration load pressure income".split(),
        "yield capacity quota density voltage traffic".split(),
        "revenue salary altitude latency tempo bonus".split(),
        "rainfall humidity torque dosage payload mileage".split(),
        "calories protein sodium fiber sugar caffeine".split(),
    ],
}
# Values and row counts per split come from disjoint ranges, so that no held-out answer (a count,
# a sum or a maximum) is ever a training answer.
_VALUE_RANGES = {"train": (1, 20), "test": (100, 199), "eval": (200, 299)}
_ROW_COUNTS = {"train": (3, 7), "test": (8, 9), "eval": (10, 12)}


@dataclass(frozen=True)
class MiniSpec:
    task_id: str
    template: str
    file: str
    columns: tuple[str, ...]
    rows: tuple[tuple[int, ...], ...]
    column_index: int  # 1-based CSV column the question is about (0 for ``rows``)
    question: str
    gold: str

    def csv_bytes(self) -> bytes:
        lines = [",".join(self.columns)] + [",".join(str(v) for v in r) for r in self.rows]
        return ("\n".join(lines) + "\n").encode("utf-8")


def _gold(template: str, rows: tuple[tuple[int, ...], ...], index: int) -> str:
    if template == "rows":
        return str(len(rows))
    values = [r[index - 1] for r in rows]
    return str(sum(values) if template == "sum" else max(values))


def split_specs(split: str, seed: int = MINI_SEED) -> list[MiniSpec]:
    """The tasks of one split (a pure function of split and seed), templates in rotation."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"unknown mini split {split!r}; choose one of {sorted(SPLIT_SIZES)}")
    specs: list[MiniSpec] = []
    for block, size in enumerate(_BLOCKS[split]):
        # Block 0's stream is named as before blocks existed, so its tasks are what they were.
        name = f"fineenvs-mini-{MINI_VERSION}-{seed}-{split}" + (f"-block{block}" if block else "")
        specs += _block_specs(
            split, random.Random(name), _STEMS[split][block], _COLUMNS[split][block], size, len(specs)
        )
    return specs


def _block_specs(
    split: str, rng: random.Random, stems: list[str], columns: list[str], size: int, first: int
) -> list[MiniSpec]:
    lo, hi = _VALUE_RANGES[split]
    specs: list[MiniSpec] = []
    seen: set[tuple[str, str, int]] = set()
    rejected = 0
    while len(specs) < size:
        number = first + len(specs)
        template = TEMPLATES[number % len(TEMPLATES)]
        stem = rng.choice(stems)
        names = ["id", rng.choice(columns)]
        index = VALUE_COLUMN
        key = (stem, names[index - 1], index)
        if template != "rows" and key in seen:
            rejected += 1
            if rejected > 100_000:  # every (file, column) pair is taken: no new task can be drawn
                raise ValueError(
                    f"the mini {split} split cannot have {size} tasks in a block: its pools have "
                    f"{len(stems)} file stems x {len(columns)} columns, and each sum/max "
                    "question needs a (file, column) pair of its own. Fix: add names to the pools "
                    "(a new MINI_VERSION or a new block) or ask for fewer tasks"
                )
            continue
        seen.add(key)
        n_rows = rng.randint(*_ROW_COUNTS[split])
        rows = tuple((i + 1, rng.randint(lo, hi)) for i in range(n_rows))
        file = f"{stem}.csv"
        column = names[index - 1]
        if template == "rows":
            question, index = f"How many data rows does {file} have?", 0
        elif template == "sum":
            question = f"What is the sum of the {column} column (column {index}) in {file}?"
        else:
            question = f"What is the largest value in the {column} column (column {index}) of {file}?"
        specs.append(
            MiniSpec(
                task_id=f"mini-{split}-{number:03d}-{template}",
                template=template,
                file=file,
                columns=tuple(names),
                rows=rows,
                column_index=index,
                question=question,
                gold=_gold(template, rows, index),
            )
        )
    return specs


def generate_mini(out_dir: Path, seed: int = MINI_SEED) -> Path:
    """Write every split under ``out_dir/<split>/tasks/<task_id>/`` (Harbor layout) + manifest."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; generate the mini set into a new directory")
    for split in SPLIT_SIZES:
        for spec in split_specs(split, seed):
            metadata: JsonObject = {
                "task_id": spec.task_id,
                "difficulty_tier": "easy",
                "difficulty_level": 1,
                "category": "data-analysis",
                "question": spec.question,
                "answer": spec.gold,
                "answer_type": "number",
                "reward_mode": "auto",
                "atol": 0.0,
                "rtol": 0.0,
                "files": [spec.file],
                "template": spec.template,
                "params": json.dumps({"column_index": spec.column_index}, sort_keys=True),
                "mini_seed": seed,
                "mini_version": MINI_VERSION,
            }
            write_harbor_task(
                out_dir / split,
                task_id=spec.task_id,
                instruction=build_instruction(spec.question, [spec.file], "number"),
                metadata=metadata,
                inputs={spec.file: spec.csv_bytes()},
            )
    manifest = {"seed": seed, "version": MINI_VERSION, "files": file_digests(out_dir)}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir


def mini_root(seed: int = MINI_SEED) -> Path:
    from fineenvs.paths import cache_dir

    # The split sizes are in the name: a set generated with other sizes is another set.
    sizes = "x".join(str(SPLIT_SIZES[s]) for s in ("train", "test", "eval"))
    return cache_dir() / "tasks" / f"mini-v{MINI_VERSION}-seed{seed}-{sizes}"


def ensure_mini(seed: int = MINI_SEED, root: Path | None = None) -> Path:
    """The mini set's directory, generated first (atomically, like the demo set) if missing."""
    target = Path(root) if root is not None else mini_root(seed)
    return ensure_generated(target, lambda out: generate_mini(out, seed))
