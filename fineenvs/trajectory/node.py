"""One model call as the trajectory graph sees it.

The proxy records, for every call of a session, the exact prompt token ids the engine saw, the
token ids it sampled and one behaviour logprob per sampled token. ``CallNode`` is that record
reduced to what the graph and the rows need; everything else the proxy stores (request messages,
sampling parameters, timings) travels in ``metadata``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from fineenvs.jsonl import JsonObject

# A behaviour logprob above this is not a log-probability (float noise on a certain token can
# give a tiny positive number; anything larger means the engine returned something else, e.g.
# raw logits or probabilities).
POSITIVE_LOGPROB_TOLERANCE = 1e-6


@dataclass
class CallNode:
    """One model call: what the engine saw, what it sampled, with which logprobs.

    ``arrival_index`` orders calls within a session; it breaks ties between calls with identical
    token sequences and decides which of two siblings was the retry, so the graph does not depend
    on the order in which ``TrajectoryGraph.add`` is called. ``logprobs_aligned`` is False when the
    proxy found the engine's ids and logprobs out of step; such a turn is kept as context only.
    A ``constrained`` call (structured output) is kept as context only by default, too.
    """

    node_id: str
    prompt_ids: list[int]
    sampled_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    has_tools: bool
    arrival_index: int
    weight_version: int | None = None
    harness_ids: dict[str, str] = field(default_factory=dict)
    metadata: JsonObject = field(default_factory=dict)
    logprobs_aligned: bool = True
    constrained: bool = False
    """Sampled under a grammar (structured output): its logprobs are the masked, renormalised
    distribution's, not the policy's, so rows keep it as context unless told otherwise."""

    def to_dict(self) -> JsonObject:
        """JSON-ready form (the format of recorded-session fixtures)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JsonObject) -> CallNode:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"CallNode.from_dict: unknown field(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**data)

    def order_key(self) -> tuple[int, str]:
        """Deterministic order of calls: arrival first, node id to break equal indices."""
        return (self.arrival_index, self.node_id)


def logprob_problem(node: CallNode, n_sampled: int | None = None) -> str | None:
    """Why this call's logprobs cannot be trained on, or None when they can.

    A call with a problem still contributes its tokens to the rows, with loss mask 0 (context).
    ``n_sampled`` overrides ``len(node.sampled_ids)`` for headers stored without their tokens.
    Positive logprobs are not a problem here: they are a fatal finding for the whole session
    (see ``findings.validate``), because they mean the engine is misconfigured.
    """
    n = len(node.sampled_ids) if n_sampled is None else n_sampled
    if n == 0:
        return "no sampled tokens"
    if node.logprobs is None:
        return "no logprobs recorded"
    if not node.logprobs_aligned:
        return "the proxy found ids and logprobs misaligned"
    if len(node.logprobs) != n:
        return f"{len(node.logprobs)} logprobs for {n} sampled tokens"
    if not all(math.isfinite(lp) for lp in node.logprobs):
        return "a logprob is NaN or infinite"
    return None


def has_positive_logprob(node: CallNode) -> bool:
    return node.logprobs is not None and any(lp > POSITIVE_LOGPROB_TOLERANCE for lp in node.logprobs)
