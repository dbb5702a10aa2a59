from __future__ import annotations

from dataclasses import replace

from fineenvs.tasks import load_tasks, subset_key, training_subset


def test_qwen_pool_takes_easy_tier_too() -> None:
    base = load_tasks("demo", split="train")
    # Enlarge the pool deterministically so every tier has enough tasks.
    pool = [replace(t, task_id=f"{t.task_id}-{i}") for i in range(12) for t in base]
    chosen = training_subset(pool, n_easy=5, n_medium=6, n_hard=7)
    tiers = [t.difficulty for t in chosen]
    assert (tiers.count("easy"), tiers.count("medium"), tiers.count("hard")) == (5, 6, 7)
    keys = [subset_key(t.task_id) for t in chosen]
    assert keys == sorted(keys), "fixed order: the subset ranking"
    assert training_subset(list(reversed(pool)), n_easy=5, n_medium=6, n_hard=7) == chosen
