"""The capture proxy: real agents call it as their model API; it records exact engine tokens.

Public API: ``create_proxy_app(settings, *, upstream=None, store)`` (a Starlette app),
``ProxySettings`` / ``SamplingPolicy`` (plain settings), ``CallStore`` (durable, delta-encoded
per-session records; ``read_session(session_id)`` rebuilds full prompt ids). Command line:
``python -m fineenvs.proxy serve --engine-url URL --served-model NAME``.
"""

from fineenvs.proxy.app import create_proxy_app
from fineenvs.proxy.settings import ProxySettings, SamplingPolicy
from fineenvs.proxy.store import CallStore, StoreError

__all__ = ["CallStore", "ProxySettings", "SamplingPolicy", "StoreError", "create_proxy_app"]
