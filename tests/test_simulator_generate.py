"""Pure tests of the simulator core: reproducibility, validity, trajectory shape and delivery disorder."""

from __future__ import annotations

import hashlib
import hmac
from collections import defaultdict
from functools import cache

import pytest

from rtrl.sections.simulator import SimulatorSettings
from schemas.codec import event_codec
from schemas.records import (
    ClarifyingQuestion,
    EditAccepted,
    EditPersisted,
    EditProposed,
    EditRejected,
    Followup,
    TrajectoryEnded,
    TrajectoryStarted,
)
from simulator import DEFAULT_START_MS, Emission, PolicyProfile, default_profile, generate, hash_user, stats

SALT = "test-salt-0123"
N = 3000


@cache
def run(trajectories: int = N, **kw) -> tuple[Emission, ...]:
    """Generate once per distinct argument set (tests share the big runs)."""
    profiles = kw.pop("profiles", None)
    settings = SimulatorSettings(trajectories=trajectories, **kw)
    return tuple(generate(settings, SALT, profiles=dict(profiles) if profiles else None))


def distinct(emissions) -> list:
    """Each event once, in delivery order."""
    seen, out = set(), []
    for em in emissions:
        if em.event.event_id not in seen:
            seen.add(em.event.event_id)
            out.append(em.event)
    return out


def by_trajectory(events) -> dict[str, list]:
    """Events of each trajectory, sorted by event time."""
    out: dict[str, list] = defaultdict(list)
    for ev in events:
        out[ev.trajectory_id].append(ev)
    return {k: sorted(v, key=lambda e: e.ts) for k, v in out.items()}


def test_same_seed_same_output_different_seed_different():
    """The same settings give an identical list; another seed gives a different one."""
    s = SimulatorSettings(seed=7, trajectories=200)
    a, b = generate(s, SALT), generate(s, SALT)
    assert a == b
    c = generate(SimulatorSettings(seed=8, trajectories=200), SALT)
    assert [e.event.event_id for e in a] != [e.event.event_id for e in c]


def test_prefix_stable_when_more_trajectories_requested():
    """A trajectory's events don't depend on how many trajectories follow it."""
    small = by_trajectory(distinct(generate(SimulatorSettings(seed=3, trajectories=50), SALT)))
    big = by_trajectory(distinct(generate(SimulatorSettings(seed=3, trajectories=80), SALT)))
    assert small.items() <= big.items()


def test_every_event_validates_and_output_is_sorted():
    """Every event passes the events codec; sends are sorted by at_ms and never precede event time."""
    codec = event_codec()
    ems = run()
    for em in ems:
        assert codec.validate(em.event) == em.event
        assert em.at_ms >= em.event.ts
    assert [e.at_ms for e in ems] == sorted(e.at_ms for e in ems)


def test_ids_unique_and_user_hashes_salted():
    """event_id identifies one event (duplicates are identical); trajectory ids are unique; user_hash is the salted HMAC."""
    first: dict[str, object] = {}
    for em in run():
        assert first.setdefault(em.event.event_id, em.event) == em.event
    starts = [ev for ev in first.values() if isinstance(ev, TrajectoryStarted)]
    assert len({ev.trajectory_id for ev in starts}) == len(starts) == N
    expected = hmac.new(SALT.encode(), b"user-00-007", hashlib.sha256).hexdigest()[:32]
    assert hash_user("user-00-007", SALT) == expected
    users = {hash_user(f"user-{o:02d}-{u:03d}", SALT) for o in range(6) for u in range(20)}
    assert {ev.user_hash for ev in first.values()} <= users


def test_start_time_and_poisson_arrivals():
    """The first trajectory starts at start_ms (default DEFAULT_START_MS when 0); starts are increasing."""
    for start, expect in ((0, DEFAULT_START_MS), (1_700_000_000_000, 1_700_000_000_000)):
        evs = distinct(generate(SimulatorSettings(trajectories=30, start_ms=start), SALT))
        starts = sorted(ev.ts for ev in evs if isinstance(ev, TrajectoryStarted))
        assert starts[0] == expect
        assert len(set(starts)) == len(starts)


def test_trajectory_shape():
    """Each trajectory begins with trajectory_started in event time, has exactly one trajectory_ended,
    which is its last event apart from persistence checks, and every decision refers to a proposed edit."""
    for _tid, evs in by_trajectory(distinct(run())).items():
        assert isinstance(evs[0], TrajectoryStarted) and evs[0].ts < evs[1].ts
        ends = [e for e in evs if isinstance(e, TrajectoryEnded)]
        assert len(ends) == 1
        live = [e for e in evs if not isinstance(e, EditPersisted)]
        assert live[-1] is ends[0]
        proposed = {e.edit_id for e in evs if isinstance(e, EditProposed)}
        decided = [e.edit_id for e in evs if isinstance(e, (EditAccepted, EditRejected))]
        assert sorted(decided) == sorted(proposed)


