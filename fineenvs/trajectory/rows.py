"""Training rows: one per root-to-leaf path of the trajectory graph.

A row's ``input_ids`` are the leaf's end (its prompt + sampled tokens): every call on the path
contributes its context tokens (tool results, template glue; mask 0, logprob 0.0) and its sampled
tokens (mask 1, the engine's behaviour logprobs). A call whose logprobs are missing, misaligned
or not finite is context only (mask 0). Rows are labelled ``agent`` / ``auxiliary`` /
``discarded`` (see ``graph``); ``RowOptions`` decides which labels are kept, and every row left
out is counted in ``RowSet``.

Shared prefixes (``RowOptions.shared_prefix``). When a call has several leaves below it (a retry
was discarded, a re-rendered history forked), its sampled tokens appear in several rows. The
policy decides how they count in the loss:

- ``per_row`` (the published behaviour, OpenEnv / TRL): every row trains them, so a call with k
  kept rows below it is trained k times. Trunk turns of a forked session weigh more than leaves.
- ``once``: only the first kept row that contains the call (depth-first order, children by
  arrival) trains them; in the other rows they become context (mask 0, logprob 0.0). A row left
  with nothing to train is labelled ``trainable=False``.
- ``inverse_count``: every row keeps mask 1 but ``loss_weight`` is 1/k on those tokens (1.0 on
  tokens of unshared calls, 0.0 where the mask is 0), so each sampled token counts once overall.

Because all rows of one attempt carry the same advantage, ``once`` and ``inverse_count`` give the
same total gradient under a plain token-sum loss; they differ when the loss is normalised per row
(GRPO's per-sequence mean) or rows land in different micro-batches. Only counts over the rows
that are actually exported (after the role and length rules) enter k.

Over-long rows (``RowOptions.overlong``, budget ``max_tokens``): ``drop`` removes the row;
``split`` cuts it after the last call whose end fits the budget. Later turns cannot become rows
of their own, because training them needs their full prefix, which is itself over budget; their
sampled tokens are counted as lost. A row whose first call already does not fit is dropped in
either mode, and two cuts that end at the same call are kept once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Literal, TypeVar

from fineenvs.jsonl import JsonObject
from fineenvs.trajectory.graph import TrajectoryGraph
from fineenvs.trajectory.node import logprob_problem

Role = Literal["agent", "auxiliary", "discarded"]


class SharedPrefix(Enum):
    per_row = "per_row"  # published: shared sampled tokens count once in every row holding them
    once = "once"  # counted in the first row only
    inverse_count = "inverse_count"  # weighted 1 / (number of rows sharing them)


class Overlong(Enum):
    drop = "drop"
    split = "split"


_E = TypeVar("_E", Overlong, SharedPrefix)


@dataclass
class RowOptions:
    """How recorded calls become training rows: the ``rows:`` section of the run config."""

    max_tokens: int | None = None
    """Token budget of one row; None: the trainer's (``trainer.token_budget`` for GRPO,
    ``trainer.max_length`` for SFT), which a run fills in. Above it a row is ``overlong``."""
    overlong: Overlong = Overlong.drop
    shared_prefix: SharedPrefix = SharedPrefix.per_row
    drop_discarded: bool = True
    """Leave out calls the proxy marked discarded (an agent's retried or abandoned branch)."""
    drop_auxiliary: bool = False
    """Leave out an agent's auxiliary calls (titles, summaries) that are not on the task's path."""
    train_constrained: bool = False
    """Train on structured-output calls too. Off by default: under a grammar mask the engine's
    logprobs are those of the masked distribution, which the trainer does not recompute (the
    same reason training refuses top_p < 1); on, their ratios are biased by the mask."""

    def __post_init__(self) -> None:
        # Python callers may name the modes as strings ("split"); the run config gives the enums.
        self.overlong = _member(Overlong, self.overlong, "overlong")
        self.shared_prefix = _member(SharedPrefix, self.shared_prefix, "shared_prefix")

    def to_json(self) -> JsonObject:
        """The options as JSON values (the modes by name), as ``RowOptions(**...)`` reads them back."""
        return {**asdict(self), "overlong": self.overlong.value, "shared_prefix": self.shared_prefix.value}

    def check(self) -> None:
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(
                f"RowOptions.max_tokens={self.max_tokens} must be positive: it is the token budget of one "
                "training row (the published recipe uses 40960)"
            )


_WHAT = {
    "overlong": "say whether rows over max_tokens are cut after the last turn that fits ('split') or "
    "left out ('drop')",
    "shared_prefix": "see fineenvs.trajectory.rows for what each policy does",
}


def _member(kind: type[_E], value: _E | str, key: str) -> _E:
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        choices = tuple(m.value for m in kind)
        raise ValueError(f"RowOptions.{key}={value!r} is not one of {choices}: {_WHAT[key]}") from None


@dataclass
class Row:
    """One training sequence; every per-token list has ``len(input_ids)`` entries."""

    row_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turn_starts: list[int]  # where each call's sampled tokens start in input_ids
    turn_ends: list[int]  # ... and end (exclusive); aligned with node_ids
    node_ids: list[str]  # calls on the path, root first
    role: Role
    trainable: bool
    prompt_len: int  # the root call's prompt length
    metadata: JsonObject = field(default_factory=dict)
    loss_weight: list[float] | None = None
    cut: bool = False  # shortened by the "split" rule
    weight_version: int | None = None
    """Oldest engine weight version among the trained calls on the path (None: a trained call
    reported none); what the row's staleness is measured against."""

    @property
    def n_trainable(self) -> int:
        return sum(self.loss_mask)


@dataclass
class RowSet:
    rows: list[Row]
    options: RowOptions
    n_paths: int = 0  # root-to-leaf paths in the graph
    dropped_discarded: int = 0
    dropped_auxiliary: int = 0
    overlong_rows: int = 0
    dropped_overlong: int = 0
    split_rows: int = 0
    dropped_duplicate_cuts: int = 0
    lost_sampled_tokens: int = 0  # trainable tokens removed by the over-long rule

    def counters(self) -> dict[str, int]:
        return {
            "n_paths": self.n_paths,
            "n_rows": len(self.rows),
            "dropped_discarded": self.dropped_discarded,
            "dropped_auxiliary": self.dropped_auxiliary,
            "overlong_rows": self.overlong_rows,
            "dropped_overlong": self.dropped_overlong,
            "split_rows": self.split_rows,
            "dropped_duplicate_cuts": self.dropped_duplicate_cuts,
            "lost_sampled_tokens": self.lost_sampled_tokens,
        }


def build_rows(
    graph: TrajectoryGraph, options: RowOptions | None = None, metadata: JsonObject | None = None
) -> RowSet:
    """Rows for every root-to-leaf path, filtered and cut by ``options``, with counters."""
    options = options or RowOptions()
    options.check()
    metadata = metadata if metadata is not None else {}
    out = RowSet(rows=[], options=options)
    discarded = graph.discarded()
    any_tools = graph.any_tools()
    seen_cuts: set[int] = set()
    # (row, path indices) of kept rows, for the shared-prefix pass
    kept: list[tuple[Row, list[int]]] = []
    for end_ids, path in graph.walk_paths():
        out.n_paths += 1
        leaf = graph.entry_header(path[-1]).node_id
        role: Role
        if leaf in discarded:
            role = "discarded"
        elif not any_tools or any(graph.entry_header(i).has_tools for i in path):
            role = "agent"
        else:
            role = "auxiliary"
        if role == "discarded" and options.drop_discarded:
            out.dropped_discarded += 1
            continue
        if role == "auxiliary" and options.drop_auxiliary:
            out.dropped_auxiliary += 1
            continue
        row = _make_row(graph, end_ids, path, role, metadata, options.train_constrained)
        if options.max_tokens is not None and len(row.input_ids) > options.max_tokens:
            out.overlong_rows += 1
            keep = _cut_point(graph, path, options.max_tokens) if options.overlong is Overlong.split else 0
            if keep == 0:
                out.dropped_overlong += 1
                out.lost_sampled_tokens += row.n_trainable
                continue
            before = row.n_trainable
            path = path[:keep]
            row = _truncate(row, keep)
            out.lost_sampled_tokens += before - row.n_trainable
            if path[-1] in seen_cuts:
                out.dropped_duplicate_cuts += 1
                continue
            seen_cuts.add(path[-1])
            out.split_rows += 1
        kept.append((row, path))
    _apply_shared_prefix(kept, options.shared_prefix.value)
    out.rows = [r for r, _ in kept]
    return out


def _make_row(
    graph: TrajectoryGraph,
    end_ids: list[int],
    path: list[int],
    role: Role,
    metadata: JsonObject,
    train_constrained: bool = False,
) -> Row:
    n = len(end_ids)
    mask = [0] * n
    logprobs = [0.0] * n
    starts: list[int] = []
    ends: list[int] = []
    versions: list[int | None] = []
    for i in path:
        a, b = graph.entry_span(i)
        starts.append(a)
        ends.append(b)
        header = graph.entry_header(i)
        usable = not header.constrained or train_constrained
        if usable and b > a and logprob_problem(header, b - a) is None and header.logprobs is not None:
            mask[a:b] = [1] * (b - a)
            logprobs[a:b] = header.logprobs
            versions.append(header.weight_version if isinstance(header.weight_version, int) else None)
    ids = [graph.entry_header(i).node_id for i in path]
    return Row(
        row_id=ids[-1],
        input_ids=end_ids,
        loss_mask=mask,
        logprobs=logprobs,
        turn_starts=starts,
        turn_ends=ends,
        node_ids=ids,
        role=role,
        trainable=role != "discarded" and any(mask),
        prompt_len=graph.entry_span(path[0])[0],
        metadata=dict(metadata),  # per row: consumers may annotate one row without touching the rest
        # A trained call with no version could be older than any that has one: then the row's
        # staleness is unknown, not the minimum of the rest.
        weight_version=None
        if not versions or None in versions
        else min(v for v in versions if v is not None),
    )


def _cut_point(graph: TrajectoryGraph, path: list[int], budget: int) -> int:
    """How many calls of ``path`` fit in ``budget`` tokens (0: not even the first)."""
    keep = 0
    for k, i in enumerate(path):
        if graph.entry_span(i)[1] <= budget:
            keep = k + 1
        else:
            break
    return keep


def _truncate(row: Row, keep: int) -> Row:
    end = row.turn_ends[keep - 1]
    mask = row.loss_mask[:end]
    return Row(
        row_id=f"{row.node_ids[keep - 1]}#cut",
        input_ids=row.input_ids[:end],
        loss_mask=mask,
        logprobs=row.logprobs[:end],
        turn_starts=row.turn_starts[:keep],
        turn_ends=row.turn_ends[:keep],
        node_ids=row.node_ids[:keep],
        role=row.role,
        trainable=row.role != "discarded" and any(mask),
        prompt_len=row.prompt_len,
        metadata=row.metadata,
        cut=True,
        weight_version=row.weight_version,  # over the whole path: conservative for the kept calls
    )


def _apply_shared_prefix(kept: list[tuple[Row, list[int]]], policy: str) -> None:
    if policy == "per_row":
        return
    counts: dict[int, int] = {}
    for row, path in kept:
        for k, i in enumerate(path):
            if row.loss_mask[row.turn_starts[k] : row.turn_ends[k]][:1] == [1]:
                counts[i] = counts.get(i, 0) + 1
    if policy == "once":
        claimed: set[int] = set()
        for row, path in kept:
            for k, i in enumerate(path):
                a, b = row.turn_starts[k], row.turn_ends[k]
                if counts.get(i, 0) == 0 or row.loss_mask[a:b][:1] != [1]:
                    continue
                if i in claimed:
                    row.loss_mask[a:b] = [0] * (b - a)
                    row.logprobs[a:b] = [0.0] * (b - a)
                else:
                    claimed.add(i)
            row.trainable = row.trainable and any(row.loss_mask)
        return
    for row, path in kept:
        weight = [float(m) for m in row.loss_mask]
        for k, i in enumerate(path):
            a, b = row.turn_starts[k], row.turn_ends[k]
            c = counts.get(i, 0)
            if c > 1 and row.loss_mask[a:b][:1] == [1]:
                weight[a:b] = [1.0 / c] * (b - a)
        row.loss_weight = weight
