"""Behaviour per policy version, read from ClickHouse ``events``: a console table and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.table import Table  # noqa: E402

#: (column, label, higher is better?)
METRICS = [
    ("trajectories", "trajectories", None),
    ("broken_tool_call_rate", "broken tool calls", False),
    ("clarification_rate", "clarifying", None),
    ("edit_rate", "edits", True),
    ("edit_persistence", "persisted", True),
    ("dissatisfied_rate", "dissatisfied", False),
    ("latency_p50_ms", "p50 ms", False),
    ("latency_p95_ms", "p95 ms", False),
]


def behaviour_by_version(ch: Any, database: str) -> list[dict[str, Any]]:
    """One row per policy version with the behaviour metrics the monitors watch."""
    sql = f"""
    WITH per_trajectory AS (
        SELECT policy_version, trajectory_id,
               countIf(type = 'tool_call') AS tool_calls,
               countIf(type = 'tool_call' AND NOT valid) AS broken,
               countIf(type = 'clarifying_question') > 0 AS clarified,
               countIf(type = 'edit_proposed') > 0 AS edited,
               avgIf(fraction, type = 'edit_persisted') AS persisted,
               countIf(type = 'followup' AND sentiment = 'dissatisfied') > 0 AS dissatisfied,
               maxIf(total_ms, type = 'latency') AS latency_ms
        FROM {database}.events FINAL
        GROUP BY policy_version, trajectory_id
    )
    SELECT policy_version,
           count() AS trajectories,
           sum(broken) / greatest(sum(tool_calls), 1) AS broken_tool_call_rate,
           avg(clarified) AS clarification_rate,
           avg(edited) AS edit_rate,
           avgIf(persisted, NOT isNaN(persisted)) AS edit_persistence,
           avg(dissatisfied) AS dissatisfied_rate,
           quantileIf(0.5)(latency_ms, latency_ms > 0) AS latency_p50_ms,
           quantileIf(0.95)(latency_ms, latency_ms > 0) AS latency_p95_ms
    FROM per_trajectory
    GROUP BY policy_version
    ORDER BY policy_version
    """
    res = ch.query(sql)
    return [dict(zip(res.column_names, row)) for row in res.result_rows]


def _fmt(name: str, v: float) -> str:
    if name == "trajectories":
        return f"{int(v):,}"
    if name.endswith("_ms"):
        return f"{v:,.0f}"
    return f"{v:.3f}"


def table(rows: list[dict[str, Any]], title: str) -> Table:
    """Rich table: one row per version, each metric with its relative change against the first version."""
    t = Table(title=title, header_style="bold")
    t.add_column("version", justify="right")
    for _, label, _ in METRICS:
        t.add_column(label, justify="right")
    first = rows[0] if rows else {}
    for row in rows:
        cells = [str(row["policy_version"])]
        for name, _, better in METRICS:
            text = _fmt(name, row[name])
            base = first.get(name) or 0
            if row is not first and base and better is not None:
                change = (row[name] - base) / base
                good = (change > 0) == better
                text += f"\n[{'green' if good else 'red'}]{change:+.1%}[/]"
            cells.append(text)
        t.add_row(*cells)
    return t


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """One bar chart per metric across policy versions, saved as a PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metrics = METRICS
    fig, axes = plt.subplots(2, 4, figsize=(14, 6))
    versions = [str(r["policy_version"]) for r in rows]
    for ax, (name, label, better) in zip(axes.flat, metrics):
        ax.bar(versions, [r[name] for r in rows], color="#4C72B0")
        arrow = "" if better is None else (" (higher is better)" if better else " (lower is better)")
        ax.set_title(label + arrow, fontsize=9)
        ax.set_xlabel("policy version", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
