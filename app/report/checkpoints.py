"""The closed loop's checkpoints, one row each: the eval gate's decision and scores, live behaviour, the table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from rich.table import Table  # noqa: E402

from app.report.cells import ABSOLUTE, HEADERS, _change, _compact, _fmt  # noqa: E402
from app.report.stats import _wilson  # noqa: E402
from monitors.alerts import Z95, standard_error  # noqa: E402
from monitors.queries import behaviour_rows, reward_stats  # noqa: E402

#: (column, label, higher is better? None = neither); where each comes from is in :data:`SOURCE`
CHECKPOINT_METRICS = [
    ("solve_rate", "held-out solve", True),
    ("edit_persistence", "edit persistence", True),
    ("dissatisfied_rate", "dissatisfied", False),
    ("latency_p50_ms", "p50 ms", False),
    ("reward_mean", "reward", True),
    ("broken_tool_call_rate", "broken calls", False),
    ("clarification_rate", "clarifying", None),
    ("on_policy_fraction", "on-policy tokens", True),
]

#: where a checkpoint metric comes from: the eval suite's held-out tasks, live traffic while the version served
#: (ClickHouse), or the trainer
SOURCE = {
    "solve_rate": "eval suite",
    "on_policy_fraction": "trainer",
    "edit_persistence": "live",
    "dissatisfied_rate": "live",
    "latency_p50_ms": "live",
    "reward_mean": "live",
    "broken_tool_call_rate": "live",
    "clarification_rate": "live",
}


def checkpoint_rows(ch: Any, database: str, reward_version: str) -> list[dict[str, Any]]:
    """One row per checkpoint (latest status): the gate's eval, live behaviour and reward of the
    version while it served (none for a rejected candidate), and the trainer's on-policy fraction.
    Estimates carry their 95% interval as ``<metric>_low`` / ``<metric>_high`` (None when undefined): the eval
    suite's solve rate a Wilson interval over its ``eval_samples``, live figures the ``behaviour`` view's intervals
    (delta method or order statistics over trajectories, each taken as independent: an interval per user, as the A/B
    test computes it, is wider when a user's trajectories are alike)."""
    cps = ch.query(
        f"SELECT version, parent, status, reason, eval_results, reward_version, reward_checksum "
        f"FROM {database}.checkpoints FINAL ORDER BY version"
    ).result_rows
    versions = [int(v) for v, *_ in cps]
    live = behaviour_rows(ch, database, versions)
    rewards = reward_stats(ch, database, reward_version)
    rows = []
    for version, parent, status, reason, ev, trained_on, trained_sum in cps:
        b = live[int(version)]
        rs = rewards.get(int(version), {})
        row: dict[str, Any] = {
            "version": int(version),
            "parent": parent,
            "status": status,
            "reason": reason,
            "reward_version": trained_on,
            "reward_checksum": trained_sum,
            "solve_rate": ev.get("solve_rate"),
            "on_policy_fraction": ev.get("on_policy_fraction"),
            "trajectories": b.get("trajectories") or 0,
            "edit_persistence": b.get("edit_persistence"),
            "dissatisfied_rate": b.get("dissatisfied_rate"),
            "latency_p50_ms": b.get("latency_p50_ms"),
            "broken_tool_call_rate": b.get("broken_tool_call_rate"),
            "clarification_rate": b.get("clarification_rate"),
            "reward_mean": rs.get("reward_mean"),
        }
        if row["solve_rate"] is not None and ev.get("eval_samples"):
            row["solve_rate_low"], row["solve_rate_high"] = _wilson(row["solve_rate"], ev["eval_samples"])
        for name in ("edit_persistence", "dissatisfied_rate", "broken_tool_call_rate", "clarification_rate"):
            se = standard_error(b, name) if row[name] is not None else None
            if se is not None:
                row[f"{name}_low"], row[f"{name}_high"] = row[name] - Z95 * se, row[name] + Z95 * se
        if row["latency_p50_ms"] is not None:
            row["latency_p50_ms_low"], row["latency_p50_ms_high"] = (
                b["latency_p50_ci_low_ms"],
                b["latency_p50_ci_high_ms"],
            )
        if rs.get("reward_var") is not None and rs.get("trajectories"):
            se = (rs["reward_var"] / rs["trajectories"]) ** 0.5
            row["reward_mean_low"], row["reward_mean_high"] = (
                row["reward_mean"] - Z95 * se,
                row["reward_mean"] + Z95 * se,
            )
        rows.append(row)
    return rows


def checkpoint_table(rows: list[dict[str, Any]], title: str) -> Table:
    """Rich table per checkpoint (its parent and the gate's decision under it) with the change of each metric
    against the first checkpoint under its value."""
    names = ["trajectories"] + [name for name, _, _ in CHECKPOINT_METRICS]
    t = _compact(
        title,
        names,
        "the change vs the first checkpoint (green: better, red: worse); under each version its gate decision and "
        "the reward version it trained on",
    )
    t.add_column("version", justify="right")
    for name in names:
        t.add_column(HEADERS[name][0], justify="right")
    first = rows[0] if rows else {}
    for row in rows:
        status = {
            "promoted": "[green]promoted[/]",
            "rejected": "[red]rejected[/]",
            "rolled_back": "[yellow]rolled back[/]",
        }.get(row["status"], row["status"])
        trained_on = f"\n[dim]{row['reward_version']}[/]" if row.get("reward_version") else ""  # what it trained on
        cells = [
            f"v{row['version']}"
            + (f" ← v{row['parent']}" if row["parent"] is not None else "")
            + f"\n{status}{trained_on}",
            f"{row['trajectories']:,}",
        ]
        for name, _, better in CHECKPOINT_METRICS:
            text = _fmt(name, row.get(name))
            change = None if row is first else _change(row.get(name), first.get(name), better, name in ABSOLUTE)
            cells.append(text if change is None else f"{text}\n{change}")
        t.add_row(*cells)
    return t


def _edge(row: dict[str, Any], name: str, side: str) -> float:
    """The interval's ``low`` or ``high`` end of a row's metric, or the value itself without an interval."""
    v = row.get(f"{name}_{side}")
    return float(row[name] if v is None else v)


def checkpoint_plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """One chart per metric across checkpoints on a shared x-axis: each value with its 95% interval as an error
    bar (rejected candidates marked with a cross), each chart labelled eval suite, live or trainer, and rates on a
    scale that holds 0 so that noise is not drawn as a trend."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = checkpoint_figure(rows, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def checkpoint_figure(rows: list[dict[str, Any]], title: str) -> Any:
    """The figure :func:`checkpoint_plot` saves (a matplotlib Figure; the caller closes it)."""
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
    for ax, (name, label, better) in zip(axes.flat, CHECKPOINT_METRICS):
        pts = [r for r in rows if r.get(name) is not None]
        for rejected, style, color, kind in ((False, "o-", "#4C72B0", "promoted"), (True, "x", "#C44E52", "rejected")):
            mine = [r for r in pts if (r["status"] == "rejected") == rejected]
            if not mine:
                continue
            xs, ys = [r["version"] for r in mine], [r[name] for r in mine]
            lows = [r.get(f"{name}_low") for r in mine]
            highs = [r.get(f"{name}_high") for r in mine]
            err = None
            if all(v is not None for v in lows + highs):
                err = [[max(y - lo, 0.0) for y, lo in zip(ys, lows)], [max(hi - y, 0.0) for y, hi in zip(ys, highs)]]
            ax.errorbar(xs, ys, yerr=err, fmt=style, color=color, capsize=3, label=kind)
        tops: list[float] = [_edge(r, name, "high") for r in pts]
        bottoms: list[float] = [_edge(r, name, "low") for r in pts]
        if pts:  # every scale holds 0, so the noise of a flat metric is not drawn as a trend
            top = 1.05 if name == "on_policy_fraction" else max(max(tops) * 1.15, 0.0)
            bottom = min(min(bottoms) * 1.15, 0.0)
            ax.set_ylim(bottom, top if top > bottom else bottom + 1.0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        arrow = "" if better is None else (" (higher is better)" if better else " (lower is better)")
        ax.set_title(f"{label} [{SOURCE[name]}]{arrow}", fontsize=9)
        ax.set_xlabel("checkpoint version", fontsize=8)
        ax.tick_params(labelbottom=True)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        f"{title} - bars: 95% intervals (live: per trajectory); [eval suite] held-out tasks, [live] served traffic"
    )
    fig.tight_layout()
    return fig
