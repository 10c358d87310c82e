"""An analyst's first look at a finished rtrl run: checkpoints and gate decisions, the A/B arms with 95%
intervals, dead letters by kind, and one PNG (training loss, held-out and live solve rates per version).

    python examples/analyst.py                    # the embedded folder .rtrl/clickhouse, opened with chdb
    python examples/analyst.py --dsn 'http://rtrl_analyst@127.0.0.1:8123/?password_file=.rtrl/clickhouse/rtrl-auth/rtrl_analyst.token'
    python examples/analyst.py --out /tmp/run.png

The DSN is ``--dsn``, else ``RTRL_ANALYST_DSN``, else ``chdb://<data_dir>/clickhouse`` (``RTRL_DATA_DIR``,
default ``.rtrl``): chdb lets one process hold a folder, so while ``rtrl run`` or ``rtrl clickhouse serve``
holds it, use the front's analyst DSN instead (monitors/ANALYST_QUERIES.md, "Connect"). Cells are marked
``# %%`` (VS Code, PyCharm, Jupytext run them one at a time). Every query is a block of
monitors/ANALYST_QUERIES.md, read by its heading, so this script runs exactly the documented SQL.
"""

# %% Settings: where the run is and where the plot goes
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import monitors  # noqa: E402
from rtrl.clickhouse import connect  # noqa: E402
from rtrl.errors import RtrlError  # noqa: E402

DATA_DIR = Path(os.environ.get("RTRL_DATA_DIR", ".rtrl"))
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--dsn",
    default=os.environ.get("RTRL_ANALYST_DSN", ""),
    help="chdb:///folder or http(s)://rtrl_analyst@host:port/?password_file=… (default: RTRL_ANALYST_DSN, "
    "else chdb://<data_dir>/clickhouse)",
)
parser.add_argument("--database", default=os.environ.get("RTRL_CLICKHOUSE__DATABASE", "rtrl"), help="rtrl's database")
parser.add_argument("--out", type=Path, default=DATA_DIR / "reports" / "analyst.png", help="the PNG to write")
args, _ = parser.parse_known_args()  # known only: a notebook kernel passes its own arguments
dsn = args.dsn or f"chdb://{(DATA_DIR / 'clickhouse').resolve()}"
console = Console(width=100)

# %% The documented queries, by heading
QUERIES_MD = Path(monitors.__file__).resolve().parent / "ANALYST_QUERIES.md"


def documented_queries(database: str) -> dict[str, str]:
    """The ```sql block of each section of ANALYST_QUERIES.md by its heading, for ``database``."""
    out = {}
    for section in re.split(r"^## ", QUERIES_MD.read_text(), flags=re.M)[1:]:
        blocks = re.findall(r"```sql\n(.*?)```", section, flags=re.S)
        if blocks:
            out[section.splitlines()[0].strip()] = re.sub(r"\brtrl\.(?=[a-z_]+\b)", f"{database}.", blocks[0])
    return out


QUERIES = documented_queries(args.database)

# %% Connect (read-only through the front, or the folder itself with chdb)
if dsn.startswith("chdb://") and not Path(dsn[len("chdb://") :], "metadata").is_dir():
    sys.exit(f"error: no embedded ClickHouse in {dsn[len('chdb://') :]}; run rtrl run first, or pass --dsn")
try:
    ch = connect(dsn)
except RtrlError as e:
    held = "; if rtrl run or rtrl clickhouse serve holds the folder, pass the front's analyst DSN with --dsn"
    sys.exit(f"error: {e}{held if dsn.startswith('chdb://') else ''}")


def rows(title: str) -> list[dict[str, Any]]:
    """The rows of the documented query ``title`` as dicts."""
    return list(ch.query(QUERIES[title]).named_results())


