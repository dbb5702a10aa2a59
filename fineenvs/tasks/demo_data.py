"""Seeded CSV tables for the offline demo set (sales, products, employees, weather).

Everything is integer-valued at generation time (prices in cents, temperatures and rain in
tenths) so that the CSV text, and every gold answer computed from it, is identical on every
platform. A table is regenerated (the generator draws again) until the questions asked about it
have exactly one right answer: no ties for "which region has the most orders" and the like.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

REGIONS = ("North", "South", "East", "West")
PRODUCTS = {
    "Apples": "Fruit",
    "Bread": "Bakery",
    "Cheese": "Dairy",
    "Dates": "Fruit",
    "Eggs": "Dairy",
    "Flour": "Bakery",
    "Grapes": "Fruit",
}
MONTHS = ("2024-01", "2024-02", "2024-03", "2024-04", "2024-05", "2024-06")
DEPARTMENTS = {"Engineering": 62000, "Sales": 48000, "Support": 39000, "Finance": 55000, "Legal": 58000}
CITIES = {"Oslo": (20, 60, 0.45), "Lima": (190, 30, 0.1), "Cairo": (240, 50, 0.05), "Perth": (70, 50, 0.3)}
MAX_DRAWS = 1000


@dataclass(frozen=True)
class Sale:
    order_id: int
    month: str
    region: str
    product: str
    units: int
    price_cents: int

    @property
    def revenue_cents(self) -> int:
        return self.units * self.price_cents


@dataclass(frozen=True)
class Employee:
    emp_id: int
    department: str
    age: int
    salary: int
    years: int
    remote: str


@dataclass(frozen=True)
class Reading:
    date: str
    city: str
    temp_tenths: int
    rain_tenths: int


def csv_bytes(header: list[str], rows: list[list[str]]) -> bytes:
    """Plain CSV: no quoting needed (no value holds a comma), '\\n' line ends, trailing newline."""
    return ("\n".join([",".join(header)] + [",".join(r) for r in rows]) + "\n").encode("utf-8")


def tenths(value: int) -> str:
    return f"{value / 10:.1f}"


def cents(value: int) -> str:
    return f"{value / 100:.2f}"


def sales_table(rng: random.Random) -> list[Sale]:
    for _ in range(MAX_DRAWS):
        base = {p: rng.randint(80, 900) for p in PRODUCTS}
        weights = [rng.randint(1, 6) for _ in REGIONS]
        sales = [
            Sale(
                order_id=1000 + i,
                month=rng.choice(MONTHS),
                region=rng.choices(REGIONS, weights)[0],
                product=(product := rng.choice(sorted(PRODUCTS))),
                units=rng.randint(1, 20),
                price_cents=base[product] + rng.randint(-40, 40),
            )
            for i in range(rng.randint(60, 90))
        ]
        if _sales_ok(sales):
            return sales
    raise RuntimeError("sales_table: no tie-free table in MAX_DRAWS draws")


def _sales_ok(sales: list[Sale]) -> bool:
    regions = Counter(s.region for s in sales).most_common()
    revenue = sorted(product_totals(sales, revenue=True).values(), reverse=True)
    units = sorted(product_totals(sales, revenue=False).values())
    half = len(units) // 2
    return (
        len(regions) > 1
        and regions[0][1] > regions[1][1]
        and len(revenue) == len(PRODUCTS)
        and len(set(revenue[:4])) == 4
        and units[half - 1] < units[half]
        and all(any(s.month == m for s in sales) for m in MONTHS)
    )


def product_totals(sales: list[Sale], *, revenue: bool) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for s in sales:
        totals[s.product] += s.revenue_cents if revenue else s.units
    return dict(totals)


def employees_table(rng: random.Random) -> list[Employee]:
    for _ in range(MAX_DRAWS):
        staff = []
        for i in range(rng.randint(50, 70)):
            department = rng.choice(sorted(DEPARTMENTS))
            age = rng.randint(22, 64)
            years = rng.randint(0, min(age - 20, 35))
            salary = DEPARTMENTS[department] + years * rng.randint(5, 15) * 100 + rng.randint(-50, 50) * 100
            remote = "yes" if rng.random() < 0.4 else "no"
            staff.append(Employee(2000 + i, department, age, salary, years, remote))
        if _employees_ok(staff):
            return staff
    raise RuntimeError("employees_table: no tie-free table in MAX_DRAWS draws")


def _employees_ok(staff: list[Employee]) -> bool:
    by_dept = group(staff, lambda e: e.department, lambda e: e.salary)
    if len(by_dept) != len(DEPARTMENTS) or any(len(v) < 2 for v in by_dept.values()):
        return False
    means = sorted((sum(v) / len(v) for v in by_dept.values()), reverse=True)
    ranges = sorted((max(v) - min(v) for v in by_dept.values()), reverse=True)
    remote = [e.salary for e in staff if e.remote == "yes"]
    onsite = [e.salary for e in staff if e.remote == "no"]
    return (
        means[0] > means[1]
        and ranges[0] > ranges[1]
        and len(remote) >= 3
        and len(onsite) >= 3
        and sum(remote) * len(onsite) != sum(onsite) * len(remote)
    )


def weather_table(rng: random.Random) -> list[Reading]:
    for _ in range(MAX_DRAWS):
        readings = []
        for city in sorted(CITIES):
            mean, spread, wet = CITIES[city]
            for day in range(1, 21):
                temp = round(rng.gauss(mean, spread))
                rain = round(rng.expovariate(1 / 60)) if rng.random() < wet else 0
                readings.append(Reading(f"2024-03-{day:02d}", city, temp, rain))
        if _weather_ok(readings):
            return readings
    raise RuntimeError("weather_table: no tie-free table in MAX_DRAWS draws")


def _weather_ok(readings: list[Reading]) -> bool:
    temps = group(readings, lambda r: r.city, lambda r: r.temp_tenths)
    highs = sorted((max(v) for v in temps.values()), reverse=True)
    ranges = sorted((max(v) - min(v) for v in temps.values()), reverse=True)
    sums = [sum(v) for v in temps.values()]
    rains = {r.rain_tenths for r in readings}
    return (
        highs[0] > highs[1]
        and ranges[0] > ranges[1]
        and len(set(sums)) == len(sums)
        and 2 <= len({r.city for r in readings if r.temp_tenths < 0}) < len(CITIES)
        and not all(r.temp_tenths < 0 for r in readings if r.city == "Oslo")
        and len(rains) > 1
        and all(any(r.rain_tenths > 0 for r in readings if r.city == c) for c in CITIES)
    )


def group(items: list[T], key: Callable[[T], K], value: Callable[[T], V]) -> dict[K, list[V]]:
    out: dict[K, list[V]] = defaultdict(list)
    for item in items:
        out[key(item)].append(value(item))
    return dict(out)


def sales_csv(sales: list[Sale]) -> bytes:
    rows = [
        [str(s.order_id), s.month, s.region, s.product, str(s.units), cents(s.price_cents)] for s in sales
    ]
    return csv_bytes(["order_id", "month", "region", "product", "units", "unit_price"], rows)


def products_csv() -> bytes:
    return csv_bytes(["product", "category"], [[p, c] for p, c in sorted(PRODUCTS.items())])


def employees_csv(staff: list[Employee]) -> bytes:
    rows = [[str(e.emp_id), e.department, str(e.age), str(e.salary), str(e.years), e.remote] for e in staff]
    return csv_bytes(["emp_id", "department", "age", "salary", "years", "remote"], rows)


def weather_csv(readings: list[Reading]) -> bytes:
    rows = [[r.date, r.city, tenths(r.temp_tenths), tenths(r.rain_tenths)] for r in readings]
    return csv_bytes(["date", "city", "temp_c", "rain_mm"], rows)
