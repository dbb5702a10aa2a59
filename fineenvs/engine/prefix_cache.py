"""Automatic prefix caching for the embedded engine: the model's state after a token prefix, reused.

Agents resend the whole conversation at every call, and the attempts of a group open with the
same prompt; vLLM skips the shared part with automatic prefix caching, and this cache does the same
for the embedded engine. An entry is transformers' own cache object (``DynamicCache``, batch 1)
after a token sequence, whatever its layers hold: attention keys and values, LFM2's
short-convolution state, Qwen3.5's linear-attention convolution and recurrent states.

Two entries per request: the state after the prompt (with the logits of its last position, so an
identical prompt needs no forward at all: the attempts of a group), and the state when the request
finished, after the prompt and every sampled token but the last (never fed). The next call of the
same agent starts with both whenever its chat template renders the reply back as sampled.

Which prefix is reused. An attention-only state can be cut back to any length, so the longest
common prefix with any entry is used. A state with convolution or recurrent layers is the state at
its end position only (it cannot be rolled back), so such an entry is used only when its whole
sequence is a prefix of the prompt; vLLM's hybrid models likewise reuse a state only at the
positions where one was saved. At least one prompt token is always fed, unless the entry holds the
logits of exactly this prompt.

Entries belong to one weight version (a weight push clears the cache: a state computed by other
weights would give other logprobs), and the cache holds at most ``max_bytes`` of tensors,
evicting the least recently used entry first.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionCacheLayerMixin


@dataclass
class _Entry:
    tokens: torch.Tensor  # int64, 1-D: the sequence the state covers
    state: Cache  # of batch 1
    logits: torch.Tensor | None  # next-token logits after ``tokens`` (float32), if kept
    version: int
    nbytes: int
    croppable: bool


@dataclass(frozen=True)
class Hit:
    """A reusable state: ``state`` (a private copy) covers the prompt's first ``length`` tokens;
    ``logits`` are the next-token logits when it covers the whole prompt."""

    state: Cache
    length: int
    logits: torch.Tensor | None


def _layer_tensors(layer: object) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    if isinstance(layer, DynamicLayer) and getattr(layer, "is_initialized", False):
        out += [t for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        out += [t for t in layer.conv_states.values() if isinstance(t, torch.Tensor)]
        out += [t for t in layer.recurrent_states.values() if isinstance(t, torch.Tensor)]
    return out


def state_nbytes(state: Cache) -> int:
    return sum(int(t.numel()) * t.element_size() for layer in state.layers for t in _layer_tensors(layer))


def is_croppable(state: Cache) -> bool:
    """Whether every layer is plain full attention, whose state can be cut back to any prefix."""
    return all(type(layer) is DynamicLayer for layer in state.layers)


def select_row(state: Cache, row: int, drop_left: int) -> Cache:
    """Row ``row`` of a batched state as a batch-1 copy, without its first ``drop_left`` (padding)
    positions in the attention layers."""
    out = copy.copy(state)
    out.layers = []
    for layer in state.layers:
        new = copy.copy(layer)
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if (
            isinstance(new, DynamicLayer)
            and isinstance(keys, torch.Tensor)
            and isinstance(values, torch.Tensor)
        ):
            new.keys = keys[row : row + 1, :, drop_left:, :].clone()
            new.values = values[row : row + 1, :, drop_left:, :].clone()
        if isinstance(new, LinearAttentionCacheLayerMixin):  # a shallow copy: its dicts are the layer's
            new.conv_states = {
                k: v[row : row + 1].clone() if isinstance(v, torch.Tensor) else v
                for k, v in new.conv_states.items()
            }
            new.recurrent_states = {
                k: v[row : row + 1].clone() if isinstance(v, torch.Tensor) else v
                for k, v in new.recurrent_states.items()
            }
            for name in (
                "is_conv_states_initialized",
                "is_recurrent_states_initialized",
                "has_previous_state",
            ):
                setattr(new, name, dict(getattr(layer, name)))
        out.layers.append(new)
    return out


def stack_rows(states: list[Cache], lengths: list[int]) -> Cache:
    """Batch-1 states of ``lengths`` tokens each -> one batched state, attention left-padded with
    zeros to the longest (the caller masks the padding). Reuses ``states[0]``'s objects."""
    width = max(lengths)
    out = states[0]
    for i, layer in enumerate(out.layers):
        rows = [s.layers[i] for s in states]
        if isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None:
            for name in ("keys", "values"):
                parts = []
                for r, n in zip(rows, lengths, strict=True):
                    t = getattr(r, name)
                    parts.append(torch.nn.functional.pad(t, (0, 0, width - n, 0)) if n < width else t)
                setattr(layer, name, torch.cat(parts, dim=0))
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for name in ("conv_states", "recurrent_states"):
                merged = getattr(layer, name)
                for k, v in list(merged.items()):
                    if isinstance(v, torch.Tensor):
                        merged[k] = torch.cat([getattr(r, name)[k] for r in rows], dim=0)
    return out


