"""The seed post's table and plot from the main job's final live A/B: v0 against the final version, per user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from monitors.alerts import Z95  # noqa: E402


def _p(p: float) -> str:
    """A p-value in at most 7 characters."""
    return "<1e-6" if p < 1e-6 else (f"{p:.1e}" if p < 1e-3 else f"{p:.3f}")


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
