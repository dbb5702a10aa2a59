"""The token-prefix tree of one optimizer step's rows: what the shared forward computes once.

Every row of a step is a token sequence; rows of one attempt share their history up to where a
call forked (a retry, a re-rendered turn), and the attempts of a group share the system prompt and
the task. The tree stores each distinct prefix once: a node is a run of tokens
``[start, end)`` shared by every row below it, and ``ends`` lists the rows that stop at the node
(a leaf, or an inner node when one row is a prefix of another; identical rows stop at the same
node). ``fineenvs.train.shared`` forwards each node once and hands its end state to its children.

Construction sorts the rows and reads the tree off the longest common prefixes of neighbours (the
LCP-interval tree of a suffix array, here over whole rows): ``O(T log R)`` for ``R`` rows of ``T``
tokens in all, with the prefix comparisons of ``fineenvs.trajectory._trie`` (slice equality, a
mismatch located by bisection).

``one_token_inner=False`` dissolves inner nodes of a single token (below a root) into their
children, each of which then starts one token earlier. Qwen3.5's gated delta net continues a state
over one token with its recurrent kernel and over more with its chunked one; both compute the same
thing, but they round differently (up to 1.3e-5 in logprob on tiny_qwen3_5, the tiny models of ``fineenvs_recipes.tiny``),
while the padded path always runs the chunked one. A one-token leaf is run with a pad token after
it instead (``fineenvs.train.shared``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fineenvs.trajectory._trie import common_prefix


@dataclass
class Node:
    start: int
    end: int
    row: int
    """A row whose ``input_ids[start:end]`` are this node's tokens."""
    children: list[Node] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    """Rows whose last token is this node's last token."""
    rows: list[int] = field(default_factory=list)
    """Every row through this node (filled by ``build_tree``)."""

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class PrefixTree:
    roots: list[Node]
    row_tokens: int
    """Tokens of all rows together: what the padded path forwards, padding aside."""
    unique_tokens: int
    """Distinct token prefixes of the rows: the step's tree at token granularity."""

    def nodes(self) -> list[Node]:
        out: list[Node] = []
        stack = list(reversed(self.roots))
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(n.children))
        return out


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    k = min(len(a), len(b))
    if a[:k] == b[:k]:
        return k
    return common_prefix(list(a), 0, list(b), 0, k)


def build_tree(seqs: Sequence[Sequence[int]], *, one_token_inner: bool = True) -> PrefixTree:
    """The prefix tree of ``seqs`` (each non-empty); see the module docstring."""
    if any(len(s) == 0 for s in seqs):
        raise ValueError("every sequence needs at least one token")
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i]))
    top = Node(0, 0, -1)  # the empty prefix; its children are the roots
    stack = [top]
    unique = 0
    prev: int | None = None
    for i in order:
        s = seqs[i]
        raw = 0 if prev is None else lcp(seqs[prev], s)
        unique += len(s) - raw
        if prev is not None and raw == len(s) == len(seqs[prev]):
            stack[-1].ends.append(i)  # identical to the previous row: the same node
            continue
        # Sorted order puts a prefix before its extensions, so ``s`` is never a prefix of the
        # previous row and always gets a node of its own below depth ``depth``.
        depth = raw
        last: Node | None = None
        while stack[-1].end > depth:
            last = stack.pop()
        parent = stack[-1]
        if parent.end < depth:
            assert last is not None and parent.children[-1] is last
            mid = Node(parent.end, depth, last.row, [last])
            last.start = depth
            parent.children[-1] = mid
            stack.append(mid)
            parent = mid
        leaf = Node(depth, len(s), i, ends=[i])
        parent.children.append(leaf)
        stack.append(leaf)
        prev = i
    if not one_token_inner:
        _dissolve_one_token_inner(top)
    tree = PrefixTree(top.children, sum(len(s) for s in seqs), unique)
    _fill_rows(tree)
    return tree


def _dissolve_one_token_inner(top: Node) -> None:
    stack = [top]
    while stack:
        node = stack.pop()
        kids: list[Node] = []
        pending = list(node.children)
        while pending:
            c = pending.pop(0)
            if c.length == 1 and c.children and c.start > 0:
                if c.ends:  # the rows that stop at it keep a one-token leaf
                    kids.append(Node(c.start, c.end, c.row, ends=c.ends))
                for g in c.children:
                    g.start = c.start
                pending[:0] = c.children  # a grandchild may itself be a one-token inner node
            else:
                kids.append(c)
        node.children = kids
        stack.extend(kids)


def _fill_rows(tree: PrefixTree) -> None:
    # Post-order without recursion: a step's tree can be as deep as it has rows.
    for node in reversed(tree.nodes()):
        node.rows = list(node.ends)
        for c in node.children:
            node.rows.extend(c.rows)
