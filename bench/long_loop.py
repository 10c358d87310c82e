"""Long-loop feedback, measured: drop delayed samples (a), train them with correction (b), or without (c).

    .venv/bin/python bench/long_loop.py [--cycles 12] [--tasks 512] [--seeds 3] [--long-share 0.2] [--verdict-cycles 3]

The experiment of :mod:`app.long_loop`: 20% of the tasks are background tasks whose verdict arrives about
three cycles after the rollout; the three arms see the same seeded traffic from the same warm start. Printed:

1. per arm, the held-out success of the final policy on 200 held-out tasks of each kind, pooled over seeds:
   P(solve), the exact probability that a sampled completion solves a task (a smooth measure), with a 95%
   interval, and the greedy solve rate with Wilson's; KL to the reference and gradient norms of the last
   cycles; how many delayed samples were trained or dropped;
2. the figure and its baseline measured in the same run: P(solve) of (b) against (a), and of (c) against
   (a), as the mean of per-seed differences with a 95% Student-t interval over seeds (each seed is a whole
   run; the held-out tasks of one run are not independent draws), each seed's difference, and the ratio; for
   long tasks (the point) and short tasks (the delayed path must not hurt them).

PNG: ``bench/long_loop.png``: long- and short-task P(solve), KL and gradient norm per cycle, one line per
arm (mean over seeds). Record the figures in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table

from app.long_loop import ARMS, CycleRow, Experiment, run_arm
from rtrl.quiet import quiet_known_warnings

Z = 1.96
R = TypeVar("R")


def wilson(hits: int, n: int) -> tuple[float, float]:
    """95% Wilson interval of a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    centre, half = p + Z * Z / (2 * n), Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return ((centre - half) / (1 + Z * Z / n), (centre + half) / (1 + Z * Z / n))


def mean_ci(xs: list[float]) -> tuple[float, float, float]:
    """Mean with a 95% normal interval (standard error of the mean)."""
    mean = statistics.fmean(xs)
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return mean, mean - Z * se, mean + Z * se


