"""Plain, typed settings of the capture proxy (the lead's builder maps the Hydra config onto these)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class SamplingPolicy:
    """The sampling the trainer can reproduce: full distribution at one temperature.

    Whatever the agent asks for is recorded per call and replaced by these values upstream;
    ``top_k = -1`` means off, penalties are neutral.
    """

    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def as_body(self) -> dict[str, float | int]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
        }


@dataclass
class ProxyOptions:
    """The proxy's options: the ``proxy:`` section of a run's config (``conf/proxy/``) and the
    flags of ``python -m fineenvs.proxy serve``. Each default is written here once."""

    host: str = "127.0.0.1"
    """Bind address; any other than loopback needs ``admin_key``."""
    port: int = 0
    """0: a free port, picked at start (the standalone ``serve`` defaults to 8100)."""
    admin_key: str | None = None
    """Required when host is not loopback; the control routes then need it."""
    store_dir: str | None = None
    """Call records; None: ``<output_dir>/records`` in a run, ``outputs/proxy_store`` standalone."""
    max_model_calls: int = 17
    """Default per-session model-call budget (the scheduler sets it per attempt)."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body accepted (413 above): a long agent session with images fits."""
    keepalive_seconds: float = 5.0
    body_timeout_s: float = 60.0
    """A client that sends headers but trickles (or never sends) its body gives up its intake slot
    after this long (408)."""
    retries: int = 3
    """Attempts per call to the engine on 408/409/429/5xx (1: no retry)."""
    max_upstream_concurrency: int = 256
    """Calls in flight to the engine at once (= engine connections); the rest wait in the proxy. An
    engine batches a few hundred sequences at most; vLLM's --max-num-seqs defaults to 256."""
    fsync: bool = True
    """fsync each record before answering the agent (off: faster, a crash may lose the last calls)."""
    workers: int = 1
    """Proxy processes, each owning a shard of the sessions (``fineenvs.proxy.workers``): one per
    spare core raises the proxy's throughput ceiling (~1 ms of CPU per call per process); ports
    ``port..port+workers-1``."""


@dataclass
class ProxySettings(ProxyOptions):
    """Everything the proxy needs to run: its options, and what the run around it decides (the
    engine it forwards to, the model, the enforced sampling)."""

    upstream_url: str = "http://127.0.0.1:8000"
    served_model: str = "tiny_qwen"
    max_output_tokens: int = 4096
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)
    retry_backoff_s: float = 0.5
    max_retry_after_s: float = 60.0
    upstream_timeout_s: float = 600.0
    replica_urls: list[str] = field(default_factory=list)
    """The servers behind a router (``upstream_url``), read directly for their weight version:
    the router forwards generation, not ``/weight_info``."""

    @property
    def store_path(self) -> Path:
        return Path(self.store_dir or "outputs/proxy_store")

    def validate(self) -> None:
        """Refuse settings that would expose an unauthenticated control plane or make no sense."""
        if not is_loopback(self.host) and not self.admin_key:
            raise ValueError(
                f"fineenvs proxy: host={self.host!r} is not a loopback address and no admin key is set; "
                "anyone who can reach the port could create sessions and read recorded rollouts. "
                "Pass --admin-key (or set FINEENVS_ADMIN_KEY), or bind --host 127.0.0.1."
            )
        if self.max_model_calls < 1:
            raise ValueError(f"fineenvs proxy: max_model_calls={self.max_model_calls} must be >= 1.")
        if self.max_output_tokens < 1:
            raise ValueError(f"fineenvs proxy: max_output_tokens={self.max_output_tokens} must be >= 1.")
        if self.max_body_bytes < 1024:
            raise ValueError(f"fineenvs proxy: max_body_bytes={self.max_body_bytes} is below 1 KiB.")
        if self.max_upstream_concurrency < 1:
            raise ValueError(
                f"fineenvs proxy: max_upstream_concurrency={self.max_upstream_concurrency} must be >= 1."
            )
        if not 1 <= self.workers <= 64:
            raise ValueError(
                f"fineenvs proxy: workers={self.workers} must be between 1 and 64 "
                "(one process per spare core is the useful maximum)."
            )
        if self.retries < 1:
            raise ValueError(f"fineenvs proxy: retries={self.retries} must be >= 1 (1 = no retry).")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
