"""Contracts of the pure, versioned reward functions (rewards.functions).

Unit tests pin each rule of the current version on hand-built trajectories; property tests
(hypothesis) pin the invariants that encode the two reward-hacking lessons of DESIGN.md:
broken tool calls are never rewarded by omission, and deferring is never a safe harbour.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewards import (
    COMPONENTS,
    CURRENT_VERSION,
    REWARD_VERSIONS,
    RewardConfig,
    RewardResult,
    compute,
    features,
    get_config,
    reward,
)
from schemas.records import (
    ClarifyingQuestion,
    EditAccepted,
    EditPersisted,
    EditProposed,
    EditRejected,
    Followup,
    Latency,
    ToolCall,
    TrajectoryEnded,
    TrajectoryStarted,
)

V2 = get_config("v2")
V1 = get_config("v1-discard-broken")


# ---------------------------------------------------------------- building trajectories


def _ev(cls, i: int, ts: int | None = None, **payload):
    return cls(
        event_id=f"ev{i}",
        trajectory_id="t1",
        ts=1_000 + i if ts is None else ts,
        org_id="org",
        user_hash="0" * 32,
        policy_version=1,
        arm="control",
        **payload,
    )


class Traj:
    """Builds one trajectory's events with unique ids and increasing timestamps."""

    def __init__(self, task_kind: str = "bugfix"):
        self.events: list = []
        self.add(TrajectoryStarted, task_kind=task_kind)

    def add(self, cls, **payload) -> Traj:
        self.events.append(_ev(cls, len(self.events), **payload))
        return self

    def tool(self, valid: bool = True) -> Traj:
        return self.add(ToolCall, tool="edit_file", valid=valid, error=None if valid else "bad json")

    def edit(self, eid: str = "e1", accepted: bool | None = True, fraction: float | None = None) -> Traj:
        self.add(EditProposed, edit_id=eid, lines=10)
        if accepted is True:
            self.add(EditAccepted, edit_id=eid)
            if fraction is not None:
                self.add(EditPersisted, edit_id=eid, fraction=fraction, checked_after_s=60.0)
        elif accepted is False:
            self.add(EditRejected, edit_id=eid)
        return self

    def followup(self, sentiment: str = "neutral", question_needed: bool | None = None) -> Traj:
        return self.add(Followup, sentiment=sentiment, question_needed=question_needed)

    def question(self, needed: bool | None = True, sentiment: str = "neutral") -> Traj:
        self.add(ClarifyingQuestion)
        if needed is not None:
            self.followup(sentiment, question_needed=needed)
        return self

    def latency(self, total_ms: float) -> Traj:
        return self.add(Latency, ttft_ms=min(total_ms, 100.0), total_ms=total_ms)

    def end(self, status: str = "completed") -> Traj:
        return self.add(TrajectoryEnded, status=status)

    def score(self, version: str = CURRENT_VERSION) -> RewardResult | None:
        return compute(self.events, version)


def _sums(r: RewardResult) -> bool:
    return math.isclose(sum(r.components.values()), r.reward, rel_tol=1e-12, abs_tol=1e-12)


# ---------------------------------------------------------------- edits


def test_persisted_edit_scores_its_fraction():
    """An accepted edit whose persistence check arrived scores w_edit * its surviving fraction."""
    r = Traj().edit(fraction=0.8).end().score()
    assert r.components["edit"] == pytest.approx(V2.w_edit * 0.8)
    assert r.reward == pytest.approx(0.8)
    assert r.flags == []


def test_edit_component_is_the_mean_over_proposed_edits():
    """Several edits: the edit component is w_edit times the mean of the per-edit outcomes."""
    r = Traj().edit("a", fraction=1.0).edit("b", accepted=False).edit("c", accepted=None).end().score()
    assert r.components["edit"] == pytest.approx(V2.w_edit * (1.0 + V2.rejected_value + 0.0) / 3)


def test_accepted_edit_without_check_gets_unverified_credit():
    """Accepted but never checked (window closed by deadline): unverified_accept_credit, flag unverified_edit."""
    r = Traj().edit(fraction=None).score()
    assert r.components["edit"] == pytest.approx(V2.w_edit * V2.unverified_accept_credit)
    assert "unverified_edit" in r.flags


