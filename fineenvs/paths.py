"""Where fineenvs keeps things outside the repository.

The cache (tiny models, installed harness CLIs) lives outside the clone so that a second CI run or
a fresh clone on the same machine reuses it: ``$FINEENVS_CACHE``, else ``$XDG_CACHE_HOME/fineenvs``,
else ``~/.cache/fineenvs``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"


def cache_dir() -> Path:
    """Root of fineenvs' cache (created on first use)."""
    env = os.environ.get("FINEENVS_CACHE")
    if env:
        root = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "fineenvs"
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_cache() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def harness_cache() -> Path:
    path = cache_dir() / "harnesses"
    path.mkdir(parents=True, exist_ok=True)
    return path


# What the installer writes into a finished install folder of the harness cache (an agent, the
# pinned Node): the version it holds. No marker, no install.
MARKER_FILE = ".fineenvs-installed.json"


def read_marker(install_dir: Path) -> dict[str, object]:
    """The install marker in ``install_dir`` ({} when there is no valid one)."""
    try:
        data = json.loads((install_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def installed_version(install_dir: Path) -> str | None:
    """The version the install marker in ``install_dir`` names; None when there is no valid one."""
    version = read_marker(install_dir).get("version")
    return version if isinstance(version, str) else None
