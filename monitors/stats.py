"""A/B statistics a growth team can trust: per-user ratio metrics, fixed-horizon and always-valid tests, CUPED.

Pure functions of per-user figures (numpy arrays), no I/O; distributions from ``scipy.stats``.

* **The unit of analysis is the unit of randomisation, the user.** A metric is a ratio of per-user sums,
  ``sum(num) / sum(den)`` over users (dissatisfied follow-ups per trajectory, persisted fraction per checked
  edit, milliseconds per trajectory, ...). Its variance comes from the delta method over users, so a power
  user's hundred correlated trajectories weigh as one user's data, not as a hundred independent draws.
* **Fixed horizon** (:func:`compare`): the relative change ``m_t / m_c - 1`` with a delta-method interval and
  a two-sided p-value. Valid at one look planned in advance: looking after every batch of traffic and stopping
  at the first p < alpha raises the false-alarm rate several-fold (``bench/ab_stats.py`` measures it).
* **Always valid** (:class:`Sequential`): the mixture sequential probability ratio test (mSPRT) with a normal
  mixing distribution N(0, tau^2) on the relative change (Johari, Koomen, Pekelis and Walsh, "Always valid
  inference: continuous monitoring of A/B tests", 2017/2022). Its p-value and confidence sequence hold at every
  look at once, so checking after every batch keeps the false-alarm rate at alpha. Variances are estimated,
  so the guarantee is asymptotic (it needs enough users per look; ``min_users`` guards the first looks).
* **CUPED** (``cuped=True``): each user's pre-period value of the metric as a covariate (Deng, Xu, Kohavi and
  Walker, WSDM 2013), theta pooled over both arms so the difference stays unbiased; the variance falls by the
  squared correlation between a user's pre-period and in-experiment behaviour.
* **The eval gate's comparison** (:func:`rate_increase_p`, :func:`holm`): a one-sided exact test that a rate
  rose, with Holm's step-down correction over a gate's rules, so the gate's false-refusal rate is a stated
  alpha rather than whatever a fixed tolerance gives at the suite's sample size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps


def _array(name: str, values: object) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one number per user (a 1-d array), got shape {a.shape}")
    return a


@dataclass(frozen=True, init=False)
class Users:
    """One arm's per-user figures for one metric: user ``u`` contributes ``num[u]`` over ``den[u]`` (e.g.
    dissatisfied trajectories over trajectories). ``pre_num`` / ``pre_den`` are the same figures from before the
    experiment (0 / 0 for a user without any); only CUPED reads them. Users with ``den == 0`` have no data for
    this metric and are left out."""

    num: np.ndarray
    den: np.ndarray
    pre_num: np.ndarray | None
    pre_den: np.ndarray | None

    def __init__(self, num: object, den: object, pre_num: object | None = None, pre_den: object | None = None):
        n, d = _array("num", num), _array("den", den)
        if (pre_num is None) != (pre_den is None):
            raise ValueError("give both pre_num and pre_den (the pre-period figures), or neither")
        pn = None if pre_num is None else _array("pre_num", pre_num)
        pd = None if pre_den is None else _array("pre_den", pre_den)
        if n.shape != d.shape or (pn is not None and (pn.shape != n.shape or pd is None or pd.shape != n.shape)):
            shapes = f"num {n.shape}, den {d.shape}"
            if pn is not None and pd is not None:
                shapes += f", pre_num {pn.shape}, pre_den {pd.shape}"
            raise ValueError(f"num, den (and pre_num, pre_den) need one value per user each; got {shapes}")
        for name, a in (("num", n), ("den", d), ("pre_num", pn), ("pre_den", pd)):
            if a is not None and not np.isfinite(a).all():
                raise ValueError(f"{name} must be finite for every user (NaN or inf found)")
        if (d < 0).any() or (pd is not None and (pd < 0).any()):
            raise ValueError("den and pre_den must be >= 0 for every user (a count or a total weight)")
        keep = d > 0
        object.__setattr__(self, "num", n[keep])
        object.__setattr__(self, "den", d[keep])
        object.__setattr__(self, "pre_num", None if pn is None else pn[keep])
        object.__setattr__(self, "pre_den", None if pd is None else pd[keep])

    @property
    def n(self) -> int:
        """Users with data for this metric."""
        return int(self.den.size)

    @property
    def mean(self) -> float:
        """The metric: sum(num) / sum(den); NaN without users."""
        return float(self.num.sum() / self.den.sum()) if self.n else math.nan

    def influence(self) -> np.ndarray:
        """Each user's linearised contribution to :attr:`mean` (delta method): ``(num - mean * den) / mean(den)``.
        It averages to 0 and ``var(influence) / n`` is the variance of the mean."""
        return (self.num - self.mean * self.den) / self.den.mean()


@dataclass(frozen=True)
class Comparison:
    """Treatment against control for one metric (:func:`compare`)."""

    control: float
    """The control arm's metric (CUPED-adjusted when ``cuped``)."""
    treatment: float
    relative: float
    """treatment / control - 1."""
    relative_se: float
    low: float
    """Lower bound of the relative change's two-sided interval at 1 - alpha."""
    high: float
    p_value: float
    """Two-sided p-value of 'no difference' (normal approximation of the difference of the means)."""
    users_control: int
    users_treatment: int
    alpha: float
    variance_ratio: float
    """Variance of the difference with CUPED / without (1.0 without CUPED): 0.6 = 40% less variance."""
    difference: float = math.nan
    """treatment - control (for a metric whose sign can change, like a reward, the figure to read)."""
    difference_se: float = math.nan

    @property
    def significant(self) -> bool:
        return self.p_value < self.alpha

    @property
    def difference_interval(self) -> tuple[float, float]:
        """The difference's two-sided ``1 - alpha`` interval (normal approximation, as ``low``/``high``)."""
        z = float(sps.norm.ppf(1 - self.alpha / 2))
        return self.difference - z * self.difference_se, self.difference + z * self.difference_se


