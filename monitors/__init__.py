"""Behaviour monitors: ClickHouse views (schemas/migrations/0002_monitors.sql), alert rules for the
promotion gate (pure, :mod:`monitors.alerts`) and the reads that feed them (:mod:`monitors.queries`).
Analysts' SQL is in ``monitors/ANALYST_QUERIES.md``.

The package exports only the pure rules: importing it (as the pure eval gate does) loads no
ClickHouse client; the reads live in :mod:`monitors.queries`, imported where they are used."""

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

__all__ = [
    "DEFAULT_RULES",
    "Alert",
    "AlertRule",
    "Change",
    "Evaluation",
    "Skipped",
    "evaluate",
    "relative_change",
    "relative_change_ci",
    "standard_error",
]
