"""A seeded per-user world for measuring A/B statistics (A/A false alarms, power, CUPED): pure numpy, no I/O.

The shapes follow :mod:`simulator.population`: user activity is heavy-tailed (Pareto 1.5: a few power users
bring most trajectories; capped at 20x the least active, as a person's working day bounds it: uncapped, Pareto
1.5 has infinite variance and the delta method's normal approximation gave 7-9% false alarms at a nominal 5%
with 800-3,000 users, bench/RESULTS.md) and users differ persistently (strictness Beta(2, 4)), which is what makes
trajectories of one user correlated and what CUPED's pre-period covariate exploits. Per user and period:

* trajectories ~ Poisson(activity x ``per_user``) (users with none in a period have no data there);
* dissatisfied follow-ups ~ Binomial(trajectories, ``dissatisfied`` x (0.5 + strictness)) per trajectory;
* broken tool calls ~ Binomial(trajectories, ``broken`` x (0.5 + strictness)); edits and clarifying questions
  the same way around ``edit`` and ``clarify``;
* latency per trajectory ~ LogNormal(sigma 0.6) with mean ``latency_ms`` x a per-user factor (repo size,
  LogNormal(0, 0.3));
* edit persistence: checked edits ~ Binomial(trajectories, 0.7), persisted fraction Beta around
  ``persistence`` x (1.2 - 0.4 x strictness).

An arm's ``effects`` multiply these rates (``{"broken": 1.3}``: 30% more broken calls); ``orgs`` and
``effect_orgs`` confine an effect to some orgs (a cohort-level hack). Users are assigned to arms by a hash of
their id, as the serving path does.

:func:`loop_period` draws the same figures from the closed loop's users instead (:mod:`simulator.world`: each
task is asked ``group_size`` times, as the loop samples a group per task, the policy's outcome drawn from a
:class:`LoopPolicy`, and the user's reaction from :func:`simulator.world.reaction`, the user's strictness fixed by
the user id), so the error rates and the power the bench reports hold for the reactions the main job's final A/B
measures. There the policy's ``effects`` act on what it does (``broken``, ``clarify``, ``edit``, ``correct``);
persistence, follow-ups and latency move only through the users' reactions to it. What stays abworld's: who
asks how often (heavy-tailed activity over ``users``; the loop's simulator asks its 600 users uniformly, a
lighter tail, so the figures here are on the conservative side).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from monitors.stats import Users
from simulator import world as loop_world
from simulator.tasks import Outcome, sample_task

METRICS: tuple[str, ...] = ("dissatisfied", "broken", "edit", "clarify", "latency_ms", "persistence")

BASE: dict[str, float] = {
    "dissatisfied": 0.12,
    "broken": 0.08,
    "edit": 0.85,
    "clarify": 0.08,
    "latency_ms": 1_000.0,
    "persistence": 0.8,
}

#: key of :func:`period`'s per-trajectory latencies: (latency of each trajectory, index of its user)
TRAJECTORY_LATENCIES = "latency_trajectories"
"""Each metric's level for an average user on the control arm."""


@dataclass(frozen=True)
class World:
    users: int = 2_000
    per_user: float = 3.0
    """Mean trajectories per user and period at activity 1 (the median user has fewer: Pareto weights)."""
    orgs: int = 10
    base: dict[str, float] = field(default_factory=lambda: dict(BASE))


@dataclass(frozen=True)
class Population:
    activity: np.ndarray
    strictness: np.ndarray
    latency_factor: np.ndarray
    org: np.ndarray
    """Org index of each user (users spread evenly over orgs)."""
    arm: np.ndarray
    """0 = control, 1 = treatment (a 50/50 split by user)."""


def population(world: World, rng: np.random.Generator, treatment_share: float = 0.5) -> Population:
    n = world.users
    arm = (rng.random(n) < treatment_share).astype(np.int64)  # a hash of the user id is uniform: same law
    return Population(
        activity=np.minimum(rng.pareto(1.5, n) + 1.0, 20.0),
        strictness=rng.beta(2.0, 4.0, n),
        latency_factor=np.exp(rng.normal(0.0, 0.3, n)),
        org=np.arange(n) % world.orgs,
        arm=arm,
    )