def _cuped(arms: Sequence[Users], infl: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[float], float]:
    """CUPED on the linearised values. The covariate is each user's linearised pre-period value of the same
    ratio, ``(pre_num - m_pre * pre_den) / mean(pre_den)`` with ``m_pre`` pooled over both arms (a user without
    pre-period data gets 0: no information); theta is pooled over the arms (within-arm centred). Returns the
    adjusted influences, each arm's mean shift ``-theta * (mean(x_arm) - mean(x_all))`` and theta."""
    pres = []
    for a in arms:
        if a.pre_num is None or a.pre_den is None:
            raise ValueError("cuped=True needs each arm's pre-period figures (Users(..., pre_num=..., pre_den=...))")
        pres.append((a.pre_num, a.pre_den))
    total_den = sum(float(d.sum()) for _, d in pres)
    if total_den == 0:  # nobody has pre-period data: nothing to adjust with
        return list(infl), [0.0] * len(arms), 0.0
    m_pre = sum(float(n.sum()) for n, _ in pres) / total_den
    scale = total_den / sum(d.size for _, d in pres)
    xs = [(n - m_pre * d) / scale for n, d in pres]
    x_all = float(np.concatenate(xs).mean())
    cov = sum(float(((x - x.mean()) * (i - i.mean())).sum()) for x, i in zip(xs, infl))
    var = sum(float(((x - x.mean()) ** 2).sum()) for x in xs)
    theta = cov / var if var > 0 else 0.0
    adjusted = [i - theta * (x - x.mean()) for x, i in zip(xs, infl)]
    shifts = [-theta * (float(x.mean()) - x_all) for x in xs]
    return adjusted, shifts, theta