def num(v: Any, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


console.print(f"[bold]rtrl run at {dsn.split('?')[0]}[/] (database {args.database})")

# %% Checkpoints and the gate's decisions
checkpoints = rows("Gate decisions and eval results per checkpoint")
table = Table(title="Checkpoints and gate decisions (held-out evals)", header_style="bold")
for col in ("version", "status", "steps", "tokens", "solve", "greedy solve", "broken calls", "clarify", "on-policy"):
    table.add_column(col, justify="right")
for c in checkpoints:
    colour = {"promoted": "green", "rejected": "red", "rolled_back": "yellow"}.get(c["status"], "white")
    table.add_row(
        f"v{c['version']}" + ("" if c["parent"] is None else f" ← v{c['parent']}"),
        f"[{colour}]{c['status']}[/]",
        f"{c['steps']:,}",
        f"{c['tokens']:,}",
        num(c["solve_rate"]),
        num(c["greedy_solve_rate"]),
        num(c["broken_tool_call_rate"]),
        num(c["clarify_rate"]),
        num(c["on_policy_fraction"]),
    )
console.print(table)
for c in checkpoints:
    reason = c["reason"] if len(c["reason"]) <= 180 else c["reason"][:179] + "…"
    console.print(f"  v{c['version']} {c['status']}: {reason}", highlight=False)

# %% The A/B arms: rates with 95% Wilson intervals per policy version and arm
ARM_METRICS = {
    "accepted_edit_rate": "solved",
    "edit_rate": "edits",
    "clarification_rate": "asks",
    "trajectories_with_broken_rate": "broken",
    "dissatisfied_rate": "dissatisfied",
}
arms: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
for r in rows("Behaviour of each arm with 95% intervals"):
    arms.setdefault((r["policy_version"], r["arm"]), {})[r["metric"]] = r
table = Table(title="A/B arms: share of trajectories, 95% Wilson interval", header_style="bold")
for col in ("version", "arm", "n", *ARM_METRICS.values()):
    table.add_column(col, justify="right")
for (version, arm), by_metric in arms.items():
    n = next(iter(by_metric.values()))["trajectories"]
    cells = [
        f"{num(m['rate'])}\n{num(m['ci_low'])}–{num(m['ci_high'])}" if (m := by_metric.get(metric)) else "-"
        for metric in ARM_METRICS
    ]
    table.add_row(f"v{version}", arm, f"{n:,}", *cells)
console.print(table)

# %% Each candidate against the control arm over the same minutes (difference, 95% interval)
table = Table(title="Candidate minus control arm over the same minutes (bold: significant)", header_style="bold")
for col in ("candidate", "metric", "n ctl/cand", "control", "cand.", "difference", "95% interval"):
    table.add_column(col, justify="right", no_wrap=True)
for r in rows("Candidate arm against the control arm over the same minutes"):
    style = "bold" if r["ci_low"] > 0 or r["ci_high"] < 0 else ""
    table.add_row(
        f"v{r['candidate_version']}",
        ARM_METRICS.get(r["metric"], r["metric"]),
        f"{r['control_n']:,}/{r['candidate_n']:,}",
        num(r["control_rate"]),
        num(r["candidate_rate"]),
        f"{r['difference']:+.3f}",
        f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]",
        style=style,
    )
console.print(table)

# %% Dead letters by kind: what input was rejected, and why
table = Table(title="Dead letters by kind", header_style="bold")
table.add_column("kind")
table.add_column("source")
table.add_column("letters", justify="right")
table.add_column("last at", no_wrap=True)
table.add_column("example reason", no_wrap=True)
for r in rows("Dead letters by kind"):
    reason = r["example_reason"] if len(r["example_reason"]) <= 32 else r["example_reason"][:31] + "…"
    table.add_row(r["kind"], r["source"], f"{r['letters']:,}", f"{r['last_at']:%Y-%m-%d %H:%M:%S}", reason)
console.print(table)

# %% One plot: training loss per step, held-out and live solve rates per version
steps = rows("Training metrics per step")
fig, (loss_ax, eval_ax, live_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
x = 0
for version in sorted({s["policy_version"] for s in steps}):
    run = [s for s in steps if s["policy_version"] == version]
    loss_ax.plot(range(x, x + len(run)), [s["loss"] for s in run], ".-", label=f"from v{version}")
    x += len(run)
loss_ax.set_title("training loss per step", fontsize=10)
loss_ax.set_xlabel("optimizer step (all runs)")
if steps:
    loss_ax.legend(fontsize=7)

for key, label in (("solve_rate", "sampled"), ("greedy_solve_rate", "greedy")):
    pts = [(c["version"], c[key], c["status"]) for c in checkpoints if c[key] is not None]
    eval_ax.plot(
        [v for v, _, s in pts if s != "rejected"], [y for _, y, s in pts if s != "rejected"], "o-", label=label
    )
    rejected = [(v, y) for v, y, s in pts if s == "rejected"]
    if rejected:
        eval_ax.plot(*zip(*rejected), "x", color="#C44E52", label=f"{label}, rejected")
eval_ax.set_title("held-out solve rate per checkpoint", fontsize=10)
eval_ax.set_xlabel("checkpoint version")
eval_ax.legend(fontsize=7)

for offset, arm in ((-0.08, "control"), (0.08, "candidate")):
    live = [(v, m["accepted_edit_rate"]) for (v, a), m in arms.items() if a == arm and "accepted_edit_rate" in m]
    if live:
        live_ax.errorbar(
            [v + offset for v, _ in live],
            [m["rate"] for _, m in live],
            yerr=[[m["rate"] - m["ci_low"] for _, m in live], [m["ci_high"] - m["rate"] for _, m in live]],
            fmt="o",
            capsize=3,
            label=f"{arm} arm",
        )
live_ax.set_title("live solve rate (edit kept), 95% Wilson", fontsize=10)
live_ax.set_xlabel("policy version")
live_ax.legend(fontsize=7)
for ax in (loss_ax, eval_ax, live_ax):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
fig.suptitle(f"rtrl run: {dsn.split('?')[0]}", fontsize=10)
fig.tight_layout()
args.out.parent.mkdir(parents=True, exist_ok=True)
fig.savefig(args.out, dpi=100)
plt.close(fig)
console.print(f"plot: {args.out}")
