"""A/B statistics (monitors/stats.py): the delta method over users against a bootstrap and scipy's Welch test,
the false-alarm rate of a fixed-horizon test with and without peeking against the always-valid mSPRT, the
confidence sequence's coverage and power under a real effect, CUPED's variance cut without bias, and the eval
gate's exact one-sided test with Holm's correction. Simulations are seeded (simulator/abworld.py); the rates
they measure are checked against their nominal value plus three binomial standard errors."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from scipy import stats as sps

from monitors.stats import (
    Sequential,
    Users,
    compare,
    holm,
    min_detectable_effect,
    msprt_halfwidth,
    msprt_lr,
    rate_increase_p,
)
from simulator import abworld


def _slack(rate: float, n: int) -> float:
    return 3 * math.sqrt(rate * (1 - rate) / n)


def test_ratio_metric_and_its_delta_method_variance_match_a_bootstrap_over_users():
    rng = np.random.default_rng(1)
    world = abworld.World(users=1500)
    pop = abworld.population(world, rng)
    now = abworld.period(world, pop, rng)
    num, den = now["dissatisfied"]
    u = Users(num, den)
    assert u.mean == pytest.approx(num.sum() / den.sum())
    assert u.n == int((den > 0).sum()) and abs(u.influence().mean()) < 1e-12
    se = math.sqrt(np.var(u.influence(), ddof=1) / u.n)
    idx = rng.integers(0, u.n, size=(2000, u.n))
    boot = u.num[idx].sum(1) / u.den[idx].sum(1)
    assert se == pytest.approx(boot.std(ddof=1), rel=0.1)
    # trajectories of one user are correlated: treating them as independent understates the error
    p = u.mean
    naive = math.sqrt(p * (1 - p) / u.den.sum())
    assert se > naive


def test_the_loop_world_period_has_the_shapes_of_abworld_and_moves_with_the_policy():
    """``abworld.loop_period``: the bench's per-user figures drawn from the closed loop's world (simulator/world.py)
    have abworld's keys and shapes, repeat with the seed, put an effect on the treatment arm only, and move as the
    world says: a policy that gets its edits right keeps more of them, annoys fewer users and answers faster."""
    world = abworld.World(users=600, per_user=2.0)
    pop = abworld.population(world, np.random.default_rng(3))
    a = abworld.loop_period(world, pop, np.random.default_rng(4))
    b = abworld.loop_period(world, pop, np.random.default_rng(4))
    ref = abworld.period(world, pop, np.random.default_rng(4))
    assert set(a) == set(ref)
    for m in a:
        assert np.array_equal(a[m][0], b[m][0]) and np.array_equal(a[m][1], b[m][1]), m  # seeded: the same figures
    n = a["broken"][1]
    lat, owner = a[abworld.TRAJECTORY_LATENCIES]
    assert lat.size == owner.size == n.sum() and np.allclose(
        np.bincount(owner.astype(int), lat, n.size), a["latency_ms"][0]
    )
    assert np.all(a["persistence"][1] <= a["edit"][0]) and np.all(a["persistence"][0] <= a["persistence"][1])

    hacked = abworld.loop_period(world, pop, np.random.default_rng(5), effects={"broken": 3.0})
    rate = {
        arm: hacked["broken"][0][pop.arm == arm].sum() / hacked["broken"][1][pop.arm == arm].sum() for arm in (0, 1)
    }
    assert 0.08 < rate[0] < 0.15 and rate[1] > 2.2 * rate[0]  # v0's 0.112, tripled on the treatment arm only

    good = abworld.loop_period(world, pop, np.random.default_rng(6), policy=abworld.LoopPolicy(correct=0.9))
    with pytest.raises(ValueError, match=r"\['dissatisfied'\] are not what a policy does"):
        abworld.loop_period(world, pop, np.random.default_rng(6), effects={"dissatisfied": 0.8})

    def overall(d: dict, m: str) -> float:
        return d[m][0].sum() / d[m][1].sum()

    assert overall(good, "persistence") > overall(a, "persistence") + 0.2
    assert overall(good, "dissatisfied") < overall(a, "dissatisfied") - 0.2
    assert overall(good, "latency_ms") < overall(a, "latency_ms") - 50


def test_loop_pools_resample_the_loop_world_with_its_rates():
    """``abworld.LoopPools`` (the bench's fast path) draws each user's groups from a pool made with
    ``loop_period``'s model: the same keys and shapes, the same overall rates within simulation error, the
    treatment's effect on the treated users only, and a user's pool fixed by the user and the seed."""
    world = abworld.World(users=800, per_user=2.0)
    pop = abworld.population(world, np.random.default_rng(7))
    pools = abworld.LoopPools(pool=16, seed=1)
    fast = pools.period(world, pop, np.random.default_rng(8))
    exact = abworld.loop_period(world, pop, np.random.default_rng(8))
    assert set(fast) == set(exact)
    n = fast["broken"][1]
    assert np.array_equal(n, exact["broken"][1])  # the same traffic from the same rng
    lat, owner = fast[abworld.TRAJECTORY_LATENCIES]
    assert lat.size == n.sum() and np.allclose(np.bincount(owner.astype(int), lat, n.size), fast["latency_ms"][0])
    for m, tol in (("dissatisfied", 0.03), ("broken", 0.02), ("edit", 0.03), ("clarify", 0.02), ("persistence", 0.05)):
        a = fast[m][0].sum() / fast[m][1].sum()
        b = exact[m][0].sum() / exact[m][1].sum()
        assert abs(a - b) < tol, (m, a, b)
    assert fast["latency_ms"][0].sum() / n.sum() == pytest.approx(exact["latency_ms"][0].sum() / n.sum(), rel=0.05)
    again = abworld.LoopPools(pool=16, seed=1).period(world, pop, np.random.default_rng(8))
    assert all(np.array_equal(fast[m][0], again[m][0]) for m in fast)
    hacked = pools.period(world, pop, np.random.default_rng(9), effects={"broken": 3.0}, effect_orgs=(0,))
    rate = {}
    for name, sel in (("treated", (pop.arm == 1) & (pop.org == 0)), ("others", ~((pop.arm == 1) & (pop.org == 0)))):
        rate[name] = hacked["broken"][0][sel].sum() / hacked["broken"][1][sel].sum()
    assert rate["treated"] > 2.2 * rate["others"] and 0.07 < rate["others"] < 0.16


def test_plain_means_agree_with_welch_and_the_interval_is_the_delta_method():
    rng = np.random.default_rng(2)
    a, b = rng.normal(10.0, 3.0, 3000), rng.normal(10.3, 4.0, 2500)
    c = compare(Users(a, np.ones_like(a)), Users(b, np.ones_like(b)))
    welch = sps.ttest_ind(b, a, equal_var=False)
    assert c.p_value == pytest.approx(welch.pvalue, rel=0.02, abs=1e-4)
    r = b.mean() / a.mean()
    se = math.sqrt(b.var(ddof=1) / b.size / a.mean() ** 2 + r * r * a.var(ddof=1) / a.size / a.mean() ** 2)
    assert c.relative == pytest.approx(r - 1) and c.relative_se == pytest.approx(se)
    assert (c.low, c.high) == pytest.approx((r - 1 - 1.959964 * se, r - 1 + 1.959964 * se), rel=1e-5)
    assert c.significant == (c.p_value < 0.05) and c.variance_ratio == 1.0
    d = b.mean() - a.mean()
    assert c.difference == pytest.approx(d) and c.difference_se == pytest.approx(
        math.sqrt(b.var(ddof=1) / b.size + a.var(ddof=1) / a.size)
    )
    lo, hi = c.difference_interval
    assert (lo, hi) == pytest.approx((d - 1.959964 * c.difference_se, d + 1.959964 * c.difference_se), rel=1e-5)


def _aa_looks(seed: int, looks: int, world: abworld.World, effects: dict | None = None, metric: str = "dissatisfied"):
    """One experiment's cumulative (control, treatment) at each look: traffic grows by one period per look."""
    rng = np.random.default_rng(seed)
    pop = abworld.population(world, rng)
    total: dict[str, list[np.ndarray]] | None = None
    for _ in range(looks):
        now = {m: v for m, v in abworld.period(world, pop, rng, effects=effects, scale=0.5).items() if m == metric}
        if total is None:
            total = {m: [v[0].copy(), v[1].copy()] for m, v in now.items()}
        else:
            for m, (n_, d_) in now.items():
                total[m][0] += n_
                total[m][1] += d_
        yield abworld.arms(pop, {m: (v[0], v[1]) for m, v in total.items()}, metric)


@pytest.mark.slow
def test_peeking_inflates_a_fixed_horizon_test_and_the_msprt_holds_alpha():
    """A/A, 300 experiments, 12 looks each: one planned look keeps ~5%; stopping at the first p < 0.05 of the
    fixed-horizon test does not; the always-valid p-value stays at or below 5% under the same peeking."""
    world = abworld.World(users=800, per_user=2.0)
    sims, looks = 300, 12
    final = peeked = seq = 0
    for s in range(sims):
        test = Sequential(tau=0.1, min_users=50)
        fixed_any = False
        for look in _aa_looks(100 + s, looks, world):
            lk = test.look(*look)
            fixed_any |= lk.comparison.p_value < 0.05
        final += lk.comparison.p_value < 0.05
        peeked += fixed_any
        seq += test.decided
    assert final / sims <= 0.05 + _slack(0.05, sims)
    assert peeked / sims > 0.12  # several-fold the nominal rate
    assert seq / sims <= 0.05 + _slack(0.05, sims)
    print(f"A/A false alarms: one look {final / sims:.3f}, peeking {peeked / sims:.3f}, mSPRT {seq / sims:.3f}")


@pytest.mark.slow
def test_the_confidence_sequence_covers_a_real_effect_at_every_look_and_decides():
    """A real +25% rise in broken calls: the running confidence sequence holds the true relative change at every
    look in >= 95% of experiments (minus simulation error), and the test decides within 12 looks in most."""
    world = abworld.World(users=1500, per_user=2.0)
    truth = 0.25
    sims = 120
    covered = decided = 0
    for s in range(sims):
        test = Sequential(tau=0.1, min_users=50)
        ok = True
        for look in _aa_looks(500 + s, 12, world, effects={"broken": 1 + truth}, metric="broken"):
            lk = test.look(*look)
            ok &= lk.low <= truth <= lk.high
        covered += ok
        decided += test.decided
    assert covered / sims >= 0.95 - _slack(0.05, sims)
    assert decided / sims >= 0.8


def test_cuped_cuts_the_variance_and_keeps_the_estimate_unbiased():
    world = abworld.World(users=2000, per_user=3.0)
    rels, ratios = [], []
    for s in range(60):
        rng = np.random.default_rng(900 + s)
        pop = abworld.population(world, rng)
        pre = abworld.period(world, pop, rng)
        now = abworld.period(world, pop, rng, effects={"latency_ms": 0.95})
        c = compare(*abworld.arms(pop, now, "latency_ms", pre=pre), cuped=True)
        plain = compare(*abworld.arms(pop, now, "latency_ms"))
        rels.append(c.relative)
        ratios.append(c.variance_ratio)
        assert c.relative_se < plain.relative_se
    rels_a = np.array(rels)
    assert abs(rels_a.mean() - (-0.05)) < 3 * rels_a.std(ddof=1) / math.sqrt(rels_a.size)
    assert np.mean(ratios) < 0.7  # a user's repo size carries over from the pre-period


def test_cuped_without_pre_period_data_is_refused_and_missing_users_are_left_unadjusted():
    u = Users([1.0, 2.0, 3.0], [1, 1, 1])
    with pytest.raises(ValueError, match="pre-period"):
        compare(u, u, cuped=True)
    none = [0.0, 0.0, 0.0]
    c = compare(
        Users([1.0, 2.0, 3.0], [1, 1, 1], none, none), Users([2.0, 3.0, 4.0], [1, 1, 1], none, none), cuped=True
    )
    assert c.variance_ratio == 1.0 and c.relative == pytest.approx(0.5)
    with pytest.raises(ValueError, match="both pre_num and pre_den"):
        Users([1.0], [1], pre_num=[1.0])


def test_the_gates_exact_test_holds_its_error_rate_and_catches_the_v1_rise():
    rng = np.random.default_rng(3)
    n, p0, sims = 800, 0.0975, 2000
    base = rng.binomial(n, p0, sims)
    cand = rng.binomial(n, p0, sims)
    alarms = sum(rate_increase_p(int(b), n, int(c), n) < 0.05 for b, c in zip(base, cand))
    assert alarms / sims <= 0.05 + _slack(0.05, sims)
    assert rate_increase_p(78, 800, 236, 800) < 1e-9  # v1's 0.0975 -> 0.295 on the eval suite
    assert rate_increase_p(78, 800, 60, 800) > 0.9  # a fall is no evidence of a rise
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005}) == {"a", "d"}
    assert holm({"a": 0.01}) == {"a"} and holm({}) == set()


