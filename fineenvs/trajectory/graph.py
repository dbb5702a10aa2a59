"""The trajectory graph of one session: calls linked by exact token prefixes.

Rules (all on token ids, never on re-rendered text):

- **Parent.** The parent of a call n is the call m whose end (prompt + sampled tokens) is the
  longest exact prefix of n's prompt. Ties between calls with identical ends go to the earliest
  ``arrival_index`` (then node id). A call that sampled nothing cannot be the parent of a call with
  exactly its prompt (that is a retry, not a continuation). Calls without such a parent are roots:
  the first call, subagents (their own system prompt), conversations after compaction.
- **Arrival order does not matter.** ``add`` may be called in any order. When a call arrives whose
  end is a longer prefix of an earlier call's prompt than that call's current parent (for instance
  an earlier root, "adoption"), the earlier call is re-parented. The resulting graph depends only
  on the set of calls (``arrival_index`` is a field of the call, not the order of ``add``).
- **Discarded (retries).** A childless call is discarded when a later-arriving sibling (same
  parent; for roots, a root with an identical prompt) with the same tools flag either continued
  (has children) or re-sent the identical prompt. Groups where nobody continued and no prompt was
  re-sent are kept (ambiguous). A childless sibling without tools next to a continuing sibling with
  tools is a side call (title generator, summariser), not a retry. A sibling whose prompt extends
  the call's whole prompt (a drift break, below) consumed its output, re-rendered: the call was not
  abandoned, so it is not a retry and keeps its row.
- **Roles.** A root-to-leaf path is ``discarded`` when its leaf is discarded, ``agent`` when any
  call on it had tools, else ``auxiliary``; when no call in the session had tools (harnesses that
  parse tool calls from text) every live path is ``agent``.
- **Drift rule.** A *drift break* is recorded for a call n when a sibling x (same parent, or both
  roots) has a prompt that is a proper prefix of n's prompt, yet x's end is not: n's prompt
  contains everything x saw and then departs from what x sampled. That is the signature of a
  harness or template re-rendering the model's own output (thinking stripped, tool arguments
  re-serialised) instead of appending it. The policy is lossless (the OpenEnv / TRL#6947 rule,
  ``fork_threshold_tokens = 0``): the graph forks exactly at the first differing token and the
  sampled tokens of x are never overwritten by the re-rendered text; x's row ends at x and n's row
  continues from the common parent. Each break reports the token position in n's prompt, the
  offset into x's sampled tokens and how many of x's sampled tokens did not carry over. One break
  is reported per call n, against the sibling it nearly extended most (longest prompt, then
  longest match, then earliest), so a harness that re-renders every turn has one break per turn.
  Cost: recording the candidates scans the prompt marks on n's path since its parent's end, which
  for such a harness (every call a root) is every earlier call, quadratic in its turns.

Cost: ``add`` is linear in the call's new tokens plus one C-speed comparison of its prompt
against the stored prefix; see ``_trie`` for why. Calls are stored as deltas against their parent
(context + sampled tokens), so the graph holds about as many token ids as the session has unique
prefixes, not the sum of its prompt lengths.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from fineenvs.trajectory._trie import Edge, TokenTrie, common_prefix
from fineenvs.trajectory.node import CallNode


@dataclass(frozen=True)
class DriftBreak:
    """Call ``node_id`` nearly extended sibling ``nearly_extends`` but departed at ``position``."""

    node_id: str
    nearly_extends: str
    position: int  # index in node_id's prompt of the first token that differs from the sibling's end
    sampled_offset: int  # that position as an offset into the sibling's sampled tokens
    lost_tokens: int  # sibling's sampled tokens that did not carry over into node_id's prompt


@dataclass(frozen=True)
class GraphStats:
    n_nodes: int
    n_roots: int
    n_leaves: int
    n_forks: int  # extra children beyond the first, summed over all calls (and root groups)
    n_discarded: int
    n_late_parents: int  # calls whose parent arrived after them (out-of-order arrival, adopted)
    n_drift_breaks: int
    prompt_tokens: int  # sum of all prompt lengths
    sampled_tokens: int
    unique_tokens: int  # distinct token prefixes stored by the index
    held_tokens: int  # token ids the graph keeps (index + delta copies)


def _as_list(ids: Sequence[int]) -> list[int]:
    """Tolerate other int sequences (array('i'), tuples) without copying lists twice."""
    return ids if type(ids) is list else list(ids)


class _Entry:
    __slots__ = (
        "header",
        "prompt_len",
        "end_len",
        "parent",
        "children",
        "owner",
        "start",
        "private",
        "prompt_group",
    )

    def __init__(self, header: CallNode, prompt_len: int, end_len: int) -> None:
        self.header = header  # the call without its token lists
        self.prompt_len = prompt_len
        self.end_len = end_len
        self.parent: int | None = None
        self.children: set[int] = set()
        # The delta (context + sampled tokens after the parent's end) is owner[start:start+n].
        self.owner: list[int] = []
        self.start = 0
        self.private = False  # owner is this call's own copy (not a shared strand of the index)
        self.prompt_group: list[int] = []  # every call with exactly this prompt (shared list)

    @property
    def sampled_len(self) -> int:
        return self.end_len - self.prompt_len


class TrajectoryGraph:
    """Calls of one session, linked by exact token prefixes; built incrementally with ``add``."""

    def __init__(self, nodes: Iterable[CallNode] = ()) -> None:
        self._trie = TokenTrie()
        self._entries: list[_Entry] = []
        self._index: dict[str, int] = {}
        self._drift_pairs: set[tuple[int, int]] = set()  # (x, n): n's prompt extends x's prompt
        # Derived labels, dropped by add().
        self._discarded_cache: frozenset[str] | None = None
        self._drift_cache: list[tuple[int, int, int]] | None = None
        self._copied_tokens = 0
        self._prompt_tokens = 0
        for node in nodes:
            self.add(node)

    # ------------------------------------------------------------------ building

    def add(self, node: CallNode) -> None:
        """Insert one call. Cost: its new tokens, plus one C-speed scan of its prompt."""
        if node.node_id in self._index:
            raise ValueError(
                f"call {node.node_id!r} was added twice to the same trajectory graph; node ids must be "
                "unique within a session (the proxy derives them per call)"
            )
        self._discarded_cache = None
        self._drift_cache = None
        plen, slen = len(node.prompt_ids), len(node.sampled_ids)
        header = replace(node, prompt_ids=[], sampled_ids=[])
        entry = _Entry(header, plen, plen + slen)
        idx = len(self._entries)
        self._entries.append(entry)
        self._index[node.node_id] = idx
        self._prompt_tokens += plen
        if plen == 0:
            # No prompt ids: nothing to link on. It stays an isolated root and validation
            # reports it as fatal.
            entry.owner = list(node.sampled_ids)
            entry.private = True
            entry.prompt_group = [idx]
            self._copied_tokens += slen
            return
        seq = _as_list(node.prompt_ids) + _as_list(node.sampled_ids)
        path, matched, fresh = self._trie.insert(seq)
        trie = self._trie
        entry.prompt_group = trie.mark_prompt(trie.edge_at(path, plen), plen, idx)
        end_edge = trie.edge_at(path, entry.end_len)
        trie.mark_end(end_edge, entry.end_len, idx)

        parent = self._best_parent(path, idx)
        base = self._entries[parent].end_len if parent is not None else 0
        if fresh is not None and base == matched:
            entry.owner, entry.start = fresh[0], fresh[1]
        else:
            # Private delta. When most of the sequence is new to this call (its parent has not
            # arrived yet), keep the concatenation itself rather than copying it again; adoption
            # trims it to the real delta later.
            if base < len(seq) // 2:
                entry.owner, entry.start = seq, base
            else:
                entry.owner, entry.start = seq[base:], 0
            entry.private = True
            self._copied_tokens += len(entry.owner)
        self._set_parent(idx, parent)

        # Earlier calls whose prompt extends this end further than their current parent's end.
        for depth, group in trie.prompts_below(end_edge, entry.end_len):
            for c in group:
                if c != idx and (depth > entry.end_len or slen > 0) and self._better(idx, c):
                    old = self._entries[c].parent
                    shift = entry.end_len - (self._entries[old].end_len if old is not None else 0)
                    self._shrink_delta(c, shift)
                    self._set_parent(c, idx)

        # Drift candidates, confirmed (or not) from the final parents in drift_breaks().
        for _depth, group in trie.prompts_on_path(path, base, plen):
            for x in group:
                if x != idx:
                    self._drift_pairs.add((x, idx))
        for depth, group in trie.prompts_below(trie.edge_at(path, plen), plen):
            if depth > plen:
                for n in group:
                    self._drift_pairs.add((idx, n))

    def _shrink_delta(self, idx: int, shift: int) -> None:
        """Drop the first ``shift`` tokens of a delta (its new parent already holds them)."""
        e = self._entries[idx]
        e.start += shift
        if e.private:
            # A call that arrived before its parent copied the whole unknown prefix; keep only
            # its new delta so memory stays with the unique tokens.
            base = self._entries[e.parent].end_len if e.parent is not None else 0
            keep = e.owner[e.start : e.start + e.end_len - base - shift]
            self._copied_tokens += len(keep) - len(e.owner)
            e.owner, e.start = keep, 0

    def _best_parent(self, path: list[Edge], idx: int) -> int | None:
        plen = self._entries[idx].prompt_len
        for depth, group in self._trie.ends_on_path(path, plen):
            best: int | None = None
            for m in group:
                if m == idx or (depth == plen and self._entries[m].sampled_len == 0):
                    continue
                if best is None or self._key(m) < self._key(best):
                    best = m
            if best is not None:
                return best
        return None

    def _better(self, cand: int, child: int) -> bool:
        """Is ``cand`` a closer parent for ``child`` than its current one?"""
        cur = self._entries[child].parent
        if cur is None:
            return True
        a, b = self._entries[cand].end_len, self._entries[cur].end_len
        return a > b or (a == b and self._key(cand) < self._key(cur))

    def _set_parent(self, idx: int, parent: int | None) -> None:
        old = self._entries[idx].parent
        if old is not None:
            self._entries[old].children.discard(idx)
        self._entries[idx].parent = parent
        if parent is not None:
            self._entries[parent].children.add(idx)

    def _key(self, idx: int) -> tuple[int, str]:
        return self._entries[idx].header.order_key()

    # ------------------------------------------------------------------ structure

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._index

    def node_ids(self) -> list[str]:
        """All calls in arrival order."""
        return [self._entries[i].header.node_id for i in self._ordered(range(len(self._entries)))]

    def _ordered(self, idxs: Iterable[int]) -> list[int]:
        return sorted(idxs, key=self._key)

    def _id(self, idx: int) -> str:
        return self._entries[idx].header.node_id

    def _idx(self, node_id: str) -> int:
        try:
            return self._index[node_id]
        except KeyError:
            raise KeyError(f"no call {node_id!r} in this trajectory graph") from None

    def parent(self, node_id: str) -> str | None:
        p = self._entries[self._idx(node_id)].parent
        return None if p is None else self._id(p)

    def children(self, node_id: str) -> list[str]:
        return [self._id(c) for c in self._ordered(self._entries[self._idx(node_id)].children)]

    def roots(self) -> list[str]:
        return [
            self._id(i) for i in self._ordered(i for i, e in enumerate(self._entries) if e.parent is None)
        ]

    def leaves(self) -> list[str]:
        """Childless calls in depth-first order (roots by arrival, children by arrival)."""
        return [self._id(i) for i in self._dfs_leaves()]

    def _dfs_leaves(self) -> list[int]:
        out: list[int] = []
        stack = list(reversed(self._ordered(i for i, e in enumerate(self._entries) if e.parent is None)))
        while stack:
            i = stack.pop()
            kids = self._entries[i].children
            if not kids:
                out.append(i)
            else:
                stack.extend(reversed(self._ordered(kids)))
        return out

    def path_to(self, node_id: str) -> list[str]:
        """Calls from the root down to ``node_id``."""
        out: list[str] = []
        i: int | None = self._idx(node_id)
        while i is not None:
            out.append(self._id(i))
            i = self._entries[i].parent
        return out[::-1]

    def header(self, node_id: str) -> CallNode:
        """The call's fields without its token lists (cheap)."""
        return self._entries[self._idx(node_id)].header

    def prompt_len(self, node_id: str) -> int:
        return self._entries[self._idx(node_id)].prompt_len

    def end_len(self, node_id: str) -> int:
        return self._entries[self._idx(node_id)].end_len

    def _delta(self, idx: int) -> list[int]:
        e = self._entries[idx]
        base = self._entries[e.parent].end_len if e.parent is not None else 0
        return e.owner[e.start : e.start + e.end_len - base]

    def end_ids(self, node_id: str) -> list[int]:
        """Prompt + sampled tokens, rebuilt from the deltas along the path."""
        out: list[int] = []
        for nid in self.path_to(node_id):
            out.extend(self._delta(self._index[nid]))
        return out

    def prompt_ids(self, node_id: str) -> list[int]:
        return self.end_ids(node_id)[: self.prompt_len(node_id)]

    def sampled_ids(self, node_id: str) -> list[int]:
        e = self._entries[self._idx(node_id)]
        base = self._entries[e.parent].end_len if e.parent is not None else 0
        return self._delta(self._idx(node_id))[e.prompt_len - base :]

    def context_ids(self, node_id: str) -> list[int]:
        """Tokens between the parent's end and this prompt's end (tool results, template glue)."""
        e = self._entries[self._idx(node_id)]
        base = self._entries[e.parent].end_len if e.parent is not None else 0
        return self._delta(self._idx(node_id))[: e.prompt_len - base]

    def call(self, node_id: str) -> CallNode:
        """The full call again, token lists included."""
        end = self.end_ids(node_id)
        plen = self.prompt_len(node_id)
        return replace(self.header(node_id), prompt_ids=end[:plen], sampled_ids=end[plen:])

    # ------------------------------------------------------------------ labels

    def discarded(self) -> set[str]:
        """Retries: see the module docstring for the exact rule."""
        if self._discarded_cache is None:
            self._discarded_cache = frozenset(self._compute_discarded())
        return set(self._discarded_cache)

    def _compute_discarded(self) -> set[str]:
        out: set[str] = set()
        consumed = {(x, n) for x, n, _ in self._drifts()}
        groups: list[list[int]] = [sorted(e.children) for e in self._entries if len(e.children) > 1]
        root_groups: dict[int, list[int]] = {}
        for i, e in enumerate(self._entries):
            if e.parent is None:
                root_groups.setdefault(id(e.prompt_group), []).append(i)
        for members in groups:
            self._discard_in(members, out, consumed, same_prompt_only=False)
        for members in root_groups.values():
            if len(members) > 1:
                self._discard_in(members, out, consumed, same_prompt_only=True)
        return out

    def _discard_in(
        self, members: list[int], out: set[str], consumed: set[tuple[int, int]], *, same_prompt_only: bool
    ) -> None:
        for n in members:
            en = self._entries[n]
            if en.children:
                continue
            for s in members:
                es = self._entries[s]
                if s == n or self._key(s) < self._key(n) or es.header.has_tools != en.header.has_tools:
                    continue
                if (n, s) in consumed:
                    continue
                same_prompt = es.prompt_group is en.prompt_group
                if same_prompt or (es.children and not same_prompt_only):
                    out.add(en.header.node_id)
                    break

    def any_tools(self) -> bool:
        return any(e.header.has_tools for e in self._entries)

    def late_parents(self) -> list[str]:
        """Calls whose parent arrived after them (they were roots until the parent came: adopted)."""
        return [
            self._id(i)
            for i in self._ordered(range(len(self._entries)))
            if (p := self._entries[i].parent) is not None and self._key(p) > self._key(i)
        ]

    def _drifts(self) -> list[tuple[int, int, int]]:
        """Every confirmed ``(x, n, offset)``: n's prompt extends x's prompt, departs from x's sampled."""
        if self._drift_cache is not None:
            return self._drift_cache
        out: list[tuple[int, int, int]] = []
        for x, n in self._drift_pairs:
            ex, en = self._entries[x], self._entries[n]
            if ex.parent != en.parent or ex.prompt_len >= en.prompt_len or ex.sampled_len == 0:
                continue
            base = self._entries[ex.parent].end_len if ex.parent is not None else 0
            dx, dn = self._delta(x), self._delta(n)
            # Both deltas start at the common parent's end; compare n's prompt after x's prompt
            # with x's sampled tokens.
            a0 = ex.prompt_len - base
            k = min(ex.sampled_len, en.prompt_len - ex.prompt_len)
            if dx[a0 : a0 + k] == dn[a0 : a0 + k]:
                if k == ex.sampled_len:
                    continue  # x's end is a prefix of n's prompt after all: not a break
                offset = k
            else:
                offset = common_prefix(dx, a0, dn, a0, k)
            out.append((x, n, offset))
        self._drift_cache = out
        return out

    def drift_breaks(self) -> list[DriftBreak]:
        """Re-rendered history, one break per call: see "Drift rule" in the module docstring.

        When several siblings qualify (a harness that re-renders every turn), the break names the
        one n nearly extended most: the longest prompt, then the longest match, then the earliest.
        """
        best: dict[int, tuple[int, int]] = {}
        for x, n, offset in self._drifts():
            cur = best.get(n)
            if cur is None or self._nearer(x, offset, *cur):
                best[n] = (x, offset)
        out: list[DriftBreak] = []
        for n in self._ordered(best):
            x, offset = best[n]
            ex = self._entries[x]
            out.append(
                DriftBreak(
                    node_id=self._id(n),
                    nearly_extends=self._id(x),
                    position=ex.prompt_len + offset,
                    sampled_offset=offset,
                    lost_tokens=ex.sampled_len - offset,
                )
            )
        return out

    def _nearer(self, x: int, offset: int, y: int, y_offset: int) -> bool:
        a = (self._entries[x].prompt_len, offset)
        b = (self._entries[y].prompt_len, y_offset)
        return a > b or (a == b and self._key(x) < self._key(y))

    def stats(self) -> GraphStats:
        roots = [i for i, e in enumerate(self._entries) if e.parent is None]
        forks = sum(len(e.children) - 1 for e in self._entries if len(e.children) > 1)
        return GraphStats(
            n_nodes=len(self._entries),
            n_roots=len(roots),
            n_leaves=sum(1 for e in self._entries if not e.children),
            n_forks=forks,
            n_discarded=len(self.discarded()),
            n_late_parents=len(self.late_parents()),
            n_drift_breaks=len(self.drift_breaks()),
            prompt_tokens=self._prompt_tokens,
            sampled_tokens=sum(e.sampled_len for e in self._entries),
            unique_tokens=self._trie.strand_tokens,
            held_tokens=self._trie.strand_tokens + self._copied_tokens,
        )

    # ------------------------------------------------------------------ rows support

    def walk_paths(self) -> Iterable[tuple[list[int], list[int]]]:
        """Yield ``(end_ids, path)`` for every leaf, depth first, path as internal indices.

        One shared buffer is extended on the way down and trimmed on the way up, so producing every
        row costs the rows' own length, not a rebuild per leaf.
        """
        buf: list[int] = []
        path: list[int] = []
        roots = self._ordered(i for i, e in enumerate(self._entries) if e.parent is None)
        stack: list[tuple[int, bool]] = [(r, False) for r in reversed(roots)]
        while stack:
            i, leaving = stack.pop()
            if leaving:
                e = self._entries[i]
                base = self._entries[e.parent].end_len if e.parent is not None else 0
                del buf[base:]
                path.pop()
                continue
            buf.extend(self._delta(i))
            path.append(i)
            stack.append((i, True))
            kids = self._entries[i].children
            if not kids:
                yield list(buf), list(path)
            else:
                stack.extend((c, False) for c in reversed(self._ordered(kids)))

    def entry_span(self, idx: int) -> tuple[int, int]:
        e = self._entries[idx]
        return e.prompt_len, e.end_len

    def entry_header(self, idx: int) -> CallNode:
        return self._entries[idx].header
