"""Prefix-shared forward and backward: each node of a step's prefix tree runs through the model once.

The padded path (``batching``) forwards every row from its first token, so a prefix held by ``k``
rows is computed ``k`` times. Here the rows become a prefix tree (``prefix_tree``) and the tree is
walked depth first. A node runs its tokens from its parent's end state, through the model's own
cache objects, and hands its end state to its children:

- full attention: the keys and values of every position so far;
- LFM2's short convolutions: the last ``L_cache`` inputs of each conv layer;
- Qwen3.5's gated delta net: its convolution inputs and the recurrent state.

Gradients. The state a node hands down is *detached*: its children see leaf tensors that collect
the gradient every branch sends back (``.grad`` accumulates over siblings). When the last child is
done, the node runs one backward from its outputs with those gradients, plus the loss of the rows
that end at it, and its own parent's leaves collect in turn. The gradient reaching the parameters
is therefore the padded path's, summed in another order; and only the path from the root to the
current node holds activations, never the whole tree (less than one padded micro-batch).

The log-probabilities of a node's tokens are computed where they are needed (tokens some row below
trains) by TRL's chunked log-prob head, from the hidden state before each token (for the first
token, the parent's last one). A row's log-probabilities are the pieces along its path, each a leaf
that accumulates the gradient of every row through it; the caller's loss sees one full-length
tensor per row, exactly the padded layout.

The cache layers are functional: ``update`` returns ``base + new`` and keeps the result aside,
never writing into the base (transformers' own layers ``copy_`` the convolution and recurrent
states in place, which autograd refuses for a tensor another branch has saved, and which would
corrupt the siblings' state). A replayed forward therefore computes the same thing again, which
is what gradient checkpointing does: under it the decoder layers are told they may keep the cache.

Supported layer types: ``full_attention``, ``conv`` (LFM2) and ``linear_attention`` (Qwen3.5);
anything else (sliding windows, Mamba) raises, naming ``prefix_sharing=padded``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from fineenvs.train.prefix_tree import Node, PrefixTree

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

ATTENTION_TYPES = ("full_attention",)
STATE_TYPES = ("conv", "linear_attention")

_UNSET = object()

Score = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""(hidden (N, H), next tokens (N,)) -> (logprobs (N,), entropies (N,) or None)."""


class _AttentionBranch(DynamicLayer):
    """Full-attention keys and values: the prefix's (read only) followed by this segment's."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        super().__init__()
        if keys is not None and values is not None:
            self.keys, self.values = keys, values
            self.is_initialized = True
            self.device, self.dtype = keys.device, keys.dtype
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_initialized and self.keys is not None and self.values is not None:
            k = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=-2)
            v = torch.cat([self.values, value_states.to(self.values.dtype)], dim=-2)
        else:
            k, v = key_states, value_states
        self.out = (k, v)
        return k, v


class _StateBranch(LinearAttentionLayer):
    """Convolution inputs and recurrent state (LFM2 conv, Qwen3.5 linear attention), read only.

    ``record_past`` makes the models take their general path even for a one-token segment: their
    single-token decode kernel updates the convolution state in place."""

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None) -> None:
        super().__init__()
        self.record_past = True
        if conv is not None:
            self.conv_states[0] = conv
            self.conv_kernel_size[0] = int(conv.shape[-1])
            self.is_conv_states_initialized[0] = True
            self.has_previous_state[0] = True
            self.device: Any = conv.device  # declared None by transformers' layer
            self.dtype: Any = conv.dtype
        if recurrent is not None:
            self.recurrent_states[0] = recurrent
            self.is_recurrent_states_initialized[0] = True
        self.out_conv: torch.Tensor | None = None
        self.out_recurrent: torch.Tensor | None = None

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if state_idx != 0:
            raise NotImplementedError("one convolution state per layer is supported")
        k = conv_kernel_size if conv_kernel_size is not None else self.conv_kernel_size[0]
        if k is None:
            raise ValueError("the model did not say its convolution kernel size")
        prev = self.conv_states[0] if self.has_previous_state[0] else None
        full = conv_states if prev is None else torch.cat([prev, conv_states.to(prev.dtype)], dim=-1)
        tail = full[..., -k:]
        if tail.shape[-1] < k:  # a prefix shorter than the kernel: zeros before it, as in a full pass
            tail = F.pad(tail, (k - tail.shape[-1], 0))
        self.out_conv = tail
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: object
    ) -> torch.Tensor:
        if state_idx != 0:
            raise NotImplementedError("one recurrent state per layer is supported")
        self.out_recurrent = recurrent_states
        return recurrent_states


class BranchCache(Cache):
    """A transformers ``Cache`` holding a prefix's state, for one segment's forward."""

    def __init__(self, kinds: Sequence[str], state: Sequence[tuple[torch.Tensor | None, ...]] | None) -> None:
        layers: list[Any] = []
        for i, kind in enumerate(kinds):
            a, b = (None, None) if state is None else state[i]
            layers.append(_AttentionBranch(a, b) if kind == "attention" else _StateBranch(a, b))
        super().__init__(layers=layers)

    def end_state(self) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Per layer: (keys, values) or (convolution inputs, recurrent state), after the segment."""
        out: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        for layer in self.layers:
            if isinstance(layer, _AttentionBranch):
                if layer.out is None:
                    raise RuntimeError("an attention layer was not run: the model skipped the cache")
                out.append(layer.out)
            else:
                assert isinstance(layer, _StateBranch)
                if layer.out_conv is None:
                    raise RuntimeError("a convolution / linear-attention layer was not run with the cache")
                out.append((layer.out_conv, layer.out_recurrent))
        return out