class PrefixCache:
    """An LRU of model states after token prefixes, for the current weight version."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the prefix cache's memory bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()
        self.bytes = 0
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of them, served from a cached state (vLLM's prefix_cache_hits)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def lookup(self, prompt: list[int], version: int) -> Hit | None:
        """The longest usable cached prefix of ``prompt`` under weight ``version``, or None."""
        if not self.enabled or not prompt:
            return None
        ids = torch.tensor(prompt, dtype=torch.long)
        best: tuple[int, int, bool] | None = None  # (length, key, with logits)
        with self._lock:
            self.queries += len(prompt)
            for key, e in self._entries.items():
                if e.version != version:
                    continue
                n = min(len(e.tokens), len(ids))
                differ = (e.tokens[:n] != ids[:n]).nonzero()
                common = int(differ[0]) if len(differ) else n
                whole = common == len(e.tokens)
                if whole and common == len(ids) and e.logits is not None:
                    length, full = common, True
                elif e.croppable:
                    length, full = min(common, len(ids) - 1), False
                elif whole and common < len(ids):
                    length, full = common, False
                else:
                    continue
                if length > 0 and (best is None or (length, full) > (best[0], best[2])):
                    best = (length, key, full)
            if best is None:
                return None
            length, key, full = best
            entry = self._entries[key]
            self._entries.move_to_end(key)
            state = copy.deepcopy(entry.state)
            self.hits += length
        if length < len(entry.tokens):
            state.crop(length - len(entry.tokens))
        return Hit(state, length, entry.logits if full else None)

    def insert(
        self,
        tokens: list[int],
        state: Cache,
        version: int,
        logits: torch.Tensor | None = None,
        *,
        copy_state: bool,
    ) -> None:
        """Keep ``state`` (batch 1, covering ``tokens``) for later prompts that start with them.
        ``copy_state=False`` hands the object over: the caller must not use it again."""
        if not self.enabled or not tokens:
            return
        nbytes = state_nbytes(state) + (logits.numel() * 4 if logits is not None else 0)
        if nbytes > self.max_bytes:
            return
        kept = copy.deepcopy(state) if copy_state else state
        entry = _Entry(
            torch.tensor(tokens, dtype=torch.long),
            kept,
            None if logits is None else logits.detach().float().clone(),
            version,
            nbytes,
            is_croppable(kept),
        )
        with self._lock:
            for key, e in list(self._entries.items()):
                if e.version != version:
                    continue
                if len(e.tokens) == len(entry.tokens) and bool(torch.equal(e.tokens, entry.tokens)):
                    if e.logits is not None and logits is None:  # the kept one is as good or better
                        self._entries.move_to_end(key)
                        return
                    self._drop(key)
                elif (
                    entry.croppable
                    and e.logits is None
                    and len(e.tokens) < len(entry.tokens)
                    and bool(torch.equal(e.tokens, entry.tokens[: len(e.tokens)]))
                ):
                    self._drop(key)  # the new state cut back is this one
            while self._entries and self.bytes + nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[self._next] = entry
            self._next += 1
            self.bytes += nbytes

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes
