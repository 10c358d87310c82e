"""The cells of the report's tables: column headers, the legend below a table, each value and its change.

The tables fit 100 columns: short headers of two lines at most (:data:`HEADERS`, the abbreviations
spelled out in a legend below the table), no outer frame, each change written under its value in at
most six characters (a change of ten times or more as ``×N``).
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

#: metrics whose change is shown as a difference, not a ratio
ABSOLUTE = {"reward_mean"}

#: each metric's column header in the tables (two lines of at most 9 characters) and, for an
#: abbreviation, what the legend below the table says it stands for
HEADERS: dict[str, tuple[str, str | None]] = {
    "trajectories": ("served", "trajectories of the version"),
    "reward_mean": ("reward", None),
    "broken_tool_call_rate": ("broken\ncalls", "broken tool calls"),
    "clarification_rate": ("clarify", "clarifying questions"),
    "edit_rate": ("edits", None),
    "edit_persistence": ("edits\nkept", "edit persistence"),
    "dissatisfied_rate": ("dissat.", "dissatisfied follow-ups"),
    "latency_p50_ms": ("p50\nms", None),
    "latency_p95_ms": ("p95\nms", None),
    "solve_rate": ("held-out\nsolve", None),
    "on_policy_fraction": ("on-policy\ntokens", None),
}


def _compact(title: str, names: list[str], changes: str) -> Table:
    """A table without outer frame, with the legend of ``names``' abbreviations and of the change lines."""
    spelled = [f"{HEADERS[n][0].replace(chr(10), ' ')}: {HEADERS[n][1]}" for n in names if HEADERS[n][1]]
    return Table(
        title=title,
        caption=" · ".join(spelled) + f". Under each value: {changes}.",
        caption_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
    )


def _relative(change: float) -> str:
    """A relative change in at most six characters: ``+4.2%``, ``-35%``, ``+640%``, ``×14``."""
    if abs(change) < 1:
        return f"{change:+.1%}"
    return f"{change:+.0%}" if change < 9.995 else f"×{change + 1:.0f}"


def _change(value: Any, base: Any, better: bool | None, absolute: bool) -> str | None:
    """The change line under a value (green when better, red when worse), or None when there is none."""
    if value is None or base is None or better is None:
        return None
    if absolute or not base:  # rewards sit around 0: a relative change would mislead
        diff = value - base
        return f"[{'green' if (diff > 0) == better else 'red'}]{diff:+.3f}[/]"
    change = (value - base) / abs(base)
    return f"[{'green' if (change > 0) == better else 'red'}]{_relative(change)}[/]"


def _fmt(name: str, v: Any) -> str:
    if v is None:
        return "-"
    if name == "trajectories":
        return f"{int(v):,}"
    if name.endswith("_ms"):
        return f"{v:,.0f}"
    return f"{v:.3f}"
