"""Long-loop feedback (issue 16): hours-long background tasks, provisional rewards and the user's verdict.

The simulator's background tasks run for hours of event time, send check-ins, and end with a verdict on the
whole outcome that arrives hours later; the reward uses the verdict, and until it arrives a background task's
reward is provisional. The reward flow's per-kind windows and spilled state are tested in
tests/test_spilled_state.py and tests/test_windowing.py, the delayed training path in tests/test_delayed_path.py.
"""

from __future__ import annotations

import math
import sqlite3
import statistics
from collections import defaultdict

import pytest

from flows.processor import Message, RewardProcessor
from flows.reward_flow import verdict_kinds
from flows.windowing import WindowConfig
from rewards import features, get_config, reward
from rewards.functions import RewardConfig
from rewards.versions import BUILTIN, RewardVersion
from rtrl.clickhouse import insert
from rtrl.errors import ConfigError
from rtrl.sections.simulator import SimulatorSettings
from rtrl.settings import load_settings
from schemas.codec import event_codec
from schemas.records import (
    Checkpoint,
    ClarifyingQuestion,
    EditProposed,
    Followup,
    Reward,
    TaskCheckin,
    TaskVerdict,
    ToolCall,
    TrajectoryEnded,
    TrajectoryStarted,
)
from simulator.generate import BACKGROUND, generate, stats
from simulator.population import PolicyProfile

SALT = "long-loop-salt"
HOUR = 3_600_000


def _sim(**kw) -> SimulatorSettings:
    base = dict(trajectories=300, long_task_share=0.3, duplicate_rate=0.0, reorder_rate=0.0, seed=7)
    return SimulatorSettings(**(base | kw))


def _by_trajectory(emissions) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for em in emissions:
        out[em.event.trajectory_id].append(em.event)
    return out


# ---------------------------------------------------------------- the simulator's background tasks


def test_background_tasks_run_for_hours_send_checkins_and_end_with_a_later_verdict():
    trajectories = _by_trajectory(generate(_sim(), SALT))
    long = {t: evs for t, evs in trajectories.items() if any(type(e) is TaskVerdict for e in evs)}
    background = {
        t: evs
        for t, evs in trajectories.items()
        if any(type(e) is TrajectoryStarted and e.task_kind == BACKGROUND for e in evs)
    }
    assert 0.2 < len(background) / len(trajectories) < 0.4  # about the share asked for
    assert set(long) <= set(background) and len(long) >= 0.7 * len(background)  # most get a verdict
    for evs in long.values():
        started = next(e for e in evs if type(e) is TrajectoryStarted)
        ended = next(e for e in evs if type(e) is TrajectoryEnded)
        verdict = next(e for e in evs if type(e) is TaskVerdict)
        checkins = [e for e in evs if type(e) is TaskCheckin]
        assert ended.ts - started.ts >= HOUR / 2  # hours of event time
        assert checkins and all(started.ts < c.ts < ended.ts for c in checkins)
        assert verdict.ts - ended.ts >= HOUR  # the verdict comes hours after the task ends
        assert verdict.verdict_after_s == pytest.approx((verdict.ts - ended.ts) / 1000)
        assert (verdict.verdict == "merged") == (verdict.fraction == 1.0)
        assert (verdict.verdict == "discarded") == (verdict.fraction == 0.0)
    # no background task has edits, questions or follow-ups: its outcome is judged whole, by the verdict
    others = (ClarifyingQuestion, EditProposed, Followup)
    assert all(type(e) not in others for evs in background.values() for e in evs)


def test_event_time_is_simulated_so_days_of_it_take_seconds():
    emissions = generate(_sim(trajectories=600, verdict_min_h=24, verdict_max_h=72), SALT)
    span_days = (max(e.event.ts for e in emissions) - min(e.event.ts for e in emissions)) / (24 * HOUR)
    assert span_days > 2  # generated in well under a second of wall time per thousand trajectories
    assert stats(emissions)["by_type"]["task_verdict"] > 0