def _moments(control: Users, treatment: Users, cuped: bool) -> tuple[float, float, float, float, float]:
    """(m_c, var(m_c), m_t, var(m_t), variance ratio) with the delta method, CUPED-adjusted when asked."""
    for name, a in (("control", control), ("treatment", treatment)):
        if a.n < 2:
            raise ValueError(f"the {name} arm has {a.n} user(s) with data for this metric; need at least 2 per arm")
    infl = [control.influence(), treatment.influence()]
    means = [control.mean, treatment.mean]
    plain = [float(np.var(i, ddof=1)) / i.size for i in infl]
    ratio = 1.0
    if cuped:
        infl, shifts, _ = _cuped([control, treatment], infl)
        means = [m + s for m, s in zip(means, shifts)]
        adj = [float(np.var(i, ddof=1)) / i.size for i in infl]
        ratio = sum(adj) / sum(plain) if sum(plain) > 0 else 1.0
        plain = adj
    return means[0], plain[0], means[1], plain[1], ratio


def _relative(m_c: float, v_c: float, m_t: float, v_t: float) -> tuple[float, float]:
    """m_t / m_c - 1 and its delta-method standard error (independent arms)."""
    if m_c == 0:
        raise ValueError("the control arm's metric is 0: a relative change is undefined (compare absolute values)")
    r = m_t / m_c
    return r - 1.0, math.sqrt(v_t / m_c**2 + r * r * v_c / m_c**2)


def compare(control: Users, treatment: Users, alpha: float = 0.05, cuped: bool = False) -> Comparison:
    """Fixed-horizon comparison of one metric: relative change, its 1 - alpha interval and a two-sided p-value.

    Valid for one look planned in advance; for repeated looks use :class:`Sequential`."""
    _check_alpha(alpha)
    m_c, v_c, m_t, v_t, ratio = _moments(control, treatment, cuped)
    rel, se = _relative(m_c, v_c, m_t, v_t)
    sd_diff = math.sqrt(v_c + v_t)
    diff = m_t - m_c
    p = float(2 * sps.norm.sf(abs(diff) / sd_diff)) if sd_diff > 0 else (1.0 if diff == 0 else 0.0)
    z = float(sps.norm.ppf(1 - alpha / 2))
    return Comparison(
        m_c, m_t, rel, se, rel - z * se, rel + z * se, p, control.n, treatment.n, alpha, ratio, diff, sd_diff
    )


def _check_alpha(alpha: float) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")


# ---------------------------------------------------------------- always valid: mSPRT


def msprt_lr(estimate: float, variance: float, tau: float) -> float:
    """The normal-mixture likelihood ratio of H1: effect ~ N(0, tau^2) against H0: effect 0, for an estimate
    with the given variance: sqrt(V / (V + tau^2)) * exp(tau^2 * estimate^2 / (2 V (V + tau^2)))."""
    if variance <= 0:
        return math.inf if estimate != 0 else 1.0
    s = variance + tau * tau
    log_lr = 0.5 * math.log(variance / s) + tau * tau * estimate * estimate / (2 * variance * s)
    return math.exp(min(log_lr, 700.0))


def msprt_halfwidth(variance: float, tau: float, alpha: float) -> float:
    """Half-width of the 1 - alpha confidence sequence around the estimate: every effect whose mixture
    likelihood ratio stays below 1 / alpha, sqrt(V (V + tau^2) / tau^2 * (2 log(1/alpha) + log((V + tau^2) / V)))."""
    if variance <= 0:
        return 0.0
    s = variance + tau * tau
    return math.sqrt(variance * s / (tau * tau) * (2 * math.log(1 / alpha) + math.log(s / variance)))


@dataclass(frozen=True)
class Look:
    """One look at a running A/B (:meth:`Sequential.look`)."""

    number: int
    """1 for the first look."""
    comparison: Comparison
    """The fixed-horizon figures at this look (their p-value is NOT valid under peeking)."""
    p_value: float
    """Always-valid p-value: the smallest 1 / likelihood ratio over every look so far (capped at 1)."""
    low: float
    """Lower bound of the relative change's 1 - alpha confidence sequence (valid at every look at once)."""
    high: float
    decided: bool
    """True once the always-valid p-value fell below alpha: stop, the difference is real."""
    judged: bool
    """False while either arm has fewer than ``min_users`` users: the look is recorded but decides nothing."""


