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
import warnings
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

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


def _ht(prev: bytes, text: bytes) -> bytes:
    # Text chains live only in memory (never in records), so they can use the hash that is fastest
    # on current CPUs (SHA extensions): twice blake2b's speed over a 300 KB prompt here.
    h = hashlib.sha256(prev)
    h.update(text)
    return h.digest()[:16]


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
class Prompt:
    """A prompt as the index needs it: int32 bytes, token count and block chain.

    Read from the engine's decimal text (``TokenIndex.read_text``), the first ``known`` tokens can
    be zeros in ``data``: their text matched an earlier prompt of the session block by block, so
    their chain values are known and no lookup or record ever reads those bytes (every match starts
    at or after block ``known // BLOCK``, whose chain value is registered). ``text_chain`` is the
    chain over the text blocks, registered once the call is recorded.
    """

    data: bytes
    n: int
    chain: list[bytes]
    text_chain: list[bytes] | None = None
    known: int = 0
    cuts: list[int] | None = None

    @classmethod
    def from_ids(cls, ids: Sequence[int] | np.ndarray | array) -> Prompt:
        data = token_bytes(ids)
        n = len(data) // 4
        return cls(data, n, block_chain(data, n))


def parse_ids(text: bytes, expected: int | None = None) -> np.ndarray | None:
    """Comma-separated non-negative int32 token ids as an int32 array, or None if not exactly that."""
    if not text.strip():
        return np.zeros(0, dtype=np.int32) if not expected else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ids64 = np.fromstring(text, dtype=np.int64, sep=",")
    except (ValueError, DeprecationWarning):
        return None
    if ids64.size != text.count(b",") + 1 or (expected is not None and ids64.size != expected):
        return None
    if ids64.size and (ids64.min() < 0 or ids64.max() >= 2**31):
        return None
    return ids64.astype(np.int32)


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
    # Chain value over the decimal text of the first k blocks -> chain value over their int32 bytes.
    text_blocks: dict[bytes, bytes] = field(default_factory=dict)
    # The last recorded prompt's text-block boundaries and chain: the next prompt usually extends
    # it, and then its blocks are checked where they were, without scanning for commas.
    last_cuts: list[int] = field(default_factory=list)
    last_text_chain: list[bytes] = field(default_factory=list)

    def read_text(self, text: bytes) -> Prompt | None:
        """A prompt from the engine's ``prompt_token_ids`` text (between the brackets).

        Parsing 50,000 decimal ids costs about a millisecond; an agent's next prompt repeats the
        previous one, so only the text past the longest block-aligned prefix already seen in this
        session is parsed (every text byte is parsed once, in the call that brought it). Returns
        None when the text is not plain integers (the caller falls back to a JSON parse).
        """
        if not text.strip():
            return Prompt.from_ids([])
        size = len(text)
        text_chain = [b""]
        cuts: list[int] = []
        start = 0
        # Block k's text runs from just after the comma ending token k*BLOCK-1 to the comma ending
        # token (k+1)*BLOCK-1 (or the end of the text). First where the last prompt had them:
        for k, end in enumerate(self.last_cuts):
            if end > size or (end < size and text[end] != 44):  # 44: ","
                break
            value = _ht(text_chain[-1], text[start:end])
            if value != self.last_text_chain[k + 1]:
                break
            text_chain.append(value)
            cuts.append(end)
            start = end + 1
        known_blocks = len(cuts)
        if start == size:
            return None  # a comma right after a known block, then nothing: not a list of ids
        # Then scan the rest for block boundaries.
        rest = np.frombuffer(text, dtype=np.uint8, offset=min(start, size)) if start < size else None
        n = known_blocks * BLOCK
        if rest is not None:
            commas = np.flatnonzero(rest == 44)
            n += int(commas.size) + 1
            new_cuts = (commas[BLOCK - 1 :: BLOCK] + start).tolist()[: n // BLOCK - known_blocks]
            if len(new_cuts) < n // BLOCK - known_blocks:
                new_cuts.append(size)  # n is a multiple of BLOCK: the last block ends the text
            for end in new_cuts:
                text_chain.append(_ht(text_chain[-1], text[start:end]))
                if known_blocks == len(cuts) and text_chain[-1] in self.text_blocks:
                    known_blocks += 1  # seen in an earlier prompt of another branch
                cuts.append(end)
                start = end + 1
        known = known_blocks * BLOCK
        tail_start = 0 if known_blocks == 0 else cuts[known_blocks - 1] + 1
        tail = parse_ids(text[tail_start:] if known < n else b"", expected=n - known)
        if tail is None:
            return None
        data = bytes(known * 4) + tail.tobytes()
        chain = [b""] + [self.text_blocks[text_chain[k]] for k in range(1, known_blocks + 1)]
        step = BLOCK * 4
        for k in range(known_blocks, n // BLOCK):
            chain.append(_h(chain[-1], data[k * step : (k + 1) * step]))
        return Prompt(data, n, chain, text_chain, known, cuts)

    def add_text(self, prompt: Prompt) -> None:
        if prompt.text_chain is not None and prompt.cuts is not None:
            for k in range(1, len(prompt.text_chain)):
                self.text_blocks.setdefault(prompt.text_chain[k], prompt.chain[k])
            self.last_cuts, self.last_text_chain = prompt.cuts, prompt.text_chain

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


def message_digests(messages: Sequence[object], chain: list[bytes] | None = None) -> list[bytes]:
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