def test_short_trajectories_do_not_change_with_the_share_of_long_ones():
    plain = _by_trajectory(generate(_sim(long_task_share=0.0), SALT))
    mixed = _by_trajectory(generate(_sim(long_task_share=0.3), SALT))
    short = {t for t, evs in mixed.items() if not any(getattr(e, "task_kind", None) == BACKGROUND for e in evs)}
    assert short and short < set(plain)
    assert all(mixed[t] == plain[t] for t in short)


def _scores(profile: PolicyProfile, seed: int) -> tuple[list[float], list[float]]:
    """(mean check-in reaction, verdict score 2 * fraction - 1) of each judged background task."""
    checkin, verdict = [], []
    for evs in _by_trajectory(
        generate(_sim(trajectories=500, long_task_share=1.0, seed=seed), SALT, {0: profile})
    ).values():
        f = features(evs)
        if f.verdict_fraction is not None and f.checkin_score is not None:
            checkin.append(f.checkin_score)
            verdict.append(2 * f.verdict_fraction - 1)
    return checkin, verdict


def test_the_verdict_is_a_sharper_signal_than_the_checkins():
    """Between a good and a poor policy, the verdict's effect size (difference of means over the pooled
    standard deviation) is larger than the check-ins': it separates the two with far less noise."""

    def effect(a: list[float], b: list[float]) -> float:
        pooled = ((statistics.pvariance(a) + statistics.pvariance(b)) / 2) ** 0.5
        return (statistics.mean(a) - statistics.mean(b)) / pooled

    good_c, good_v = _scores(PolicyProfile(edit_quality=0.8), seed=1)
    poor_c, poor_v = _scores(PolicyProfile(edit_quality=0.4), seed=2)
    assert effect(good_v, poor_v) > 0 and effect(good_c, poor_c) > 0
    assert effect(good_v, poor_v) > 1.5 * effect(good_c, poor_c)


def test_simulator_verdict_range_is_validated():
    with pytest.raises(ConfigError, match="verdict_min_h"):
        load_settings(env={"RTRL_SIMULATOR__VERDICT_MIN_H": "5", "RTRL_SIMULATOR__VERDICT_MAX_H": "2"})


# ---------------------------------------------------------------- rewards: provisional, then the verdict


def _task(verdict: str | None, fraction: float = 1.0, reactions=("satisfied",), broken: int = 0, question=False):
    env = dict(trajectory_id="bg-1", org_id="org-1", user_hash="0" * 32, policy_version=3, arm="control")
    evs = [TrajectoryStarted(event_id="e0", ts=0, task_kind=BACKGROUND, **env)]
    if question:
        evs.append(ClarifyingQuestion(event_id="eq", ts=1, **env))
    evs += [ToolCall(event_id=f"t{i}", ts=2 + i, tool="shell", valid=False, error="boom", **env) for i in range(broken)]
    evs += [
        TaskCheckin(event_id=f"c{i}", ts=(i + 1) * HOUR, progress=0.5, sentiment=s, **env)
        for i, s in enumerate(reactions)
    ]
    evs.append(TrajectoryEnded(event_id="end", ts=4 * HOUR, status="completed", **env))
    if verdict is not None:
        evs.append(
            TaskVerdict(
                event_id="v", ts=30 * HOUR, verdict=verdict, fraction=fraction, verdict_after_s=26 * 3600, **env
            )
        )
    return evs


def _score(events, version="v2"):
    return reward(features(events), get_config(version))


def test_the_verdict_decides_a_long_tasks_reward_and_replaces_the_checkins():
    merged, partly, discarded = (
        _score(_task("merged")),
        _score(_task("partly_kept", 0.6)),
        _score(_task("discarded", 0)),
    )
    assert merged.reward > partly.reward > discarded.reward
    assert merged.components["verdict"] == 1.0 and discarded.components["verdict"] == -1.0
    assert partly.components["verdict"] == pytest.approx(0.2)
    for r in (merged, partly, discarded):
        assert r.components["checkin"] == 0.0  # the verdict judges the whole outcome
    assert "verdict_merged" in merged.flags and "verdict_discarded" in discarded.flags
    # happy check-ins do not save a discarded task, unhappy ones do not sink a merged one
    assert _score(_task("discarded", 0, reactions=("satisfied",) * 4)).reward < 0
    assert _score(_task("merged", reactions=("dissatisfied",) * 4)).reward > 0


