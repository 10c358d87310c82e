"""Behaviour monitors on the real engine: the views of 0002_monitors.sql against figures computed
independently in Python, replay safety, the pure alert rules, the promotion check, the A/B table's
delta-method intervals, and the analyst queries of monitors/ANALYST_QUERIES.md."""

from __future__ import annotations

import math
import random
import re
import statistics
from pathlib import Path

import msgspec
import numpy as np
import pytest

from monitors.alerts import (
    DEFAULT_RULES,
    AlertRule,
    MismatchRule,
    StepAlert,
    evaluate,
    mismatch_alerts,
    mismatch_summary,
    relative_change_ci,
)
from monitors.queries import ab_table, behaviour, check_promotion, format_ab_table, reward_stats, train_mismatch
from rewards.versions import BUILTIN
from rtrl.clickhouse import insert
from schemas.records import BatchStats, Checkpoint, DeadLetter, Reward, TrainStep, TrajectorySummary

T0 = 1_750_000_000_000
Z = 1.96


def traj(
    tid: str,
    pv: int,
    org: str = "acme",
    *,
    revision: int = 0,
    tool_calls: int = 0,
    broken: int = 0,
    questions: int = 0,
    edits: int = 0,
    checks: int = 0,
    persisted: float = 0.0,
    followups: int = 0,
    dissatisfied: int = 0,
    latency: float | None = None,
) -> TrajectorySummary:
    return TrajectorySummary(
        trajectory_id=tid,
        policy_version=pv,
        org_id=org,
        arm="control",
        task_kind="bugfix",
        revision=revision,
        close_reason="ended",
        status="completed",
        n_events=1 + tool_calls + questions + edits + followups,
        tool_calls=tool_calls,
        broken_tool_calls=broken,
        clarifying_questions=questions,
        unneeded_questions=0,
        edits_proposed=edits,
        edits_accepted=min(edits, checks),
        persistence_checks=checks,
        persisted_fraction_sum=persisted,
        followups=followups,
        dissatisfied_followups=dissatisfied,
        latency_ms=latency,
        ttft_ms=None if latency is None else latency / 4,
        first_event_ts=T0,
        last_event_ts=T0 + 60_000,
    )


def random_trajectories(
    rng: random.Random,
    pv: int,
    n: int,
    *,
    broken_p: float = 0.1,
    edit_p: float = 0.6,
    dissatisfied_p: float = 0.15,
    latency_scale: float = 1500.0,
) -> list[TrajectorySummary]:
    out = []
    for i in range(n):
        calls = rng.randint(0, 6)
        edits = rng.randint(1, 3) if rng.random() < edit_p else 0
        checks = rng.randint(0, edits)
        follow = rng.randint(0, 2)
        out.append(
            traj(
                f"v{pv}-{i}",
                pv,
                rng.choice(["acme", "globex", "initech"]),
                tool_calls=calls,
                broken=sum(rng.random() < broken_p for _ in range(calls)),
                questions=int(rng.random() < 0.2),
                edits=edits,
                checks=checks,
                persisted=sum(rng.random() for _ in range(checks)),
                followups=follow,
                dissatisfied=min(follow, int(rng.random() < dissatisfied_p)),
                latency=None if rng.random() < 0.1 else round(rng.lognormvariate(0, 0.6) * latency_scale, 1),
            )
        )
    return out


def order_statistic_ci(values: list[float], p: float) -> tuple[float, float]:
    """Distribution-free 95% interval of the p-quantile: ranks floor(np - z sqrt(np(1-p))) and
    ceil(np + z sqrt(np(1-p))) + 1 of the sorted values, clamped to 1..n (1-based)."""
    xs, n = sorted(values), len(values)
    half = Z * math.sqrt(n * p * (1 - p))
    lo = max(1, math.floor(n * p - half))
    hi = min(n, math.ceil(n * p + half) + 1)
    return xs[lo - 1], xs[hi - 1]