def test_rejected_edit_scores_rejected_value():
    """A rejected edit scores w_edit * rejected_value (negative)."""
    r = Traj().edit(accepted=False).end().score()
    assert r.components["edit"] == pytest.approx(V2.w_edit * V2.rejected_value)
    assert r.reward < 0


def test_edit_neither_accepted_nor_rejected_scores_zero():
    """An edit the user never acted on contributes 0."""
    assert Traj().edit(accepted=None).end().score().components["edit"] == 0.0


def test_latest_persistence_check_wins():
    """When an edit is checked twice, the later check's fraction counts."""
    t = Traj().edit(fraction=0.9)
    t.add(EditPersisted, edit_id="e1", fraction=0.3, checked_after_s=3600.0)
    assert t.end().score().components["edit"] == pytest.approx(0.3)


# ---------------------------------------------------------------- broken tool calls


def test_broken_tool_call_is_negative_and_flagged():
    """v2 keeps a trajectory with a broken call, penalises it by w_broken and flags invalid_tool_call."""
    ok = Traj().tool().edit(fraction=1.0).end().score()
    bad = Traj().tool(valid=False).edit(fraction=1.0).end().score()
    assert bad is not None
    assert bad.components["broken_tool_calls"] == pytest.approx(-V2.w_broken)
    assert bad.reward == pytest.approx(ok.reward - V2.w_broken)
    assert "invalid_tool_call" in bad.flags and "invalid_tool_call" not in ok.flags


def test_broken_tool_call_penalty_is_capped():
    """Only broken_cap broken calls count: the penalty bottoms out at -w_broken * broken_cap."""
    t = Traj()
    for _ in range(V2.broken_cap + 6):
        t.tool(valid=False)
    r = t.end().score()
    assert r.components["broken_tool_calls"] == pytest.approx(-V2.w_broken * V2.broken_cap)


def test_v1_discards_broken_trajectories_while_v2_penalises_them():
    """The buggy v1 returns None for any trajectory with a broken call; v2 scores it (negatively)."""
    t = Traj().tool(valid=False).edit(fraction=1.0).end()
    assert t.score("v1-discard-broken") is None
    r2 = t.score("v2")
    assert r2 is not None and r2.components["broken_tool_calls"] < 0
    clean = Traj().tool().edit(fraction=1.0).end()
    assert clean.score("v1-discard-broken") == clean.score("v2")


# ---------------------------------------------------------------- follow-ups, latency, status


@pytest.mark.parametrize(
    "sentiments, expected",
    [
        ([], 0.0),
        (["neutral"], 0.0),
        (["satisfied"], V2.w_satisfied),
        (["satisfied", "satisfied"], V2.w_satisfied),
        (["dissatisfied"], -V2.w_dissatisfied),
        (["satisfied", "dissatisfied"], -V2.w_dissatisfied),
    ],
)
def test_followup_component(sentiments, expected):
    """Any dissatisfied follow-up costs w_dissatisfied; satisfied with none dissatisfied earns w_satisfied."""
    t = Traj().edit(fraction=1.0)
    for s in sentiments:
        t.followup(s)
    r = t.end().score()
    assert r.components["followup"] == pytest.approx(expected)
    assert ("dissatisfied_followup" in r.flags) == ("dissatisfied" in sentiments)


def test_answers_to_questions_are_not_followups():
    """A follow-up answering a clarifying question (question_needed set) does not count as a follow-up."""
    r = Traj().question(needed=True, sentiment="dissatisfied").edit(fraction=1.0).end().score()
    assert r.components["followup"] == 0.0


@pytest.mark.parametrize(
    "total_ms, fraction",
    [(0.0, 0.0), (10_000.0, 0.0), (35_000.0, 0.5), (60_000.0, 1.0), (1e9, 1.0)],
)
def test_latency_penalty_ramps_and_saturates(total_ms, fraction):
    """latency = -w_latency * clamp((latency - target) / scale, 0, 1) on the worst reported latency."""
    r = Traj().latency(total_ms).end().score()
    assert r.components["latency"] == pytest.approx(-V2.w_latency * fraction)