def test_provisional_reward_reads_the_checkins():
    happy, unhappy = (
        _score(_task(None, reactions=("satisfied", "neutral"))),
        _score(_task(None, reactions=("dissatisfied",))),
    )
    assert happy.components["checkin"] == pytest.approx(0.3 * 0.5)
    assert unhappy.components["checkin"] == pytest.approx(-0.3)
    assert happy.components["verdict"] == 0.0


def test_broken_calls_stay_negative_and_asking_is_no_safe_harbour_for_long_tasks():
    assert _score(_task("merged", broken=2)).reward < _score(_task("merged")).reward
    # a provisional reward of a task that only asked is capped at the neutral baseline, like any deferral
    asked = _score(_task(None, reactions=("satisfied",) * 3, question=True))
    assert asked.reward == 0.0 and "deferred_edit" in asked.flags
    # once the user merged its work it is judged by the verdict, not capped
    assert _score(_task("merged", question=True)).reward > 0


def test_components_still_sum_to_the_reward():
    for evs in (_task("merged", broken=1), _task(None), _task("partly_kept", 0.4, question=True)):
        r = _score(evs)
        assert sum(r.components.values()) == pytest.approx(r.reward)


def test_builtin_checksums_survive_the_new_weights_but_a_changed_weight_changes_it():
    v2 = BUILTIN["v2"]
    assert "w_verdict" not in v2.weights_json and "w_checkin" not in v2.weights_json
    harsher = RewardVersion(RewardConfig(version="v2-verdict-x2", w_verdict=2.0))
    assert '"w_verdict":2.0' in harsher.weights_json and harsher.checksum != v2.checksum


def _messages(events, partition=0):
    codec = event_codec()
    return [Message(e.trajectory_id.encode(), codec.encode(e), partition, i) for i, e in enumerate(events)]


def test_reward_flow_emits_a_provisional_reward_then_the_verdicts_final_revision():
    settings = load_settings(env={"RTRL_SDK__SALT": SALT})
    assert verdict_kinds(settings) == (BACKGROUND,)
    proc = RewardProcessor("test", WindowConfig(settings.flow), ["v2"], verdict_kinds=verdict_kinds(settings))
    events = sorted(_task("merged"), key=lambda e: e.ts)
    env = dict(org_id="org-1", user_hash="0" * 32, policy_version=3, arm="control")
    # later short trajectories move the partition's clock past the background task's end, up to its verdict
    tick = [
        TrajectoryStarted(event_id=f"x{h}", trajectory_id=f"short-{h}", ts=h * HOUR, task_kind="bugfix", **env)
        for h in range(5, 30, 5)
    ]
    out = proc.process(_messages(events[:-1] + tick + events[-1:]), now_ms=1)
    bg = [r for r in out.rewards if r.trajectory_id == "bg-1"]
    assert [(r.revision, r.provisional) for r in bg] == [(0, True), (1, False)]
    assert bg[0].components["checkin"] > 0 and bg[0].components["verdict"] == 0
    assert bg[1].components["verdict"] == 1.0 and bg[1].close_reason == "late"
    short = [r for r in out.rewards + proc.finish(now_ms=2).rewards if r.trajectory_id.startswith("short")]
    assert len(short) == 5 and not any(r.provisional for r in short)  # other kinds are never provisional
    assert not out.dead_letters