def expected_behaviour(rows: list[TrajectorySummary]) -> dict:
    """Every view column computed from the rows in plain Python (statistics/numpy), not from SQL."""
    n = len(rows)
    ind = lambda f: [1.0 if f(r) else 0.0 for r in rows]  # noqa: E731
    var = lambda xs: statistics.variance(xs) if len(xs) > 1 else None  # noqa: E731
    edited, clar = ind(lambda r: r.edits_proposed > 0), ind(lambda r: r.clarifying_questions > 0)
    wb, dis = ind(lambda r: r.broken_tool_calls > 0), ind(lambda r: r.dissatisfied_followups > 0)
    calls = sum(r.tool_calls for r in rows)
    broken_rate = sum(r.broken_tool_calls for r in rows) / max(calls, 1)
    mean_calls = statistics.fmean(r.tool_calls for r in rows)
    broken_var = (
        statistics.variance([r.broken_tool_calls - broken_rate * r.tool_calls for r in rows]) / mean_calls**2
        if n > 1 and mean_calls > 0
        else None
    )
    checked = [r for r in rows if r.persistence_checks > 0]
    persistence = (
        sum(r.persisted_fraction_sum for r in checked) / sum(r.persistence_checks for r in checked) if checked else None
    )
    persistence_var = (
        statistics.variance([r.persisted_fraction_sum - persistence * r.persistence_checks for r in checked])
        / statistics.fmean(r.persistence_checks for r in checked) ** 2
        if len(checked) > 1
        else None
    )
    lat = [r.latency_ms for r in rows if r.latency_ms is not None]
    out = {
        "trajectories": n,
        "edit_rate": statistics.fmean(edited),
        "edit_rate_var": var(edited),
        "clarification_rate": statistics.fmean(clar),
        "clarification_rate_var": var(clar),
        "tool_calls": calls,
        "broken_tool_call_rate": broken_rate,
        "broken_tool_call_rate_var": broken_var,
        "trajectories_with_broken_rate": statistics.fmean(wb),
        "trajectories_with_broken_rate_var": var(wb),
        "persistence_checks": sum(r.persistence_checks for r in rows),
        "edit_persistence_n": len(checked),
        "edit_persistence": persistence,
        "edit_persistence_var": persistence_var,
        "dissatisfied_rate": statistics.fmean(dis),
        "dissatisfied_rate_var": var(dis),
        "latency_n": len(lat),
        "latency_mean_ms": statistics.fmean(lat) if lat else None,
        "latency_var": var(lat),
        "latency_p50_ms": float(np.percentile(lat, 50)) if lat else None,
        "latency_p95_ms": float(np.percentile(lat, 95)) if lat else None,
    }
    for p, name in ((0.5, "p50"), (0.95, "p95")):
        lo, hi = order_statistic_ci(lat, p) if lat else (None, None)
        out[f"latency_{name}_ci_low_ms"], out[f"latency_{name}_ci_high_ms"] = lo, hi
    return out


def assert_row_matches(got: dict, want: dict, where: str) -> None:
    for k, v in want.items():
        if v is None:
            assert got[k] is None, f"{where} {k}: {got[k]} should be NULL"
        else:
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), f"{where} {k}"


# ---------------------------------------------------------------- the behaviour view


def test_behaviour_view_equals_python_figures(ch_client, ch_db):
    """Every column of ``behaviour`` — rates, ratio metrics, exact quantiles, variances and the
    quantiles' order-statistic intervals — equals an independent Python computation, for each
    (version, org) and for the org_id = '*' row over all orgs; there are no other rows."""
    rng = random.Random(7)
    rows = random_trajectories(rng, 1, 240) + random_trajectories(rng, 2, 180, broken_p=0.2)
    insert(ch_client, ch_db, "trajectories", rows)
    res = ch_client.query(f"SELECT * FROM {ch_db}.behaviour")
    got = {(r[0], r[1]): dict(zip(res.column_names, r)) for r in res.result_rows}
    groups: dict[tuple[int, str], list] = {}
    for r in rows:
        groups.setdefault((r.policy_version, r.org_id), []).append(r)
        groups.setdefault((r.policy_version, "*"), []).append(r)
    assert set(got) == set(groups)
    for key, members in groups.items():
        assert_row_matches(got[key], expected_behaviour(members), str(key))
    assert behaviour(ch_client, ch_db, 2, "globex") == got[(2, "globex")]
    assert behaviour(ch_client, ch_db, 2) == got[(2, "*")]


