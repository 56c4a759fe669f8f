"""Numbers and tables as text: the formats every markdown output shares (report, gate, spot-check).

A leaf module (imports nothing of attnbench), so any module that writes text can use it without an
import circle.
"""
from __future__ import annotations

import math


def finite(x) -> bool:
    """True for a number that is not NaN or infinite (None, strings and NaN are not)."""
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def format_n(n, model: bool = False) -> str:
    """1024 → "1K", 65536 → "64K", 1048576 → "1M"; other lengths and image sizes as the integer."""
    n = int(n)
    if not model and n > 0:
        if n % (1 << 20) == 0:
            return f"{n >> 20}M"
        if n % 1024 == 0:
            return f"{n >> 10}K"
    return str(n)


def format_ratio(x) -> str:
    """Two decimals (0.44, 4.57); small ratios keep two significant digits (0.0042)."""
    if x is None or not finite(x):
        return "–"
    x = float(x)
    if abs(x) >= 0.095:
        return f"{x:.2f}"
    return f"{x:.2g}"


def format_range(lo, hi) -> str:
    a, b = format_ratio(lo), format_ratio(hi)
    return a if a == b else f"{a}–{b}"


def format_ms(x) -> str:
    return "–" if x is None or not finite(x) else f"{float(x):.4g}"


def _cell_md(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table; "|" inside a cell is escaped and newlines become spaces."""
    lines = ["| " + " | ".join(_cell_md(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell_md(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
