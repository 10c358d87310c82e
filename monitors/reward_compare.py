"""How reward version B differs from version A over the same trajectories (``rtrl rewards compare A B``).

Pure functions of :class:`Pair` rows (one closed trajectory, both versions' rewards or None where a version
has none: it discarded the trajectory, as ``v1-discard-broken`` does one with a broken tool call); the rows
come from the ``reward_pairs`` view (:func:`monitors.queries.reward_pairs`). Statistics come from
``scipy.stats``:

* **mean shift** per policy version and org (``'*'`` = all orgs): ``B - A`` paired over the trajectories both
  versions scored, with a 95% t interval; each version's mean over everything it scored, and their change;
* **distribution shift**: the two-sample Kolmogorov-Smirnov statistic and the Wasserstein distance between the
  versions' reward distributions (all each scored); the KS p-value treats the two as independent samples, which
  they are not (mostly the same trajectories): read it as a guide, the paired interval as the test;
* **rank correlation**: Spearman's rho over the trajectories both scored (None where either side is constant);
* **sign flips** (a reward >= 0 under A and < 0 under B, or the reverse) and **discards** (scored by one
  version only), with how many of A's discards B scores negative;
* **behaviour flags** under each version: the share of its scored trajectories carrying a flag and their mean
  reward, plus two behaviours read from the trajectory itself (a broken tool call, a clarifying question) so a
  version that discards them shows up as a lower share;
* **cohorts that move most**: ``org_id/task_kind`` ordered by the absolute change of the mean reward (each
  version's mean over what it scored, a 95% interval that accounts for the trajectories both scored), cohorts
  of fewer than 10 trajectories last.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

#: behaviours of the trajectory itself (not of a reward version), shown among the flags
TRAJECTORY_FLAGS = ("broken tool call", "clarifying question")


@dataclass(frozen=True)
class Pair:
    """One closed trajectory and its reward under each version (None: that version did not score it)."""

    trajectory_id: str
    policy_version: int
    org_id: str
    task_kind: str
    reward_a: float | None
    reward_b: float | None
    flags_a: tuple[str, ...] = ()
    flags_b: tuple[str, ...] = ()
    broken_tool_calls: int = 0
    clarifying_questions: int = 0

    def flags(self, side: str) -> set[str]:
        """The flags of the side's reward plus the trajectory's own behaviours (empty when it has no reward)."""
        if (self.reward_a if side == "a" else self.reward_b) is None:
            return set()
        own = {TRAJECTORY_FLAGS[0]} if self.broken_tool_calls else set()
        if self.clarifying_questions:
            own.add(TRAJECTORY_FLAGS[1])
        return set(self.flags_a if side == "a" else self.flags_b) | own


@dataclass(frozen=True)
class Shift:
    """Version B against version A over one group of trajectories."""

    policy_version: int | None  # None: every policy version (a cohort row)
    group: str  # the org ('*' = all) or the cohort org_id/task_kind
    trajectories: int
    scored_a: int
    scored_b: int
    both: int
    mean_a: float | None
    mean_b: float | None
    change: float | None  # mean_b - mean_a: each over everything its version scored (discards move it)
    change_low: float | None  # 95% t interval; the means share trajectories, so their covariance is subtracted
    change_high: float | None
    shift: float | None  # mean of B - A over the trajectories both scored
    shift_low: float | None
    shift_high: float | None
    ks: float | None
    ks_p: float | None
    wasserstein: float | None
    spearman: float | None
    to_negative: int  # >= 0 under A, < 0 under B
    to_positive: int  # < 0 under A, >= 0 under B
    discarded_by_a: int  # scored by B only
    discarded_by_a_negative_b: int  # of those, negative under B
    discarded_by_b: int  # scored by A only


@dataclass(frozen=True)
class FlagRow:
    """One behaviour flag under each version: the share of the version's scored trajectories with it and their
    mean reward."""

    flag: str
    n_a: int
    share_a: float | None
    mean_a: float | None
    n_b: int
    share_b: float | None
    mean_b: float | None


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def _finite(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def shift(pairs: Sequence[Pair], policy_version: int | None, group: str) -> Shift:
    """Every figure of :class:`Shift` over ``pairs``."""
    a = [p.reward_a for p in pairs if p.reward_a is not None]
    b = [p.reward_b for p in pairs if p.reward_b is not None]
    both = [(p.reward_a, p.reward_b) for p in pairs if p.reward_a is not None and p.reward_b is not None]
    d = np.array([y - x for x, y in both], dtype=float)
    mean_d = low = high = None
    if len(d):
        mean_d = float(d.mean())
        if len(d) > 1:
            se = float(d.std(ddof=1)) / math.sqrt(len(d))
            half = float(stats.t.ppf(0.975, len(d) - 1)) * se
            low, high = mean_d - half, mean_d + half
    ks = ks_p = w = None
    if a and b:
        res = stats.ks_2samp(a, b)
        ks, ks_p = float(res.statistic), float(res.pvalue)
        w = float(stats.wasserstein_distance(a, b))
    rho = None
    if len(both) > 2:
        xs, ys = zip(*both)
        if len(set(xs)) > 1 and len(set(ys)) > 1:
            rho = _finite(float(stats.spearmanr(xs, ys).statistic))
    only_b = [p.reward_b for p in pairs if p.reward_a is None and p.reward_b is not None]
    change = c_low = c_high = None
    if a and b:
        change = float(np.mean(b) - np.mean(a))
        if len(a) > 1 and len(b) > 1:
            # Var(mean_b - mean_a) over trajectories drawn independently, each scored by A, B or both: the
            # means share the trajectories both scored, whose covariance enters as n_both / (n_a n_b)
            cov = float(np.cov([x for x, _ in both], [y for _, y in both])[0, 1]) if len(both) > 1 else 0.0
            var = np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b) - 2 * cov * len(both) / (len(a) * len(b))
            half = float(stats.t.ppf(0.975, min(len(a), len(b)) - 1)) * math.sqrt(max(0.0, float(var)))
            c_low, c_high = change - half, change + half
    return Shift(
        policy_version=policy_version,
        group=group,
        trajectories=len(pairs),
        scored_a=len(a),
        scored_b=len(b),
        both=len(both),
        mean_a=_mean(a),
        mean_b=_mean(b),
        change=change,
        change_low=c_low,
        change_high=c_high,
        shift=mean_d,
        shift_low=low,
        shift_high=high,
        ks=ks,
        ks_p=ks_p,
        wasserstein=w,
        spearman=rho,
        to_negative=sum(1 for x, y in both if x >= 0 > y),
        to_positive=sum(1 for x, y in both if x < 0 <= y),
        discarded_by_a=len(only_b),
        discarded_by_a_negative_b=sum(1 for y in only_b if y < 0),
        discarded_by_b=sum(1 for p in pairs if p.reward_a is not None and p.reward_b is None),
    )


def by_policy_version(pairs: Iterable[Pair]) -> list[Shift]:
    """One :class:`Shift` per policy version and org, the row over all orgs (``'*'``) first in each version."""
    groups: dict[tuple[int, str], list[Pair]] = defaultdict(list)
    for p in pairs:
        groups[(p.policy_version, "*")].append(p)
        groups[(p.policy_version, p.org_id)].append(p)
    order = sorted(groups, key=lambda k: (k[0], k[1] != "*", k[1]))
    return [shift(groups[k], k[0], k[1]) for k in order]


def flag_rows(pairs: Sequence[Pair]) -> list[FlagRow]:
    """Each flag either version raised, and each behaviour of :data:`TRAJECTORY_FLAGS`, under A and under B."""
    out = []
    scored = {side: [p for p in pairs if (p.reward_a if side == "a" else p.reward_b) is not None] for side in "ab"}
    names = sorted({f for p in pairs for side in "ab" for f in p.flags(side)} - set(TRAJECTORY_FLAGS))
    for flag in list(TRAJECTORY_FLAGS) + names:
        cells = []
        for side in "ab":
            have = [p for p in scored[side] if flag in p.flags(side)]
            rewards = [float(p.reward_a if side == "a" else p.reward_b) for p in have]  # type: ignore[arg-type]
            share = len(have) / len(scored[side]) if scored[side] else None
            cells.append((len(have), share, _mean(rewards)))
        (na, sa, ma), (nb, sb, mb) = cells
        out.append(FlagRow(flag, na, sa, ma, nb, sb, mb))
    return out


def movers(pairs: Iterable[Pair], top: int = 8, min_trajectories: int = 10) -> list[Shift]:
    """The ``top`` cohorts (``org_id/task_kind``, all policy versions) whose mean reward changes most in absolute
    value (:attr:`Shift.change`: what each version scored, so a cohort whose trajectories one version discards
    moves too), then by the paired shift; cohorts under ``min_trajectories`` come after the others (a cohort of
    one trajectory moves by chance)."""
    groups: dict[str, list[Pair]] = defaultdict(list)
    for p in pairs:
        groups[f"{p.org_id}/{p.task_kind}"].append(p)
    rows = [shift(ps, None, g) for g, ps in groups.items()]
    rows.sort(key=lambda s: (s.trajectories < min_trajectories, -abs(s.change or 0.0), -abs(s.shift or 0.0), s.group))
    return rows[:top]


def flipped(pairs: Iterable[Pair], limit: int = 5) -> list[Pair]:
    """Up to ``limit`` trajectories whose sign flips or that one version discards, the largest moves first
    (what an analyst opens next)."""

    def move(p: Pair) -> float:
        if p.reward_a is None or p.reward_b is None:
            return abs(p.reward_a if p.reward_b is None else p.reward_b)  # type: ignore[arg-type]
        return abs(p.reward_b - p.reward_a)

    picked = [
        p
        for p in pairs
        if (p.reward_a is None) != (p.reward_b is None)
        or (p.reward_a is not None and p.reward_b is not None and (p.reward_a >= 0) != (p.reward_b >= 0))
    ]
    return sorted(picked, key=lambda p: (-move(p), p.trajectory_id))[:limit]
