"""What the main job shows: behaviour and reward per policy version from ClickHouse, as a table and PNGs.

Figures come from the monitors' views (``behaviour`` over ``trajectories FINAL``, ``reward_stats``
over ``rewards FINAL``) and the A/B comparison with 95% intervals from :func:`monitors.queries.ab_table`.

The tables fit 100 columns: short headers of two lines at most (:data:`HEADERS`, the abbreviations
spelled out in a legend below the table), no outer frame, each change written under its value in at
most six characters (a change of ten times or more as ``×N``).

The package re-exports every public name of its modules, one concern each:

- :mod:`app.report.versions`: one row per policy version (:func:`version_rows`), its table, the A/B
  comparison against the first version and the plot (``rtrl ab``).
- :mod:`app.report.checkpoints`: one row per checkpoint of the closed loop (:func:`checkpoint_rows`), its
  table and plot.
- :mod:`app.report.summary`: the three lines that open the main job's ending (:func:`summary_lines`).
- :mod:`app.report.final_ab`: the final live A/B's table and plot (:func:`final_ab_table`, :func:`final_ab_plot`).
- :mod:`app.report.rewards`: ``rtrl rewards compare A B`` (:func:`reward_comparison`).
- :mod:`app.report.adapters`: per-org adapters (:func:`adapter_rows`, :func:`adapter_table`, :func:`adapter_plot`).
- :mod:`app.report.cells` and :mod:`app.report.stats`: what the others share: the tables' headers and cells, and
  Wilson's and Newcombe's 95% intervals.
"""

from __future__ import annotations

from app.report.adapters import adapter_plot, adapter_rows, adapter_table
from app.report.cells import ABSOLUTE, HEADERS
from app.report.checkpoints import (
    CHECKPOINT_METRICS,
    SOURCE,
    checkpoint_figure,
    checkpoint_plot,
    checkpoint_rows,
    checkpoint_table,
)
from app.report.final_ab import final_ab_plot, final_ab_table
from app.report.rewards import reward_comparison, reward_comparison_plot, reward_comparison_tables
from app.report.stats import newcombe
from app.report.summary import HEADLINE, summary_lines
from app.report.versions import METRICS, comparison, plot, table, version_rows

__all__ = [
    # per policy version
    "METRICS",
    "comparison",
    "plot",
    "table",
    "version_rows",
    # per checkpoint
    "CHECKPOINT_METRICS",
    "SOURCE",
    "checkpoint_figure",
    "checkpoint_plot",
    "checkpoint_rows",
    "checkpoint_table",
    # the summary lines
    "HEADLINE",
    "summary_lines",
    # the final live A/B
    "final_ab_plot",
    "final_ab_table",
    # rtrl rewards compare
    "reward_comparison",
    "reward_comparison_plot",
    "reward_comparison_tables",
    # per-org adapters
    "adapter_plot",
    "adapter_rows",
    "adapter_table",
    # shared: table cells, intervals
    "ABSOLUTE",
    "HEADERS",
    "newcombe",
]