def test_msprt_formulas_and_the_minimum_detectable_effect():
    assert msprt_lr(0.0, 1.0, 1.0) == pytest.approx(math.sqrt(0.5))
    v, tau, alpha = 0.01**2, 0.05, 0.05
    h = msprt_halfwidth(v, tau, alpha)
    assert msprt_lr(h, v, tau) == pytest.approx(1 / alpha, rel=1e-9)  # the sequence's edge: LR = 1/alpha
    assert h > 1.96 * 0.01  # wider than the fixed-horizon interval: the price of peeking
    assert min_detectable_effect(0.01) == pytest.approx((1.959964 + 0.841621) * 0.01, rel=1e-5)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Users([1, 2], [1]), "one value per user"),
        (lambda: Users([1, 2], [1, -1]), "den and pre_den must be >= 0"),
        (lambda: Users([[1]], [[1]]), "1-d array"),
        (lambda: Users([1, math.inf], [1, 1]), "num must be finite"),
        (lambda: Users([1, 2], [1, 1], [1, math.nan], [1, 1]), "pre_num must be finite"),
        (lambda: compare(Users([1.0], [1]), Users([1.0, 2.0], [1, 1])), "need at least 2 per arm"),
        (lambda: compare(Users([0.0, 0.0], [1, 1]), Users([1.0, 2.0], [1, 1])), "control arm's metric is 0"),
        (lambda: compare(Users([1.0, 2.0], [1, 1]), Users([1.0, 2.0], [1, 1]), alpha=1.5), "alpha"),
        (lambda: Sequential(tau=0), "tau"),
        (lambda: rate_increase_p(5, 4, 1, 4), "hits"),
    ],
)
def test_bad_inputs_name_what_is_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- per-user figures from ClickHouse


