"""Per-org adapters, measured: the shared policy alone (a) against the shared policy plus an adapter per specialised org (b).

    .venv/bin/python bench/per_org.py [--cycles 16] [--tasks 128] [--group-size 16] [--seeds 1] [--orgs 4]
        [--specialised 2] [--specialised-share 0.5] [--min-samples 256] [--rank 8] [--alpha 16] [--adapter-lr 0.002] [--adapter-kl 0.3]
        [--adapter-kl-estimator full] [--shared-traffic served] [--revalidate-scales 0.5]

The experiment of :mod:`app.per_org`: the last ``--specialised`` of ``--orgs`` orgs follow a convention of their
own on two task kinds (:func:`simulator.tasks.conventions_for`: with the defaults org-2's reviewers want the tests
run first and org-3's a search, where every other org's read the file first, :data:`simulator.tasks.GLOBAL_HABIT`);
the specialised orgs carry ``--specialised-share`` of the traffic (0.5: every org the same share);
both arms see the same seeded traffic from the same warm start; in (b) each specialised org's adapter trains on its adapter stream, is gated and, once
promoted, serves its org. Printed, for every org, on 200 held-out tasks of that org the gate never sees, after
the last cycle:

1. P(solve) (the exact probability that a sampled completion solves a task) of (a) the shared policy alone and
   of (b) what serves the org (its adapter when one is promoted, else the shared policy), and their difference
   (b) - (a) with a 95% interval: Student t over seeds when there are several (each seed is a whole run), else
   paired over the org's held-out tasks (the same tasks scored by both arms; normal interval); the greedy solve
   rates, (b)'s greedy rate on the org's convention kinds and on its general kinds apart, and (b)'s shared
   policy alone (the adapter's gain over the base it sits on);
2. the gate's decisions per org over the run: promoted, refused (candidates and re-validations), revalidated,
   rescaled (passed at a fraction of its effect) and retired.

The verdict lines say whether each specialised org's (b) beats (a) (the interval above 0) and whether each other
org stays within ``--tolerance`` of (a) (the point difference >= -tolerance). PNG: ``bench/per_org.png``: per
org, P(solve) per cycle of (a), of (b) served and of (b)'s shared policy alone (mean over seeds). Record the
figures in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from app.per_org import ARMS, Experiment, OrgRow, run_arm
from rtrl.quiet import quiet_known_warnings
from simulator.tasks import conventions_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for bench.long_loop
from bench.long_loop import (  # noqa: E402  # the long-loop bench's helpers
    Z,
    every_arm_and_seed,
    machine_and_time,
    save_figure,
    seed_interval,
)


def paired_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean of the per-task differences b - a with a 95% normal interval (the same tasks scored twice)."""
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(diffs)
    half = Z * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return mean, mean - half, mean + half


