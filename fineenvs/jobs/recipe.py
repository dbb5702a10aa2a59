"""``job=recipe``: run a recipe (``recipe=<name>``, from the ``fineenvs.recipes`` plugins).

A recipe is a whole experiment built from runs of the library, like torchtune's recipes: it sets
up (folders, what it reuses from an earlier attempt), trains (its stages, each a normal run), and
cleans up whether training finished or not. The library knows only that interface
(``fineenvs.config.Recipe`` and ``RecipeSettings``); the recipes live apart from it
(``fineenvs_recipes``), and their settings are checked at compose time by ``RecipeSettings.problems``.
"""

from __future__ import annotations

from fineenvs.config import RunConfig


def run_recipe(run: RunConfig) -> float | None:
    """Set up, train and clean up the configured recipe (validation already checked it is set)."""
    assert run.recipe is not None
    recipe = run.recipe.recipe(run)
    recipe.setup()
    try:
        return recipe.train()
    finally:
        recipe.cleanup()
