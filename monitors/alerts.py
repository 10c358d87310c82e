"""Alert rules for the promotion gate: pure functions of two rows of behaviour metrics, no I/O.

A rule says which way a metric must not move and how far (relative to the parent version):
the broken-tool-call rate must not rise (the seed post's first reward hack), the edit rate must
not fall (the second), and so on. :func:`evaluate` compares a candidate's row with its parent's
and returns an :class:`Evaluation` that says, separately, which rules fired (``alerts``), which
could not be judged for lack of data (``skipped``) and which were checked and passed.

:class:`MismatchRule` and :func:`mismatch_alerts` judge the trainer's own steps (``train_metrics``
rows): a step whose training-inference mismatch (k3 KL or largest absolute log-ratio between the
behaviour log-probs and the trainer's on on-policy tokens) is above a limit fires, and the eval gate
refuses a candidate trained by such a step.

:func:`relative_change_ci` and :func:`standard_error` turn the view's n / mean / variance
figures into a relative change with a 95% confidence interval (delta method on a ratio of
independent estimates), as in the seed post's A/B table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Direction = Literal["increase", "decrease"]

Z95 = 1.96  # two-sided 95% normal quantile (rounded, as in the views' order-statistic ranks)


@dataclass(frozen=True)
class AlertRule:
    """One guarded metric of the ``behaviour`` view."""

    metric: str
    """Column of the behaviour row, e.g. ``broken_tool_call_rate``."""
    direction: Direction
    """The direction that is *bad*: ``increase`` (e.g. broken calls) or ``decrease`` (e.g. edit rate)."""
    threshold: float
    """Largest tolerated relative move in the bad direction: 0.2 = 20% of the parent's value."""
    min_samples: int = 200
    """Both versions need at least this many samples (column ``samples``) or the rule is skipped."""
    floor: float = 0.0
    """Absolute floor for tiny baselines: the relative change is taken against max(|parent|, floor),
    so a parent rate of 0.001 (or 0) does not turn a trivial absolute move into a huge relative one."""
    samples: str = "trajectories"
    """Column holding the metric's sample count (``edit_persistence_n`` for persistence, ``latency_n`` for latency)."""

    def __post_init__(self) -> None:
        if self.direction not in ("increase", "decrease"):
            raise ValueError(
                f"AlertRule({self.metric}).direction must be 'increase' or 'decrease', not {self.direction!r}"
            )
        if not self.threshold > 0:
            raise ValueError(f"AlertRule({self.metric}).threshold must be > 0 (a relative change, 0.2 = 20%)")
        if self.min_samples < 0 or self.floor < 0:
            raise ValueError(f"AlertRule({self.metric}).min_samples and floor must be >= 0")


#: What the promotion gate watches by default (both reward-hacking lessons of the seed post first).
DEFAULT_RULES: tuple[AlertRule, ...] = (
    AlertRule("broken_tool_call_rate", "increase", 0.20, floor=0.01),
    AlertRule("edit_rate", "decrease", 0.10, floor=0.05),
    AlertRule("clarification_rate", "increase", 0.25, floor=0.02),
    AlertRule("edit_persistence", "decrease", 0.05, min_samples=100, samples="edit_persistence_n"),
    AlertRule("dissatisfied_rate", "increase", 0.15, floor=0.02),
    AlertRule("latency_p95_ms", "increase", 0.20, floor=100.0, samples="latency_n"),
)


@dataclass(frozen=True)
class Alert:
    """A rule that fired: the candidate moved the metric too far in the bad direction."""

    metric: str
    direction: Direction
    parent: float
    candidate: float
    relative_change: float
    """(candidate - parent) / max(|parent|, floor); +-inf when that base is 0."""
    threshold: float
    message: str


@dataclass(frozen=True)
class Skipped:
    """A rule that could not be judged: too few samples, or no value on one side."""

    metric: str
    reason: str
    candidate_samples: float
    parent_samples: float


@dataclass(frozen=True)
class Evaluation:
    """The outcome of every rule: fired, skipped, or checked and passed."""

    alerts: tuple[Alert, ...]
    skipped: tuple[Skipped, ...]
    passed: tuple[str, ...]
    """Metrics whose rule was evaluated and did not fire."""

    @property
    def insufficient(self) -> bool:
        """True when at least one rule could not be judged for lack of data."""
        return bool(self.skipped)

    @property
    def ok(self) -> bool:
        """Strict verdict: every rule was judged and none fired. (``not alerts`` is the lenient one.)"""
        return not self.alerts and not self.skipped

    def summary(self) -> str:
        """One line for a checkpoint's ``reason``."""
        parts = [a.message for a in self.alerts]
        parts += [f"{s.metric} not judged: {s.reason}" for s in self.skipped]
        if not parts:
            return f"behaviour ok: {', '.join(self.passed)} within limits"
        return "; ".join(parts)


def _number(row: Mapping[str, object], key: str, side: str) -> float | None:
    if key not in row:
        raise KeyError(f"{side} row has no column {key!r}; fix the AlertRule or read the row from the behaviour view")
    v = row[key]
    if v is None:
        return None
    v = float(v)  # type: ignore[arg-type]
    return None if math.isnan(v) else v


