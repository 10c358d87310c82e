"""What the main job shows: behaviour and reward per policy version from ClickHouse, as a table and PNGs.

Figures come from the monitors' views (``behaviour`` over ``trajectories FINAL``, ``reward_stats``
over ``rewards FINAL``) and the A/B comparison with 95% intervals from :func:`monitors.queries.ab_table`.

The tables fit 100 columns: short headers of two lines at most (:data:`HEADERS`, the abbreviations
spelled out in a legend below the table), no outer frame, each change written under its value in at
most six characters (a change of ten times or more as ``×N``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from monitors.alerts import Z95, standard_error  # noqa: E402
from monitors.queries import Side, ab_table, behaviour_rows, reward_stats, user_sums, users_of  # noqa: E402
from monitors.stats import compare  # noqa: E402

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


def _fmt(name: str, v: Any) -> str:
    if v is None:
        return "-"
    if name == "trajectories":
        return f"{int(v):,}"
    if name.endswith("_ms"):
        return f"{v:,.0f}"
    return f"{v:.3f}"


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


# ---------------------------------------------------------------- the closed loop: one row per checkpoint

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


def _wilson(p: float, n: float) -> tuple[float, float]:
    """95% Wilson interval of a proportion p over n samples."""
    if n <= 0:
        return p, p
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * (p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5 / (1 + z2 / n)
    return centre - half, centre + half


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


# ---------------------------------------------------------------- the three lines that open the main job's ending

#: (behaviour column, label) of the headline metrics, as the seed post reports them
HEADLINE = [
    ("edit_persistence", "edits kept"),
    ("dissatisfied_rate", "dissatisfied"),
    ("latency_mean_ms", "latency"),
]


def _p(p: float) -> str:
    """A p-value in at most 7 characters."""
    return "<1e-6" if p < 1e-6 else (f"{p:.1e}" if p < 1e-3 else f"{p:.3f}")


def _headline(label: str, c: Any) -> str:
    """One headline metric of the summary: relative change with its 95% interval in points, '-' without one."""
    return f"{label} -" if c is None else f"{label} {c.relative:+.1%} [{100 * c.low:+.1f}, {100 * c.high:+.1f}]"


def summary_lines(ch: Any, database: str, rows: list[dict[str, Any]], reward_version: str, ab: Any = None) -> list[str]:
    """Three lines of at most 100 characters: v0 -> the final version for the headline metrics (edit persistence,
    dissatisfied follow-ups, mean latency: per user, relative change in % with its 95% interval), the reward
    difference, and the count of promotions and refusals. With ``ab`` (the main job's final live A/B,
    :class:`app.job.FinalAB`) the figures are the A/B's, users randomised between v0 and the final version;
    without, before/after: the versions served at different times.
    ``rows``: :func:`checkpoint_rows`."""
    promoted = [r for r in rows[1:] if r["status"] == "promoted"]
    refused = [r for r in rows[1:] if r["status"] == "rejected"]
    back = [r for r in rows[1:] if r["status"] == "rolled_back"]
    serving = max((r["version"] for r in rows if r["status"] == "promoted"), default=0)
    decisions = (
        f"{len(rows) - 1} candidates: {len(promoted)} promoted, {len(refused)} refused"
        + (f", {len(back)} rolled back" if back else "")
        + f"; v{serving} serves"
    )
    if ab is not None:
        by = {r.metric: r for r in ab.rows}
        parts = []
        for m, label in HEADLINE:
            c = by[m].comparison if m in by else None
            parts.append(_headline(label, c))
        rc = by["reward_mean"].comparison if "reward_mean" in by else None
        reward = f"reward ({reward_version}) -"
        if rc is not None:
            lo, hi = rc.difference_interval
            reward = f"reward ({reward_version}) {rc.difference:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        head = f"v0 -> v{ab.final} (A/B)"
        return [
            f"{head}: " + ", ".join(parts[:2]),
            f"{head}: {parts[2]}, {reward}",
            decisions + "; live A/B by user, 95% CI",
        ]
    # the newest promoted version that served traffic (the one promoted at the last decision has served none yet)
    final = max((r["version"] for r in rows if r["status"] == "promoted" and r["trajectories"]), default=0)
    decisions += (f" (not live: v{final}'s figures)" if final != serving else "") + "; per user, 95% CI"
    if final == 0:
        return ["No promoted candidate has served traffic yet: nothing to compare with v0 live.", "", decisions]
    # per user, as an analyst would query it (monitors.queries.user_sums over trajectories FINAL)
    before, after = (user_sums(ch, database, Side(v, "control")) for v in (0, final))
    parts = []
    for m, label in HEADLINE:
        try:
            c = compare(users_of(before, m), users_of(after, m))
        except ValueError:  # too few users with data for the metric, or a zero baseline
            c = None
        parts.append(_headline(label, c))
    stats = reward_stats(ch, database, reward_version)
    r0, r1 = stats.get(0), stats.get(final)
    reward = f"reward ({reward_version}) -"
    if r0 and r1 and r0.get("reward_var") is not None and r1.get("reward_var") is not None:
        diff = r1["reward_mean"] - r0["reward_mean"]
        se = (r0["reward_var"] / r0["trajectories"] + r1["reward_var"] / r1["trajectories"]) ** 0.5
        reward = f"reward ({reward_version}) {diff:+.3f} [{diff - Z95 * se:+.3f}, {diff + Z95 * se:+.3f}]"
    return [f"v0 -> v{final}: " + ", ".join(parts[:2]), f"v0 -> v{final}: {parts[2]}, {reward}", decisions]


# ---------------------------------------------------------------- the seed's table: the final live A/B


def _value(metric: str, v: float) -> str:
    return f"{v:,.0f}" if metric.endswith("_ms") else f"{v:.4f}"


def final_ab_table(ab: Any, reward_version: str) -> Table:
    """The seed post's table from the main job's final live A/B (:class:`app.job.FinalAB`): per metric v0's and
    the final version's figure, the relative change with its 95% interval and the p-value (per user, the delta
    method; the reward's change is its difference, a reward's sign can change)."""
    arms = list(ab.trajectories.values())
    users = next((r.comparison for r in ab.rows if r.comparison is not None), None)
    who = f"{users.users_control:,} vs {users.users_treatment:,} users" if users is not None else "no users"
    t = Table(
        title=f"Live A/B, v{ab.final} against v0: users randomised by hashed user id ({who}; "
        f"{min(arms):,}+ trajectories per arm, {ab.seconds:.0f}s), per user with 95% CI, from ClickHouse",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for name, justify in [("metric", "left"), ("v0", "right"), (f"v{ab.final}", "right"), ("change", "right")]:
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    t.add_column("95% CI", justify="right")
    t.add_column("p", justify="right")
    for r in ab.rows:
        c = r.comparison
        label = r.label + (f" ({reward_version})" if r.metric == "reward_mean" else "")
        if c is None:
            why = "too few users" if "at least 2" in r.reason else ("v0 at 0" if "is 0" in r.reason else r.reason[:30])
            t.add_row(label, "-", "-", "-", "-", why)
            continue
        if r.metric == "reward_mean":
            lo, hi = c.difference_interval
            change, ci = f"{c.difference:+.3f}", f"[{lo:+.3f}, {hi:+.3f}]"
        else:
            change, ci = f"{c.relative:+.1%}", f"[{c.low:+.1%}, {c.high:+.1%}]"
        good = (c.relative > 0) == (r.better == "up") if r.metric != "reward_mean" else (c.difference > 0)
        colour = ("green" if good else "red") if c.significant else "dim"
        t.add_row(
            label,
            _value(r.metric, c.control),
            _value(r.metric, c.treatment),
            f"[{colour}]{change}[/]",
            ci,
            _p(c.p_value),
        )
    return t


def final_ab_plot(ab: Any, path: Path, reward_version: str) -> Path:
    """The final A/B as a PNG: per metric the relative change (the reward: its difference) with its 95% interval,
    a line at no change."""
    rows = [r for r in ab.rows if r.comparison is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.6 * max(3, len(rows)) + 1.5), gridspec_kw={"width_ratios": [3, 1]})
    try:
        rel = [r for r in rows if r.metric != "reward_mean"]
        ax = axes[0]
        for i, r in enumerate(rel):
            c = r.comparison
            assert c is not None
            good = (c.relative > 0) == (r.better == "up")
            colour = ("tab:green" if good else "tab:red") if c.significant else "tab:gray"
            ax.errorbar(
                [100 * c.relative],
                [i],
                xerr=[[100 * (c.relative - c.low)], [100 * (c.high - c.relative)]],
                fmt="o",
                color=colour,
                capsize=4,
            )
        ax.set_yticks(range(len(rel)), [r.label for r in rel])
        ax.axvline(0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("relative change, % (95% interval)")
        ax.set_title(f"[live] v{ab.final} vs v0", fontsize=10)
        ax = axes[1]
        rw = [r for r in rows if r.metric == "reward_mean"]
        for r in rw:
            c = r.comparison
            assert c is not None
            ax.errorbar([c.difference], [0], xerr=[[Z95 * c.difference_se]], fmt="o", color="tab:blue", capsize=4)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_yticks([0], [f"reward ({reward_version})"])
        ax.set_xlabel("difference (95% interval)")
        ax.set_title("[live] reward", fontsize=10)
        arms = ", ".join(f"{a}: {n:,}" for a, n in ab.trajectories.items())
        fig.suptitle(f"The final live A/B, users randomised by hashed user id (trajectories {arms})", fontsize=10)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


# ---------------------------------------------------------------- rtrl rewards compare A B


def _num(v: float | None, fmt: str = "{:+.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _shift_cells(s: Any) -> list[str]:
    ci = "" if s.shift_low is None else f"\n[{s.shift_low:+.3f}, {s.shift_high:+.3f}]"
    ks = "-" if s.ks is None else f"{s.ks:.2f}\np={s.ks_p:.2g}"
    disc = f"{s.discarded_by_a:,}" + (f"\n({s.discarded_by_a_negative_b:,} < 0)" if s.discarded_by_a else "")
    return [
        f"{s.trajectories:,}",
        f"{s.scored_a:,}/{s.scored_b:,}",
        _num(s.mean_a),
        _num(s.mean_b),
        _num(s.change),
        _num(s.shift) + ci,
        ks,
        _num(s.wasserstein, "{:.3f}"),
        _num(s.spearman, "{:.2f}"),
        f"{s.to_negative:,}/{s.to_positive:,}",
        disc,
        f"{s.discarded_by_b:,}",
    ]


_SHIFT_HEADERS = (
    "traj.",
    "scored\nA/B",
    "mean A",
    "mean B",
    "change",
    "shift B-A\n[95% CI]",
    "KS",
    "W1",
    "rho",
    "flips\n+→- / -→+",
    "discarded\nby A",
    "disc.\nby B",
)
_SHIFT_LEGEND = (
    "traj.: closed trajectories; scored A/B: how many each version has a reward for; mean A, mean B: over what each "
    "scored, and their change; shift: mean of B - A over the trajectories both scored, 95% t interval; KS: "
    "two-sample Kolmogorov-Smirnov statistic and p-value (p treats the versions as independent samples: a guide); "
    "W1: Wasserstein distance; rho: Spearman rank correlation over both scored; flips: reward >= 0 under A and < 0 "
    "under B, and the reverse; discarded by A: scored by B only (in brackets: negative under B)"
)


def reward_comparison_tables(a: str, b: str, pairs: list[Any]) -> list[Table]:
    """The comparison of reward version ``b`` against ``a`` over ``pairs`` (:class:`monitors.reward_compare.Pair`)
    as rich tables: per policy version and org, behaviour flags, the cohorts that move most, and examples."""
    from monitors import reward_compare as rc

    out = []
    t = Table(title=f"reward {b} against {a}, per policy version and org", title_justify="left", box=box.SIMPLE_HEAD)
    t.caption, t.caption_justify = _SHIFT_LEGEND, "left"
    t.add_column("policy\nversion", justify="right")
    t.add_column("org")
    for h in _SHIFT_HEADERS:
        t.add_column(h, justify="right")
    for s in rc.by_policy_version(pairs):
        t.add_row(f"v{s.policy_version}", s.group, *_shift_cells(s), end_section=False)
    out.append(t)
    f = Table(title=f"behaviour flags under A = {a} and B = {b}", title_justify="left", box=box.SIMPLE_HEAD)
    f.caption = "share: of the version's scored trajectories; mean: their mean reward under that version"
    f.caption_justify = "left"
    for col in ("flag", "n A", "share A", "mean A", "n B", "share B", "mean B"):
        f.add_column(col, justify="left" if col == "flag" else "right")
    for r in rc.flag_rows(pairs):
        f.add_row(
            r.flag, f"{r.n_a:,}", _share(r.share_a), _num(r.mean_a), f"{r.n_b:,}", _share(r.share_b), _num(r.mean_b)
        )
    out.append(f)
    m = Table(title="cohorts that move most (org/task kind, all policy versions)", title_justify="left")
    m.box = box.SIMPLE_HEAD
    m.add_column("cohort")
    for h in _SHIFT_HEADERS:
        m.add_column(h, justify="right")
    for s in rc.movers(pairs):
        m.add_row(s.group, *_shift_cells(s))
    out.append(m)
    e = Table(title="trajectories that flip sign or that one version discards (largest moves)", title_justify="left")
    e.box = box.SIMPLE_HEAD
    for col in ("trajectory", "policy", "cohort", a, b):
        e.add_column(col, justify="right" if col in (a, b, "policy") else "left")
    for p in rc.flipped(pairs):
        e.add_row(
            p.trajectory_id,
            f"v{p.policy_version}",
            f"{p.org_id}/{p.task_kind}",
            "discarded" if p.reward_a is None else f"{p.reward_a:+.3f}",
            "discarded" if p.reward_b is None else f"{p.reward_b:+.3f}",
        )
    out.append(e)
    return out


def reward_comparison_plot(a: str, b: str, pairs: list[Any], path: Path) -> Path:
    """Three panels: B against A per trajectory (A's discards on a strip at the left), both distributions, and
    the paired shift per cohort with its 95% interval."""
    from monitors import reward_compare as rc

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5))
    both = [(p.reward_a, p.reward_b) for p in pairs if p.reward_a is not None and p.reward_b is not None]
    only_b = [p.reward_b for p in pairs if p.reward_a is None and p.reward_b is not None]
    values = [v for pair in both for v in pair] + only_b
    lo, hi = (min(values), max(values)) if values else (-1.0, 1.0)
    if both:
        ax1.scatter([x for x, _ in both], [y for _, y in both], s=8, alpha=0.5, label="scored by both")
    if only_b:
        strip = lo - 0.15 * (hi - lo or 1.0)
        ax1.scatter([strip] * len(only_b), only_b, s=8, alpha=0.5, color="tab:red", label=f"discarded by {a}")
    ax1.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, linestyle="--")
    ax1.axhline(0, color="black", linewidth=0.5)
    ax1.set_xlabel(f"reward under {a}")
    ax1.set_ylabel(f"reward under {b}")
    ax1.set_title("per trajectory")
    ax1.legend(loc="upper left", fontsize=8)
    bins = np.linspace(lo, hi, 31) if hi > lo else 10
    for side, label in (("a", a), ("b", b)):
        xs = [p.reward_a if side == "a" else p.reward_b for p in pairs]
        ax2.hist([x for x in xs if x is not None], bins=bins, alpha=0.5, label=label)
    ax2.set_xlabel("reward")
    ax2.set_ylabel("trajectories")
    ax2.set_title("distribution of each version's rewards")
    ax2.legend(fontsize=8)
    moved = [s for s in rc.movers(pairs, top=12) if s.change is not None][::-1]  # the largest on top
    ys = range(len(moved))
    mid = [float(s.change or 0.0) for s in moved]
    low = [m if s.change_low is None else s.change_low for m, s in zip(mid, moved)]
    high = [m if s.change_high is None else s.change_high for m, s in zip(mid, moved)]
    ax3.errorbar(
        mid,
        list(ys),
        xerr=[[m - lo for m, lo in zip(mid, low)], [hi - m for m, hi in zip(mid, high)]],
        fmt="o",
        capsize=3,
    )
    ax3.set_yticks(list(ys), [s.group for s in moved], fontsize=8)
    ax3.axvline(0, color="black", linewidth=0.5)
    ax3.set_xlabel(f"mean reward {b} - {a}, each over what it scored (95% CI)")
    ax3.set_title("cohorts that move most")
    fig.suptitle(f"reward version {b} against {a} ({len(pairs):,} trajectories)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def reward_comparison(
    settings: Any, a: str, b: str, since: int | None, until: int | None, console: Any, client: Any = None
) -> int:
    """``rtrl rewards compare A B``: the tables and ``<data_dir>/reports/rewards-A-vs-B.png``; 1 when no closed
    trajectory lies in the range."""
    from monitors.queries import reward_pairs
    from rtrl import clickhouse
    from rtrl.errors import ConfigError

    db = settings.clickhouse.database
    if client is None:  # read only (no migration): what a read-only analyst may run too
        client = clickhouse.connect(settings.clickhouse_dsn, settings.clickhouse.timeout_s)
    try:
        pairs = reward_pairs(client, db, a, b, since, until)
    except Exception as e:  # noqa: BLE001 - a missing view or grant: say which and what to do
        raise ConfigError(
            f"cannot read {db}.reward_pairs at {clickhouse.redact(settings.clickhouse_dsn)} "
            f"({clickhouse.redact(str(e).splitlines()[0][:300])}); fix: run `rtrl migrate` as the writer, or check clickhouse.dsn "
            "and clickhouse.database"
        ) from None
    if not pairs:
        console.print(
            f"no closed trajectory in {db}.trajectories in the range: nothing to compare (fix: widen --from/--to, "
            "or run the reward flow first)"
        )
        return 1
    for t in reward_comparison_tables(a, b, pairs):
        console.print(t)
    png = reward_comparison_plot(a, b, pairs, settings.data_path / "reports" / f"rewards-{a}-vs-{b}.png")
    console.print(f"plot: {png}")
    return 0


# ---------------------------------------------------------------- per-org adapters (issue 17)


def newcombe(p1: float, n1: float, p2: float, n2: float) -> tuple[float, float]:
    """95% interval of ``p2 - p1`` (Newcombe's hybrid score method from each rate's Wilson interval)."""
    l1, u1 = _wilson(p1, n1)
    l2, u2 = _wilson(p2, n2)
    d = p2 - p1
    return d - ((p2 - l2) ** 2 + (u1 - p1) ** 2) ** 0.5, d + ((u2 - p2) ** 2 + (p1 - l1) ** 2) ** 0.5


def adapter_rows(ch: Any, database: str) -> list[dict[str, Any]]:
    """Per org with adapter decisions: what serves it (its newest promoted adapter version, if any), how many
    versions were promoted, refused and rolled back, and the serving version's gate scores on the org's held-out
    tasks (sampled solve rate with the adapter and of the base alone, over ``eval_samples`` completions) and on the
    global guard."""
    rows = ch.query(
        f"SELECT org, version, base_version, status, eval_results FROM {database}.adapter_checkpoints FINAL "
        "ORDER BY org, version"
    ).result_rows
    out: dict[str, dict[str, Any]] = {}
    for org, version, base, status, ev in rows:
        r = out.setdefault(org, {"org": org, "promoted": 0, "rejected": 0, "rolled_back": 0, "serving": None})
        if status in ("promoted", "rejected", "rolled_back"):
            r[status] += 1
        if status == "promoted":
            r["serving"] = (version, base, dict(ev))
    return list(out.values())


def adapter_table(rows: list[dict[str, Any]]) -> Table:
    """The per-org adapters table: solve rates with and without the adapter, the difference with its 95% interval."""
    t = Table(
        title="Per-org adapters: the serving adapter against the base alone on the org's held-out tasks",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        caption="solve: sampled held-out solve rate (P(solve) over the eval's completions), 95% Newcombe interval; "
        "guard: the global regression guard's solve rate, adapter / base; versions: promoted, refused, rolled back",
        caption_justify="left",
    )
    for name, just in (
        ("org", "left"),
        ("serving", "left"),
        ("base\nsolve", "right"),
        ("adapter\nsolve", "right"),
        ("change [95% CI]", "right"),
        ("guard\nadapter/base", "right"),
        ("versions\n+ / - / back", "right"),
    ):
        t.add_column(name, justify=just)  # type: ignore[arg-type]
    for r in rows:
        counts = f"{r['promoted']} / {r['rejected']} / {r['rolled_back']}"
        if r["serving"] is None:
            t.add_row(r["org"], "base alone", "-", "-", "-", "-", counts)
            continue
        version, base, ev = r["serving"]
        n = ev.get("eval_samples", 0.0)
        a, b = ev.get("solve_rate", 0.0), ev.get("base_solve_rate", 0.0)
        lo, hi = newcombe(b, n, a, n)
        guard = f"{ev.get('guard_solve_rate', 0.0):.3f} / {ev.get('guard_base_solve_rate', 0.0):.3f}"
        t.add_row(
            r["org"],
            f"a{version} on v{base}",
            f"{b:.3f}",
            f"{a:.3f}",
            f"{a - b:+.3f} [{lo:+.3f}, {hi:+.3f}]",
            guard,
            counts,
        )
    return t


def adapter_plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Bars per org: the base alone and the serving adapter on the org's held-out tasks, with 95% intervals."""
    served = [r for r in rows if r["serving"] is not None]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(served) + 2), 3.6))
    x = np.arange(len(served))
    for k, (label, key) in enumerate((("base alone", "base_solve_rate"), ("with its adapter", "solve_rate"))):
        vals: list[float] = []
        errs: list[list[float]] = [[], []]
        for r in served:
            ev = r["serving"][2]
            p, n = ev.get(key, 0.0), ev.get("eval_samples", 0.0)
            lo, hi = _wilson(p, n)
            vals.append(p)
            errs[0].append(p - lo)
            errs[1].append(hi - p)
        ax.bar(x + (k - 0.5) * 0.38, vals, 0.38, yerr=errs, capsize=3, label=label)
    ax.set_xticks(x, [f"{r['org']}\na{r['serving'][0]} on v{r['serving'][1]}" for r in served])
    ax.set_ylabel("held-out solve rate (sampled)")
    ax.set_title("Per-org adapters on their org's held-out tasks")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
