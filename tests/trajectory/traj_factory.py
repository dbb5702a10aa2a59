"""Builders for hand-made sessions: readable token lists, logprobs derived from positions."""

from __future__ import annotations

from typing import Any

from fineenvs.trajectory import CallNode


def lp(sampled: list[int]) -> list[float]:
    """Deterministic, distinct, negative logprobs so a misplaced one is visible in asserts."""
    return [-0.01 * (1 + (t % 97)) for t in sampled]


def call(
    i: int,
    prompt: list[int],
    sampled: list[int],
    *,
    tools: bool = True,
    logprobs: list[float] | None | str = "auto",
    node_id: str | None = None,
    aligned: bool = True,
) -> CallNode:
    return CallNode(
        node_id=node_id or f"n{i}",
        prompt_ids=list(prompt),
        sampled_ids=list(sampled),
        logprobs=lp(sampled) if logprobs == "auto" else logprobs,  # type: ignore[arg-type]
        finish_reason="tool_calls" if tools else "stop",
        has_tools=tools,
        arrival_index=i,
        logprobs_aligned=aligned,
    )


def end(node: CallNode) -> list[int]:
    return node.prompt_ids + node.sampled_ids


SYSTEM = [1, 2, 3, 4, 5]  # system prompt + first user message
SUB_SYSTEM = [1, 2, 9, 9, 5]  # a subagent's system prompt (departs at token 2)


def chain(n_turns: int, *, start: int = 0, system: list[int] | None = None) -> list[CallNode]:
    """A clean agent chain: each prompt is the previous end plus a tool result."""
    nodes: list[CallNode] = []
    prompt = list(system or SYSTEM)
    for k in range(n_turns):
        base = 100 * (start + k + 1)
        sampled = [base + 1, base + 2, base + 3]
        nodes.append(call(start + k, prompt, sampled))
        prompt = end(nodes[-1]) + [base + 50, base + 51]  # tool result + template glue
    return nodes


def proxy_calls_to_nodes(calls: list[dict[str, Any]]) -> list[CallNode]:
    """The proxy's recorded calls (``GET /sessions/{id}/rollout`` -> ``calls``) as graph nodes:
    the conversion the proxy and the attempt runner use."""
    from fineenvs.trajectory.record import calls_to_nodes

    return calls_to_nodes(calls)