def test_per_user_figures_come_from_clickhouse_and_equal_python(ch_client, ch_db):
    """user_sums (and the analysts' user_behaviour view) give per user the sums each metric's ratio is built from,
    over trajectories FINAL (a replayed row counts once), per arm and time window; users_of turns them into the
    same Users a Python computation gives, with the pre-period as the CUPED covariate."""
    import random

    from monitors.queries import USER_SUMS, Side, user_sums, users_of
    from rtrl.clickhouse import insert
    from schemas.records import TrajectorySummary

    rng = random.Random(5)
    t0 = 1_750_000_000_000
    rows = []
    for i in range(400):
        user = f"{rng.randrange(60):032x}"
        arm = "candidate" if int(user, 16) % 2 else "control"
        pre = i < 120  # the first 120 trajectories are the pre-period, on the serving version
        calls = rng.randrange(4)
        checks = rng.randrange(2)
        rows.append(
            TrajectorySummary(
                trajectory_id=f"t{i}",
                policy_version=1 if pre or arm == "control" else 2,
                org_id="acme",
                arm="control" if pre else arm,
                task_kind="bugfix",
                revision=0,
                close_reason="ended",
                status="completed",
                n_events=3,
                tool_calls=calls,
                broken_tool_calls=min(calls, rng.randrange(2)),
                clarifying_questions=rng.randrange(2),
                unneeded_questions=0,
                edits_proposed=rng.randrange(2),
                edits_accepted=checks,
                persistence_checks=checks,
                persisted_fraction_sum=rng.random() * checks,
                followups=1,
                dissatisfied_followups=rng.randrange(2),
                latency_ms=rng.choice([None, 500.0 + 1000 * rng.random()]),
                ttft_ms=None,
                first_event_ts=t0 + i * 1000,
                last_event_ts=t0 + i * 1000 + 500,
                user_hash=user,
            )
        )
    insert(ch_client, ch_db, "trajectories", rows + rows[:50])  # a replay of the first 50 counts once
    start = t0 + 120 * 1000
    got = user_sums(ch_client, ch_db, Side(2, "candidate"), since_ms=start)
    mine = [r for r in rows if r.policy_version == 2 and r.arm == "candidate"]
    assert set(got) == {r.user_hash for r in mine}
    for user, sums in got.items():
        theirs = [r for r in mine if r.user_hash == user]
        assert sums["trajectories"] == len(theirs)
        assert sums["broken_calls"] == sum(r.broken_tool_calls for r in theirs)
        assert sums["dissatisfied"] == sum(r.dissatisfied_followups > 0 for r in theirs)
        assert sums["persisted"] == pytest.approx(sum(r.persisted_fraction_sum for r in theirs))
        assert sums["latency_sum_ms"] == pytest.approx(sum(r.latency_ms or 0 for r in theirs))
        assert sums["latency_n"] == sum(r.latency_ms is not None for r in theirs)
    view = ch_client.query(
        f"SELECT user_hash, trajectories, broken_calls FROM {ch_db}.user_behaviour "
        "WHERE policy_version = 2 AND arm = 'candidate'"
    ).result_rows
    assert {u: (n, b) for u, n, b in view} == {u: (s["trajectories"], s["broken_calls"]) for u, s in got.items()}

    control = user_sums(ch_client, ch_db, Side(1, "control"), since_ms=start)
    pre = user_sums(ch_client, ch_db, Side(1, "control"), until_ms=start)
    assert sum(s["trajectories"] for s in pre.values()) == 120
    ctrl_rows = [r for r in rows if r.policy_version == 1 and r.arm == "control" and r.first_event_ts >= start]

    def python_users(members, metric):  # the same per-user ratio, summed in Python from the rows
        num_of = {
            "edit_rate": lambda r: r.edits_proposed > 0,
            "clarification_rate": lambda r: r.clarifying_questions > 0,
            "dissatisfied_rate": lambda r: r.dissatisfied_followups > 0,
            "trajectories_with_broken_rate": lambda r: r.broken_tool_calls > 0,
            "broken_tool_call_rate": lambda r: r.broken_tool_calls,
            "edit_persistence": lambda r: r.persisted_fraction_sum,
            "latency_mean_ms": lambda r: r.latency_ms or 0.0,
        }[metric]
        den_of = {
            "broken_tool_call_rate": lambda r: r.tool_calls,
            "edit_persistence": lambda r: r.persistence_checks,
            "latency_mean_ms": lambda r: r.latency_ms is not None,
        }.get(metric, lambda r: 1)
        users = sorted({r.user_hash for r in members})
        num = [sum(float(num_of(r)) for r in members if r.user_hash == u) for u in users]
        den = [sum(float(den_of(r)) for r in members if r.user_hash == u) for u in users]
        return Users(num, den)

    for metric in USER_SUMS:
        c = compare(users_of(control, metric), users_of(got, metric))
        expected = compare(python_users(ctrl_rows, metric), python_users(mine, metric))
        assert (c.relative, c.relative_se, c.p_value) == pytest.approx(
            (expected.relative, expected.relative_se, expected.p_value)
        )
        adjusted = compare(users_of(control, metric, pre), users_of(got, metric, pre), cuped=True)
        assert (adjusted.users_control, adjusted.users_treatment) == (c.users_control, c.users_treatment)
        assert math.isfinite(adjusted.relative) and adjusted.variance_ratio > 0
    with pytest.raises(KeyError, match="no per-user figures"):
        users_of(got, "latency_p95_ms")