def seed_interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean of per-seed differences with a 95% Student-t interval over seeds (each seed is one whole training
    run: the tasks of one run are not independent draws of the arms' difference)."""
    from scipy import stats

    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, float("nan"), float("nan")
    half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, mean - half, mean + half


def main() -> None:
    quiet_known_warnings()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--tasks", type=int, default=512, help="prompts per cycle (x4 samples)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--long-share", type=float, default=0.2)
    ap.add_argument("--verdict-cycles", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    console = Console(width=200)  # wide tables stay readable when the output goes to a file
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    started = time.monotonic()

    def one(arm: str, seed: int) -> list[CycleRow]:
        exp = Experiment(
            cycles=args.cycles,
            tasks_per_cycle=args.tasks,
            long_share=args.long_share,
            verdict_cycles=args.verdict_cycles,
            seed=seed,
        )

        def show(r: CycleRow) -> None:
            console.print(
                f"  seed {seed} {arm:<11} cycle {r.cycle:>2}/{args.cycles}: long {r.long_success:.3f} short "
                f"{r.short_success:.3f} kl {r.kl:.4f} grad {r.grad_norm:.3f} delayed {r.delayed_samples} "
                f"(lag {r.delayed_lag:.1f}) dropped {r.dropped} verdicts {r.verdicts}"
            )

        return run_arm(arm, exp, progress=show)

    results = every_arm_and_seed(console, arms, args.seeds, one)

    final = {a: [runs[-1] for runs in results[a]] for a in arms}
    table = Table(title=f"Long-loop experiment: the policy after {args.cycles} cycles, {args.seeds} seed(s)")
    for col in ("arm", "long: P(solve) [95% CI]", "short: P(solve) [95% CI]", "long greedy [95% CI]",
                "short greedy [95% CI]", "KL (last 3)", "grad norm (last 3)", "delayed trained", "dropped"):  # fmt: skip
        table.add_column(col, justify="right" if col != "arm" else "left")
    for a in arms:
        cells = []
        for kind in ("long", "short"):
            probs = [p for r in final[a] for p in getattr(r, f"{kind}_probs")]
            m, lo, hi = mean_ci(probs)
            cells.append(f"{m:.3f} [{lo:.3f}, {hi:.3f}]")
        for kind in ("long", "short"):
            solved = [x for r in final[a] for x in getattr(r, f"{kind}_solved")]
            lo, hi = wilson(sum(solved), len(solved))
            cells.append(f"{sum(solved) / len(solved):.3f} [{lo:.3f}, {hi:.3f}]")
        tail = [r for runs in results[a] for r in runs[-3:]]
        table.add_row(
            a,
            *cells,
            f"{statistics.fmean(r.kl for r in tail):.4f}",
            f"{statistics.fmean(r.grad_norm for r in tail):.3f}",
            f"{sum(r.delayed_samples for runs in results[a] for r in runs):,}",
            f"{sum(runs[-1].dropped for runs in results[a]):,}",
        )
    console.print(table)
    console.print(
        "P(solve): the probability that a sampled completion solves a held-out task, exactly (any first token, then "
        "the right edit), averaged over the tasks of every seed; greedy: the share of tasks the greedy completion "
        "solves. These intervals are over the held-out tasks; the comparison below takes its intervals over seeds."
    )
    if "drop" in arms:
        base = final["drop"]
        cmp = Table(
            title="Against the baseline measured in the same run, (a) drop: P(solve) of the final policy; the "
            "interval is over seeds (each seed a whole run, paired with (a)'s run on the same seed)"
        )
        for col in ("arm", "kind", "P(solve)", "baseline (a)", "difference [95% CI over seeds]", "per seed", "ratio"):
            cmp.add_column(col, justify="right" if col not in ("arm", "kind") else "left")
        for a in arms:
            if a == "drop":
                continue
            for kind in ("long", "short"):
                per_seed = [
                    statistics.fmean(getattr(y, f"{kind}_probs")) - statistics.fmean(getattr(x, f"{kind}_probs"))
                    for x, y in zip(base, final[a], strict=True)
                ]
                d, lo, hi = seed_interval(per_seed)
                pa = statistics.fmean(p for r in base for p in getattr(r, f"{kind}_probs"))
                pb = statistics.fmean(p for r in final[a] for p in getattr(r, f"{kind}_probs"))
                cmp.add_row(
                    a,
                    kind,
                    f"{pb:.3f}",
                    f"{pa:.3f}",
                    f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]",
                    " ".join(f"{x:+.3f}" for x in per_seed),
                    f"{pb / pa:.2f}",
                )
        console.print(cmp)
    machine_and_time(console, started)
    plot(results, args.cycles, Path(__file__).with_name("long_loop.png"))


def every_arm_and_seed(
    console: Console, arms: list[str], seeds: int, one: Callable[[str, int], list[R]]
) -> dict[str, list[list[R]]]:
    """``one(arm, seed)`` (a whole run's rows) for every seed and arm, seed by seed, each run's time printed."""
    results: dict[str, list[list[R]]] = {a: [] for a in arms}
    for seed in range(seeds):
        for arm in arms:
            t = time.monotonic()
            results[arm].append(one(arm, seed))
            console.print(f"seed {seed} arm {arm}: {time.monotonic() - t:.0f} s")
    return results


def machine_and_time(console: Console, started: float) -> None:
    """The machine and the wall time since ``started`` (``time.monotonic()``), under a bench's tables."""
    console.print(
        f"{platform.node()} {platform.processor() or platform.machine()}: {time.monotonic() - started:.0f} s in all"
    )


def save_figure(fig: Any, title: str, path: Path) -> None:
    """Title, lay out and write a bench's figure (110 dpi), and say where."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot(results: dict[str, list[list[CycleRow]]], cycles: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = (
        ("long_expected", "long tasks: held-out P(solve)"),
        ("short_expected", "short tasks: held-out P(solve)"),
        ("kl", "KL to the reference (mean over the cycle's steps)"),
        ("grad_norm", "gradient norm (mean over the cycle's steps)"),
    )
    labels = {
        "drop": "(a) drop delayed",
        "corrected": "(b) delayed, truncated IS",
        "uncorrected": "(c) delayed, no correction",
    }
    for ax, (attr, title) in zip(axes.flat, panels):
        for arm, runs in results.items():
            xs = list(range(1, cycles + 1))
            ys = [statistics.fmean(getattr(run[i], attr) for run in runs) for i in range(cycles)]
            ax.plot(xs, ys, marker="o", markersize=3, label=labels.get(arm, arm))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("cycle (policy version)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    save_figure(
        fig, "Delayed verdicts (about 3 cycles late, 20% of tasks): drop vs train with and without correction", path
    )


if __name__ == "__main__":
    main()
