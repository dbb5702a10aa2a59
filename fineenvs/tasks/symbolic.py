"""Symbolic equivalence, the last rung of the ladder ("1/3" == "0.3333", "2*sqrt(2)" == "sqrt(8)").

sympy's parser evaluates Python, and the text comes from an agent, so it is parsed only after a
whitelist check: digits, operators, brackets, and names from `_NAMES` or single letters. Anything
else is "not an expression" (the rung is skipped), never parsed. Expressions are capped at
`MAX_CHARS` so simplification stays cheap.
"""

from __future__ import annotations

import re
from typing import Any

MAX_CHARS = 80
_ALLOWED = re.compile(r"^[0-9A-Za-z_+\-*/^(). ]+$")
_NAMES = {"sqrt", "pi", "exp", "log", "ln", "sin", "cos", "tan", "E", "e", "oo", "Rational"}


def parse_expression(text: str) -> Any | None:
    """A sympy expression for safe, short arithmetic text; None otherwise (or without sympy)."""
    text = text.strip().replace("^", "**")
    if not text or len(text) > MAX_CHARS or "__" in text or not _ALLOWED.match(text):
        return None
    for name in re.findall(r"[A-Za-z_]+", text):
        if name not in _NAMES and len(name) > 1:
            return None
    if not re.search(r"[0-9A-Za-z]", text):
        return None
    # Power towers ("9^9^9^9") would make sympy compute for ever; one small power is plenty.
    if text.count("**") > 1 or re.search(r"\*\*\s*\(?\s*[-+]?\d{4,}", text):
        return None
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            convert_xor,
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )
    except ImportError:  # pragma: no cover - sympy ships with torch
        return None
    names: dict[str, Any] = {"ln": sympy.log, "e": sympy.E}
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    try:
        return parse_expr(text, local_dict=names, transformations=transformations, evaluate=True)
    except Exception:  # noqa: BLE001 - any parse failure means "not an expression"
        return None


def equivalent(prediction: str, gold: str, *, atol: float, rtol: float) -> bool | None:
    """True/False when both sides are expressions; None when the rung does not apply."""
    pred = parse_expression(prediction)
    ref = parse_expression(gold) if pred is not None else None
    if pred is None or ref is None:
        return None
    import sympy

    if not pred.free_symbols and not ref.free_symbols:
        try:
            p, g = complex(sympy.N(pred)), complex(sympy.N(ref))
        except (TypeError, ValueError):
            return False
        if p.imag or g.imag:
            return abs(p - g) <= max(atol, rtol * abs(g))
        return abs(p.real - g.real) <= max(atol, rtol * abs(g.real))
    return bool(sympy.simplify(pred - ref) == 0)