def difference(shared: list[OrgRow], served: list[OrgRow]) -> tuple[float, float, float, str]:
    """(b) served - (a) shared P(solve) with its interval and how it was taken, over the seeds' final rows."""
    if len(shared) > 1:
        per_seed = [y.served_expected - x.shared_expected for x, y in zip(shared, served, strict=True)]
        return (*seed_interval(per_seed), "t over seeds")
    return (*paired_interval(list(shared[0].shared_probs), list(served[0].served_probs)), "paired over tasks")


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def main() -> None:
    quiet_known_warnings()
    d = Experiment()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=d.cycles)
    ap.add_argument("--tasks", type=int, default=d.tasks_per_cycle, help="prompts per cycle")
    ap.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--orgs", type=int, default=d.orgs)
    ap.add_argument("--specialised", type=int, default=d.specialised, help="the last orgs have a convention")
    ap.add_argument(
        "--specialised-share", type=float, default=d.specialised_share, help="the specialised orgs' traffic share"
    )
    ap.add_argument("--min-samples", type=int, default=d.min_samples, help="adapters.min_samples")
    ap.add_argument("--rank", type=int, default=d.rank, help="adapters.rank")
    ap.add_argument("--alpha", type=float, default=d.alpha, help="adapters.alpha")
    ap.add_argument("--adapter-lr", type=float, default=d.adapter_lr, help="adapters.lr (0 = train.lr)")
    ap.add_argument("--adapter-kl", type=float, default=d.adapter_kl, help="adapters.kl_coef (0 = loss.kl_coef)")
    ap.add_argument(
        "--adapter-updates", type=int, default=d.adapter_updates, help="adapters.updates_per_step (1: no reuse)"
    )
    ap.add_argument(
        "--adapter-targets",
        default=",".join(d.adapter_targets),
        help="adapters.targets, comma-separated (empty: the default, the layers' four linears and output_layer)",
    )
    ap.add_argument(
        "--adapter-kl-estimator",
        default=d.adapter_kl_estimator,
        choices=("full", "k3", ""),
        help="adapters.kl_estimator ('' = loss.kl_estimator)",
    )
    ap.add_argument(
        "--shared-traffic",
        default=d.shared_traffic,
        choices=("all", "unadapted", "served"),
        help="adapters.shared_traffic; served: all, an adapted org's batches through the adapter that served them",
    )
    ap.add_argument(
        "--revalidate-scales",
        default=",".join(f"{x:g}" for x in d.revalidate_scales),
        help="adapters.revalidate_scales (comma-separated; '' = retire a refused re-validation at once)",
    )
    ap.add_argument("--tolerance", type=float, default=0.03, help="largest P(solve) loss an other org may show")
    args = ap.parse_args()
    console = Console(width=220)  # wide tables stay readable when the output goes to a file
    started = time.monotonic()

    def one(arm: str, seed: int) -> list[OrgRow]:
        exp = Experiment(
            cycles=args.cycles,
            tasks_per_cycle=args.tasks,
            group_size=args.group_size,
            orgs=args.orgs,
            specialised=args.specialised,
            specialised_share=args.specialised_share,
            min_samples=args.min_samples,
            rank=args.rank,
            alpha=args.alpha,
            adapter_lr=args.adapter_lr,
            adapter_kl=args.adapter_kl,
            adapter_kl_estimator=args.adapter_kl_estimator,
            adapter_updates=args.adapter_updates,
            adapter_targets=tuple(t for t in args.adapter_targets.split(",") if t),
            shared_traffic=args.shared_traffic,
            revalidate_scales=tuple(float(x) for x in args.revalidate_scales.split(",") if x.strip()),
            seed=seed,
        )

        def show(rows: list[OrgRow]) -> None:
            cells = " | ".join(
                f"{r.org} {r.served_expected:.3f}" + (f" ({r.served_by})" if r.served_by != "shared" else "")
                for r in rows
            )
            console.print(f"  seed {seed} {arm:<8} cycle {rows[0].cycle:>2}/{args.cycles}: P(solve) {cells}")

        return run_arm(arm, exp, progress=show)

    results = every_arm_and_seed(console, list(ARMS), args.seeds, one)
    report(console, results, args.orgs, args.specialised, args.cycles, args.tolerance)
    machine_and_time(console, started)
    plot(results, args.cycles, Path(__file__).with_name("per_org.png"))


def _final(runs: list[list[OrgRow]], org: str) -> list[OrgRow]:
    """Each seed's row of ``org`` after the last cycle."""
    return [[r for r in rows if r.org == org][-1] for rows in runs]