def test_replayed_and_reclosed_trajectories_count_once(ch_client, ch_db):
    """A row inserted twice (at-least-once replay) counts once, and a re-close with a higher
    revision replaces the earlier figures rather than adding to them: views read FINAL at query time."""
    first = [traj("a", 1, edits=0, latency=1000.0), traj("b", 1, edits=1, checks=1, persisted=0.5, latency=2000.0)]
    insert(ch_client, ch_db, "trajectories", first)
    insert(ch_client, ch_db, "trajectories", first)  # replay
    row = behaviour(ch_client, ch_db, 1)
    assert row["trajectories"] == 2 and row["edit_rate"] == 0.5 and row["edit_persistence"] == 0.5
    # late events re-close "a": it now has an edit whose persistence was checked
    insert(
        ch_client, ch_db, "trajectories", [traj("a", 1, revision=1, edits=1, checks=1, persisted=1.0, latency=3000.0)]
    )
    insert(ch_client, ch_db, "trajectories", first)  # an old revision replayed again loses to revision 1
    row = behaviour(ch_client, ch_db, 1)
    assert row["trajectories"] == 2
    assert row["edit_rate"] == 1.0
    assert row["edit_persistence"] == pytest.approx(0.75)
    assert row["latency_p50_ms"] == pytest.approx(2500.0)
    assert_row_matches(
        row,
        expected_behaviour([traj("a", 1, revision=1, edits=1, checks=1, persisted=1.0, latency=3000.0), first[1]]),
        "replayed",
    )


def test_metrics_without_samples_are_null_not_errors(ch_client, ch_db):
    """No persistence check -> edit_persistence NULL; no latency -> latency NULL; one trajectory ->
    variances NULL; a version with no trajectory reads as trajectories 0 with None metrics."""
    insert(ch_client, ch_db, "trajectories", [traj("x", 5, tool_calls=0)])
    row = behaviour(ch_client, ch_db, 5)
    assert row["trajectories"] == 1 and row["broken_tool_call_rate"] == 0.0
    for col in (
        "edit_persistence",
        "edit_persistence_var",
        "latency_p50_ms",
        "latency_p95_ci_high_ms",
        "latency_mean_ms",
        "edit_rate_var",
        "broken_tool_call_rate_var",
    ):
        assert row[col] is None, col
    empty = behaviour(ch_client, ch_db, 99)
    assert empty["trajectories"] == 0 and empty["edit_rate"] is None and empty["latency_n"] == 0


def test_reward_stats_per_reward_version(ch_client, ch_db):
    """reward_stats(rv) gives count, mean and sample variance of rewards per (version, org) and
    overall under that reward version only; a re-emitted reward (higher revision) replaces the old one."""
    rng = random.Random(3)
    rewards = []
    for i in range(60):
        for rv in ("v1", "v2"):
            rewards.append(
                Reward(
                    trajectory_id=f"t{i}",
                    policy_version=1 + i % 2,
                    reward_version=rv,
                    revision=0,
                    reward=round(rng.gauss(0.3 if rv == "v2" else 0.0, 1.0), 6),
                    components={},
                    flags=[],
                    close_reason="ended",
                    org_id=["acme", "globex"][i % 3 == 0],
                    arm="control",
                    task_kind="bugfix",
                    n_events=3,
                    event_counts={},
                    first_event_ts=T0,
                    last_event_ts=T0 + 1,
                    emitted_at=T0 + 2,
                )
            )
    insert(ch_client, ch_db, "rewards", rewards)
    late = [
        Reward(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "revision": 1, "reward": 5.0})
        for r in rewards
        if r.trajectory_id in ("t0", "t1") and r.reward_version == "v2"
    ]
    insert(ch_client, ch_db, "rewards", late)
    insert(ch_client, ch_db, "rewards", rewards)  # replay of revision 0 loses
    final = {r.trajectory_id: r for r in rewards if r.reward_version == "v2"} | {r.trajectory_id: r for r in late}
    res = ch_client.query(f"SELECT * FROM {ch_db}.reward_stats(rv = 'v2')")
    got = {(r[0], r[1]): dict(zip(res.column_names, r)) for r in res.result_rows}
    groups: dict[tuple[int, str], list[float]] = {}
    for r in final.values():
        groups.setdefault((r.policy_version, r.org_id), []).append(r.reward)
        groups.setdefault((r.policy_version, "*"), []).append(r.reward)
    assert set(got) == set(groups)
    for key, xs in groups.items():
        assert got[key]["trajectories"] == len(xs)
        assert got[key]["reward_mean"] == pytest.approx(statistics.fmean(xs), rel=1e-9)
        assert got[key]["reward_var"] == pytest.approx(statistics.variance(xs), rel=1e-9)
    assert reward_stats(ch_client, ch_db, "v2")[1] == got[(1, "*")]
    assert reward_stats(ch_client, ch_db, "v3") == {}


# ---------------------------------------------------------------- pure alert rules


def row(n: int = 1000, **metrics: float | None) -> dict:
    return {"trajectories": n, **metrics}


