"""The capture proxy: real agents call it as their model API; it records exact engine tokens.

Public API: ``create_proxy_app(settings, *, upstream=None, store)`` (a Starlette app),
``ProxySettings`` / ``SamplingPolicy`` (plain settings), ``CallStore`` (durable, delta-encoded
per-session records; ``read_session(session_id)`` rebuilds full prompt ids). Command line:
``python -m fineenvs.proxy serve --engine-url URL --served-model NAME``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fineenvs.proxy.settings import ProxySettings, SamplingPolicy

if TYPE_CHECKING:
    from fineenvs.proxy.app import create_proxy_app
    from fineenvs.proxy.store import CallStore, StoreError

__all__ = ["CallStore", "ProxySettings", "SamplingPolicy", "StoreError", "create_proxy_app"]


def __getattr__(name: str) -> Any:
    # The app and the store load Starlette and NumPy: only for code that serves or reads records,
    # not for everything that reads the settings (the run config takes its defaults from them).
    if name == "create_proxy_app":
        from fineenvs.proxy.app import create_proxy_app

        return create_proxy_app
    if name in ("CallStore", "StoreError"):
        from fineenvs.proxy import store

        return getattr(store, name)
    raise AttributeError(f"module 'fineenvs.proxy' has no attribute {name!r}")