def test_simulated_background_tasks_get_final_rewards_through_the_reward_processor():
    settings = load_settings(env={"RTRL_SDK__SALT": SALT})
    emissions = generate(_sim(trajectories=400, verdict_min_h=1, verdict_max_h=6), SALT)
    proc = RewardProcessor("test", WindowConfig(settings.flow), ["v2"], verdict_kinds=verdict_kinds(settings))
    codec = event_codec()
    out = proc.process(
        [Message(em.event.trajectory_id.encode(), codec.encode(em.event), 0, i) for i, em in enumerate(emissions)],
        now_ms=1,
    )
    out.extend(proc.finish(now_ms=2))
    latest: dict[str, Reward] = {}
    for r in out.rewards:
        latest[r.trajectory_id] = r
    final_bg = [r for r in latest.values() if r.task_kind == BACKGROUND and not r.provisional]
    provisional_first = {
        r.trajectory_id for r in out.rewards if r.task_kind == BACKGROUND and r.revision == 0 and r.provisional
    }
    fractions = {em.event.trajectory_id: em.event.fraction for em in emissions if type(em.event) is TaskVerdict}
    assert final_bg and {r.trajectory_id for r in final_bg} == set(fractions)  # final exactly when judged
    assert {r.trajectory_id for r in final_bg} <= provisional_first  # each was provisional first
    for r in final_bg:  # its reward reads the verdict
        assert r.components["verdict"] == pytest.approx(2 * fractions[r.trajectory_id] - 1)
        assert r.components["checkin"] == 0.0 and r.revision > 0
    assert not out.dead_letters or all(d.kind in ("duplicate", "too_late") for d in out.dead_letters)


# ---------------------------------------------------------------- analysts see the delay (ClickHouse views)

T0 = 1_750_000_000_000


def _reward(tid, version, kind, revision, value, provisional, emitted_at, span_h=0.1, verdict=False) -> Reward:
    return Reward(
        trajectory_id=tid,
        policy_version=version,
        reward_version="v2",
        revision=revision,
        reward=value,
        components={"verdict": value} if verdict else {},
        flags=[],
        close_reason="late" if revision else "ended",
        org_id="org-1",
        arm="control",
        task_kind=kind,
        n_events=5,
        event_counts={"task_verdict": 1} if verdict else {},
        first_event_ts=T0,
        last_event_ts=T0 + int(span_h * HOUR),
        emitted_at=emitted_at,
        provisional=provisional,
    )


def _checkpoint(version: int, at: int) -> Checkpoint:
    return Checkpoint(
        version=version,
        parent=version - 1 if version else None,
        created_at=at,
        steps=1,
        samples=1,
        tokens=1,
        eval_results={},
        status="promoted",
        reason="test",
        kafka_offsets={},
        path="",
    )