def period(
    world: World,
    pop: Population,
    rng: np.random.Generator,
    effects: dict[str, float] | None = None,
    effect_orgs: tuple[int, ...] | None = None,
    scale: float = 1.0,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One period's per-user figures: metric -> (num, den). ``effects`` apply to the treatment arm (only in
    ``effect_orgs`` when given); ``scale`` multiplies the traffic (looks at a growing experiment)."""
    effects = effects or {}
    treated = _treated(pop, effect_orgs)
    mult = {m: np.where(treated, effects.get(m, 1.0), 1.0) for m in METRICS}
    n = rng.poisson(pop.activity * world.per_user * scale)
    lean = 0.5 + pop.strictness
    b = world.base
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for m in ("dissatisfied", "broken", "edit", "clarify"):
        p = np.clip(b[m] * lean * mult[m], 0.0, 1.0)
        out[m] = (rng.binomial(n, p).astype(np.float64), n.astype(np.float64))
    owner = np.repeat(np.arange(n.size), n)
    mean_lat = (b["latency_ms"] * pop.latency_factor * mult["latency_ms"])[owner]
    sigma = 0.6
    lat = mean_lat * np.exp(sigma * rng.standard_normal(owner.size) - sigma * sigma / 2)
    out["latency_ms"] = (np.bincount(owner, weights=lat, minlength=n.size), n.astype(np.float64))
    out[TRAJECTORY_LATENCIES] = (lat, owner.astype(np.float64))
    checks = rng.binomial(n, 0.7)
    keep = np.clip(b["persistence"] * (1.2 - 0.4 * pop.strictness) * mult["persistence"], 0.01, 0.99)
    conc = 8.0  # Beta(keep * c, (1 - keep) * c): a checked edit keeps a fraction around keep
    checked = np.repeat(np.arange(n.size), checks)
    fracs = rng.beta(keep[checked] * conc, (1 - keep[checked]) * conc)
    frac_sum = np.bincount(checked, weights=fracs, minlength=n.size)
    out["persistence"] = (frac_sum, checks.astype(np.float64))
    return out


def arms(
    pop: Population, now: dict[str, tuple[np.ndarray, np.ndarray]], metric: str, pre: dict | None = None
) -> tuple[Users, Users]:
    """(control, treatment) :class:`Users` of one metric; with ``pre`` each user's pre-period figures of it as
    the CUPED covariate."""
    num, den = now[metric]
    pn, pd = pre[metric] if pre is not None else (None, None)
    out = []
    for a in (0, 1):
        sel = pop.arm == a
        out.append(Users(num[sel], den[sel], None if pn is None else pn[sel], None if pd is None else pd[sel]))
    return out[0], out[1]


@dataclass(frozen=True)
class LoopPolicy:
    """What a policy does in the closed loop's world, per completion: a broken tool call with chance ``broken``
    (independent of the answer, as the two tokens are sampled in turn), then a clarifying question with chance
    ``clarify``, else an edit with chance ``edit`` (right with chance ``correct``), else nothing. The defaults
    are v0's held-out figures in the main job on the defaults (solve 0.083, broken calls 0.112, clarifying ~0.12;
    live, v0's broken-call rate was 0.103)."""

    broken: float = 0.112
    clarify: float = 0.12
    edit: float = 0.9
    correct: float = 0.1


_POLICY_EFFECTS = frozenset({"broken", "clarify", "edit", "correct"})
#: columns of one trajectory's figures in the loop's world (kept: NaN without an accepted edit)
_DISSATISFIED, _BROKEN, _EDIT, _CLARIFY, _LATENCY, _KEPT = range(6)


def _check_effects(effects: dict[str, float], group_size: int) -> None:
    unknown = set(effects) - _POLICY_EFFECTS
    if unknown:
        raise ValueError(
            f"loop_period: effects {sorted(unknown)} are not what a policy does here (broken, clarify, edit, "
            "correct); persistence, follow-ups and latency follow from the users' reactions"
        )
    if group_size < 1:
        raise ValueError(f"loop_period: group_size must be >= 1, not {group_size!r}")


def _group(
    r: random.Random, user: str, policy: LoopPolicy, effects: dict[str, float], group_size: int, users: loop_world.World
) -> list[tuple[float, float, float, float, float, float]]:
    """One task asked ``group_size`` times by ``user``: each completion's figures (the columns above)."""
    p_broken = min(1.0, policy.broken * effects.get("broken", 1.0))
    p_clarify = min(1.0, policy.clarify * effects.get("clarify", 1.0))
    p_edit = min(1.0, policy.edit * effects.get("edit", 1.0))
    p_correct = min(1.0, policy.correct * effects.get("correct", 1.0))
    task = sample_task(r, "org")
    out = []
    for _ in range(group_size):
        tool = None if r.random() < p_broken else r.choice(_TOOLS)
        asked = r.random() < p_clarify
        edit: int | None = None
        if not asked and r.random() < p_edit:
            edit = task.answer if r.random() < p_correct else (task.answer + r.randrange(1, 10)) % 10
        o = Outcome(tool=tool, edit=edit, asked=asked, correct=edit is not None and edit == task.answer)
        re = loop_world.reaction(task, o, r, user=user, world=users)
        kept = math.nan if re.kept is None else re.kept
        out.append(
            (
                float(re.sentiment == "dissatisfied"),
                float(o.broken),
                float(edit is not None),
                float(asked),
                re.latency_ms,
                kept,
            )
        )
    return out


_TOOLS = list(loop_world.TOOL_MS)