def test_persisted_refers_to_accepted_edit_of_same_trajectory():
    """Every edit_persisted names an accepted edit of its trajectory, once, at accept ts + checked_after_s."""
    checked = 0
    for evs in by_trajectory(distinct(run())).values():
        accepted = {e.edit_id: e.ts for e in evs if isinstance(e, EditAccepted)}
        persisted = [e for e in evs if isinstance(e, EditPersisted)]
        assert sorted(p.edit_id for p in persisted) == sorted(accepted)
        for p in persisted:
            assert p.ts == accepted[p.edit_id] + round(p.checked_after_s * 1000)
            checked += 1
    assert checked > N / 3


def test_several_edits_and_clarifications_happen():
    """Some trajectories hold several edits; clarifying questions are answered by a followup with question_needed."""
    groups = by_trajectory(distinct(run()))
    assert sum(sum(isinstance(e, EditProposed) for e in evs) > 1 for evs in groups.values()) > N / 20
    answers = {True: [], False: []}
    for evs in groups.values():
        for i, e in enumerate(evs):
            if isinstance(e, ClarifyingQuestion):
                nxt = evs[i + 1]
                assert isinstance(nxt, Followup) and nxt.question_needed is not None
                answers[nxt.question_needed].append(nxt.sentiment == "dissatisfied")
    assert answers[True] and answers[False]
    rate = {k: sum(v) / len(v) for k, v in answers.items()}
    assert rate[False] > rate[True] + 0.2, rate


def test_duplicates_at_configured_rate():
    """About duplicate_rate of events are sent twice, later, with the same event_id and identical content."""
    ems = run(duplicate_rate=0.05)
    s = stats(list(ems))
    assert 0.035 < s["duplicates"] / s["events"] < 0.065, s
    first: dict[str, Emission] = {}
    for em in ems:
        if em.event.event_id in first:
            assert em.event == first[em.event.event_id].event
            assert em.at_ms >= first[em.event.event_id].at_ms
        else:
            first[em.event.event_id] = em
    assert stats(list(run(duplicate_rate=0.0)))["duplicates"] == 0


def test_reorders_present():
    """With reorder_rate, events are delivered after a later event of their trajectory, roughly at that rate."""
    with_reorder = stats(list(run(reorder_rate=0.05)))
    without = stats(list(run(reorder_rate=0.0)))
    extra = with_reorder["reordered"] - without["reordered"]
    assert 0.025 < extra / with_reorder["events"] < 0.075, (with_reorder, without)
    assert without["reordered"] < 0.01 * without["events"]  # only network jitter


def test_late_checks_arrive_after_end_and_hours_late():
    """Persistence checks usually arrive after trajectory_ended; about late_check_rate arrive hours later."""
    ems = run(late_check_rate=0.1)
    sent: dict[str, int] = {}
    for em in ems:
        sent.setdefault(em.event.event_id, em.at_ms)
    ended = {ev.trajectory_id: sent[ev.event_id] for ev in distinct(ems) if isinstance(ev, TrajectoryEnded)}
    checks = [ev for ev in distinct(ems) if isinstance(ev, EditPersisted)]
    after = [sent[c.event_id] > ended[c.trajectory_id] for c in checks]
    assert sum(after) / len(after) > 0.8
    hours_late = [
        c for c in checks if c.checked_after_s >= 7200 and sent[c.event_id] - ended[c.trajectory_id] > 3_600_000
    ]
    assert 0.06 < len(hours_late) / len(checks) < 0.14
    assert stats(list(ems))["late_checks"] == len([c for c in checks if c.checked_after_s > 1800])


def test_broken_tool_call_profile():
    """A policy profile with a higher p_broken_tool_call yields a higher broken-tool-call rate; broken calls carry an error."""
    low = stats(list(run(1000, profiles=((0, PolicyProfile(p_broken_tool_call=0.02)),))))
    high = stats(list(run(1000, profiles=((0, PolicyProfile(p_broken_tool_call=0.3)),))))
    assert high["broken_tool_call_rate"] > low["broken_tool_call_rate"] + 0.15
    for em in run(1000, profiles=((0, PolicyProfile(p_broken_tool_call=0.3)),)):
        ev = em.event
        if ev.__struct_config__.tag == "tool_call":
            assert (ev.error is None) == ev.valid


def test_default_profile_improves_with_version():
    """Later default policy versions break fewer tool calls and write better edits."""
    v0, v5 = default_profile(0), default_profile(5)
    assert v5.p_broken_tool_call < v0.p_broken_tool_call and v5.edit_quality > v0.edit_quality
    with pytest.raises(ValueError):
        PolicyProfile(p_edit=1.5)


def test_stats_summary():
    """stats counts trajectories, events and rates consistently with the generated list."""
    ems = list(run())
    s = stats(ems)
    assert s["trajectories"] == N and s["emissions"] == len(ems)
    assert s["events"] + s["duplicates"] == len(ems)
    assert sum(s["by_type"].values()) == s["events"]
    assert sum(s["status"].values()) == N
    for key in ("broken_tool_call_rate", "clarification_rate", "edit_rate", "accept_rate", "mean_persisted_fraction"):
        assert 0.0 < s[key] < 1.0, key
