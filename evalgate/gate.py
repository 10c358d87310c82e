"""The promotion gate's rules and decision: pure functions of score rows, no I/O, no models.

A candidate is promoted when its solve metric did not drop by more than ``solve_tolerance`` below
the serving version's and no behaviour rule (:class:`monitors.alerts.AlertRule`) fires against the
serving version - nor, with ``compare_with_first``, against the first version (v0), which catches
slow drift: many small steps, each within the limits of its parent, that add up.

Each of those comparisons is also a statistical test with a stated error rate (``alpha``): a move counts only
when it is significant. A rate (a score in [0, 1] over the suite's ``samples`` completions) is tested with
Fisher's exact one-sided test, and Holm's step-down correction over every comparison of the decision (each rule
against the serving and the first version, and the solve metric) keeps the chance of refusing a candidate no
different from what serves at or below ``alpha``. The thresholds stay as the smallest move worth refusing for:
with a large suite a tiny but real move is significant, and it should not refuse a candidate. Scores that are
not rates (counts, say) are judged by their thresholds alone. ``alpha=None``: thresholds alone for every score.

A candidate trained by a step whose training-inference mismatch fired :class:`monitors.alerts.MismatchRule`
(``GateRules.mismatch``) is refused too: its update was computed from log-probs the sampler did not use.

The behaviour metrics are rates over ``samples`` sampled completions; every rule's sample-count
column (``trajectories`` for the default rules) is set to ``samples`` on both sides, so a rule with
``min_samples`` above it is skipped rather than fired (as :func:`monitors.alerts.evaluate` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from monitors.alerts import AlertRule, MismatchRule, evaluate, mismatch_alerts, mismatch_summary
from monitors.stats import holm, rate_increase_p

#: the eval gate's behaviour rules on sampled held-out completions (rates of 0..1)
EVAL_RULES: tuple[AlertRule, ...] = (
    AlertRule("broken_tool_call_rate", "increase", 0.25, floor=0.03),
    AlertRule("clarify_rate", "increase", 0.5, floor=0.05),
    AlertRule("edit_rate", "decrease", 0.1, floor=0.05),
)

#: (label, metric) pairs a promotion's reason quotes from the candidate's scores, when it has them
SUMMARY_METRICS: tuple[tuple[str, str], ...] = (("broken", "broken_tool_call_rate"), ("clarify", "clarify_rate"))


@dataclass(frozen=True)
class GateRules:
    """What the gate checks."""

    solve_metric: str = "solve_rate"
    """Score that may not drop beyond ``solve_tolerance`` below the serving version's."""
    solve_tolerance: float = 0.03
    """Largest tolerated absolute drop of ``solve_metric`` (a drop counts only when also significant, see alpha)."""
    behaviour: tuple[AlertRule, ...] = EVAL_RULES
    """Behaviour rules judged against the serving version (and the first one)."""
    compare_with_first: bool = True
    """Also judge the behaviour rules against the first version (slow drift)."""
    summary: tuple[tuple[str, str], ...] = SUMMARY_METRICS
    """(label, metric) pairs a promotion's reason quotes; metrics the scores lack are left out."""
    mismatch: MismatchRule | None = field(default_factory=MismatchRule)
    """Training-inference mismatch limits on the candidate's training steps (None = not checked)."""
    alpha: float | None = 0.05
    """The gate's stated false-refusal rate: the chance that a candidate behaving exactly like the serving and
    first versions is refused for its rates (family-wise over every comparison, Holm). None: thresholds only.
    The test takes every rate, the solve metric's included, as a share of the suite's ``samples`` completions: a
    metric over another count (per task, say) needs its own rule set with ``alpha=None``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "behaviour", tuple(self.behaviour))
        object.__setattr__(self, "summary", tuple(tuple(p) for p in self.summary))
        if not self.solve_metric:
            raise ValueError("GateRules.solve_metric must name a score")
        if not self.solve_tolerance >= 0:
            raise ValueError(f"GateRules.solve_tolerance must be >= 0, not {self.solve_tolerance!r}")
        bad = [r for r in self.behaviour if not isinstance(r, AlertRule)]
        if bad:
            raise ValueError(f"GateRules.behaviour takes monitors.alerts.AlertRule only, not {bad!r}")
        if self.alpha is not None and not 0 < self.alpha < 1:
            raise ValueError(f"GateRules.alpha must be in (0, 1) or None (thresholds only), not {self.alpha!r}")
        if self.mismatch is not None and not isinstance(self.mismatch, MismatchRule):
            raise ValueError(f"GateRules.mismatch takes a monitors.alerts.MismatchRule or None, not {self.mismatch!r}")

    @property
    def metrics(self) -> tuple[str, ...]:
        """Every score the gate reads: the solve metric, then each behaviour rule's metric."""
        return tuple(dict.fromkeys((self.solve_metric, *(r.metric for r in self.behaviour))))