def relative_change(parent: float, candidate: float, floor: float = 0.0) -> float:
    """(candidate - parent) / max(|parent|, floor); 0 when equal, +-inf when the base is 0."""
    delta = candidate - parent
    base = max(abs(parent), floor)
    if base == 0:
        return 0.0 if delta == 0 else math.copysign(math.inf, delta)
    return delta / base


def evaluate(
    candidate: Mapping[str, object],
    parent: Mapping[str, object],
    rules: Sequence[AlertRule] = DEFAULT_RULES,
) -> Evaluation:
    """Judge a candidate's behaviour row against its parent's with each rule.

    A rule fires when the relative change in its bad direction is strictly above its threshold.
    It is skipped (not fired, not passed) when either version has fewer than ``min_samples``
    samples or no value for the metric. A rule naming a column the rows do not have raises
    KeyError: a misspelt rule must not pass silently.
    """
    alerts: list[Alert] = []
    skipped: list[Skipped] = []
    passed: list[str] = []
    for rule in rules:
        n_c = _number(candidate, rule.samples, "candidate") or 0.0
        n_p = _number(parent, rule.samples, "parent") or 0.0
        c = _number(candidate, rule.metric, "candidate")
        p = _number(parent, rule.metric, "parent")
        if n_c < rule.min_samples or n_p < rule.min_samples:
            reason = f"{rule.samples} candidate {n_c:g}, parent {n_p:g}; need {rule.min_samples} each"
            skipped.append(Skipped(rule.metric, reason, n_c, n_p))
            continue
        if c is None or p is None:
            side = "candidate" if c is None else "parent"
            skipped.append(Skipped(rule.metric, f"no value for the {side}", n_c, n_p))
            continue
        rel = relative_change(p, c, rule.floor)
        bad = rel if rule.direction == "increase" else -rel
        if bad > rule.threshold:
            verb = "rose" if c > p else "fell"
            floored = f" (against floor {rule.floor:g})" if rule.floor > abs(p) else ""
            message = (
                f"{rule.metric} {verb} {abs(rel):.1%}{floored}: {p:.4g} -> {c:.4g}; "
                f"limit {rule.threshold:.0%} {rule.direction}"
            )
            alerts.append(Alert(rule.metric, rule.direction, p, c, rel, rule.threshold, message))
        else:
            passed.append(rule.metric)
    return Evaluation(tuple(alerts), tuple(skipped), tuple(passed))


# ---------------------------------------------------------------- training-inference mismatch