def layer_kinds(config: PretrainedConfig) -> list[str]:
    """``attention`` or ``state`` per decoder layer; raises for layer types the branch cache lacks."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = int(text.num_hidden_layers)
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * n)
    bad = sorted({t for t in types if t not in ATTENTION_TYPES + STATE_TYPES})
    if bad:
        raise ValueError(
            f"prefix_sharing='shared' carries full attention, short convolutions and linear attention "
            f"across a branch point, but {type(config).__name__} has layer types {bad}; train this model "
            "with trainer.prefix_sharing=padded"
        )
    return ["attention" if t in ATTENTION_TYPES else "state" for t in types]


def one_token_continuations(config: PretrainedConfig) -> bool:
    """Whether a state may be continued over a single token exactly as over many: not for the
    gated delta net, whose one-token kernel rounds differently (``prefix_tree``)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return "linear_attention" not in (getattr(text, "layer_types", None) or [])


@dataclass
class Handoff:
    """A node's end state as its children see it: leaves that collect the gradient they send back."""

    state: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    hidden: torch.Tensor  # (1, 1, H): the last position's hidden state; it predicts a child's first token
    lps: list[torch.Tensor]  # logprob pieces from the root to this node, one per node
    entropies: list[torch.Tensor]


@dataclass
class _Out:
    state: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    hidden: torch.Tensor
    lp: torch.Tensor  # (length,) logprob of each of the node's tokens; 0 where not scored
    entropy: torch.Tensor


@dataclass
class _Frame:
    node: Node
    parent: Handoff | None
    out: _Out | None = None
    handoff: Handoff | None = None
    next_child: int = 0


@dataclass
class TreeStats:
    forward_passes: int = 0
    tokens_forwarded: int = 0
    backward_passes: int = 0


def trained_positions(masks: Sequence[np.ndarray]) -> Callable[[Node], np.ndarray]:
    """Positions of a node (relative to its start) that some row through it trains."""

    def needed(node: Node) -> np.ndarray:
        acc = np.zeros(node.length, dtype=bool)
        for r in node.rows:
            acc |= masks[r][node.start : node.end]
        return np.flatnonzero(acc)

    return needed


def all_positions(node: Node) -> np.ndarray:
    return np.arange(node.length)