def test_evaluate_threshold_edge_and_direction():
    """A rule fires only when the relative move in its bad direction is strictly above the threshold;
    the same move in the good direction never fires."""
    up = AlertRule("latency_p95_ms", "increase", 0.2, min_samples=10)
    assert evaluate(row(latency_p95_ms=1200.0), row(latency_p95_ms=1000.0), [up]).alerts == ()  # exactly +20%
    ev = evaluate(row(latency_p95_ms=1201.0), row(latency_p95_ms=1000.0), [up])
    assert [a.metric for a in ev.alerts] == ["latency_p95_ms"] and not ev.ok
    a = ev.alerts[0]
    assert (a.parent, a.candidate, a.threshold) == (1000.0, 1201.0, 0.2)
    assert a.relative_change == pytest.approx(0.201) and "rose 20.1%" in a.message
    assert evaluate(row(latency_p95_ms=500.0), row(latency_p95_ms=1000.0), [up]).ok  # faster is fine

    down = AlertRule("edit_rate", "decrease", 0.1, min_samples=10)
    assert evaluate(row(edit_rate=0.45), row(edit_rate=0.5), [down]).passed == ("edit_rate",)  # exactly -10%
    fired = evaluate(row(edit_rate=0.3), row(edit_rate=0.5), [down])
    assert fired.alerts[0].relative_change == pytest.approx(-0.4) and "fell 40.0%" in fired.alerts[0].message
    assert evaluate(row(edit_rate=0.9), row(edit_rate=0.5), [down]).ok


def test_evaluate_floor_for_tiny_baselines():
    """With a floor, the relative change is taken against max(|parent|, floor): a zero or tiny
    baseline does not make a trivial absolute move an alert, while a real jump still is."""
    rule = AlertRule("broken_tool_call_rate", "increase", 0.2, min_samples=10, floor=0.01)
    assert evaluate(row(broken_tool_call_rate=0.002), row(broken_tool_call_rate=0.0), [rule]).ok
    assert evaluate(row(broken_tool_call_rate=0.003), row(broken_tool_call_rate=0.001), [rule]).ok
    assert not evaluate(row(broken_tool_call_rate=0.05), row(broken_tool_call_rate=0.0), [rule]).ok
    bare = AlertRule("broken_tool_call_rate", "increase", 0.2, min_samples=10)
    ev = evaluate(row(broken_tool_call_rate=0.002), row(broken_tool_call_rate=0.0), [bare])
    assert ev.alerts[0].relative_change == math.inf
    assert evaluate(row(broken_tool_call_rate=0.0), row(broken_tool_call_rate=0.0), [bare]).ok


def test_evaluate_skips_rules_without_enough_data():
    """Too few samples on either side, or no value (NULL/NaN), skips the rule: it neither fires nor
    passes, ``insufficient`` is set and ``ok`` (the strict verdict) is False; rules read their own
    sample column (persistence counts trajectories with a check). A misspelt column raises."""
    rule = AlertRule("edit_rate", "decrease", 0.1, min_samples=100)
    ev = evaluate(row(50, edit_rate=0.1), row(1000, edit_rate=0.5), [rule])
    assert ev.alerts == () and ev.passed == () and ev.insufficient and not ev.ok
    assert ev.skipped[0].metric == "edit_rate" and ev.skipped[0].candidate_samples == 50
    assert "need 100" in ev.skipped[0].reason and "not judged" in ev.summary()
    assert evaluate(row(1000, edit_rate=0.1), row(99, edit_rate=0.5), [rule]).insufficient
    assert (
        evaluate(row(1000, edit_rate=None), row(1000, edit_rate=0.5), [rule]).skipped[0].reason
        == "no value for the candidate"
    )
    assert evaluate(row(1000, edit_rate=float("nan")), row(1000, edit_rate=0.5), [rule]).insufficient
    pers = AlertRule("edit_persistence", "decrease", 0.05, min_samples=100, samples="edit_persistence_n")
    ev = evaluate(
        row(1000, edit_persistence=0.1, edit_persistence_n=20),
        row(1000, edit_persistence=0.9, edit_persistence_n=500),
        [pers],
    )
    assert ev.insufficient and not ev.alerts
    with pytest.raises(KeyError, match="edit_rat"):
        evaluate(row(edit_rate=0.5), row(edit_rate=0.5), [AlertRule("edit_rat", "decrease", 0.1)])
    with pytest.raises(ValueError, match="direction"):
        AlertRule("edit_rate", "down", 0.1)  # type: ignore[arg-type]


