"""Long-loop feedback, measured: drop delayed samples (a), train them with correction (b), or without (c).

    .venv/bin/python bench/long_loop.py [--cycles 12] [--tasks 256] [--seeds 3] [--long-share 0.2] [--verdict-cycles 3]

The experiment of :mod:`app.long_loop`: 20% of the tasks are background tasks whose verdict arrives about
three cycles after the rollout; the three arms see the same seeded traffic from the same warm start. Printed:

1. per arm, the held-out success (greedy solve rate on 200 held-out tasks of each kind) of the final policy,
   averaged over seeds, with a 95% interval (Wilson's on the pooled tasks), KL to the reference and gradient
   norms of the last cycles, and how many delayed samples were trained or dropped;
2. the figure and its baseline measured in the same run: long-task success of (b) against (a), and of (c)
   against (a), as a difference with a 95% interval paired by held-out task (same tasks, same seeds) and as a
   ratio; the same for short tasks (the delayed path must not hurt them).

PNG: ``bench/long_loop.png``: long-task success, short-task success, KL and gradient norm per cycle, one line
per arm (mean over seeds). Record the figures in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from app.long_loop import ARMS, CycleRow, Experiment, run_arm

Z = 1.96


def wilson(hits: int, n: int) -> tuple[float, float]:
    """95% Wilson interval of a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    centre, half = p + Z * Z / (2 * n), Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return ((centre - half) / (1 + Z * Z / n), (centre + half) / (1 + Z * Z / n))


def paired_difference(a: list[bool], b: list[bool]) -> tuple[float, float, float]:
    """Mean of b - a over paired binary outcomes, with a 95% normal interval of the paired differences."""
    d = [int(y) - int(x) for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(d)
    se = statistics.pstdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    return mean, mean - Z * se, mean + Z * se


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--tasks", type=int, default=256, help="prompts per cycle (x4 samples)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--long-share", type=float, default=0.2)
    ap.add_argument("--verdict-cycles", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    console = Console()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    results: dict[str, list[list[CycleRow]]] = {a: [] for a in arms}
    started = time.monotonic()
    for seed in range(args.seeds):
        exp = Experiment(
            cycles=args.cycles,
            tasks_per_cycle=args.tasks,
            long_share=args.long_share,
            verdict_cycles=args.verdict_cycles,
            seed=seed,
        )
        for arm in arms:
            t = time.monotonic()

            def show(r: CycleRow, arm: str = arm, seed: int = seed) -> None:
                console.print(
                    f"  seed {seed} {arm:<11} cycle {r.cycle:>2}/{args.cycles}: long {r.long_success:.3f} short "
                    f"{r.short_success:.3f} kl {r.kl:.4f} grad {r.grad_norm:.3f} delayed {r.delayed_samples} "
                    f"(lag {r.delayed_lag:.1f}) dropped {r.dropped} verdicts {r.verdicts}"
                )

            results[arm].append(run_arm(arm, exp, progress=show))
            console.print(f"seed {seed} arm {arm}: {time.monotonic() - t:.0f} s")

    table = Table(title=f"Long-loop experiment: final policy after {args.cycles} cycles, {args.seeds} seed(s)")
    for col in ("arm", "long success [95% CI]", "short success [95% CI]", "KL (last 3)", "grad norm (last 3)",
                "delayed trained", "dropped"):  # fmt: skip
        table.add_column(col, justify="right" if col != "arm" else "left")
    final = {a: [runs[-1] for runs in results[a]] for a in arms}
    for a in arms:
        longs = [x for r in final[a] for x in r.long_solved]
        shorts = [x for r in final[a] for x in r.short_solved]
        lo, hi = wilson(sum(longs), len(longs))
        slo, shi = wilson(sum(shorts), len(shorts))
        tail = [r for runs in results[a] for r in runs[-3:]]
        table.add_row(
            a,
            f"{sum(longs) / len(longs):.3f} [{lo:.3f}, {hi:.3f}]",
            f"{sum(shorts) / len(shorts):.3f} [{slo:.3f}, {shi:.3f}]",
            f"{statistics.fmean(r.kl for r in tail):.4f}",
            f"{statistics.fmean(r.grad_norm for r in tail):.3f}",
            f"{sum(r.delayed_samples for runs in results[a] for r in runs):,}",
            f"{sum(runs[-1].dropped for runs in results[a]):,}",
        )
    console.print(table)
    if "drop" in arms:
        base = final["drop"]
        cmp = Table(title="Against the baseline measured in the same run: (a) drop")
        for col in ("arm", "kind", "success", "baseline (a)", "difference [95% CI, paired by task]", "ratio"):
            cmp.add_column(col, justify="right" if col not in ("arm", "kind") else "left")
        for a in arms:
            if a == "drop":
                continue
            for kind in ("long", "short"):
                xs = [x for r in base for x in getattr(r, f"{kind}_solved")]
                ys = [x for r in final[a] for x in getattr(r, f"{kind}_solved")]
                d, lo, hi = paired_difference(xs, ys)
                pa, pb = sum(xs) / len(xs), sum(ys) / len(ys)
                cmp.add_row(a, kind, f"{pb:.3f}", f"{pa:.3f}", f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]",
                            f"{pb / pa:.2f}" if pa else "inf")  # fmt: skip
        console.print(cmp)
    console.print(
        f"{platform.node()} {platform.processor() or platform.machine()}: {time.monotonic() - started:.0f} s in all"
    )
    plot(results, args.cycles, Path(__file__).with_name("long_loop.png"))


def plot(results: dict[str, list[list[CycleRow]]], cycles: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = (
        ("long_success", "long-task held-out success (greedy)"),
        ("short_success", "short-task held-out success (greedy)"),
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
    fig.suptitle("Delayed verdicts (about 3 cycles late, 20% of tasks): drop vs train with and without correction")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
