"""Per-org adapters: what serves each org, its gate scores against the base alone, as a table and a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402

from app.report.stats import _wilson, newcombe  # noqa: E402


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