def test_no_latency_costs_nothing():
    """Without a latency event the latency component is 0."""
    assert Traj().end().score().components["latency"] == 0.0


@pytest.mark.parametrize(
    "status, expected",
    [("completed", 0.0), ("error", -V2.w_error), ("abandoned", -V2.w_abandoned), (None, 0.0)],
)
def test_status_component(status, expected):
    """Ending in error or abandoned is penalised; completed or not ended (deadline) costs nothing."""
    t = Traj().edit(fraction=1.0)
    if status is not None:
        t.end(status)
    r = t.score()
    assert r.components["status"] == pytest.approx(expected)
    assert (f"status_{status}" in r.flags) == (status in ("error", "abandoned"))


# ---------------------------------------------------------------- deferral


def test_deferral_is_capped_at_zero_even_with_satisfied_followup():
    """A question with no edit earns at most the neutral baseline 0, even when the user is satisfied."""
    r = Traj().question(needed=True).followup("satisfied").end().score()
    assert r.reward == 0.0
    assert r.components["followup"] == pytest.approx(V2.w_satisfied)
    assert r.components["deferral_cap"] == pytest.approx(-V2.w_satisfied)
    assert "deferred_edit" in r.flags


def test_needed_question_deferral_scores_zero_at_most():
    """A needed question without an edit scores 0 alone and keeps the penalties of a bad context."""
    assert Traj().question(needed=True).end().score().reward == 0.0
    assert Traj().question(needed=None).end().score().reward == 0.0
    bad = Traj().question(needed=True).end("abandoned").score()
    assert bad.reward == pytest.approx(-V2.w_abandoned)
    assert bad.components["deferral_cap"] == 0.0


def test_unneeded_question_is_penalised():
    """Each answer showing a question was unneeded costs w_unneeded_question when no edit followed."""
    r = Traj().question(needed=False).end().score()
    assert r.components["deferral"] == pytest.approx(-V2.w_unneeded_question)
    assert r.reward == pytest.approx(-V2.w_unneeded_question)
    assert {"deferred_edit", "unneeded_question"} <= set(r.flags)
    r2 = Traj().question(needed=False).question(needed=False).end().score()
    assert r2.reward == pytest.approx(-2 * V2.w_unneeded_question)


def test_unneeded_question_followed_by_edit_gets_smaller_penalty():
    """With an edit after all, an unneeded question costs w_unneeded_question_with_edit and is no deferral."""
    r = Traj().question(needed=False).edit(fraction=1.0).end().score()
    assert r.components["deferral"] == pytest.approx(-V2.w_unneeded_question_with_edit)
    assert r.components["deferral_cap"] == 0.0
    assert r.reward == pytest.approx(V2.w_edit - V2.w_unneeded_question_with_edit)
    assert "deferred_edit" not in r.flags and "unneeded_question" in r.flags


def test_v1_lets_an_unneeded_question_deferral_score_above_v2():
    """The buggy v1 has no cap and no unneeded-question penalty: asking was a safe harbour."""
    t = Traj().question(needed=False).followup("satisfied").end()
    r1, r2 = t.score("v1-discard-broken"), t.score("v2")
    assert r1.reward == pytest.approx(V2.w_satisfied) and r1.reward > 0
    assert r2.reward < 0 < r1.reward
    assert "deferred_edit" in r1.flags  # monitors still see the behaviour under v1


# ---------------------------------------------------------------- bookkeeping and registry


def test_components_sum_to_reward_exactly():
    """Every component is named and the named components sum to the reward."""
    t = (
        Traj().tool().tool(valid=False).question(needed=False).edit("a", fraction=0.6)
        .edit("b", accepted=False).edit("c", fraction=None).followup("satisfied").latency(40_000).end("error")
    )  # fmt: skip
    for version in REWARD_VERSIONS:
        r = t.score(version)
        if r is None:
            continue
        assert tuple(r.components) == COMPONENTS
        assert _sums(r)
        assert r.flags == sorted(r.flags)


