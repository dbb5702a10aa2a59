"""Plugins: what the library loads by name without importing it, through Python entry points.

The library never imports its scaffolding (``fineenvs_recipes``: tiny models, the
mini-reproduction and its scripted teacher). Where a run names one of those pieces, the library
looks it up in an entry-point group, the way vLLM loads its general plugins and pytest its
plugins: the package that provides the piece declares it in its ``pyproject.toml``, and deleting
the package deletes the plugin without touching the library.

The groups (each entry names an object the library calls through a small interface):

- ``fineenvs.model_builders``: builds a model locally (``model.source=tiny`` uses the one named
  ``tiny``); interface ``fineenvs.models.ModelBuilder``.
- ``fineenvs.engine_policies``: a scripted policy whose replies the embedded engine forces instead
  of sampling (``engine.policy=<name>``); interface ``fineenvs.engine.server.ScriptedPolicy``.
- ``fineenvs.recipes``: a recipe's settings schema (``job=recipe recipe=<name>``); interface
  ``fineenvs.recipe.Recipe``.
"""

from __future__ import annotations

from importlib.metadata import entry_points

MODEL_BUILDERS = "fineenvs.model_builders"
ENGINE_POLICIES = "fineenvs.engine_policies"
RECIPES = "fineenvs.recipes"


class PluginError(LookupError):
    """A named plugin is not installed, or does not load."""


def plugin_names(group: str) -> list[str]:
    """The names installed in ``group``, sorted."""
    return sorted({ep.name for ep in entry_points(group=group)})


def load_plugin(group: str, name: str) -> object:
    """The object the entry point ``name`` of ``group`` names, imported now."""
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        raise PluginError(
            f"no plugin {name!r} in the entry-point group {group}: installed are {plugin_names(group) or 'none'}. "
            "The project's own (tiny models, the mini-reproduction, its teacher) come with the "
            "fineenvs_recipes package of this repository. Fix: install the project "
            "(scripts/setup.sh, or pip install -e . in the checkout), or name an installed one"
        )
    try:
        return found[0].load()
    except Exception as err:  # an entry point's import can fail in any way
        raise PluginError(
            f"the plugin {name!r} of {group} ({found[0].value}) does not load: {type(err).__name__}: {err}. "
            "Fix: reinstall the package that provides it (pip install -e . in the checkout)"
        ) from err