def test_default_rules_cover_the_seed_post_hacks():
    """DEFAULT_RULES guard broken tool calls, edits, clarifications, persistence, dissatisfaction and
    p95 latency, each with the bad direction of the seed post's lessons."""
    want = {
        "broken_tool_call_rate": "increase",
        "edit_rate": "decrease",
        "clarification_rate": "increase",
        "edit_persistence": "decrease",
        "dissatisfied_rate": "increase",
        "latency_p95_ms": "increase",
    }
    assert {r.metric: r.direction for r in DEFAULT_RULES} == want


# ---------------------------------------------------------------- promotion check


def deterministic_version(pv: int, n: int = 250, broken_every: tuple[int, ...] = (0,)) -> list[TrajectorySummary]:
    return [
        traj(
            f"v{pv}-{i}",
            pv,
            ["acme", "globex"][i % 2],
            tool_calls=4,
            broken=int(i % 5 in broken_every),
            questions=int(i % 7 == 0),
            edits=int(i % 3 != 0),
            checks=int(i % 3 != 0),
            persisted=0.8 if i % 3 != 0 else 0.0,
            followups=1,
            dissatisfied=int(i % 10 == 0),
            latency=1000.0 + (i * 37) % 500,
        )
        for i in range(n)
    ]


def test_check_promotion_flags_doubled_broken_calls_and_passes_healthy(ch_client, ch_db):
    """With DEFAULT_RULES, a candidate whose broken-tool-call rate doubled (0.05 -> 0.10) gets exactly
    that alert; a candidate behaving like its parent is ok; one with too little data is not ok but has
    no alert (insufficient)."""
    insert(
        ch_client,
        ch_db,
        "trajectories",
        deterministic_version(1)
        + deterministic_version(2, broken_every=(0, 1))
        + deterministic_version(3)
        + deterministic_version(4, n=20),
    )
    bad = check_promotion(ch_client, ch_db, candidate_version=2, parent_version=1)
    assert bad.parent["broken_tool_call_rate"] == pytest.approx(0.05)
    assert bad.candidate["broken_tool_call_rate"] == pytest.approx(0.10)
    assert [a.metric for a in bad.alerts] == ["broken_tool_call_rate"] and not bad.ok
    assert bad.alerts[0].relative_change == pytest.approx(1.0)
    assert "broken_tool_call_rate rose 100.0%" in bad.reason

    good = check_promotion(ch_client, ch_db, 3, 1)
    assert good.ok and good.alerts == () and good.skipped == ()
    assert set(good.passed) == {r.metric for r in DEFAULT_RULES}

    thin = check_promotion(ch_client, ch_db, 4, 1)
    assert thin.alerts == () and thin.insufficient and not thin.ok

    per_org = check_promotion(
        ch_client,
        ch_db,
        2,
        1,
        org_id="acme",
        rules=[AlertRule("broken_tool_call_rate", "increase", 0.2, min_samples=50)],
    )
    assert per_org.candidate["trajectories"] == 125 and [a.metric for a in per_org.alerts] == ["broken_tool_call_rate"]


# ---------------------------------------------------------------- A/B table


def python_delta(m_a: float, s2_a: float, n_a: int, m_b: float, s2_b: float, n_b: int) -> tuple[float, float, float]:
    """The brief's formula: rel = m_b/m_a - 1, se = (m_b/m_a) sqrt(s_a^2/(n_a m_a^2) + s_b^2/(n_b m_b^2))."""
    rel = m_b / m_a - 1
    se = (m_b / m_a) * math.sqrt(s2_a / (n_a * m_a**2) + s2_b / (n_b * m_b**2))
    return rel, rel - Z * se, rel + Z * se