def test_views_show_time_to_verdict_late_arrivals_and_provisional_against_final(ch_client, ch_db):
    # versions 1, 2 promoted at T0 + 1 h, 2 h; 3 rejected (never promoted); 4 promoted at T0 + 3 h
    insert(ch_client, ch_db, "checkpoints", [_checkpoint(v, T0 + min(v, 3) * HOUR) for v in (1, 2, 4)])
    rows = [_reward(f"s{i}", 0, "bugfix", 0, 0.5, False, T0 + 600_000) for i in range(4)]  # short: on time
    # background tasks served by version 0: provisional at T0 + 0.5 h, the verdict's revision at T0 + 3.5 h
    for i, (prov, final) in enumerate([(0.2, 1.0), (0.3, -1.0), (-0.1, 0.6)]):
        rows.append(_reward(f"b{i}", 0, "background", 0, prov, True, T0 + HOUR // 2, span_h=4))
        rows.append(_reward(f"b{i}", 0, "background", 1, final, False, T0 + 7 * HOUR // 2, span_h=30, verdict=True))
    rows.append(_reward("b-open", 0, "background", 0, 0.1, True, T0 + HOUR // 2, span_h=4))  # no verdict yet
    insert(ch_client, ch_db, "rewards", rows)

    def view(name: str) -> dict[tuple, dict]:
        res = ch_client.query(f"SELECT * FROM {ch_db}.{name}")
        out = [dict(zip(res.column_names, r)) for r in res.result_rows]
        return {tuple(v for k, v in r.items() if k in ("task_kind", "judged", "reward_version")): r for r in out}

    delays = view("verdict_delays")
    assert delays[("background", 1)]["trajectories"] == 3 and delays[("background", 1)]["hours_p50"] == pytest.approx(
        30
    )
    assert delays[("background", 0)]["trajectories"] == 1 and delays[("bugfix", 0)]["hours_max"] == pytest.approx(0.1)

    arrival = view("reward_arrival")
    bg, short = arrival[("v2", "background")], arrival[("v2", "bugfix")]
    # the lag the batch flow measures: the newest promoted version (4) minus the rollout's (0)
    assert (bg["rewards"], bg["after_replacement"], bg["versions_behind_max"]) == (3, 3, 4)
    assert bg["share_after_replacement"] == 1.0 and bg["more_than_one_version_behind"] == 3
    assert (short["rewards"], short["after_replacement"]) == (4, 0)  # rewarded before version 1 came

    cmp = view("provisional_vs_final")[("v2", "background")]
    assert (cmp["final_rewards"], cmp["still_provisional"], cmp["revised_from_provisional"]) == (3, 1, 3)
    assert cmp["provisional_mean"] == pytest.approx(0.4 / 3) and cmp["final_mean"] == pytest.approx(0.6 / 3)
    assert cmp["revision_mean"] == pytest.approx((0.8 - 1.3 + 0.7) / 3)
    assert cmp["sign_held"] == pytest.approx(1 / 3)  # only b0 kept its sign (b1 flipped, b2 went -0.1 -> 0.6)
    assert cmp["correlation"] == pytest.approx(statistics.correlation([0.2, 0.3, -0.1], [1.0, -1.0, 0.6]))
    short_cmp = view("provisional_vs_final")[("v2", "bugfix")]
    assert (short_cmp["final_rewards"], short_cmp["revised_from_provisional"]) == (4, 0)


# ---------------------------------------------------------------- the experiment: (b) corrected beats (a) drop


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard: ~2 minutes alone, about three beside two other workers' tests
def test_training_delayed_verdicts_with_correction_beats_dropping_them():
    """A short seeded run of the long-loop experiment (app/long_loop.py: 20% background tasks whose verdict
    arrives three cycles after the rollout): the arm that trains the delayed samples with the truncated
    importance weight (b) ends with a higher held-out P(solve) on background tasks than the arm that drops them
    (a), and no lower on short tasks. Both arms share the warm start and the traffic of the first three cycles
    (nothing is delayed yet), so those cycles are identical; after that only (b) trains delayed samples, each
    about three versions old."""
    from app.long_loop import Experiment, run_arm

    exp = Experiment(cycles=10, tasks_per_cycle=512, eval_tasks=200, seed=0)
    drop, corrected = run_arm("drop", exp), run_arm("corrected", exp)
    for a, b in zip(drop[:3], corrected[:3]):  # before the first verdict: the same run
        assert (a.long_expected, a.short_expected) == pytest.approx((b.long_expected, b.short_expected))
    assert sum(r.delayed_samples for r in drop) == 0 and drop[-1].dropped > 0
    assert sum(r.delayed_samples for r in corrected) > 0 and corrected[-1].dropped == 0
    assert all(2.5 <= r.delayed_lag <= 4 for r in corrected if r.delayed_samples)  # about three versions late

    def tail(rows, attr):
        return statistics.fmean(getattr(r, attr) for r in rows[-3:])

    # over the last three cycles (seeds 0, 1, 2 gave greedy +0.15, +0.08, +0.11 and P(solve) +0.13, +0.01, +0.04)
    assert tail(corrected, "long_success") > tail(drop, "long_success") + 0.03
    assert tail(corrected, "long_expected") > tail(drop, "long_expected")
    assert tail(corrected, "short_expected") >= tail(drop, "short_expected") - 0.03
    assert tail(corrected, "short_success") >= tail(drop, "short_success") - 0.05
    assert all(math.isfinite(r.grad_norm) and math.isfinite(r.kl) for r in drop + corrected)


@pytest.mark.slow
def test_reward_flow_on_the_broker_stores_provisional_then_final_rewards_with_spilled_windows(
    broker, topic_prefix, ch_dsn, ch_client, ch_db, tmp_path
):
    """Simulated background tasks through the real reward flow (the broker, ClickHouse, windows spilled to
    SQLite under a tiny memory budget): each judged task's provisional reward is kept in provisional_rewards,
    its final reward (the verdict's revision) replaces it in rewards, both went to rtrl.rewards, and the
    analyst views count them."""
    from bytewax.testing import run_main
    from confluent_kafka import Producer

    from flows.reward_flow import build_flow
    from rtrl.kafka import producer_config, read_topic
    from schemas.codec import JsonCodec

    emissions = generate(_sim(trajectories=200, verdict_min_h=1, verdict_max_h=6, seed=3), SALT)
    codec = event_codec()
    producer = Producer(producer_config(broker.bootstrap))
    for em in emissions:  # one partition: one clock for the whole stream
        producer.produce(topic_prefix + "events", key=b"k", value=codec.encode(em.event))
    assert producer.flush(30) == 0
    env = {
        "RTRL_SDK__SALT": SALT,
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        "RTRL_CLICKHOUSE__DSN": ch_dsn,
        "RTRL_CLICKHOUSE__DATABASE": ch_db,
        "RTRL_FLOW__TAIL": "false",
        "RTRL_FLOW__STATE_MEMORY_MB": "0.02",
        "RTRL_DATA_DIR": str(tmp_path),
    }
    run_main(build_flow(load_settings(env=env)))
    files = list((tmp_path / "state" / "rewards").glob("*.sqlite"))
    spilled = sum(sqlite3.connect(f).execute("SELECT count(*) FROM windows").fetchone()[0] for f in files)
    assert spilled > 50  # windows did spill (closed ones are kept for their allowed lateness)

    judged = {
        e.event.trajectory_id for e in emissions if type(e.event) is TaskVerdict
    }  # background tasks with a verdict
    background = {
        e.event.trajectory_id
        for e in emissions
        if type(e.event) is TrajectoryStarted and e.event.task_kind == BACKGROUND
    }
    q = lambda sql: ch_client.query(sql.format(db=ch_db)).result_rows  # noqa: E731
    final = dict(
        q(
            "SELECT trajectory_id, provisional FROM {db}.rewards FINAL WHERE reward_version = 'v2' AND task_kind = 'background'"
        )
    )
    assert set(final) == background and judged
    assert {t for t, p in final.items() if not p} == judged  # the verdict made them final
    kept = {t for (t,) in q("SELECT trajectory_id FROM {db}.provisional_rewards FINAL WHERE reward_version = 'v2'")}
    assert judged <= kept  # the provisional reward each verdict replaced is still there
    published = [JsonCodec(Reward).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "rewards")]
    one = next(iter(sorted(judged)))
    assert [
        (r.revision > 0, r.provisional) for r in published if r.trajectory_id == one and r.reward_version == "v2"
    ] == [
        (False, True),
        (True, False),
    ]
    row = q(
        "SELECT final_rewards, still_provisional, revised_from_provisional FROM {db}.provisional_vs_final "
        "WHERE reward_version = 'v2' AND task_kind = 'background'"
    )[0]
    assert row == (len(judged), len(background - judged), len(judged))
    delays = dict(q("SELECT judged, hours_p50 FROM {db}.verdict_delays WHERE task_kind = 'background'"))
    assert delays[1] > 1  # a verdict comes at least an hour after the task's end


@pytest.mark.slow
def test_exact_solve_probability_matches_sampled_completions():
    """simulator.policy.solve_probability (the experiment's smooth measure) is what sampling gives: on a warm-started
    policy, the per-task probability averaged over tasks equals the solve rate of many sampled completions."""
    import random

    import torch

    from app.loop_config import loop_settings
    from app.serving import loop_model_config
    from simulator.policy import sample, solve_probability, warm_start
    from simulator.tasks import KINDS, held_out, sample_task, score
    from trainer.model import build_model, init_parallel

    cfg, precision = loop_model_config(loop_settings(load_settings(env={"RTRL_SDK__SALT": SALT})))
    init_parallel(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, precision)
    rng = random.Random(0)
    warm_start(model, [sample_task(rng, "w", kinds=(*KINDS, BACKGROUND)) for _ in range(200)], steps=60, seed=0)
    tasks = held_out(20, seed=3) + held_out(20, seed=3, kinds=(BACKGROUND,))
    exact = statistics.fmean(solve_probability(model, tasks))
    draws = 400
    comps, _ = sample(model, tasks * draws, torch.Generator().manual_seed(1))
    rate = score(tasks * draws, comps)["solve_rate"]
    se = math.sqrt(exact * (1 - exact) / (len(tasks) * draws))
    assert 0.05 < exact < 0.95 and abs(rate - exact) < 4 * se


# ---------------------------------------------------------------- settings, and resuming under new settings


def test_a_delayed_lag_at_or_below_the_policy_lag_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"train\.max_delayed_lag = 2 is not above train\.max_policy_lag = 2"):
        load_settings(env={"RTRL_TRAIN__MAX_POLICY_LAG": "2", "RTRL_TRAIN__MAX_DELAYED_LAG": "2"})
    assert load_settings(env={"RTRL_TRAIN__MAX_DELAYED_LAG": "0"}).train.max_delayed_lag == 0  # 0: no delayed path


def test_resumed_windows_take_the_current_window_rules_unless_some_are_spilled(tmp_path):
    """A reward flow resumed from a snapshot made under other window rules reschedules the windows in memory by
    the current ones; with windows spilled to the state file (due times written under the old rules) it refuses,
    naming the settings and the fix."""
    import pickle

    from flows.reward_flow import reconfigure
    from flows.spill import SqliteStore
    from flows.windowing import PartitionWindows
    from rtrl.sections.flows import FlowSettings

    env = dict(trajectory_id="bg", org_id="o", user_hash="0" * 32, policy_version=0, arm="control")
    old = PartitionWindows(
        WindowConfig(FlowSettings(deadline_s=HOUR / 1000, task_kinds={}))
    )  # before per-kind rules: background closes at 1 h
    old.ingest(TrajectoryStarted(event_id="s", ts=0, task_kind=BACKGROUND, **env), 0)
    resumed = pickle.loads(pickle.dumps(old))
    new = WindowConfig(load_settings(env={"RTRL_SDK__SALT": SALT}).flow)
    reconfigure(resumed, new)
    tick = dict(env, trajectory_id="other")
    later = TrajectoryStarted(event_id="t", ts=2 * HOUR, task_kind="bugfix", **tick)
    assert [c.trajectory_id for c in old.ingest(later, 1) if hasattr(c, "close_reason")] == ["bg"]  # old: closed
    assert not [c for c in resumed.ingest(later, 1) if getattr(c, "trajectory_id", "") == "bg"]  # new: a day

    spilled = PartitionWindows(
        WindowConfig(FlowSettings(deadline_s=HOUR / 1000, task_kinds={})),
        store=SqliteStore.fresh(tmp_path / "p0.sqlite"),
    )
    spilled.budget_bytes = 1  # everything goes to the file
    spilled.ingest(TrajectoryStarted(event_id="s", ts=0, task_kind=BACKGROUND, **env), 0)
    spilled.ingest(later, 1)
    assert spilled.store is not None and len(spilled.store)
    with pytest.raises(ConfigError, match=r"flow\.task_kinds.*fix: restore the settings"):
        reconfigure(spilled, new)


def test_resumed_batch_builders_take_the_current_config_and_expire_what_they_hold():
    """A cohort's builders resumed by the batch flow use the current settings' config (a snapshot from before the
    delayed path would otherwise join provisional rewards), and a builder from an older snapshot, without the
    index of held rollouts, still expires them on time."""
    import pickle

    from flows.batch_flow import _configured, batch_config
    from flows.batching import BatchBuilder
    from tests.test_batching import config, ro

    settings = load_settings(env={"RTRL_SDK__SALT": SALT})
    old = BatchBuilder(config(join_wait_s=1))
    old.add_rollout(ro("t1", at=0))
    del old.__dict__["_waits"]  # as pickled before the index existed
    resumed = _configured(pickle.loads(pickle.dumps(old)), batch_config(settings))
    assert resumed.config == batch_config(settings) and resumed.config.train.max_delayed_lag == 4
    assert resumed.config.verdict_wait(BACKGROUND) is not None
    resumed.advance_to(60_000 + 2)  # past the current join wait (batching.join_wait_s = 60 s)
    assert resumed.counts["unmatched_rollout"] == 1 and not resumed.rollouts
