"""Sessions: one per rollout attempt, found by a secret key, persisted as metadata + key digest.

The key is what the agent presents (``/s/<key>`` path prefix or its API key); only its SHA-256
digest is kept, in memory and in ``meta.json``, so neither the store nor a log can leak a live
key. Counters are in memory and rebuilt from the session's log the first time an old session is
touched after a restart.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field

import orjson

from fineenvs.jsonl import JsonObject
from fineenvs.proxy.store import SESSION_ID_RE, CallStore

# Events that consumed a model call (forwarded to the engine) and the counter each one feeds.
COUNTED_EVENTS = {
    "context_stop": "context_stops",
    "upstream_rejected": "rejected_calls",
    "upstream_error": "upstream_errors",
}
RESERVED_METADATA = ("key", "api_key", "session_key", "authorization")


def new_session_id() -> str:
    """A fresh session id: random, so no two runs on one store collide."""
    return "s" + secrets.token_hex(12)


def shard_of(session_id: str, shards: int) -> int:
    """The shard (proxy worker process) that owns ``session_id``: a stable hash, the same in every
    process and across restarts, so routing needs no table (``fineenvs.proxy.workers``)."""
    if shards <= 1:
        return 0
    digest = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def _seed_or_none(value: object) -> int | None:
    """``value`` when it is a usable session seed (an int in [0, 2**63), not a bool), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
        return value
    return None


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class Session:
    session_id: str
    key_sha256: str
    metadata: JsonObject
    max_model_calls: int
    created_at: float
    closed: bool = False
    model_calls: int = 0
    recorded_calls: int = 0
    flagged_calls: int = 0
    budget_stops: int = 0
    context_stops: int = 0
    upstream_errors: int = 0
    rejected_calls: int = 0
    last_call_at: float | None = None
    inflight: int = 0
    next_index: int = 0
    hydrated: bool = True
    harness_ids: dict[str, list[str]] = field(default_factory=dict)
    sampling_seed: int | None = None
    """Set: call ``i`` of the session is sampled with the engine seed ``call_seed(sampling_seed, i)``
    (common random numbers, ``fineenvs.proxy.upstream``); None: the engine's own stream."""

    def meta(self) -> JsonObject:
        return {
            "session_id": self.session_id,
            "key_sha256": self.key_sha256,
            "metadata": self.metadata,
            "max_model_calls": self.max_model_calls,
            "created_at": self.created_at,
            "closed": self.closed,
            "sampling_seed": self.sampling_seed,
        }

    def stats(self) -> JsonObject:
        now = time.time()
        return {
            "session_id": self.session_id,
            "metadata": self.metadata,
            "closed": self.closed,
            "max_model_calls": self.max_model_calls,
            "model_calls": self.model_calls,
            "recorded_calls": self.recorded_calls,
            "flagged_calls": self.flagged_calls,
            "budget_stops": self.budget_stops,
            "context_stops": self.context_stops,
            "upstream_errors": self.upstream_errors,
            "rejected_calls": self.rejected_calls,
            "inflight": self.inflight,
            "created_at": self.created_at,
            "last_call_at": self.last_call_at,
            "idle_s": round(now - (self.last_call_at or self.created_at), 3),
            "harness_ids": self.harness_ids,
        }


class SessionRegistry:
    """All sessions by id and by key digest; the store holds their durable copy."""

    def __init__(
        self, store: CallStore, default_max_model_calls: int, *, shard: tuple[int, int] = (0, 1)
    ) -> None:
        self.store = store
        self.default_max_model_calls = default_max_model_calls
        self.shard = shard
        self.by_id: dict[str, Session] = {}
        self.by_digest: dict[str, Session] = {}
        for meta in store.load_metas():
            # With --workers N each process loads only the sessions it owns (one writer per log).
            if shard[1] > 1 and shard_of(str(meta.get("session_id")), shard[1]) != shard[0]:
                continue
            try:
                session = Session(
                    session_id=str(meta["session_id"]),
                    key_sha256=str(meta["key_sha256"]),
                    metadata=dict(meta.get("metadata") or {}),
                    max_model_calls=int(meta["max_model_calls"]),
                    created_at=float(meta["created_at"]),
                    closed=bool(meta.get("closed")),
                    hydrated=False,
                    sampling_seed=_seed_or_none(meta.get("sampling_seed")),
                )
            except (KeyError, TypeError, ValueError):
                continue
            self.by_id[session.session_id] = session
            if not session.closed:
                self.by_digest[session.key_sha256] = session

    async def create(
        self,
        metadata: JsonObject,
        *,
        max_model_calls: int | None = None,
        session_id: str | None = None,
        sampling_seed: int | None = None,
    ) -> tuple[Session, str]:
        if session_id is None:
            session_id = new_session_id()
        elif not SESSION_ID_RE.match(session_id) or session_id in self.by_id:
            raise ValueError(
                f"session_id {session_id!r} is taken or not of the form [A-Za-z0-9][A-Za-z0-9_.-]{{0,127}}; "
                "omit session_id to get a fresh one."
            )
        bad = [k for k in metadata if k.lower() in RESERVED_METADATA]
        if bad:
            raise ValueError(
                f"metadata keys {bad} are reserved (secrets never go into records); rename them."
            )
        budget = self.default_max_model_calls if max_model_calls is None else max_model_calls
        if budget < 1:
            raise ValueError(f"max_model_calls={budget} must be >= 1.")
        if sampling_seed is not None and _seed_or_none(sampling_seed) is None:
            raise ValueError(
                f"sampling_seed={sampling_seed!r} must be an integer in [0, 2**63); omit it to let the "
                "engine draw from its own stream."
            )
        key = secrets.token_urlsafe(32)
        session = Session(
            session_id, key_digest(key), metadata, budget, time.time(), sampling_seed=sampling_seed
        )
        await self.store.create_session(session_id, session.meta())
        self.by_id[session_id] = session
        self.by_digest[session.key_sha256] = session
        return session, key

    def lookup(self, key: str) -> Session | None:
        session = self.by_digest.get(key_digest(key))
        if session is not None and not session.hydrated:
            self.hydrate(session)
        return session

    def get(self, session_id: str) -> Session | None:
        session = self.by_id.get(session_id)
        if session is not None and not session.hydrated:
            self.hydrate(session)
        return session

    def hydrate(self, session: Session) -> None:
        """Rebuild counters of a session created before a restart from its log."""
        path = self.store.session_dir(session.session_id) / "calls.jsonl"
        session.hydrated = True
        if not path.exists():
            return
        with open(path, "rb") as fh:
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break
                rec = orjson.loads(raw)
                index = rec.get("index")
                if isinstance(index, int):
                    session.next_index = max(session.next_index, index + 1)
                kind = rec.get("kind")
                if rec.get("type") == "call":
                    session.model_calls += 1
                    session.recorded_calls += 1
                    session.flagged_calls += 0 if rec.get("logprobs_aligned") else 1
                    session.last_call_at = rec.get("timings", {}).get("arrived_at", session.last_call_at)
                elif kind == "budget_stop":
                    session.budget_stops += 1
                elif kind in COUNTED_EVENTS:
                    session.model_calls += 1
                    setattr(session, COUNTED_EVENTS[kind], getattr(session, COUNTED_EVENTS[kind]) + 1)

    async def close(self, session: Session) -> None:
        session.closed = True
        self.by_digest.pop(session.key_sha256, None)
        await self.store.save_meta(session.session_id, session.meta())

    def forget(self, session: Session) -> None:
        self.by_id.pop(session.session_id, None)
        self.by_digest.pop(session.key_sha256, None)
