"""Delta encoding of a session's prompts against its earlier calls, in memory proportional to hashes.

A call's prompt usually starts with an earlier call's prompt + sampled tokens (the agent appended a
tool result), so storing it whole makes a 17-call attempt cost the square of its length. We store
``(parent call, offset, suffix)`` where ``prompt[:offset] == parent_end[:offset]`` and
``parent_end = parent.prompt + parent.sampled``.

Finding the parent without keeping token lists in RAM: every call's end sequence is hashed as a
chain over fixed blocks of ``BLOCK`` tokens (``chain[k]`` covers the first ``k*BLOCK`` tokens);
each new chain value is remembered with the first call that produced it. An exact end position
``L`` (a previous prompt end or call end) is remembered as the chain value before ``L`` plus the
tail. Lookup is one pass over the new prompt's blocks plus one tail hash per distinct end length
inside the last matching block, so the cost is linear in the prompt and never all-pairs. The same scheme over canonical messages
(one "block" per message) delta-encodes the recorded request messages.

What is not covered: a shared prefix that ends inside a block and is not an earlier call's end is
found only down to the previous block boundary (at most ``BLOCK - 1`` tokens stored twice).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

BLOCK = 512
_DIGEST = 12


def token_bytes(ids: Sequence[int] | np.ndarray | array) -> bytes:
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int32, copy=False).tobytes()
    return ids.tobytes() if isinstance(ids, array) else array("i", ids).tobytes()


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    for part in parts:
        h.update(part)
    return h.digest()


def block_chain(data: bytes, n_tokens: int) -> list[bytes]:
    """``chain[k]`` = hash of the first ``k * BLOCK`` tokens (``chain[0]`` = empty)."""
    step = BLOCK * 4
    chain = [b""]
    prev = b""
    for k in range(n_tokens // BLOCK):
        prev = _h(prev, data[k * step : (k + 1) * step])
        chain.append(prev)
    return chain


def end_hash(chain: list[bytes], data: bytes, length: int) -> bytes:
    k = length // BLOCK
    return _h(b"end", chain[k], data[k * BLOCK * 4 : length * 4])


@dataclass
class PrefixMatch:
    parent: str | None
    offset: int


@dataclass
class TokenIndex:
    """Per-session memory: block-chain hashes and end hashes, never the tokens themselves.

    Ends are filed under the chain value of the block they end in: an end at ``L`` can only beat
    the longest block match ``k`` if it lies in block ``k`` (all its full blocks would match too),
    so a lookup hashes one tail per distinct end length in that block, not one per earlier call.
    """

    blocks: dict[bytes, str] = field(default_factory=dict)
    ends: dict[bytes, dict[int, dict[bytes, str]]] = field(default_factory=dict)

    def match(self, data: bytes, n: int, chain: list[bytes]) -> PrefixMatch:
        best = PrefixMatch(None, 0)
        top = 0
        for k in range(len(chain) - 1, 0, -1):
            owner = self.blocks.get(chain[k])
            if owner is not None:
                best, top = PrefixMatch(owner, k * BLOCK), k
                break
        by_length = self.ends.get(chain[top])
        if by_length:
            for length in sorted(by_length, reverse=True):
                if best.offset < length <= n:
                    owner = by_length[length].get(end_hash(chain, data, length))
                    if owner is not None:
                        return PrefixMatch(owner, length)
        return best

    def _add_end(self, chain: list[bytes], data: bytes, length: int, call_id: str) -> None:
        by_length = self.ends.setdefault(chain[length // BLOCK], {})
        by_length.setdefault(length, {}).setdefault(end_hash(chain, data, length), call_id)

    def add(self, call_id: str, prompt: bytes, n_prompt: int, prompt_chain: list[bytes], full: bytes) -> None:
        n_full = len(full) // 4
        chain = prompt_chain
        if n_full // BLOCK > len(prompt_chain) - 1:
            # Extend the prompt's chain over the sampled tokens instead of rehashing from zero.
            step = BLOCK * 4
            chain = list(prompt_chain)
            prev = chain[-1]
            for k in range(len(chain) - 1, n_full // BLOCK):
                prev = _h(prev, full[k * step : (k + 1) * step])
                chain.append(prev)
        for digest in chain[1:]:
            self.blocks.setdefault(digest, call_id)
        self._add_end(prompt_chain, prompt, n_prompt, call_id)
        if n_full != n_prompt:
            self._add_end(chain, full, n_full, call_id)


def message_digests(messages: Sequence[Any], chain: list[bytes] | None = None) -> list[bytes]:
    """Chain hashes over canonical messages; ``out[i]`` covers ``messages[:i + 1]``.

    With ``chain`` (an earlier result), continues it over ``messages`` and returns the whole chain.
    """
    out: list[bytes] = list(chain or [])
    prev = out[-1] if out else b""
    for message in messages:
        # Key order is the dialect's, deterministic for the same input: no need to sort.
        prev = _h(prev, orjson.dumps(message))
        out.append(prev)
    return out


@dataclass
class MessageIndex:
    """Chain hash of each message-list prefix seen in the session -> first call that had it."""

    prefixes: dict[bytes, str] = field(default_factory=dict)

    def match(self, chain: list[bytes]) -> PrefixMatch:
        for i in range(len(chain) - 1, -1, -1):
            owner = self.prefixes.get(chain[i])
            if owner is not None:
                return PrefixMatch(owner, i + 1)
        return PrefixMatch(None, 0)

    def add(self, call_id: str, chain: list[bytes]) -> None:
        for digest in chain:
            self.prefixes.setdefault(digest, call_id)


@dataclass
class SessionIndex:
    tokens: TokenIndex = field(default_factory=TokenIndex)
    messages: MessageIndex = field(default_factory=MessageIndex)
    tools: set[str] = field(default_factory=set)