class Sequential:
    """An always-valid test of one metric, looked at as often as wished (mSPRT on the relative change).

    ``tau`` is the mixing distribution's standard deviation on the relative-change scale: the size of effect the
    test is most sensitive to (0.05: changes around 5%). Choose it before the data; any value keeps the error
    rate, a good one shortens the time to a decision. ``min_users``: looks with fewer users in an arm do not
    decide (the variance estimate behind the normal approximation needs data)."""

    def __init__(self, tau: float = 0.05, alpha: float = 0.05, min_users: int = 100, cuped: bool = False):
        _check_alpha(alpha)
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"tau must be a positive relative effect size (0.05 = 5%), got {tau!r}")
        if min_users < 2:
            raise ValueError(f"min_users must be >= 2, got {min_users!r}")
        self.tau, self.alpha, self.min_users, self.cuped = tau, alpha, min_users, cuped
        self.looks: list[Look] = []
        self._p = 1.0
        self._low, self._high = -math.inf, math.inf

    @property
    def p_value(self) -> float:
        return self._p

    @property
    def decided(self) -> bool:
        return self._p <= self.alpha

    def look(self, control: Users, treatment: Users) -> Look:
        """Judge the data so far (each arm's users with their cumulative figures)."""
        c = compare(control, treatment, self.alpha, self.cuped)
        judged = min(c.users_control, c.users_treatment) >= self.min_users
        if judged:
            v = c.relative_se**2
            self._p = min(self._p, 1.0 / max(msprt_lr(c.relative, v, self.tau), 1.0))
            half = msprt_halfwidth(v, self.tau, self.alpha)
            # the running intersection: a confidence sequence holds at every look, so their meet does too
            self._low, self._high = max(self._low, c.relative - half), min(self._high, c.relative + half)
        look = Look(len(self.looks) + 1, c, self._p, self._low, self._high, self.decided, judged)
        self.looks.append(look)
        return look


# ---------------------------------------------------------------- the eval gate: exact one-sided tests


def rate_increase_p(base_hits: int, base_n: int, cand_hits: int, cand_n: int) -> float:
    """One-sided exact p-value (Fisher) that the candidate's rate is higher than the base's: small when the
    candidate's ``cand_hits`` of ``cand_n`` are more than chance allows given the base's ``base_hits`` of ``base_n``."""
    for name, hits, n in (("base", base_hits, base_n), ("candidate", cand_hits, cand_n)):
        if not (0 <= hits <= n) or n <= 0:
            raise ValueError(f"the {name} needs 0 <= hits <= n and n > 0, got hits {hits!r} of n {n!r}")
    table = [[cand_hits, cand_n - cand_hits], [base_hits, base_n - base_hits]]
    return float(sps.fisher_exact(table, alternative="greater").pvalue)


def holm(p_values: Mapping[str, float], alpha: float = 0.05) -> set[str]:
    """Holm's step-down procedure: the names whose hypotheses are rejected with the family-wise error rate at
    ``alpha`` (uniformly more powerful than Bonferroni, valid under any dependence)."""
    _check_alpha(alpha)
    order = sorted(p_values.items(), key=lambda kv: kv[1])
    rejected: set[str] = set()
    m = len(order)
    for k, (name, p) in enumerate(order):
        if p > alpha / (m - k):
            break
        rejected.add(name)
    return rejected