@dataclass(frozen=True)
class MismatchRule:
    """Limits on the training-inference mismatch the trainer measures per step (``train_metrics``:
    ``mismatch_k3``, ``mismatch_max_abs_log_ratio``, over on-policy trained tokens).

    A large mismatch means the log-probs the inference engine sampled with and the trainer's disagree
    (numerics, a stale or wrong checkpoint, a tokenizer or sampling bug): the importance ratios are then
    noise and the update is not what the loss says. The trainer recomputes log-probs with the weights it
    has, which within a cycle have moved on from the sampling version, so the measure also holds the
    policy's own drift since then (on the loop's defaults a step's largest |log-ratio| reached ~7 and its
    mean k3 2.4 from drift alone, against ~5e-7 at the first step of a cycle): the default limit (max
    |log-ratio| 15, k3 not checked) sits well above that and catches a sampler that does not sample from
    the weights it reports (a wrong checkpoint, a temperature, a tokenizer mismatch), not bf16-level noise."""

    k3: float = 0.0
    """Largest tolerated per-step mean k3 KL(behaviour || trainer); 0 = not checked (the default,
    ``loop.mismatch_k3_max``: the mean is heavy-tailed under drift, one token with a log-ratio of 5.6
    among 112 gave 2.4)."""
    max_abs_log_ratio: float = 15.0
    """Largest tolerated per-step max |trainer - behaviour log-prob| (15: a ratio of e^15); 0 = not checked
    (default: ``loop.mismatch_log_ratio_max``)."""

    def __post_init__(self) -> None:
        for name in ("k3", "max_abs_log_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"MismatchRule.{name} must be a finite number >= 0 (0 = not checked), not {v!r}")

    @property
    def limits(self) -> dict[str, float]:
        """train_metrics column -> limit, for the limits that are checked."""
        both = {"mismatch_k3": self.k3, "mismatch_max_abs_log_ratio": self.max_abs_log_ratio}
        return {k: v for k, v in both.items() if v > 0}


@dataclass(frozen=True)
class StepAlert:
    """A trainer step whose mismatch exceeded a :class:`MismatchRule` limit."""

    run_id: str
    step: int
    metric: str
    value: float
    threshold: float
    message: str


def _step_field(row: object, key: str) -> object:
    if isinstance(row, Mapping):
        if key not in row:
            raise KeyError(f"train_metrics row has no column {key!r} (migration 0007_train_safety adds it)")
        return row[key]
    return getattr(row, key)


def mismatch_alerts(steps: Iterable[object], rule: MismatchRule = MismatchRule()) -> tuple[StepAlert, ...]:
    """The steps whose mismatch is above ``rule``'s limits (strictly; NaN fires), in order.

    ``steps`` are ``train_metrics`` rows: :class:`schemas.records.TrainStep` records or mappings with the
    columns ``run_id``, ``step``, ``mismatch_k3`` and ``mismatch_max_abs_log_ratio``."""
    out: list[StepAlert] = []
    for row in steps:
        for metric, limit in rule.limits.items():
            v = float(_step_field(row, metric))  # type: ignore[arg-type]
            if v <= limit:
                continue
            run_id, step = str(_step_field(row, "run_id")), int(_step_field(row, "step"))  # type: ignore[call-overload]
            message = f"{metric} {v:.4g} > {limit:g} at step {step} of run {run_id}"
            out.append(StepAlert(run_id, step, metric, v, limit, message))
    return tuple(out)


def mismatch_summary(alerts: Sequence[StepAlert]) -> str:
    """One line for a checkpoint's reason: how many steps fired and the worst value per metric."""
    if not alerts:
        return "training-inference mismatch within limits"
    parts = []
    for metric in dict.fromkeys(a.metric for a in alerts):
        worst = max((a for a in alerts if a.metric == metric), key=lambda a: (math.isnan(a.value), a.value))
        steps = sorted({a.step for a in alerts if a.metric == metric})
        parts.append(f"{metric} above {worst.threshold:g} in {len(steps)} step(s), worst {worst.message}")
    return "training-inference mismatch: " + "; ".join(parts)


# ---------------------------------------------------------------- confidence intervals

#: metric -> (variance column, sample-count column) for metrics that are means or ratios of means
VARIANCE_COLUMNS: dict[str, tuple[str, str]] = {
    "edit_rate": ("edit_rate_var", "trajectories"),
    "clarification_rate": ("clarification_rate_var", "trajectories"),
    "broken_tool_call_rate": ("broken_tool_call_rate_var", "trajectories"),
    "trajectories_with_broken_rate": ("trajectories_with_broken_rate_var", "trajectories"),
    "edit_persistence": ("edit_persistence_var", "edit_persistence_n"),
    "dissatisfied_rate": ("dissatisfied_rate_var", "trajectories"),
    "latency_mean_ms": ("latency_var", "latency_n"),
    "reward_mean": ("reward_var", "trajectories"),
}

#: quantile metric -> (low, high) columns of its distribution-free 95% interval
QUANTILE_CI_COLUMNS: dict[str, tuple[str, str]] = {
    "latency_p50_ms": ("latency_p50_ci_low_ms", "latency_p50_ci_high_ms"),
    "latency_p95_ms": ("latency_p95_ci_low_ms", "latency_p95_ci_high_ms"),
}


def standard_error(row: Mapping[str, object], metric: str) -> float | None:
    """Standard error of ``row[metric]`` from the view's figures; None when undefined.

    Means and ratios: sqrt(var / n). Quantiles: (high - low) / (2 * 1.96) of the order-statistic
    95% interval, the normal-equivalent width of that interval.
    """
    if metric in VARIANCE_COLUMNS:
        var_col, n_col = VARIANCE_COLUMNS[metric]
        var, n = _number(row, var_col, "metric"), _number(row, n_col, "metric")
        if var is None or not n:
            return None
        return math.sqrt(var / n)
    if metric in QUANTILE_CI_COLUMNS:
        lo_col, hi_col = QUANTILE_CI_COLUMNS[metric]
        lo, hi = _number(row, lo_col, "metric"), _number(row, hi_col, "metric")
        if lo is None or hi is None:
            return None
        return (hi - lo) / (2 * Z95)
    raise KeyError(
        f"no standard error is defined for {metric!r}; known: {sorted(VARIANCE_COLUMNS) + sorted(QUANTILE_CI_COLUMNS)}"
    )


@dataclass(frozen=True)
class Change:
    """Relative change of B against A with its confidence interval."""

    relative: float
    """m_b / m_a - 1."""
    se: float
    low: float
    high: float


def relative_change_ci(
    m_a: float | None, se_a: float | None, m_b: float | None, se_b: float | None, z: float = Z95
) -> Change | None:
    """Relative change m_b/m_a - 1 of two independent estimates with a delta-method interval.

    se = (m_b/m_a) * sqrt(se_a^2/m_a^2 + se_b^2/m_b^2), written as sqrt(r^2 se_a^2 + se_b^2)/|m_a|
    (r = m_b/m_a) so that m_b = 0 is defined; with se^2 = s^2/n it is the usual ratio-of-means
    formula. None when an input is missing or m_a is 0.
    """
    if m_a is None or m_b is None or se_a is None or se_b is None or m_a == 0:
        return None
    r = m_b / m_a
    se = math.sqrt(r * r * se_a * se_a + se_b * se_b) / abs(m_a)
    return Change(r - 1.0, se, r - 1.0 - z * se, r - 1.0 + z * se)