class SharedForward:
    """Walks a prefix tree through ``model`` (see the module docstring).

    ``on_rows(node, lps, entropies)`` is called once per node where rows end, with the logprob
    and entropy pieces along the path (concatenated: one value per position of those rows, 0.0
    at position 0 and wherever nothing was scored); in training it returns the loss of those rows
    (a scalar with its graph) or None. Without ``train`` nothing is detached or backpropagated:
    run it under ``torch.no_grad()`` to score rows.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        score: Score,
        pad_token_id: int,
        autocast: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.model = model
        self.backbone = model.base_model
        self.kinds = layer_kinds(model.config)
        self.one_token_inner = one_token_continuations(model.config)
        self.score = score
        self.pad_token_id = pad_token_id
        self.autocast = autocast
        params = inspect.signature(self.backbone.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def run(
        self,
        tree: PrefixTree,
        seqs: Sequence[Sequence[int]],
        *,
        needed: Callable[[Node], np.ndarray],
        on_rows: Callable[[Node, list[torch.Tensor], list[torch.Tensor]], torch.Tensor | None],
        train: bool,
    ) -> TreeStats:
        stats = TreeStats()
        device = next(self.model.parameters()).device
        with self._checkpoint_with_cache(train):
            stack = [_Frame(root, None) for root in reversed(tree.roots)]
            while stack:
                f = stack[-1]
                if f.out is None:
                    f.out = self._forward(f.node, f.parent, seqs, needed, device, stats)
                    if f.node.children:
                        f.handoff = self._handoff(f.out, f.parent, train)
                if f.next_child < len(f.node.children):
                    child = f.node.children[f.next_child]
                    f.next_child += 1
                    stack.append(_Frame(child, f.handoff))
                    continue
                self._finish(f, on_rows, train, stats)
                stack.pop()
        return stats

    # -- one node ----------------------------------------------------------------------------

    def _forward(
        self,
        node: Node,
        parent: Handoff | None,
        seqs: Sequence[Sequence[int]],
        needed: Callable[[Node], np.ndarray],
        device: torch.device,
        stats: TreeStats,
    ) -> _Out:
        tokens = list(seqs[node.row][node.start : node.end])
        n = len(tokens)
        feed = tokens
        if parent is not None and n == 1 and not self.one_token_inner:
            # The gated delta net takes its recurrent kernel for a one-token continuation and the
            # chunked one (the padded path's) otherwise; a pad token after it, which changes
            # nothing before it, keeps the chunked one. The tree has no such inner nodes.
            assert not node.children, "build the tree with one_token_inner=runner.one_token_inner"
            feed = tokens + [self.pad_token_id]
        ids = torch.tensor([feed], dtype=torch.long, device=device)
        positions = torch.arange(node.start, node.start + len(feed), device=device)[None]
        cache = BranchCache(self.kinds, None if parent is None else parent.state)
        with self.autocast():
            out = self.backbone(
                input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_kw: cache}
            )
            hidden = out.last_hidden_state[0, :n]  # (n, H)
            stats.forward_passes += 1
            stats.tokens_forwarded += len(feed)
            idx = needed(node)
            if parent is None:
                idx = idx[idx > 0]  # position 0 has nothing before it
                before = hidden[:-1]
                src = idx - 1
            else:
                before = torch.cat([parent.hidden[0].to(hidden.dtype), hidden[:-1]], dim=0)
                src = idx
            lp = torch.zeros(n, dtype=torch.float32, device=device)
            ent = torch.zeros(n, dtype=torch.float32, device=device)
            if len(idx):
                where = torch.as_tensor(idx, dtype=torch.long, device=device)
                targets = ids[0, where]
                vals, ents = self.score(
                    before[torch.as_tensor(src, dtype=torch.long, device=device)], targets
                )
                lp = lp.index_put((where,), vals.float())
                if ents is not None:
                    ent = ent.index_put((where,), ents.detach().float())
        return _Out(cache.end_state(), hidden[-1:][None], lp, ent)

    @staticmethod
    def _handoff(out: _Out, parent: Handoff | None, train: bool) -> Handoff:
        def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or not train:
                return t
            return t.detach().requires_grad_(t.requires_grad)

        hidden = leaf(out.hidden)
        lp = leaf(out.lp)
        assert hidden is not None and lp is not None
        return Handoff(
            state=[(leaf(a), leaf(b)) for a, b in out.state],
            hidden=hidden,
            lps=([] if parent is None else parent.lps) + [lp],
            entropies=([] if parent is None else parent.entropies) + [out.entropy],
        )

    def _finish(
        self,
        f: _Frame,
        on_rows: Callable[[Node, list[torch.Tensor], list[torch.Tensor]], torch.Tensor | None],
        train: bool,
        stats: TreeStats,
    ) -> None:
        assert f.out is not None
        loss = None
        if f.node.ends:
            lps = ([] if f.parent is None else f.parent.lps) + [f.out.lp]
            ents = ([] if f.parent is None else f.parent.entropies) + [f.out.entropy]
            with self.autocast():
                loss = on_rows(f.node, lps, ents)
        if not train:
            return
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if loss is not None and loss.requires_grad:
            tensors.append(loss)
            grads.append(torch.ones_like(loss))
        if f.handoff is not None:
            for out_t, leaf in _pairs(f.out, f.handoff):
                if leaf.grad is not None and out_t.requires_grad:
                    tensors.append(out_t)
                    grads.append(leaf.grad)
        if tensors:
            torch.autograd.backward(tensors, grads)
            stats.backward_passes += 1

    @contextlib.contextmanager
    def _checkpoint_with_cache(self, train: bool) -> Iterator[None]:
        """Under gradient checkpointing, transformers drops the cache of a checkpointed layer
        (a replay would update it twice); these layers are replay-safe, so keep it."""
        key = "_can_checkpoint_with_cache"
        changed: list[tuple[torch.nn.Module, object]] = []
        if train:
            for m in self.model.modules():
                if getattr(m, "gradient_checkpointing", False) and hasattr(m, key):
                    changed.append((m, m.__dict__.get(key, _UNSET)))
                    setattr(m, key, True)
        try:
            yield
        finally:
            for m, before in changed:
                if before is _UNSET:
                    delattr(m, key)  # back to the class attribute
                else:
                    setattr(m, key, before)


def _pairs(out: _Out, handoff: Handoff) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield out.lp, handoff.lps[-1]
    yield out.hidden, handoff.hidden
    for (a, b), (la, lb) in zip(out.state, handoff.state, strict=True):
        if a is not None and la is not None:
            yield a, la
        if b is not None and lb is not None:
            yield b, lb
