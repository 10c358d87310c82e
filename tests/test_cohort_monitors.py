"""Cohort-level hacks (monitors/stats.py CohortMonitor): a broken-call or deferral rise confined to one org of
about 3% of users is flagged for that org within one cycle of traffic, while the overall comparison does not
see it; no other org and no A/A control alarms. Seeded simulations (simulator/abworld.py).

One cycle here is production-sized: 10,000 users over 33 orgs (about 300 users, 3% each), three trajectories per
user at activity 1 (about 80,000 trajectories), looked at ten times as it fills. The hack triples the org's rate,
the size of v1's own rise on the eval suite (0.088 -> 0.27); over seeds 0-9 a tripled broken-call rate was flagged
in 10 of 10 cycles and a tripled deferral rate in 9 (a 2.5x rise: 10 and 7), by the 6th-10th look."""

from __future__ import annotations

import math

import numpy as np
import pytest

from monitors.stats import CohortMonitor, Users, compare
from simulator import abworld

ORGS = 33
WORLD = abworld.World(users=10_000, per_user=3.0, orgs=ORGS)
METRICS = {"broken": "increase", "clarify": "increase"}
COHORTS = [f"org-{i:02d}" for i in range(ORGS)]


def _users(total: list[np.ndarray], sel: np.ndarray) -> Users:
    return Users(total[0][sel], total[1][sel])


def _cycle(seed: int, effects: dict | None = None, effect_orgs: tuple[int, ...] | None = None, looks: int = 10):
    """Run one cycle: per look the cumulative per-org (control, treatment) Users of each metric, and the monitor."""
    rng = np.random.default_rng(seed)
    pop = abworld.population(WORLD, rng)
    monitor = CohortMonitor(COHORTS, METRICS)
    totals = {m: [np.zeros(WORLD.users), np.zeros(WORLD.users)] for m in METRICS}
    overall = None
    for _ in range(looks):
        now = abworld.period(WORLD, pop, rng, effects=effects, effect_orgs=effect_orgs, scale=1 / looks)
        for m in METRICS:
            totals[m][0] += now[m][0]
            totals[m][1] += now[m][1]
        data: dict[str, dict[str, tuple[Users, Users]]] = {}
        for i, cohort in enumerate(COHORTS):
            mine = pop.org == i
            data[cohort] = {
                m: (_users(totals[m], mine & (pop.arm == 0)), _users(totals[m], mine & (pop.arm == 1))) for m in METRICS
            }
        monitor.look(data)
        overall = compare(*abworld.arms(pop, {"broken": (totals["broken"][0], totals["broken"][1])}, "broken"))
    return monitor, overall


@pytest.mark.parametrize("metric", ["broken", "clarify"])
def test_a_hack_in_one_org_is_flagged_for_that_org_only_within_one_cycle(metric):
    monitor, overall = _cycle(7, effects={metric: 3.0}, effect_orgs=(5,))
    assert set(monitor.alarms) == {("org-05", metric)}
    alarm = monitor.alarms[("org-05", metric)]
    assert alarm.low > 0 and alarm.look <= 10 and "org-05" in alarm.message and metric in alarm.message
    if metric == "broken":  # the hack moves the whole population by ~4%: the overall one-look test misses it
        assert not overall.significant


@pytest.mark.slow
def test_no_alarm_on_an_aa_control():
    """A/A cycles: the chance of any alarm over 33 orgs x 2 metrics x 10 looks stays at or below alpha (0.05) plus
    three binomial standard errors over 40 seeded cycles."""
    sims = 40
    alarmed = sum(bool(_cycle(100 + s)[0].alarms) for s in range(sims))
    assert alarmed / sims <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / sims)


def test_the_monitor_refuses_undeclared_cohorts_and_bad_directions():
    with pytest.raises(ValueError, match="'increase' or 'decrease'"):
        CohortMonitor(["a"], {"broken": "up"})
    with pytest.raises(ValueError, match="at least one cohort"):
        CohortMonitor([], {"broken": "increase"})
    m = CohortMonitor(["a"], {"broken": "increase"})
    u = Users([1.0, 2.0], [10, 10])
    with pytest.raises(ValueError, match=r"cohorts \['b'\] were not declared"):
        m.look({"b": {"broken": (u, u)}})
    with pytest.raises(ValueError, match="metric 'latency' was not declared"):
        m.look({"a": {"latency": (u, u)}})
    assert m.look({"a": {"broken": (u, u)}}) == [] and m.tests[("a", "broken")].alpha == 0.05


def test_the_monitor_reads_its_cohorts_from_clickhouse(ch_client, ch_db):
    """Per-org, per-user figures of both arms from the trajectories table (cohort_users) drive the monitor: the
    org whose candidate arm breaks three times as many tool calls alarms, the other does not."""
    import random

    from monitors.queries import Side, cohort_users
    from rtrl.clickhouse import insert
    from schemas.records import TrajectorySummary

    rng = random.Random(3)
    rows = []
    for i in range(12_000):
        org = "org-00" if i % 2 else "org-01"
        user = f"{rng.randrange(600):032x}"
        arm = "candidate" if int(user, 16) % 2 else "control"
        p = 0.08 * (3.0 if org == "org-00" and arm == "candidate" else 1.0)
        broken = int(rng.random() < p)
        rows.append(
            TrajectorySummary(
                trajectory_id=f"t{i}",
                policy_version=2 if arm == "candidate" else 1,
                org_id=org,
                arm=arm,
                task_kind="bugfix",
                revision=0,
                close_reason="ended",
                status="completed",
                n_events=3,
                tool_calls=1,
                broken_tool_calls=broken,
                clarifying_questions=0,
                unneeded_questions=0,
                edits_proposed=1,
                edits_accepted=0,
                persistence_checks=0,
                persisted_fraction_sum=0.0,
                followups=1,
                dissatisfied_followups=0,
                latency_ms=None,
                ttft_ms=None,
                first_event_ts=1_750_000_000_000 + i,
                last_event_ts=1_750_000_000_000 + i,
                user_hash=f"{org}-{user}"[-32:],
            )
        )
    insert(ch_client, ch_db, "trajectories", rows)
    data = cohort_users(ch_client, ch_db, Side(1, "control"), Side(2, "candidate"), ["broken_tool_call_rate"])
    assert sorted(data) == ["org-00", "org-01"]
    control, treatment = data["org-00"]["broken_tool_call_rate"]
    assert control.n + treatment.n == len({r.user_hash for r in rows if r.org_id == "org-00"})
    monitor = CohortMonitor(sorted(data), {"broken_tool_call_rate": "increase"})
    alarms = monitor.look(data)
    assert [(a.cohort, a.metric) for a in alarms] == [("org-00", "broken_tool_call_rate")]