def _figures(rows: np.ndarray, owner: np.ndarray, size: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-user (num, den) of every metric from trajectory rows (the columns above) and their users."""
    den = np.bincount(owner, minlength=size).astype(np.float64)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {
        m: (np.bincount(owner, weights=rows[:, c], minlength=size), den)
        for m, c in (("dissatisfied", _DISSATISFIED), ("broken", _BROKEN), ("edit", _EDIT), ("clarify", _CLARIFY))
    }
    out["latency_ms"] = (np.bincount(owner, weights=rows[:, _LATENCY], minlength=size), den)
    out[TRAJECTORY_LATENCIES] = (rows[:, _LATENCY].copy(), owner.astype(np.float64))
    kept = rows[:, _KEPT]
    has = ~np.isnan(kept)
    out["persistence"] = (
        np.bincount(owner[has], weights=kept[has], minlength=size),
        np.bincount(owner[has], minlength=size).astype(np.float64),
    )
    return out


def loop_period(
    world: World,
    pop: Population,
    rng: np.random.Generator,
    effects: dict[str, float] | None = None,
    effect_orgs: tuple[int, ...] | None = None,
    scale: float = 1.0,
    policy: LoopPolicy = LoopPolicy(),
    users: loop_world.World = loop_world.WORLD,
    group_size: int = 4,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """:func:`period`'s figures from the loop's world (:func:`simulator.world.reaction`): per user
    Poisson(activity x ``per_user`` x ``scale``) trajectories of ``policy`` (its rates times the treatment's
    ``effects``, in ``effect_orgs`` only when given), a new task every ``group_size`` of them, user ``u`` being
    ``org-<org>-user-<u>``. Persistence is the kept fraction over accepted edits, latency the reaction's.
    ``world.base`` is not used. Every reaction is drawn afresh (about 50 us each): :class:`LoopPools` is the fast
    way for many periods."""
    effects = effects or {}
    _check_effects(effects, group_size)
    treated = _treated(pop, effect_orgs)
    n = rng.poisson(pop.activity * world.per_user * scale)
    r = random.Random(int(rng.integers(2**63)))
    rows: list[tuple[float, ...]] = []
    for u in np.flatnonzero(n):
        user = f"org-{pop.org[u]}-user-{u}"
        need = int(n[u])
        while need > 0:
            got = _group(r, user, policy, effects if treated[u] else {}, group_size, users)[:need]
            rows.extend(got)
            need -= len(got)
    table = np.asarray(rows, dtype=np.float64).reshape(-1, 6)
    return _figures(table, np.repeat(np.arange(n.size), n), n.size)


def _treated(pop: Population, effect_orgs: tuple[int, ...] | None) -> np.ndarray:
    """The users an arm's effects apply to: the treatment arm, within ``effect_orgs`` when given."""
    treated = pop.arm == 1
    if effect_orgs is not None:
        treated &= np.isin(pop.org, effect_orgs)
    return treated


class LoopPools:
    """:func:`loop_period` for many periods: each user's reactions come from a pool of ``pool`` groups drawn once
    per user (and per set of effects) with :func:`loop_period`'s model, seeded by the user and ``seed``, then
    resampled (groups with replacement) in every period, in numpy. The users are fixed by their id, as in the
    loop's world, so a pool is the user: what a period draws keeps that user's strictness and the groups' task
    correlation; resampling from ``pool`` groups leaves the within-user variance at ``(pool-1)/pool`` of the
    model's. ``period`` has :func:`period`'s signature, for the bench."""

    def __init__(
        self,
        policy: LoopPolicy = LoopPolicy(),
        users: loop_world.World = loop_world.WORLD,
        group_size: int = 4,
        pool: int = 16,
        seed: int = 0,
    ):
        if pool < 1:
            raise ValueError(f"LoopPools: pool must be >= 1, not {pool!r}")
        _check_effects({}, group_size)
        self.policy, self.users, self.group_size, self.pool, self.seed = policy, users, group_size, pool, seed
        self._pools: dict[tuple, dict[str, np.ndarray]] = {}

    def _pool(self, user: str, effects: dict[str, float]) -> np.ndarray:
        key = tuple(sorted(effects.items()))
        cache = self._pools.setdefault(key, {})
        got = cache.get(user)
        if got is None:
            r = random.Random(f"{self.seed}:{key}:{user}")
            groups = [_group(r, user, self.policy, effects, self.group_size, self.users) for _ in range(self.pool)]
            got = cache[user] = np.asarray(groups, dtype=np.float64)  # (pool, group_size, 6)
        return got

    def period(
        self,
        world: World,
        pop: Population,
        rng: np.random.Generator,
        effects: dict[str, float] | None = None,
        effect_orgs: tuple[int, ...] | None = None,
        scale: float = 1.0,
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        effects = effects or {}
        _check_effects(effects, self.group_size)
        treated = _treated(pop, effect_orgs)
        n = rng.poisson(pop.activity * world.per_user * scale)
        size, gs = n.size, self.group_size
        table = np.stack(
            [self._pool(f"org-{pop.org[u]}-user-{u}", effects if treated[u] else {}) for u in range(size)]
        )  # (users, pool, group_size, 6)
        groups = -(-n // gs)  # whole groups per user, the last one cut to n
        owner_g = np.repeat(np.arange(size), groups)
        picked = table[owner_g, rng.integers(self.pool, size=owner_g.size)].reshape(-1, 6)
        owner_t = np.repeat(owner_g, gs)
        start = np.repeat(np.cumsum(groups * gs) - groups * gs, groups * gs)
        keep = np.arange(owner_t.size) - start < n[owner_t]
        return _figures(picked[keep], owner_t[keep], size)