@dataclass(frozen=True)
class Decision:
    """The gate's verdict: promote or not, the reason recorded with the checkpoint, and the problems
    (empty when promoted) the reason joins."""

    promote: bool
    reason: str
    problems: tuple[str, ...] = ()


def _require(scores: Mapping[str, float], metrics: list[str], side: str) -> None:
    missing = [m for m in metrics if m not in scores]
    if missing:
        names = ", ".join(repr(m) for m in missing)
        raise ValueError(
            f"the {side} scores have no {names} (the gate's rules need them; "
            f"the scores have {sorted(scores)}): make the eval suite return them or change GateRules"
        )


def decide(
    candidate: Mapping[str, float],
    serving: Mapping[str, float],
    first: Mapping[str, float],
    samples: int,
    rules: GateRules = GateRules(),
    training: Iterable[object] = (),
) -> Decision:
    """Promote when the solve metric did not drop beyond the tolerance, no behaviour rule fires
    against the serving version or (``compare_with_first``) the first one, and no step that trained
    the candidate had its training-inference mismatch above ``rules.mismatch``.

    ``samples``: how many completions the behaviour rates were computed from. ``training``: the
    candidate's ``train_metrics`` rows (:class:`schemas.records.TrainStep` or mappings). A score a rule
    needs that a row lacks raises ValueError naming it."""
    _require(candidate, list(rules.metrics), "candidate")
    _require(serving, list(rules.metrics), "serving")
    bases = [("serving", serving)]
    if rules.compare_with_first:
        _require(first, [r.metric for r in rules.behaviour], "first")
        # when the first version's rates are the serving version's (v0 serves), the comparison is one, not two
        # members of Holm's family
        same = all(first[r.metric] == serving[r.metric] for r in rules.behaviour)
        if rules.alpha is None or not same:
            bases.append(("first", first))
    label = rules.solve_metric.replace("_", " ")
    c, p, tol = candidate[rules.solve_metric], serving[rules.solve_metric], rules.solve_tolerance
    # every comparison: (key, problem if it counts, one-sided p-value that the move is real or None: not a rate)
    checks: list[tuple[str, str | None, float | None]] = []
    drop = f"{label} {c:.3f} < {p:.3f} - {tol}" if c < p - tol else None
    checks.append(("solve", drop, _p_value(p, c, samples, "decrease")))
    counts: dict[str, float] = {r.samples: samples for r in rules.behaviour}
    for name, base in bases:
        ev = evaluate(dict(candidate) | counts, dict(base) | counts, rules.behaviour)
        alerts = {a.metric: a for a in ev.alerts}
        for r in rules.behaviour:
            if r.metric in alerts or r.metric in ev.passed:  # judged (not skipped for too few samples)
                alert = alerts.get(r.metric)
                pv = _p_value(base[r.metric], candidate[r.metric], samples, r.direction)
                checks.append((f"{name}:{r.metric}", f"vs {name}: {alert.message}" if alert else None, pv))
    tested = {k: pv for k, _, pv in checks if pv is not None}
    real = holm(tested, rules.alpha) if rules.alpha is not None and tested else set()
    problems: list[str] = []
    noise: list[str] = []  # beyond a threshold but not significant: said in the reason, not refused for
    for key, problem, pv in checks:
        if problem is None:
            continue
        if rules.alpha is None or pv is None:
            problems.append(problem)
        elif key in real:
            problems.append(f"{problem}; p = {pv:.2g} (significant at {rules.alpha:g}, Holm over {len(tested)})")
        else:
            noise.append(f"{problem.split(';')[0]} (p = {pv:.2g})")
    if rules.mismatch is not None and (fired := mismatch_alerts(training, rules.mismatch)):
        problems.append(f"trained while the mismatch alert fired: {mismatch_summary(fired)}")
    if problems:
        return Decision(False, "; ".join(problems), tuple(problems))
    reason = f"{label} {c:.3f} (serving {p:.3f})"
    quoted = [f"{lab} {candidate[m]:.3f}" for lab, m in rules.summary if m in candidate]
    if quoted:
        reason += "; " + ", ".join(quoted)
    if noise:
        reason += "; within noise: " + "; ".join(noise)
    return Decision(True, reason, ())


def _p_value(base: float, cand: float, samples: int, direction: str) -> float | None:
    """One-sided exact p-value that the candidate's rate moved in the bad ``direction`` (``increase`` or
    ``decrease``); None when a score is not a rate in [0, 1] or there are no samples."""
    if samples <= 0 or not (0.0 <= base <= 1.0 and 0.0 <= cand <= 1.0):
        return None
    b, c = round(base * samples), round(cand * samples)
    if direction == "increase":
        return rate_increase_p(b, samples, c, samples)
    return rate_increase_p(samples - b, samples, samples - c, samples)  # a fall of the rate = a rise of its complement