def test_registry_and_get_config():
    """The registry holds v2 (current) and the buggy v1; unknown names raise a KeyError listing them."""
    assert CURRENT_VERSION == "v2" and {"v2", "v1-discard-broken"} <= set(REWARD_VERSIONS)
    assert all(name == cfg.version for name, cfg in REWARD_VERSIONS.items())
    v1, v2 = REWARD_VERSIONS["v1-discard-broken"], REWARD_VERSIONS["v2"]
    # v1 differs from v2 only in the two deliberate bugs.
    assert (
        dataclasses.replace(
            v1,
            version="v2",
            discard_broken=False,
            w_unneeded_question=v2.w_unneeded_question,
            w_unneeded_question_with_edit=v2.w_unneeded_question_with_edit,
            deferral_ceiling=v2.deferral_ceiling,
        )
        == v2
    )
    with pytest.raises(KeyError) as exc:
        get_config("v0")
    assert "v2" in str(exc.value) and "v1-discard-broken" in str(exc.value)
    with pytest.raises(KeyError):
        compute(Traj().events, "nope")


def test_compute_defaults_to_current_version_and_reward_is_pure():
    """compute(events) uses CURRENT_VERSION; reward() of the same features twice is identical."""
    t = Traj().edit(fraction=0.7).followup("satisfied").end()
    f = features(t.events)
    assert compute(t.events) == reward(f, get_config(CURRENT_VERSION)) == reward(f, get_config(CURRENT_VERSION))


def test_config_rejects_bad_weights_and_is_frozen():
    """Configs are immutable and refuse negative magnitudes or a non-positive latency scale."""
    with pytest.raises(ValueError):
        RewardConfig(version="x", w_broken=-1.0)
    with pytest.raises(ValueError):
        RewardConfig(version="x", latency_scale_ms=0.0)
    with pytest.raises(ValueError):
        RewardConfig(version="")
    with pytest.raises(dataclasses.FrozenInstanceError):
        V2.w_edit = 2.0  # type: ignore[misc]


# ---------------------------------------------------------------- property tests

_SETTINGS = settings(max_examples=200, deadline=None)
_EDIT_IDS = ("e0", "e1", "e2")
_sentiment = st.sampled_from(["dissatisfied", "neutral", "satisfied"])
_fraction = st.floats(0.0, 1.0, allow_nan=False)


def _spec(*, edits: bool, questions: bool) -> st.SearchStrategy:
    """One event as (class, payload) without ids; question answers only when ``questions``."""
    options = [
        st.tuples(st.just(ToolCall), st.booleans().map(lambda v: dict(tool="t", valid=v, error=None if v else "x"))),
        st.tuples(st.just(Followup), _sentiment.map(lambda s: dict(sentiment=s, question_needed=None))),
        st.tuples(
            st.just(Latency),
            st.floats(0, 200_000, allow_nan=False).map(lambda ms: dict(ttft_ms=min(ms, 50.0), total_ms=ms)),
        ),
        st.tuples(
            st.just(TrajectoryEnded), st.sampled_from(["completed", "abandoned", "error"]).map(lambda s: dict(status=s))
        ),
    ]
    if edits:
        eid = st.sampled_from(_EDIT_IDS)
        options += [
            st.tuples(st.just(EditProposed), eid.map(lambda e: dict(edit_id=e, lines=3))),
            st.tuples(st.just(EditAccepted), eid.map(lambda e: dict(edit_id=e))),
            st.tuples(st.just(EditRejected), eid.map(lambda e: dict(edit_id=e))),
            st.tuples(
                st.just(EditPersisted),
                st.tuples(eid, _fraction).map(lambda p: dict(edit_id=p[0], fraction=p[1], checked_after_s=1.0)),
            ),
        ]
    if questions:
        options += [
            st.tuples(st.just(ClarifyingQuestion), st.just({})),
            st.tuples(
                st.just(Followup),
                st.tuples(_sentiment, st.booleans()).map(lambda p: dict(sentiment=p[0], question_needed=p[1])),
            ),
        ]
    return st.one_of(options)


def _materialise(specs, timestamps, start: int = 0) -> list:
    return [_ev(cls, start + i, ts=ts, **payload) for i, ((cls, payload), ts) in enumerate(zip(specs, timestamps))]


