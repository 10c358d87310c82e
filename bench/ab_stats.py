"""A/B error rates, measured: A/A false alarms under continuous peeking, power, CUPED, time to catch the v1 hack.

    .venv/bin/python bench/ab_stats.py [--world loop|abworld] [--sims 200] [--looks 12] [--users 2000] [--seed 0]

Everything is simulated per user (simulator/abworld.py: heavy-tailed activity capped at 20x, persistent user
traits) and judged by monitors/stats.py and monitors/alerts.py; nothing else runs. ``--world loop`` (the
default) draws each trajectory's figures from the closed loop's users (``abworld.LoopPools``: v0's outcome rates,
groups of four per task, :func:`simulator.world.reaction`, strictness by user id; each user's reactions pooled once
and resampled), the reactions the main job's final A/B measures; who asks how often stays abworld's heavy tail.
``--world abworld`` draws from abworld's per-user rates (about 10 s). What each figure means:

1. **A/A false alarms with continuous peeking.** ``--sims`` experiments with no difference between the arms;
   each is looked at ``--looks`` times as its traffic grows (one period of traffic per look). An experiment
   raises a false alarm when a test fires at any look. Reported per metric: the behaviour monitors' fixed
   relative thresholds (``monitors.alerts.DEFAULT_RULES``, what the loop's A/B mode used), a fixed-horizon
   z-test at p < 0.05 looked at every time (the baseline), and the always-valid mSPRT (tau 0.1). The ratio is
   mSPRT / baseline; the nominal rate is 0.05, and the title's +- is three binomial standard errors of the
   simulation. For latency the monitor's rule reads the p95 (``latency_p95_ms``) while the two tests compare
   per-user mean latency (a quantile is not a ratio of per-user sums).
2. **Power.** The minimum relative effect a one-look test at alpha 0.05 detects with 80% power, per headline
   metric, against users per arm, from the relative change's standard error (median over A/A runs), with and
   without CUPED (each user's pre-period figures as covariate). The ratio is CUPED / plain.
3. **CUPED.** The variance of the difference with CUPED over without, per metric (mean over runs).
4. **The v1 hack.** Broken tool calls doubled on the treatment arm (the eval suite saw 0.0975 -> 0.17..0.295
   under v1-discard-broken, bench/RESULTS.md): how many treatment-arm trajectories until the mSPRT, looked at
   every 200 trajectories, fires; median and 90th percentile over runs.

PNG: ``bench/ab_stats.png`` (``--world loop``) or ``bench/ab_stats_abworld.png`` (minimum detectable effect
against users per arm).
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

from monitors.alerts import DEFAULT_RULES, evaluate
from monitors.stats import Sequential, compare, min_detectable_effect
from simulator import abworld

#: abworld metric -> the behaviour view's column the monitors' rule reads
RULE_COLUMN = {
    "broken": "broken_tool_call_rate",
    "edit": "edit_rate",
    "clarify": "clarification_rate",
    "persistence": "edit_persistence",
    "dissatisfied": "dissatisfied_rate",
    "latency_ms": "latency_p95_ms",
}
HEADLINE = ("persistence", "dissatisfied", "latency_ms", "broken")


def _row(pop: abworld.Population, total: dict, lat: np.ndarray, owner: np.ndarray, arm: int) -> dict:
    """The behaviour view's figures of one arm (what monitors.alerts.evaluate reads)."""
    sel = pop.arm == arm
    n = total["broken"][1][sel].sum()
    row: dict[str, float | None] = {"trajectories": float(n)}
    for m in ("broken", "edit", "clarify", "dissatisfied"):
        row[RULE_COLUMN[m]] = float(total[m][0][sel].sum() / n) if n else None
    checks = total["persistence"][1][sel].sum()
    row["edit_persistence"] = float(total["persistence"][0][sel].sum() / checks) if checks else None
    row["edit_persistence_n"] = float(checks)
    mine = lat[sel[owner.astype(np.int64)]]
    row["latency_p95_ms"] = float(np.quantile(mine, 0.95)) if mine.size else None
    row["latency_n"] = float(mine.size)
    return row