def test_ab_table_matches_python_delta_method(ch_client, ch_db):
    """ab_table's relative changes and 95% intervals equal a Python delta-method computation from the
    raw trajectories (means/ratios via per-trajectory variances; quantiles via the order-statistic
    interval's width / (2*1.96)); the baseline row has no change; the SQL A/B query of
    ANALYST_QUERIES.md gives the same numbers."""
    rng = random.Random(11)
    v1 = random_trajectories(rng, 1, 400)
    v2 = random_trajectories(rng, 2, 350, dissatisfied_p=0.25, latency_scale=1300.0)
    insert(ch_client, ch_db, "trajectories", v1 + v2)
    table = ab_table(ch_client, ch_db, [1, 2], baseline=1)
    assert [r["policy_version"] for r in table] == [1, 2]
    assert table[0]["edit_persistence_rel"] is None and table[0]["latency_p95_ms_ci_low"] is None
    a, b = expected_behaviour(v1), expected_behaviour(v2)
    want = {
        "dissatisfied_rate": python_delta(
            a["dissatisfied_rate"],
            a["dissatisfied_rate_var"],
            a["trajectories"],
            b["dissatisfied_rate"],
            b["dissatisfied_rate_var"],
            b["trajectories"],
        ),
        "edit_persistence": python_delta(
            a["edit_persistence"],
            a["edit_persistence_var"],
            a["edit_persistence_n"],
            b["edit_persistence"],
            b["edit_persistence_var"],
            b["edit_persistence_n"],
        ),
    }
    for q in ("p50", "p95"):
        se = lambda e, q=q: (e[f"latency_{q}_ci_high_ms"] - e[f"latency_{q}_ci_low_ms"]) / (2 * Z)  # noqa: E731
        m = f"latency_{q}_ms"
        want[m] = python_delta(a[m], se(a) ** 2, 1, b[m], se(b) ** 2, 1)
    row2 = table[1]
    for m, (rel, lo, hi) in want.items():
        assert row2[m] == pytest.approx(b[m], rel=1e-9)
        assert (row2[f"{m}_rel"], row2[f"{m}_ci_low"], row2[f"{m}_ci_high"]) == pytest.approx(
            (rel, lo, hi), rel=1e-9
        ), m
    assert row2["dissatisfied_rate_ci_low"] > 0  # 0.15 -> 0.25 at these sizes is a significant rise
    assert "+" in format_ab_table(table)

    sql = analyst_queries()["A/B table: relative change with 95% confidence interval"]
    res = ch_client.query(in_database(sql, ch_db))
    by_metric = {r[0]: dict(zip(res.column_names, r)) for r in res.result_rows}
    assert set(by_metric) == set(want)
    for m, (rel, lo, hi) in want.items():
        got = by_metric[m]
        assert (got["relative_change"], got["ci_low"], got["ci_high"]) == pytest.approx((rel, lo, hi), rel=1e-9), m


def test_relative_change_ci_edge_cases():
    """No interval without a baseline value or error; a zero candidate mean is defined (rel = -1)."""
    assert relative_change_ci(0.0, 0.1, 0.5, 0.1) is None
    assert relative_change_ci(0.5, None, 0.5, 0.1) is None
    c = relative_change_ci(0.5, 0.01, 0.0, 0.02)
    assert c.relative == -1.0 and c.se == pytest.approx(0.04)


# ---------------------------------------------------------------- analyst queries


def analyst_queries() -> dict[str, str]:
    """The ```sql blocks of monitors/ANALYST_QUERIES.md by their section title."""
    text = (Path(__file__).resolve().parent.parent / "monitors" / "ANALYST_QUERIES.md").read_text()
    out = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        if title == "Connect":  # how to reach the database (bash and Python), not a query
            continue
        blocks = re.findall(r"```sql\n(.*?)```", section, flags=re.S)
        assert len(blocks) == 1, title
        out[title] = blocks[0]
    return out


def in_database(sql: str, db: str) -> str:
    """The documented query pointed at ``db`` instead of the default database ``rtrl``."""
    return re.sub(r"\brtrl\.(?=[a-z_]+\b)", f"{db}.", sql)


def short_reward(tid: str, version: int, rv: str, reward: float, org: str = "acme", arm: str = "control") -> Reward:
    """A reward row of a one-event trajectory at T0."""
    return Reward(
        trajectory_id=tid,
        policy_version=version,
        reward_version=rv,
        revision=0,
        reward=reward,
        components={},
        flags=[],
        close_reason="ended",
        org_id=org,
        arm=arm,
        task_kind="bugfix",
        n_events=1,
        event_counts={},
        first_event_ts=T0,
        last_event_ts=T0,
        emitted_at=T0,
    )


