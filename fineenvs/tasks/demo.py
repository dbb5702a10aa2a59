"""The offline demo set: data-analysis tasks over seeded CSV files, in the Harbor layout.

Four instances of the same 24 question templates (over sales/products, employees and weather
tables drawn from the seed) make 96 tasks: instances a and b are the train split (48), c the test
split, d the eval split (24 each). Tiers per instance: 7 easy, 8 medium, 9 hard. Answer types:
number (with tolerance), short label, list (ordered and unordered), yes/no, percentage. Gold
answers are computed from the generated tables; `tests/tasks/test_demo.py` recomputes each one
independently from the CSV files with pandas.

Generation is pure (no clock, no environment), so the same seed always gives byte-identical
files. `ensure_demo` generates once into the cache (``cache_dir()/tasks/demo-v<version>-seed<seed>``)
through a temporary directory and an atomic rename, so concurrent first uses cannot see half a set.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import statistics
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fineenvs.jsonl import JsonObject
from fineenvs.tasks import demo_data as dd
from fineenvs.tasks.harbor import write_harbor_task
from fineenvs.tasks.row_layout import build_instruction

DEMO_SEED = 20260701
DEMO_VERSION = 1
SPLIT_INSTANCES: dict[str, tuple[str, ...]] = {"train": ("a", "b"), "test": ("c",), "eval": ("d",)}
LEVELS = {"easy": 1, "medium": 3, "hard": 5}
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Spec:
    """One generated question with its gold answer."""

    name: str
    difficulty: str
    answer_type: str
    question: str
    gold: str
    files: tuple[str, ...]
    match_mode: str = "auto"
    atol: float = 0.0
    rtol: float = 0.0
    params: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class Tables:
    sales: list[dd.Sale]
    staff: list[dd.Employee]
    weather: list[dd.Reading]

    def files(self) -> dict[str, bytes]:
        return {
            "sales.csv": dd.sales_csv(self.sales),
            "products.csv": dd.products_csv(),
            "employees.csv": dd.employees_csv(self.staff),
            "weather.csv": dd.weather_csv(self.weather),
        }


def _g(value: float, decimals: int) -> str:
    text = f"{value:.{decimals}f}"
    return "0" if text.strip("-0.") == "" else text


def _sales_specs(t: Tables, rng: random.Random) -> list[Spec]:
    s, f, fp = t.sales, ("sales.csv",), ("sales.csv", "products.csv")
    region = rng.choice(sorted({x.region for x in s}))
    units = dd.product_totals(s, revenue=False)
    ordered = sorted(units.values())
    threshold = ordered[len(ordered) // 2 - 1]
    revenue = dd.product_totals(s, revenue=True)
    top3 = sorted(revenue, key=lambda p: -revenue[p])[:3]
    m1, m2 = sorted(rng.sample(dd.MONTHS, 2))
    by_month = {m: sum(x.revenue_cents for x in s if x.month == m) for m in dd.MONTHS}
    change = (by_month[m2] - by_month[m1]) / by_month[m1] * 100
    category = rng.choice(sorted(set(dd.PRODUCTS.values())))
    rev = "units * unit_price"
    return [
        Spec("sales_orders", "easy", "number", "How many orders (data rows) are in sales.csv?", str(len(s)), f),
        Spec("sales_units", "easy", "number", "What is the sum of the units column in sales.csv?",
             str(sum(x.units for x in s)), f),
        Spec("sales_top_region", "easy", "label", "Which region has the most orders in sales.csv?",
             Counter(x.region for x in s).most_common(1)[0][0], f),
        Spec("sales_region_revenue", "medium", "number",
             f"What is the total revenue ({rev}) of region {region} in sales.csv? Round to 2 decimals.",
             dd.cents(sum(x.revenue_cents for x in s if x.region == region)), f, atol=0.01,
             params={"region": region}),
        Spec("sales_products_over", "medium", "list",
             f"Which products sold more than {threshold} units in total in sales.csv? List them alphabetically.",
             ", ".join(sorted(p for p, u in units.items() if u > threshold)), f, match_mode="list",
             params={"threshold": threshold}),
        Spec("sales_top3_revenue", "hard", "list",
             f"Which 3 products have the highest total revenue ({rev}) in sales.csv? Highest first.",
             ", ".join(top3), f, match_mode="ordered_list"),
        Spec("sales_month_change", "hard", "percentage",
             f"By what percentage did total revenue ({rev}) change from month {m1} to month {m2} in sales.csv? "
             "Round to 1 decimal; negative if it fell.",
             _g(change, 1) + "%", f, match_mode="percent", atol=0.1, params={"m1": m1, "m2": m2}),
        Spec("sales_category_units", "hard", "number",
             f"Using products.csv for each product's category, how many units in sales.csv were sold in "
             f"category {category}?",
             str(sum(x.units for x in s if dd.PRODUCTS[x.product] == category)), fp,
             params={"category": category}),
    ]  # fmt: skip


def _staff_specs(t: Tables, rng: random.Random) -> list[Spec]:
    e, f = t.staff, ("employees.csv",)
    max_age = max(x.age for x in e)
    older = rng.choice([max_age - 3, max_age + 2])
    dept = rng.choice(sorted(dd.DEPARTMENTS))
    salaries = dd.group(e, lambda x: x.department, lambda x: x.salary)
    remote = [x for x in e if x.remote == "yes"]
    years = rng.randint(2, 10)
    while not [x for x in remote if x.years >= years]:
        years -= 1
    median = statistics.median([x.salary for x in remote if x.years >= years])
    remote_mean = statistics.fmean([x.salary for x in remote])
    onsite_mean = statistics.fmean([x.salary for x in e if x.remote == "no"])
    return [
        Spec("emp_max_age", "easy", "number", "What is the highest age in employees.csv?", str(max_age), f),
        Spec("emp_any_older", "easy", "yes_no", f"Is any employee in employees.csv older than {older}?",
             "yes" if max_age > older else "no", f, params={"age": older}),
        Spec("emp_dept_mean", "medium", "number",
             f"What is the mean salary of the {dept} department in employees.csv? Round to 2 decimals.",
             _g(statistics.fmean(salaries[dept]), 2), f, atol=0.01, params={"department": dept}),
        Spec("emp_remote_pct", "medium", "percentage",
             "What percentage of employees in employees.csv have remote = yes? Round to 1 decimal.",
             _g(len(remote) / len(e) * 100, 1) + "%", f, match_mode="percent", atol=0.1),
        Spec("emp_top_dept", "medium", "label", "Which department has the highest mean salary in employees.csv?",
             max(salaries, key=lambda d: statistics.fmean(salaries[d])), f),
        Spec("emp_widest_dept", "hard", "label",
             "Which department has the largest salary range (max minus min) in employees.csv?",
             max(salaries, key=lambda d: max(salaries[d]) - min(salaries[d])), f),
        Spec("emp_remote_median", "hard", "number",
             f"What is the median salary of remote employees (remote = yes) with years of at least {years} "
             "in employees.csv?",
             _g(median, 1), f, atol=0.01, params={"years": years}),
        Spec("emp_remote_richer", "hard", "yes_no",
             "In employees.csv, is the mean salary of remote employees (remote = yes) higher than that of "
             "the others?",
             "yes" if remote_mean > onsite_mean else "no", f),
    ]  # fmt: skip


def _weather_specs(t: Tables, rng: random.Random) -> list[Spec]:
    w, f = t.weather, ("weather.csv",)
    temps = dd.group(w, lambda r: r.city, lambda r: r.temp_tenths)
    city = rng.choice(sorted(dd.CITIES))
    c1, c2 = rng.sample(sorted(dd.CITIES), 2)
    mm = rng.choice([0, 1, 5])
    rain_city = rng.choice(sorted(dd.CITIES))
    days = [r for r in w if r.city == rain_city]
    corr = statistics.correlation([r.temp_tenths / 10 for r in w], [r.rain_tenths / 10 for r in w])
    return [
        Spec("wx_min_temp", "easy", "number", "What is the lowest temp_c in weather.csv?",
             dd.tenths(min(r.temp_tenths for r in w)), f, atol=0.01),
        Spec("wx_hottest_city", "easy", "label", "Which city has the highest single temp_c value in weather.csv?",
             max(temps, key=lambda c: max(temps[c])), f),
        Spec("wx_city_rain", "medium", "number",
             f"What is the total rain_mm of {city} in weather.csv? Round to 1 decimal.",
             dd.tenths(sum(r.rain_tenths for r in w if r.city == city)), f, atol=0.05, params={"city": city}),
        Spec("wx_warmer", "medium", "yes_no", f"In weather.csv, is the mean temp_c of {c1} higher than that of {c2}?",
             "yes" if sum(temps[c1]) / len(temps[c1]) > sum(temps[c2]) / len(temps[c2]) else "no", f,
             params={"c1": c1, "c2": c2}),
        Spec("wx_freezing_cities", "medium", "list",
             "Which cities have at least one temp_c below 0 in weather.csv? List them alphabetically.",
             ", ".join(sorted(c for c, v in temps.items() if min(v) < 0)), f, match_mode="list"),
        Spec("wx_corr", "hard", "number",
             "What is the Pearson correlation between temp_c and rain_mm over all rows of weather.csv? "
             "Round to 3 decimals.",
             _g(corr, 3), f, atol=0.001),
        Spec("wx_rainy_pct", "hard", "percentage",
             f"On what percentage of {rain_city}'s days in weather.csv was rain_mm above {mm}? Round to 1 decimal.",
             _g(sum(r.rain_tenths > mm * 10 for r in days) / len(days) * 100, 1) + "%", f,
             match_mode="percent", atol=0.1, params={"city": rain_city, "mm": mm}),
        Spec("wx_widest_city", "hard", "label",
             "Which city has the largest temp_c range (max minus min) in weather.csv?",
             max(temps, key=lambda c: max(temps[c]) - min(temps[c])), f),
    ]  # fmt: skip


TEMPLATES: tuple[Callable[[Tables, random.Random], list[Spec]], ...] = (
    _sales_specs,
    _staff_specs,
    _weather_specs,
)


def instance_specs(seed: int, instance: str) -> tuple[Tables, list[Spec]]:
    """The tables and the 24 questions of one instance (a pure function of seed and instance)."""
    rng = random.Random(f"fineenvs-demo-{DEMO_VERSION}-{seed}-{instance}")
    tables = Tables(dd.sales_table(rng), dd.employees_table(rng), dd.weather_table(rng))
    specs = [spec for make in TEMPLATES for spec in make(tables, rng)]
    return tables, specs


def generate_demo(out_dir: Path, seed: int = DEMO_SEED) -> Path:
    """Write the demo set (all splits) under `out_dir`; returns `out_dir`.

    Layout: ``out_dir/<split>/tasks/<task_id>/...`` plus ``out_dir/manifest.json`` (seed, version,
    sha256 of every file), written last.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; generate the demo set into a new directory")
    for split, instances in SPLIT_INSTANCES.items():
        for instance in instances:
            tables, specs = instance_specs(seed, instance)
            files = tables.files()
            for spec in specs:
                task_id = f"demo-{instance}-{spec.name}"
                metadata: JsonObject = {
                    "task_id": task_id,
                    "difficulty_tier": spec.difficulty,
                    "difficulty_level": LEVELS[spec.difficulty],
                    "category": "data-analysis",
                    "question": spec.question,
                    "answer": spec.gold,
                    "answer_type": spec.answer_type,
                    "reward_mode": spec.match_mode,
                    "atol": spec.atol,
                    "rtol": spec.rtol,
                    "files": list(spec.files),
                    "template": spec.name,
                    "params": json.dumps(spec.params, sort_keys=True),
                    "demo_seed": seed,
                    "demo_version": DEMO_VERSION,
                }
                write_harbor_task(
                    out_dir / split,
                    task_id=task_id,
                    instruction=build_instruction(spec.question, spec.files, spec.answer_type),
                    metadata=metadata,
                    inputs={name: files[name] for name in spec.files},
                )
    manifest = {"seed": seed, "version": DEMO_VERSION, "files": file_digests(out_dir)}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir


def demo_root(seed: int = DEMO_SEED) -> Path:
    from fineenvs.paths import cache_dir

    return cache_dir() / "tasks" / f"demo-v{DEMO_VERSION}-seed{seed}"


def ensure_demo(seed: int = DEMO_SEED, root: Path | None = None) -> Path:
    """The demo set's directory, generating it first if it is missing or incomplete."""
    target = Path(root) if root is not None else demo_root(seed)
    return ensure_generated(target, lambda out: generate_demo(out, seed))


def ensure_generated(target: Path, generate: Callable[[Path], Path]) -> Path:
    """``target`` holding a generated task set (``MANIFEST`` written last), generating it once.

    Generation goes to a temporary directory next to ``target`` and is renamed into place, so
    concurrent first uses never see half a set; an incomplete copy without a manifest is replaced.
    """
    if (target / MANIFEST).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        generate(staging / "set")
        if (target / MANIFEST).is_file():  # another process finished first: use its copy
            return target
        if target.exists():  # no manifest: an incomplete copy (e.g. made by hand), replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging / "set", target)
        except OSError:
            if not (target / MANIFEST).is_file():  # lost a race to nobody: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` but the manifest, by relative path (for the manifest)."""
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