def false_alarms(
    world: abworld.World, sims: int, looks: int, seed: int, period=abworld.period
) -> dict[str, dict[str, float]]:
    metrics = list(RULE_COLUMN)
    fired = {k: dict.fromkeys(metrics, 0) for k in ("monitor", "fixed", "msprt")}
    for s in track(range(sims), description="A/A experiments (peeking at every look)"):
        rng = np.random.default_rng(seed * 100_000 + s)
        pop = abworld.population(world, rng)
        seq = {m: Sequential(tau=0.1, min_users=100) for m in metrics}
        hit = {k: dict.fromkeys(metrics, False) for k in fired}
        total: dict[str, list[np.ndarray]] = {}
        lats, owners = [], []
        for _ in range(looks):
            now = period(world, pop, rng)
            lat, owner = now.pop(abworld.TRAJECTORY_LATENCIES)
            lats.append(lat)
            owners.append(owner)
            for m, (num, den) in now.items():
                if m in total:
                    total[m][0] = total[m][0] + num
                    total[m][1] = total[m][1] + den
                else:
                    total[m] = [num, den]
            rows = [_row(pop, total, np.concatenate(lats), np.concatenate(owners), a) for a in (0, 1)]
            alerts = {a.metric for a in evaluate(rows[1], rows[0], DEFAULT_RULES).alerts}
            for m in metrics:
                hit["monitor"][m] |= RULE_COLUMN[m] in alerts
                control, treatment = abworld.arms(pop, {m: (total[m][0], total[m][1])}, m)
                look = seq[m].look(control, treatment)
                hit["fixed"][m] |= look.comparison.p_value < 0.05
                hit["msprt"][m] |= look.decided
        for k in fired:
            for m in metrics:
                fired[k][m] += hit[k][m]
    return {k: {m: v / sims for m, v in d.items()} for k, d in fired.items()}


def power(world: abworld.World, sizes: list[int], runs: int, seed: int, period=abworld.period) -> tuple[dict, dict]:
    """Per size and headline metric: (MDE plain, MDE CUPED) and the mean CUPED variance ratio."""
    mde: dict[int, dict[str, tuple[float, float]]] = {}
    ratio: dict[str, list[float]] = {m: [] for m in HEADLINE}
    for size in track(sizes, description="power by users per arm"):
        w = abworld.World(users=2 * size, per_user=world.per_user, orgs=world.orgs)
        ses: dict[str, list[tuple[float, float]]] = {m: [] for m in HEADLINE}
        for r in range(runs):
            rng = np.random.default_rng(seed * 1_000 + size + r)
            pop = abworld.population(w, rng)
            pre = period(w, pop, rng)
            now = period(w, pop, rng)
            for m in HEADLINE:
                plain = compare(*abworld.arms(pop, now, m))
                cup = compare(*abworld.arms(pop, now, m, pre=pre), cuped=True)
                ses[m].append((plain.relative_se, cup.relative_se))
                ratio[m].append(cup.variance_ratio)
        mde[size] = {
            m: (
                min_detectable_effect(float(np.median([a for a, _ in v]))),
                min_detectable_effect(float(np.median([b for _, b in v]))),
            )
            for m, v in ses.items()
        }
    return mde, {m: float(np.mean(v)) for m, v in ratio.items()}