def test_analyst_queries_run_and_say_what_they_answer(ch_client, ch_db):
    """Every documented query runs as pasted (with the database renamed) on a populated database and
    returns rows, and each has a one-line description before it."""
    rng = random.Random(5)
    v1, v2 = random_trajectories(rng, 1, 60), random_trajectories(rng, 2, 60)
    v2 = [msgspec.structs.replace(t, arm="candidate") if i % 2 else t for i, t in enumerate(v2)]  # A/B arms
    # the main job's final A/B: v2 against v1 (arms ab-final, ab-v0), users by hash, trajectories t10..t29
    final_ab = [
        msgspec.structs.replace(
            t, trajectory_id=f"t{10 + i}", arm="ab-final" if i % 2 else "ab-v0", user_hash=f"{i % 8:032x}"
        )
        for i, t in enumerate(v2[:20])
    ]
    insert(ch_client, ch_db, "trajectories", v1 + v2 + final_ab)
    insert(ch_client, ch_db, "reward_versions", [v.record(T0) for v in BUILTIN.values()])
    insert(ch_client, ch_db, "train_metrics", [train_step("loop-0-v2", s, 0.01, 0.5) for s in (1, 2)])
    # a later shared-policy step that trained some tokens through a serving adapter (shared_traffic = served)
    served_step = msgspec.structs.replace(train_step("loop-0-v3", 1, 0.01, 0.5), served_through_tokens=60)
    insert(ch_client, ch_db, "train_metrics", [served_step])
    adapter_step = msgspec.structs.replace(train_step("loop-0-org-1-a1", 1, 0.01, 0.5), adapter="org-1")
    insert(ch_client, ch_db, "train_metrics", [adapter_step])
    # a step that trained two of the trajectories, and a cohort whose monitor_only samples were kept from training
    trained = msgspec.structs.replace(
        train_step("loop-0-v4", 1, 0.01, 0.5), sample_ids=[v1[0].trajectory_id, v1[1].trajectory_id]
    )
    insert(ch_client, ch_db, "train_metrics", [trained])
    governed = BatchStats(
        cohort="org-3/bugfix",
        samples=0,
        batches=0,
        counts={"data_use:monitor_only": 3, "unmatched_reward": 0},
        lag_accepted={},
        lag_dropped={},
        clock=T0,
    )
    insert(ch_client, ch_db, "batch_stats", [governed])
    insert(
        ch_client,
        ch_db,
        "adapter_checkpoints",
        [
            Checkpoint(
                version=1,
                parent=None,
                created_at=T0,
                steps=1,
                samples=8,
                tokens=64,
                eval_results={"solve_rate": 0.6, "base_solve_rate": 0.4, "guard_solve_rate": 0.5},
                status="promoted",
                reason="test",
                kafka_offsets={},
                path="/a/org-1/1",
                org="org-1",
                base_version=2,
            )
        ],
    )
    insert(
        ch_client,
        ch_db,
        "checkpoints",
        [
            Checkpoint(
                version=v,
                parent=None if v == 1 else 1,
                created_at=T0,
                steps=2,
                samples=10,
                tokens=100,
                eval_results={"solve_rate": 0.1 * v, "greedy_solve_rate": 0.05 * v},
                status="promoted",
                reason="test",
                kafka_offsets={},
                path="",
            )
            for v in (1, 2)
        ],
    )
    insert(
        ch_client,
        ch_db,
        "rewards",
        [short_reward(f"t{i}", 1 + i % 2, rv, float(i % 4)) for i in range(10) for rv in ("v1-discard-broken", "v2")]
        + [
            short_reward(t.trajectory_id, t.policy_version, "v2", float(i % 3) - 1.0, t.org_id, t.arm)
            for i, t in enumerate(final_ab)
        ],
    )
    insert(
        ch_client,
        ch_db,
        "dead_letters",
        [
            DeadLetter(
                kind="malformed",
                source="rtrl.events",
                partition=0,
                offset=i,
                key=None,
                field="$",
                reason="not JSON",
                payload="{",
                at=T0,
            )
            for i in range(3)
        ],
    )
    queries = analyst_queries()
    assert len(queries) >= 5
    text = (Path(__file__).resolve().parent.parent / "monitors" / "ANALYST_QUERIES.md").read_text()
    for title, sql in queries.items():
        section = text.split(f"## {title}", 1)[1].split("```sql", 1)[0].strip()
        assert section, f"{title} has no description"
        rows = ch_client.query(in_database(sql, ch_db)).result_rows
        assert rows, title
    dead = ch_client.query(in_database(queries["Dead letters by kind"], ch_db)).result_rows
    assert dead[0][:3] == ("malformed", "rtrl.events", 3)


# ---------------------------------------------------------------- training-inference mismatch (train_metrics)


