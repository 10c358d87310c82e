"""The three lines that open the main job's ending: v0 against the final version, and the gate's decisions."""

from __future__ import annotations

from typing import Any

from monitors.alerts import Z95
from monitors.queries import Side, reward_stats, user_sums, users_of
from monitors.stats import compare

#: (behaviour column, label) of the headline metrics, as the seed post reports them
HEADLINE = [
    ("edit_persistence", "edits kept"),
    ("dissatisfied_rate", "dissatisfied"),
    ("latency_mean_ms", "latency"),
]


def _headline(label: str, c: Any) -> str:
    """One headline metric of the summary: relative change with its 95% interval in points, '-' without one."""
    return f"{label} -" if c is None else f"{label} {c.relative:+.1%} [{100 * c.low:+.1f}, {100 * c.high:+.1f}]"


def summary_lines(ch: Any, database: str, rows: list[dict[str, Any]], reward_version: str, ab: Any = None) -> list[str]:
    """Three lines of at most 100 characters: v0 -> the final version for the headline metrics (edit persistence,
    dissatisfied follow-ups, mean latency: per user, relative change in % with its 95% interval), the reward
    difference, and the count of promotions and refusals. With ``ab`` (the main job's final live A/B,
    :class:`app.job.FinalAB`) the figures are the A/B's, users randomised between v0 and the final version;
    without, before/after: the versions served at different times.
    ``rows``: :func:`app.report.checkpoints.checkpoint_rows`."""
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