def min_detectable_effect(relative_se: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest relative change a two-sided fixed-horizon test at ``alpha`` detects with ``power``, for a
    relative change measured with this standard error: (z_{1-alpha/2} + z_{power}) * se."""
    _check_alpha(alpha)
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power!r}")
    return float((sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power)) * relative_se)


# ---------------------------------------------------------------- cohorts: one org's hack among many


@dataclass(frozen=True)
class CohortAlarm:
    """A cohort (an org) whose metric moved the bad way, by an always-valid test."""

    cohort: str
    metric: str
    relative: float
    low: float
    high: float
    p_value: float
    look: int
    """The look at which it fired (1 = the first)."""
    alpha: float
    """The level of this cohort's test (the monitor's alpha split over cohorts and metrics)."""

    @property
    def message(self) -> str:
        return (
            f"{self.cohort}: {self.metric} {self.relative:+.1%} (always-valid sequence at {self.alpha:.2g}: "
            f"[{self.low:+.1%}, {self.high:+.1%}], p = {self.p_value:.2g}) at look {self.look}"
        )


class CohortMonitor:
    """Always-valid tests per cohort and metric, so a hack confined to one org (a few % of users) is flagged for
    that org while the overall comparison drowns it.

    One :class:`Sequential` per (cohort, metric), each at ``alpha / (cohorts x metrics)`` (Bonferroni), so the
    chance of any false alarm over every cohort, metric and look stays at or below ``alpha``. A cohort alarms when
    its confidence sequence excludes 0 on the bad side of ``metrics[m]`` (``increase``: a rise is bad). ``tau`` is
    the relative effect the tests are tuned to: 1.0 (a doubling), because a cohort is small, so only a large move
    in it can be seen, and a hack confined to one org is large there (any tau keeps the error rate)."""

    def __init__(
        self,
        cohorts: Sequence[str],
        metrics: Mapping[str, str],
        alpha: float = 0.05,
        tau: float = 1.0,
        min_users: int = 50,
    ):
        _check_alpha(alpha)
        if not cohorts or not metrics:
            raise ValueError("a cohort monitor needs at least one cohort and one metric")
        bad = {m: d for m, d in metrics.items() if d not in ("increase", "decrease")}
        if bad:
            raise ValueError(f"each metric's bad direction is 'increase' or 'decrease', got {bad}")
        self.cohorts, self.metrics, self.alpha = tuple(cohorts), dict(metrics), alpha
        each = alpha / (len(self.cohorts) * len(self.metrics))
        self.tests = {
            (c, m): Sequential(tau=tau, alpha=each, min_users=min_users) for c in self.cohorts for m in metrics
        }
        self.alarms: dict[tuple[str, str], CohortAlarm] = {}
        self.looks = 0

    def look(self, data: Mapping[str, Mapping[str, tuple[Users, Users]]]) -> list[CohortAlarm]:
        """Judge ``data[cohort][metric] = (control, treatment)`` (cumulative); returns the alarms new at this look.
        A cohort or metric missing from ``data`` (no traffic yet) is not judged; an unknown one raises."""
        self.looks += 1
        unknown = sorted(set(data) - set(self.cohorts))
        if unknown:
            raise ValueError(
                f"cohorts {unknown} were not declared when the monitor started (the alpha split needs them)"
            )
        new = []
        for cohort, by_metric in data.items():
            for metric, (control, treatment) in by_metric.items():
                if metric not in self.metrics:
                    raise ValueError(f"metric {metric!r} was not declared (known: {sorted(self.metrics)})")
                if (cohort, metric) in self.alarms or min(control.n, treatment.n) < 2:
                    continue
                test = self.tests[(cohort, metric)]
                try:
                    lk = test.look(control, treatment)
                except ValueError:  # a control without any event (rate 0): no relative change to judge yet
                    continue
                worse = lk.low > 0 if self.metrics[metric] == "increase" else lk.high < 0
                if lk.judged and lk.decided and worse:
                    alarm = CohortAlarm(
                        cohort, metric, lk.comparison.relative, lk.low, lk.high, lk.p_value, self.looks, test.alpha
                    )
                    self.alarms[(cohort, metric)] = alarm
                    new.append(alarm)
        return new
