"""The project's scaffolding: what its tests, the smoke run and the recipes need, apart from the library.

- ``tiny``: tiny offline models (random weights, locally trained tokenizers, real chat templates)
  and the text their tokenizers learn from;
- ``mini_repro``: the learning mini-reproduction on a CPU (setup, train, cleanup) and its scripted
  teacher.

This package imports the library; the library never imports it (``tests/test_import_graph.py``).
The library reaches these pieces by name through entry points (``fineenvs/plugins.py``), declared
in ``pyproject.toml``; deleting this package and those lines leaves the library whole.
"""