def report(
    console: Console, results: dict[str, list[list[OrgRow]]], orgs: int, specialised: int, cycles: int, tol: float
) -> None:
    conventions = conventions_for(orgs, specialised)
    seeds = len(results["shared"])
    how = "Student t over seeds" if seeds > 1 else "paired over the org's tasks"
    table = Table(
        title=f"Per-org adapters after {cycles} cycles, {seeds} seed(s): (a) the shared policy alone, (b) the shared "
        f"policy plus the specialised orgs' adapters; interval: {how}"
    )
    for col in ("org", "convention", "(a) P(solve)", "(b) served P(solve)", "(b) - (a) [95% CI]", "greedy (a) -> (b)",
                "(b) greedy conv / general", "(b) base alone", "(b) served by", "gate: prom / ref / reval / resc / retired"):  # fmt: skip
        table.add_column(
            col, justify="left" if col in ("org", "convention", "(b) served by") else "right", no_wrap=True
        )
    verdicts = []
    for org in [f"org-{i}" for i in range(orgs)]:
        a, b = _final(results["shared"], org), _final(results["adapters"], org)
        diff, lo, hi, _ = difference(a, b)
        conv = conventions.get(org)
        counts = {k: 0 for k in ("rescaled", "promoted", "refused", "revalidated", "retired")}
        for rows in results["adapters"]:
            for r in rows:
                if r.org == org:
                    for dec in r.decisions:
                        counts[next(k for k in counts if k in dec)] += 1
        table.add_row(
            org,
            conv.describe() if conv else "global",
            _fmt(statistics.fmean(r.shared_expected for r in a)),
            _fmt(statistics.fmean(r.served_expected for r in b)),
            f"{diff:+.3f} [{lo:+.3f}, {hi:+.3f}]",
            f"{_fmt(statistics.fmean(r.shared_success for r in a))} -> "
            f"{_fmt(statistics.fmean(r.served_success for r in b))}",
            f"{_fmt(statistics.fmean(r.served_convention for r in b))} / "
            f"{_fmt(statistics.fmean(r.served_general for r in b))}",
            _fmt(statistics.fmean(r.shared_expected for r in b)),
            ", ".join(sorted({r.served_by for r in b})),
            " / ".join(str(counts[k]) for k in ("promoted", "refused", "revalidated", "rescaled", "retired")),
        )
        if conv:
            ok = lo > 0
            verdicts.append(
                f"{org} (specialised): (b) beats (a) by {diff:+.3f}, interval above 0: {'yes' if ok else 'NO'}"
            )
        else:
            ok = diff >= -tol
            verdicts.append(f"{org} (global): (b) - (a) = {diff:+.3f} >= -{tol}: {'yes' if ok else 'NO'}")
    console.print(table)
    console.print(
        "P(solve): the exact probability that a sampled completion solves a held-out task of the org, averaged over "
        "its 200 report tasks (a stream the gate's suite never draws from); greedy: the share the greedy completion "
        "solves. The interval of (b) - (a): Student t over seeds with several seeds, else paired over the org's "
        "tasks (one run: it says how sure the figure is for this run, not across runs)."
    )
    for v in verdicts:
        console.print(v)


def plot(results: dict[str, list[list[OrgRow]]], cycles: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    orgs = sorted({r.org for rows in results["shared"] for r in rows})
    cols = min(len(orgs), 4)
    nrows = math.ceil(len(orgs) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.3 * nrows), squeeze=False, sharey=True)
    xs = list(range(1, cycles + 1))

    def curve(runs: list[list[OrgRow]], org: str, attr: str) -> list[float]:
        per_seed = [[r for r in rows if r.org == org] for rows in runs]
        return [statistics.fmean(getattr(rows[i], attr) for rows in per_seed) for i in range(cycles)]

    for ax, org in zip(axes.flat, orgs):
        spec = next(r.specialised for r in results["shared"][0] if r.org == org)
        ax.plot(xs, curve(results["shared"], org, "shared_expected"), marker="o", ms=3, label="(a) shared alone")
        ax.plot(xs, curve(results["adapters"], org, "served_expected"), marker="o", ms=3, label="(b) served")
        ax.plot(xs, curve(results["adapters"], org, "shared_expected"), ls="--", label="(b) its shared policy alone")
        ax.set_title(f"{org} ({'own convention' if spec else 'global convention'})", fontsize=10)
        ax.set_xlabel("cycle (base version)")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(orgs) :]:
        ax.set_visible(False)
    axes.flat[0].set_ylabel("held-out P(solve)")
    axes.flat[0].legend(fontsize=7)
    save_figure(fig, "Per-org adapters: each org's held-out P(solve) per cycle (mean over seeds)", path)


if __name__ == "__main__":
    main()
