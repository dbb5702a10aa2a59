"""A radix trie over token sequences that indexes where each call's prompt and end lie.

The trie is the graph's index, not its data: every call inserts its end (prompt + sampled tokens)
and leaves two marks on the path, one at the depth where its prompt ends and one where its end
ends. "The end of m is a prefix of the prompt of n" then reads "m's end mark lies on n's path, at
or above n's prompt mark", and the queries the graph needs become walks over a few edges.

Why it is linear in the unique tokens:

- Edges are views ``owner[start:stop]`` into append-only lists ("strands"); splitting an edge
  makes two views of the same list and copies nothing.
- When a call continues the most recent leaf of a strand (the common case: the next turn of a
  chain), its new tokens are appended to that strand and the leaf edge grows in place, so a chain
  of any length stays one edge and a walk costs one slice comparison per branch point, not one
  step per turn.
- Comparisons are whole-slice list equality (C speed); only a mismatch is located by bisection.

Marks are kept per edge in sorted depth lists, so "the deepest end mark above depth d on this
path" is a bisection on the last edges of the path.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator


class Vertex:
    __slots__ = ("depth", "children")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.children: dict[int, Edge] = {}


class Edge:
    """Tokens ``owner[start:stop]`` at depths ``top.depth + 1 .. child.depth``, plus the marks there."""

    __slots__ = ("owner", "start", "stop", "top", "child", "ends", "end_at", "prompts", "prompt_at")

    def __init__(self, owner: list[int], start: int, stop: int, top: Vertex, child: Vertex) -> None:
        self.owner = owner
        self.start = start
        self.stop = stop
        self.top = top
        self.child = child
        self.ends: list[int] = []
        self.end_at: dict[int, list[int]] = {}
        self.prompts: list[int] = []
        self.prompt_at: dict[int, list[int]] = {}

    def contains(self, depth: int) -> bool:
        return self.top.depth < depth <= self.child.depth


def common_prefix(a: list[int], i: int, b: list[int], j: int, k: int) -> int:
    """Length of the common prefix of ``a[i:i+k]`` and ``b[j:j+k]``, known to differ somewhere.

    Bisection over slice equality: O(k) element comparisons in C, O(log k) Python steps.
    """
    lo, hi = 0, k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[i + lo : i + mid] == b[j + lo : j + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TokenTrie:
    def __init__(self) -> None:
        self.root = Vertex(0)
        self.strand_tokens = 0  # token ids held by the trie: the number of distinct prefixes
        self.n_edges = 0
        # The previous insertion (its sequence and path): valid until the next insertion, because
        # only insertions change the trie's edges.
        self._last: tuple[list[int], list[Edge]] | None = None

    def walk(self, seq: list[int]) -> tuple[list[Edge], int]:
        """Edges along ``seq`` and how deep ``seq`` matches the trie (its longest stored prefix).

        Starts from the previous insertion when ``seq`` extends it (the next turn of a chain), so
        a call does not re-walk the branch points of its whole history.
        """
        last = self._last
        if (
            last is not None
            and len(seq) >= len(last[0])
            and seq[len(last[0]) - 1] == last[0][-1]  # cheap rejections before the full comparison
            and seq[0] == last[0][0]
            and seq[: len(last[0])] == last[0]
        ):
            return self._walk_from(seq, list(last[1]), len(last[0]))
        return self._walk_from(seq, [], 0)

    def _walk_from(self, seq: list[int], path: list[Edge], d: int) -> tuple[list[Edge], int]:
        n = len(seq)
        if path:
            e = path[-1]
            if d < e.child.depth:  # resume inside the last edge
                off = e.start + d - e.top.depth
                k = min(e.child.depth - d, n - d)
                if e.owner[off : off + k] != seq[d : d + k]:
                    return path, d + common_prefix(e.owner, off, seq, d, k)
                d += k
                if d < e.child.depth:
                    return path, d
            v = e.child
        else:
            v = self.root
        while d < n:
            nxt = v.children.get(seq[d])
            if nxt is None:
                break
            length = nxt.stop - nxt.start
            k = min(length, n - d)
            path.append(nxt)
            if nxt.owner[nxt.start : nxt.start + k] == seq[d : d + k]:
                d += k
                if k < length:
                    break
                v = nxt.child
            else:
                d += common_prefix(nxt.owner, nxt.start, seq, d, k)
                break
        return path, d

    def insert(self, seq: list[int]) -> tuple[list[Edge], int, tuple[list[int], int] | None]:
        """Store ``seq``; return its path, how much was already stored, and where the new tokens went.

        The third value is ``(strand, offset)`` with ``strand[offset:offset + len(seq) - matched]``
        equal to the new tokens, or None when ``seq`` was already stored entirely.
        """
        path, m, fresh = self._insert(seq)
        self._last = (seq, path)
        return path, m, fresh

    def _insert(self, seq: list[int]) -> tuple[list[Edge], int, tuple[list[int], int] | None]:
        path, m = self.walk(seq)
        if m == len(seq):
            return path, m, None
        if not path:
            v = self.root
        else:
            last = path[-1]
            if last.child.depth == m:
                v = last.child
            else:
                upper = self._split(last, m)
                path[-1] = upper
                v = upper.child
        tail = seq[m:]
        self.strand_tokens += len(tail)
        if path and not v.children and path[-1].child is v and path[-1].stop == len(path[-1].owner):
            # Continue the strand in place: a chain of turns stays one edge.
            e = path[-1]
            offset = e.stop
            e.owner.extend(tail)
            e.stop += len(tail)
            v.depth += len(tail)
            return path, m, (e.owner, offset)
        leaf = Vertex(len(seq))
        e = Edge(tail, 0, len(tail), v, leaf)
        v.children[tail[0]] = e
        self.n_edges += 1
        path.append(e)
        return path, m, (tail, 0)

    def _split(self, e: Edge, depth: int) -> Edge:
        """Cut ``e`` at ``depth``; return the new upper edge (``e`` stays the lower part)."""
        off = depth - e.top.depth
        mid = Vertex(depth)
        upper = Edge(e.owner, e.start, e.start + off, e.top, mid)
        e.top.children[e.owner[e.start]] = upper
        e.start += off
        e.top = mid
        mid.children[e.owner[e.start]] = e
        k = bisect_right(e.ends, depth)
        upper.ends, e.ends = e.ends[:k], e.ends[k:]
        for x in upper.ends:
            upper.end_at[x] = e.end_at.pop(x)
        k = bisect_right(e.prompts, depth)
        upper.prompts, e.prompts = e.prompts[:k], e.prompts[k:]
        for x in upper.prompts:
            upper.prompt_at[x] = e.prompt_at.pop(x)
        self.n_edges += 1
        return upper

    @staticmethod
    def edge_at(path: list[Edge], depth: int) -> Edge:
        for e in reversed(path):
            if e.contains(depth):
                return e
        raise ValueError(f"depth {depth} is not on this path")

    @staticmethod
    def mark_end(e: Edge, depth: int, idx: int) -> list[int]:
        group = e.end_at.get(depth)
        if group is None:
            group = e.end_at[depth] = []
            insort(e.ends, depth)
        group.append(idx)
        return group

    @staticmethod
    def mark_prompt(e: Edge, depth: int, idx: int) -> list[int]:
        """Add a prompt mark; the returned list is shared by every call with this exact prompt."""
        group = e.prompt_at.get(depth)
        if group is None:
            group = e.prompt_at[depth] = []
            insort(e.prompts, depth)
        group.append(idx)
        return group

    @staticmethod
    def ends_on_path(path: list[Edge], limit: int) -> Iterator[tuple[int, list[int]]]:
        """End marks on ``path`` at depth <= ``limit``, deepest first.

        Lazy: callers stop at the first usable mark, which is almost always on the last edge.
        """
        for e in reversed(path):
            if e.top.depth >= limit:
                continue
            i = bisect_right(e.ends, limit) - 1
            while i >= 0:
                yield e.ends[i], e.end_at[e.ends[i]]
                i -= 1

    @staticmethod
    def prompts_on_path(path: list[Edge], lo: int, hi: int) -> list[tuple[int, list[int]]]:
        """Prompt marks on ``path`` with ``lo <= depth < hi``."""
        out: list[tuple[int, list[int]]] = []
        for e in reversed(path):
            if e.child.depth < lo:
                break
            if e.top.depth >= hi:
                continue
            i = bisect_left(e.prompts, lo)
            while i < len(e.prompts) and e.prompts[i] < hi:
                out.append((e.prompts[i], e.prompt_at[e.prompts[i]]))
                i += 1
        return out

    @staticmethod
    def prompts_below(e0: Edge, d0: int) -> list[tuple[int, list[int]]]:
        """Prompt marks at depth >= ``d0`` in the subtree under position (``e0``, ``d0``).

        The scan does not go past an end mark deeper than ``d0``: whatever lies beneath it has that
        end (or a deeper one) as a closer candidate parent. Prompt marks at the same depth as such
        an end mark are still returned, the caller decides between equals.
        """
        out: list[tuple[int, list[int]]] = []
        stack: list[tuple[Edge, int]] = [(e0, d0)]
        while stack:
            e, a = stack.pop()
            j = bisect_left(e.ends, max(a, d0 + 1))
            stop = e.ends[j] if j < len(e.ends) else None
            hi = stop if stop is not None else e.child.depth
            i = bisect_left(e.prompts, a)
            while i < len(e.prompts) and e.prompts[i] <= hi:
                out.append((e.prompts[i], e.prompt_at[e.prompts[i]]))
                i += 1
            if stop is None:
                for c in e.child.children.values():
                    stack.append((c, c.top.depth + 1))
        return out