def test_the_final_ab_table_comes_from_the_analyst_views_and_equals_python(ch_client, ch_db):
    """live_ab (the main job's seed table) reads user_behaviour_between and user_rewards_between: per metric the
    relative change, its interval and p-value over users equal a Python computation from the rows (a replayed
    trajectory and a re-emitted reward count once, the reward at its newest revision, other reward versions and
    arms left out), and the documented analyst query gives the same figures."""
    import random

    from monitors.queries import LIVE_AB_METRICS, Side, live_ab
    from rtrl.clickhouse import insert
    from schemas.records import Reward, TrajectorySummary
    from tests.test_monitors import analyst_queries, in_database

    rng = random.Random(11)
    t0 = 1_750_000_000_000
    trajectories, rewards = [], []
    for i in range(600):
        user = f"{rng.randrange(120):032x}"
        arm = "ab-final" if int(user, 16) % 2 else "ab-v0"
        final = arm == "ab-final"
        calls = 1 + rng.randrange(3)
        checks = int(rng.random() < (0.6 if final else 0.5))
        trajectories.append(
            TrajectorySummary(
                trajectory_id=f"t{i}",
                policy_version=7 if final else 0,
                org_id=f"org-{i % 3}",
                arm=arm,
                task_kind="bugfix",
                revision=0,
                close_reason="ended",
                status="completed",
                n_events=5,
                tool_calls=calls,
                broken_tool_calls=min(calls, int(rng.random() < (0.05 if final else 0.1))),
                clarifying_questions=int(rng.random() < 0.1),
                unneeded_questions=0,
                edits_proposed=1,
                edits_accepted=checks,
                persistence_checks=checks,
                persisted_fraction_sum=checks * rng.choice([0.0, 0.5, 1.0, 1.0]),
                followups=1,
                dissatisfied_followups=int(rng.random() < (0.3 if final else 0.45)),
                latency_ms=rng.choice([None, 800.0 + 600 * rng.random()]),
                ttft_ms=None,
                first_event_ts=t0 + i * 100,
                last_event_ts=t0 + i * 100 + 50,
                user_hash=user,
            )
        )
        for rv in ("v2", "v1-discard-broken"):
            rewards.append(
                Reward(
                    trajectory_id=f"t{i}",
                    policy_version=7 if final else 0,
                    reward_version=rv,
                    revision=0,
                    reward=rng.gauss(0.2 if final else -0.1, 0.7),
                    components={},
                    flags=[],
                    close_reason="ended",
                    org_id=f"org-{i % 3}",
                    arm=arm,
                    task_kind="bugfix",
                    n_events=5,
                    event_counts={},
                    first_event_ts=t0 + i * 100,
                    last_event_ts=t0 + i * 100 + 50,
                    emitted_at=t0 + i * 100 + 60,
                )
            )
    newer = [msgspec.structs.replace(r, revision=1, reward=r.reward + 1.0) for r in rewards[:40:2]]  # v2, t0..t19
    other = [msgspec.structs.replace(t, trajectory_id=f"c{i}", arm="control") for i, t in enumerate(trajectories[:50])]
    insert(ch_client, ch_db, "trajectories", trajectories + trajectories[:30] + other)
    insert(ch_client, ch_db, "rewards", rewards + newer)
    table = {r.metric: r for r in live_ab(ch_client, ch_db, Side(0, "ab-v0"), Side(7, "ab-final"), "v2")}
    assert list(table) == [m for m, _, _ in LIVE_AB_METRICS]

    reward_of = {r.trajectory_id: r.reward for r in rewards if r.reward_version == "v2"}
    reward_of |= {r.trajectory_id: r.reward for r in newer}
    per_metric = {
        "edit_persistence": (lambda t: t.persisted_fraction_sum, lambda t: t.persistence_checks),
        "dissatisfied_rate": (lambda t: t.dissatisfied_followups > 0, lambda t: 1),
        "latency_mean_ms": (lambda t: t.latency_ms or 0.0, lambda t: t.latency_ms is not None),
        "broken_tool_call_rate": (lambda t: t.broken_tool_calls, lambda t: t.tool_calls),
        "clarification_rate": (lambda t: t.clarifying_questions > 0, lambda t: 1),
        "reward_mean": (lambda t: reward_of[t.trajectory_id], lambda t: 1),
    }

    def python_users(arm: str, metric: str) -> Users:
        rows = [t for t in trajectories if t.arm == arm]
        users = sorted({t.user_hash for t in rows})
        num_of, den_of = per_metric[metric]
        num = [sum(float(num_of(t)) for t in rows if t.user_hash == u) for u in users]
        den = [sum(float(den_of(t)) for t in rows if t.user_hash == u) for u in users]
        return Users(num, den)

    for metric, row in table.items():
        c = row.comparison
        assert c is not None, row.reason
        want = compare(python_users("ab-v0", metric), python_users("ab-final", metric))
        assert (c.relative, c.low, c.high, c.p_value, c.difference) == pytest.approx(
            (want.relative, want.low, want.high, want.p_value, want.difference), rel=1e-9
        ), metric
    assert table["dissatisfied_rate"].comparison.relative < 0 < table["reward_mean"].comparison.difference

    sql = analyst_queries()["The main job's final A/B: the seed's table"]
    res = ch_client.query(in_database(sql, ch_db))
    documented = {r[0]: dict(zip(res.column_names, r)) for r in res.result_rows}
    assert set(documented) == set(table)
    for metric, row in table.items():
        c, d = row.comparison, documented[metric]
        assert (d["relative_change"], d["ci_low"], d["ci_high"], d["p_value"]) == pytest.approx(
            (c.relative, c.low, c.high, c.p_value), rel=1e-6, abs=1e-12
        ), metric
        assert (d["users_v0"], d["users_final"]) == (c.users_control, c.users_treatment)


def test_the_final_ab_table_says_why_a_metric_cannot_be_compared(ch_client, ch_db):
    """An arm with too few users for a metric gets a row with the reason instead of a comparison."""
    from monitors.queries import Side, live_ab

    rows = live_ab(ch_client, ch_db, Side(0, "ab-v0"), Side(7, "ab-final"), "v2")
    assert rows and all(r.comparison is None and "need at least 2" in r.reason for r in rows)
