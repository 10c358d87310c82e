"""Behaviour and reward per policy version from ClickHouse: the table, the A/B comparison and the plot.

Figures come from the monitors' views (``behaviour`` over ``trajectories FINAL``, ``reward_stats``
over ``rewards FINAL``) and the A/B comparison with 95% intervals from :func:`monitors.queries.ab_table`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.table import Table  # noqa: E402

from app.report.cells import ABSOLUTE, HEADERS, _change, _compact, _fmt  # noqa: E402
from monitors.queries import ab_table, behaviour_rows, reward_stats  # noqa: E402

#: (column, label, higher is better? None = neither)
METRICS = [
    ("trajectories", "trajectories", None),
    ("reward_mean", "reward", True),
    ("broken_tool_call_rate", "broken tool calls", False),
    ("clarification_rate", "clarifying", None),
    ("edit_rate", "edits", True),
    ("edit_persistence", "persisted", True),
    ("dissatisfied_rate", "dissatisfied", False),
    ("latency_p50_ms", "p50 ms", False),
    ("latency_p95_ms", "p95 ms", False),
]


def version_rows(ch: Any, database: str, reward_version: str) -> list[dict[str, Any]]:
    """One row per policy version seen in ``trajectories``: behaviour plus the reward mean under ``reward_version``."""
    versions = [
        v for (v,) in ch.query(f"SELECT DISTINCT policy_version FROM {database}.trajectories ORDER BY 1").result_rows
    ]
    behaviour = behaviour_rows(ch, database, versions)
    rewards = reward_stats(ch, database, reward_version)
    rows = []
    for v in versions:
        row = dict(behaviour[v])
        row["reward_mean"] = rewards.get(v, {}).get("reward_mean")
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], title: str, ab: list[dict[str, Any]] | None = None) -> Table:
    """Rich table: one row per version; under each value its change against the first version and, where
    ``ab`` has its 95% interval, the interval's half-width (the delta-method interval is symmetric)."""
    names = [name for name, _, _ in METRICS]
    t = _compact(title, names, "the change vs the first version (green: better, red: worse) ± its 95% CI")
    t.add_column("version", justify="right")
    for name in names:
        t.add_column(HEADERS[name][0], justify="right")
    first = rows[0] if rows else {}
    ab_by_version = {r["policy_version"]: r for r in ab or []}
    for row in rows:
        cells = [f"v{row['policy_version']}"]
        for name, _, better in METRICS:
            text = _fmt(name, row.get(name))
            change = None if row is first else _change(row.get(name), first.get(name), better, name in ABSOLUTE)
            if change is not None:
                text += "\n" + change
                ci = ab_by_version.get(row["policy_version"], {})
                low, high = ci.get(f"{name}_ci_low"), ci.get(f"{name}_ci_high")
                if name not in ABSOLUTE and low is not None and high is not None:
                    half = (high - low) / 2
                    text += f"\n[dim]±{half:.0%}[/]" if half >= 1 else f"\n[dim]±{half:.1%}[/]"
            cells.append(text)
        t.add_row(*cells)
    return t


def comparison(ch: Any, database: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A/B rows (relative change with 95% CI) of every version against the first."""
    versions = [r["policy_version"] for r in rows]
    return ab_table(ch, database, versions, versions[0]) if versions else []


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """One bar chart per metric across policy versions, saved as a PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(3, 3, figsize=(13, 9))
    versions = [str(r["policy_version"]) for r in rows]
    for ax, (name, label, better) in zip(axes.flat, METRICS):
        ax.bar(versions, [r.get(name) or 0 for r in rows], color="#4C72B0")
        arrow = "" if better is None else (" (higher is better)" if better else " (lower is better)")
        ax.set_title(label + arrow, fontsize=9)
        ax.set_xlabel("policy version", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