def hack_detection(world: abworld.World, runs: int, seed: int, every: int = 200, period=abworld.period) -> list[float]:
    """Treatment-arm trajectories until the mSPRT on broken calls fires, with broken calls doubled."""
    out = []
    for r in track(range(runs), description="v1 hack: trajectories to the alarm"):
        rng = np.random.default_rng(seed * 7_000 + r)
        pop = abworld.population(world, rng)
        seq = Sequential(tau=0.1, min_users=100)
        num = np.zeros(world.users)
        den = np.zeros(world.users)
        served = 0.0
        for _ in range(400):
            step = every / (world.per_user * world.users / 2 * float(np.mean(pop.activity)))
            now = period(world, pop, rng, effects={"broken": 2.0}, scale=step)
            num, den = num + now["broken"][0], den + now["broken"][1]
            served = float(den[pop.arm == 1].sum())
            control, treatment = abworld.arms(pop, {"broken": (num, den)}, "broken")
            if control.n >= 2 and treatment.n >= 2 and seq.look(control, treatment).decided:
                break
        out.append(served if seq.decided else math.inf)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sims", type=int, default=200, help="A/A experiments (>= 200 for the issue's figure)")
    ap.add_argument("--looks", type=int, default=12, help="looks per A/A experiment")
    ap.add_argument("--users", type=int, default=2000, help="users in an A/A experiment (both arms)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--world",
        choices=("loop", "abworld"),
        default="loop",
        help="loop: the closed loop's world (simulator/world.py, what the main job's A/B sees); abworld: per-user rates",
    )
    ap.add_argument("--runs", type=int, default=20, help="A/A runs per size for power and CUPED")
    args = ap.parse_args()
    # the loop's users: each user's reactions pooled once (simulator.world.reaction), resampled per period
    period = abworld.LoopPools(seed=args.seed).period if args.world == "loop" else abworld.period
    console = Console()
    t0 = time.monotonic()
    world = abworld.World(users=args.users, per_user=1.0)
    console.print(
        f"{platform.node()} · {platform.processor() or platform.machine()} · world {args.world} · {args.sims} A/A "
        f"experiments of {args.users:,} users, {args.looks} looks each"
    )
    fa = false_alarms(world, args.sims, args.looks, args.seed, period)
    slack = 3 * math.sqrt(0.05 * 0.95 / args.sims)
    t = Table(title=f"A/A false alarms with {args.looks} looks (nominal 0.05; 3 simulation SE: +-{slack:.3f})")
    t.add_column("metric (view column)", no_wrap=True)
    for c in ("monitor rule", "z, peeking (baseline)", "mSPRT", "ratio"):
        t.add_column(c, justify="right")
    for m in RULE_COLUMN:
        base, seq = fa["fixed"][m], fa["msprt"][m]
        t.add_row(
            RULE_COLUMN[m], f"{fa['monitor'][m]:.3f}", f"{base:.3f}", f"{seq:.3f}", f"{seq / base:.2f}" if base else "-"
        )
    console.print(t)

    sizes = [500, 1000, 2000, 5000, 10000]
    mde, ratio = power(abworld.World(per_user=3.0), sizes, runs=args.runs, seed=args.seed, period=period)
    t = Table(title="Minimum detectable relative effect, 80% power, alpha 0.05, one look (plain / CUPED)")
    t.add_column("users per arm", justify="right")
    for m in HEADLINE:
        t.add_column(m, justify="right")
    for size in sizes:
        t.add_row(f"{size:,}", *(f"{mde[size][m][0]:.1%} / {mde[size][m][1]:.1%}" for m in HEADLINE))
    console.print(t)
    t = Table(title="CUPED: variance of the difference with / without (pre-period of the same length)")
    t.add_column("metric")
    t.add_column("variance ratio", justify="right")
    t.add_column("MDE ratio", justify="right")
    for m in HEADLINE:
        t.add_row(m, f"{ratio[m]:.2f}", f"{math.sqrt(ratio[m]):.2f}")
    console.print(t)

    served = hack_detection(abworld.World(users=4000, per_user=1.0), runs=50, seed=args.seed, period=period)
    finite = [s for s in served if math.isfinite(s)]
    console.print(
        f"v1 hack (broken calls x2 on the treatment arm): the mSPRT fired in {len(finite)}/{len(served)} runs after "
        f"a median of {np.median(finite):,.0f} treatment trajectories (p90 {np.quantile(finite, 0.9):,.0f})"
        if finite
        else "v1 hack: the mSPRT never fired"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m in HEADLINE:
        (line,) = ax.plot(sizes, [100 * mde[s][m][0] for s in sizes], marker="o", label=f"{m}")
        ax.plot(sizes, [100 * mde[s][m][1] for s in sizes], marker="o", ls="--", color=line.get_color())
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("users per arm")
    ax.set_ylabel("minimum detectable effect (%)")
    ax.set_title(f"80% power, alpha 0.05: solid plain, dashed CUPED (simulated, world {args.world})")
    ax.legend()
    fig.tight_layout()
    out = Path(__file__).with_name("ab_stats.png" if args.world == "loop" else "ab_stats_abworld.png")
    fig.savefig(out, dpi=110)
    console.print(f"plot: {out} · {time.monotonic() - t0:.0f}s")


if __name__ == "__main__":
    main()