@st.composite
def trajectories(draw, *, edits: bool = True, questions: bool = True, start: int = 0, max_size: int = 14) -> list:
    """Random event lists of one trajectory with unique event ids; timestamps collide on purpose."""
    specs = draw(st.lists(_spec(edits=edits, questions=questions), max_size=max_size))
    specs = [(TrajectoryStarted, dict(task_kind="bugfix"))] + specs
    ts = draw(st.lists(st.integers(0, 20), min_size=len(specs), max_size=len(specs)))
    return _materialise(specs, ts, start)


@_SETTINGS
@given(trajectories(), st.integers(0, 20))
def test_adding_a_broken_tool_call_never_raises_the_reward(events, ts):
    """(a) v2: one more broken tool call never raises the reward, and the trajectory is never discarded."""
    more = events + [_ev(ToolCall, 10_000, ts=ts, tool="t", valid=False, error="x")]
    before, after = compute(events), compute(more)
    assert after is not None and "invalid_tool_call" in after.flags
    assert after.reward <= before.reward


@_SETTINGS
@given(
    trajectories(edits=False, questions=False, start=100),
    st.booleans(),
    _sentiment,
    st.floats(0.5, 1.0),
    st.lists(st.integers(0, 20), min_size=3, max_size=3),
)
def test_deferral_never_outscores_a_persisted_edit(context, needed, sentiment, fraction, ts):
    """(b) Asking (question + answer, no edit) never beats the same context plus an accepted edit
    whose persistence check shows a fraction >= 0.5."""
    deferral = context + _materialise(
        [(ClarifyingQuestion, {}), (Followup, dict(sentiment=sentiment, question_needed=needed))], ts
    )
    edit = context + _materialise(
        [
            (EditProposed, dict(edit_id="e", lines=1)),
            (EditAccepted, dict(edit_id="e")),
            (EditPersisted, dict(edit_id="e", fraction=fraction, checked_after_s=1.0)),
        ],
        ts,
    )
    rd, re_ = compute(deferral), compute(edit)
    assert "deferred_edit" in rd.flags
    assert rd.reward <= re_.reward


@_SETTINGS
@given(trajectories(), st.data())
def test_reward_is_invariant_to_order_and_duplicates(events, data):
    """(c) Permuting events or repeating some of them changes neither reward, components nor flags."""
    dups = data.draw(st.lists(st.sampled_from(events), max_size=5))
    shuffled = data.draw(st.permutations(events + dups))
    for version in REWARD_VERSIONS:
        assert compute(shuffled, version) == compute(events, version)


@_SETTINGS
@given(trajectories())
def test_reward_is_finite_and_components_sum_to_it(events):
    """(d) Under every version the reward is finite, components are the full named set and sum to it."""
    for version in REWARD_VERSIONS:
        r = compute(events, version)
        if r is None:
            assert version == "v1-discard-broken" and features(events).broken_tool_calls > 0
            continue
        assert math.isfinite(r.reward)
        assert tuple(r.components) == COMPONENTS
        assert all(math.isfinite(v) for v in r.components.values())
        assert _sums(r)
        assert r.flags == sorted(set(r.flags))


@_SETTINGS
@given(trajectories(edits=False))
def test_every_deferred_trajectory_scores_at_most_zero(events):
    """(e) v2: a trajectory that asked a question and proposed no edit never scores above 0."""
    f = features(events)
    r = reward(f, V2)
    if f.deferred:
        assert r.reward <= 0.0 and "deferred_edit" in r.flags
    else:
        assert "deferred_edit" not in r.flags


@_SETTINGS
@given(trajectories())
def test_v1_only_removes_penalties(events):
    """Where v1 keeps a trajectory it scores it at least as high as v2 (v2 only adds the cap and the
    unneeded-question penalty); v1 drops exactly the trajectories with a broken call."""
    f = features(events)
    r1, r2 = reward(f, V1), reward(f, V2)
    assert (r1 is None) == (f.broken_tool_calls > 0)
    if r1 is not None:
        assert r1.reward >= r2.reward
        assert r1.flags == r2.flags