def train_step(run_id: str, step: int, k3: float, max_abs: float) -> TrainStep:
    return TrainStep(
        run_id=run_id,
        step=step,
        policy_version=3,
        loss=0.1,
        pg_loss=0.1,
        kl=0.01,
        clip_fraction=0.1,
        is_truncated_fraction=0.0,
        tokens=100,
        on_policy_fraction=0.9,
        lag_histogram={"0": 9, "1": 1},
        tokens_per_s=1000.0,
        batch_ids=[f"{run_id}-b{step}"],
        at=T0 + step,
        sample_ids=[f"{run_id}-s{step}"],
        grad_norm=1.5 + step,
        dual_clip_fraction=0.01,
        seq_guarded_tokens=step,
        mismatch_k3=k3,
        mismatch_max_abs_log_ratio=max_abs,
    )


def test_mismatch_rule_fires_above_the_limits_and_not_at_or_below():
    """Strictly above a limit fires (one alert per metric and step); at or below does not; NaN fires;
    a limit of 0 is not checked; negative or infinite limits are refused."""
    rule = MismatchRule(k3=0.5, max_abs_log_ratio=8.0)
    steps = [
        train_step("r", 1, 0.49, 7.9),
        train_step("r", 2, 0.5, 8.0),
        train_step("r", 3, 0.51, 8.0),
        train_step("r", 4, 0.1, 8.01),
        train_step("r", 5, 2.0, 30.0),
        train_step("r", 6, math.nan, 1.0),
    ]
    fired = mismatch_alerts(steps, rule)
    assert [(a.step, a.metric) for a in fired] == [
        (3, "mismatch_k3"),
        (4, "mismatch_max_abs_log_ratio"),
        (5, "mismatch_k3"),
        (5, "mismatch_max_abs_log_ratio"),
        (6, "mismatch_k3"),
    ]
    assert fired[0] == StepAlert("r", 3, "mismatch_k3", 0.51, 0.5, "mismatch_k3 0.51 > 0.5 at step 3 of run r")
    assert mismatch_alerts(steps[:2], rule) == ()
    assert [a.step for a in mismatch_alerts(steps, MismatchRule(k3=0.5, max_abs_log_ratio=0.0))] == [3, 5, 6]
    assert mismatch_alerts(steps, MismatchRule(k3=0.0, max_abs_log_ratio=0.0)) == ()
    assert mismatch_summary(()) == "training-inference mismatch within limits"
    summary = mismatch_summary(mismatch_alerts(steps[:5], rule))
    assert summary == (
        "training-inference mismatch: mismatch_k3 above 0.5 in 2 step(s), worst mismatch_k3 2 > 0.5 at step 5 "
        "of run r; mismatch_max_abs_log_ratio above 8 in 2 step(s), worst mismatch_max_abs_log_ratio 30 > 8 at "
        "step 5 of run r"
    )
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="MismatchRule.k3"):
            MismatchRule(k3=bad)
    with pytest.raises(KeyError, match="mismatch_k3"):
        mismatch_alerts([{"run_id": "r", "step": 1}], rule)


def test_train_mismatch_reads_train_metrics_from_clickhouse(ch_client, ch_db):
    """Migration 0007 adds the safety columns to train_metrics (verify() agrees with TrainStep); the rows
    round-trip, and monitors.queries.train_mismatch fires on exactly the run's steps above the limits,
    reading FINAL (a replayed step replaces itself)."""
    from rtrl.clickhouse import select, verify

    verify(ch_client, ch_db)
    rows = [train_step("a", 1, 0.01, 0.5), train_step("a", 2, 3.0, 0.5), train_step("a", 3, 0.02, 20.0)]
    rows += [train_step("b", 1, 9.0, 99.0)]
    insert(ch_client, ch_db, "train_metrics", rows)
    insert(ch_client, ch_db, "train_metrics", [train_step("a", 1, 0.01, 0.5)])  # a replay of step 1
    back = select(ch_client, ch_db, "train_metrics", "WHERE run_id = 'a' ORDER BY step")
    assert back == rows[:3]
    fired = train_mismatch(ch_client, ch_db, "a", MismatchRule(k3=2.0, max_abs_log_ratio=15.0))
    assert [(a.step, a.metric, a.value) for a in fired] == [
        (2, "mismatch_k3", 3.0),
        (3, "mismatch_max_abs_log_ratio", 20.0),
    ]
    assert train_mismatch(ch_client, ch_db, "a", MismatchRule(k3=5.0, max_abs_log_ratio=25.0)) == ()
    assert train_mismatch(ch_client, ch_db, "nobody") == ()
