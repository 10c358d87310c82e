"""Behaviour monitors: ClickHouse views (schemas/migrations/0002_monitors.sql), alert rules for the
promotion gate (pure, :mod:`monitors.alerts`) and the reads that feed them (:mod:`monitors.queries`).
Analysts' SQL is in ``monitors/ANALYST_QUERIES.md``."""

from monitors.alerts import (
    DEFAULT_RULES,
    Alert,
    AlertRule,
    Change,
    Evaluation,
    Skipped,
    evaluate,
    relative_change,
    relative_change_ci,
    standard_error,
)
from monitors.queries import (
    AB_METRICS,
    GateReport,
    ab_table,
    behaviour,
    behaviour_rows,
    check_promotion,
    format_ab_table,
    reward_stats,
)

__all__ = [
    "AB_METRICS",
    "DEFAULT_RULES",
    "Alert",
    "AlertRule",
    "Change",
    "Evaluation",
    "GateReport",
    "Skipped",
    "ab_table",
    "behaviour",
    "behaviour_rows",
    "check_promotion",
    "evaluate",
    "format_ab_table",
    "relative_change",
    "relative_change_ci",
    "reward_stats",
    "standard_error",
]
