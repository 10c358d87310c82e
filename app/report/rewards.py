"""``rtrl rewards compare A B``: how reward version B differs from A over the same trajectories, as tables and a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402


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
