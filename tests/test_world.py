"""The simulated world of the closed loop (simulator.world): every headline metric depends on the policy.

Pure and seeded: each test draws thousands of reactions from seeded generators and checks what the model in
simulator/world.py's docstring says, through the real event records and the real reward function."""

from __future__ import annotations

import random
import statistics

import pytest

from rewards import compute
from schemas.records import EditPersisted, Followup, Latency, TrajectoryEnded
from simulator.tasks import ASK, DIGIT0, MALFORMED, Task, outcome, sample_task, warm_start_completion
from simulator.world import TOOL_MS, WORLD, Mailbox, World, react, reaction, strictness
from tests.test_tasks_policy import Recorder

TASK = Task("t", "o", "bugfix", "hard", 3, 4)  # answer 7, edits of 1 + 4 lines when right
RIGHT, WRONG = DIGIT0 + TASK.answer, DIGIT0 + (TASK.answer + 1) % 10
USERS = [f"org-0-user-{i}" for i in range(300)]


def reactions(completion: list[int], n: int = 4000, seed: int = 0, task: Task = TASK):
    rng = random.Random(seed)
    out = outcome(task, completion)
    return [reaction(task, out, rng, rng.choice(USERS)) for _ in range(n)]


def share(rs, pred) -> float:
    return sum(map(pred, rs)) / len(rs)


def test_same_seed_same_events_and_users_have_fixed_traits():
    def events(seed):
        rec = Recorder()
        react(rec, TASK, outcome(TASK, [5, RIGHT]), random.Random(seed), 1000, user="org-0-user-7")
        return [
            (type(e).__name__, e.ts, getattr(e, "fraction", None), getattr(e, "total_ms", None)) for e in rec.events
        ]

    assert events(3) == events(3) and events(3) != events(4)
    s = [strictness(u) for u in USERS]
    assert s == [strictness(u) for u in USERS] and all(0 < x < 1 for x in s)
    assert statistics.mean(s) == pytest.approx(2 / 6, abs=0.04)  # Beta(2, 4)


def test_wrong_edits_are_sometimes_accepted_and_reverted_fully_or_partly():
    rs = reactions([5, WRONG])
    accepted = [r for r in rs if r.accepted]
    # accept_wrong * (1 - s), s ~ Beta(2, 4): about 0.35 * 2/3
    assert share(rs, lambda r: r.accepted) == pytest.approx(WORLD.accept_wrong * 2 / 3, abs=0.04)
    full = [r for r in accepted if r.kept == 0.0]
    assert len(full) / len(accepted) == pytest.approx(WORLD.revert_fully, abs=0.05)
    partly = [r.kept for r in accepted if r.kept]
    assert partly and all(0.1 <= k <= 0.6 for k in partly)


def test_right_edits_are_sometimes_partly_rewritten_and_rarely_rejected():
    rs = reactions([5, RIGHT])
    kept = [r.kept for r in rs if r.accepted]
    assert 0 < share(rs, lambda r: r.accepted is False) < 0.05  # strict users reject a right edit now and then
    rewritten = [k for k in kept if k is not None and k < 1]
    # rewrite_right + rewrite_strict * s
    assert len(rewritten) / len(kept) == pytest.approx(WORLD.rewrite_right + WORLD.rewrite_strict / 3, abs=0.04)
    assert all(0.5 <= k <= 0.95 for k in rewritten)


def test_persistence_arrives_late_through_the_callers_clock():
    rec, held = Recorder(), []
    react(
        rec,
        TASK,
        outcome(TASK, [5, RIGHT]),
        random.Random(1),
        1000,
        user="org-0-user-1",
        later=lambda d, f: held.append((d, f)),
    )
    assert not any(isinstance(e, EditPersisted) for e in rec.events)  # not yet: the check runs later
    ((delay, send),) = held
    assert WORLD.persist_delay_ms[0] <= delay <= WORLD.persist_delay_ms[1]
    send()
    end = next(e for e in rec.events if isinstance(e, TrajectoryEnded))
    check = rec.events[-1]
    assert isinstance(check, EditPersisted) and check.ts == end.ts + delay and check.checked_after_s == delay / 1000

    t = [0.0]
    box, sent = Mailbox(clock=lambda: t[0]), []
    box.later(500, lambda: sent.append("a"))
    box.later(100, lambda: sent.append("b"))
    assert box.deliver() == 0
    t[0] = 0.2
    assert box.deliver() == 1 and sent == ["b"]
    box.later(10_000, lambda: sent.append("c"))
    assert box.deliver(everything=True) == 2 and sent == ["b", "a", "c"]  # at close: everything, in due order


def test_latency_depends_on_what_the_policy_does():
    mean = lambda rs: statistics.mean(r.latency_ms for r in rs)  # noqa: E731
    read, tests = reactions([5, RIGHT]), reactions([6, RIGHT])
    assert mean(tests) - mean(read) == pytest.approx(TOOL_MS["run_tests"] - TOOL_MS["read_file"], rel=0.15)
    broken = reactions([MALFORMED[0], RIGHT])
    # a broken call costs its retries: one, a second with chance second_retry, each retry_ms + U(0, 300)
    retries = (1 + WORLD.second_retry) * (WORLD.retry_ms + 150)
    assert mean(broken) - statistics.mean(TOOL_MS.values()) - (mean(read) - TOOL_MS["read_file"]) == pytest.approx(
        retries, rel=0.15
    )
    wrong = reactions([5, WRONG])
    assert statistics.mean(r.lines for r in wrong) == pytest.approx(1 + TASK.b + 3.5, abs=0.1)  # longer answers
    assert mean(wrong) - mean(read) == pytest.approx(3.5 * WORLD.ms_per_line, rel=0.15)
    ask = reactions([5, ASK])
    assert mean(ask) < mean(read)  # a question is short


def test_dissatisfied_follow_ups_depend_on_the_outcome():
    def dis(c):
        return share(reactions(c), lambda r: r.sentiment == "dissatisfied")

    right, wrong, ask, nothing = dis([5, RIGHT]), dis([5, WRONG]), dis([5, ASK]), dis([5, 0])
    broken_right = dis([MALFORMED[0], RIGHT])
    assert right < 0.15 < ask < 0.6 < wrong < nothing
    # the broken call's own annoyance, and its retries' slowness on top
    assert WORLD.dissatisfied_broken - 0.03 < broken_right - right < WORLD.dissatisfied_broken + WORLD.dissatisfied_slow
    rs = reactions([5, WRONG])
    rejected = [r for r in rs if r.accepted is False]
    reverted = [r for r in rs if r.accepted and r.kept == 0.0]
    partly = [r for r in rs if r.accepted and r.kept]
    d = lambda xs: share(xs, lambda r: r.sentiment == "dissatisfied")  # noqa: E731
    assert d(rejected) > d(reverted) > d(partly)
    assert (
        share([r for r in reactions([5, RIGHT]) if r.sentiment != "dissatisfied"], lambda r: r.sentiment == "satisfied")
        == 1
    )


def test_a_better_policy_moves_every_headline_metric_and_the_reward():
    """The warm start's behaviour against a trained one's (more right edits, fewer broken calls and questions):
    persistence up, dissatisfied follow-ups down, latency down, v2 reward up, through the real event records."""

    def world(broken, ask, right, seed=5):
        rng, kept, checks, dis, lat, rewards = random.Random(seed), 0.0, 0, 0, [], []
        for i in range(3000):
            task = sample_task(rng, "o")
            rec = Recorder()
            completion = warm_start_completion(rng, task, broken, ask, right)
            # persistence checks sent at once (with their later event times)
            react(rec, task, outcome(task, completion), rng, 1000, user=f"org-0-user-{i % 300}")
            for e in rec.events:
                if isinstance(e, EditPersisted):
                    kept, checks = kept + e.fraction, checks + 1
                elif isinstance(e, Followup):
                    dis += e.sentiment == "dissatisfied"
                elif isinstance(e, Latency):
                    lat.append(e.total_ms)
            rewards.append(compute(rec.events, "v2").reward)
        return kept / checks, dis / 3000, statistics.mean(lat), statistics.mean(rewards)

    p0, d0, l0, r0 = world(0.1, 0.1, 0.35)
    p1, d1, l1, r1 = world(0.01, 0.02, 0.85)
    assert p1 > p0 + 0.05 and d1 < d0 - 0.1 and l1 < 0.95 * l0 and r1 > r0 + 0.2


def test_the_world_refuses_impossible_numbers():
    with pytest.raises(ValueError, match="accept_wrong"):
        World(accept_wrong=1.5)
    with pytest.raises(ValueError, match="persist_delay_ms"):
        World(persist_delay_ms=(900, 100))
    with pytest.raises(ValueError, match="retry_ms"):
        World(retry_ms=-1.0)
    assert World().accept_wrong == WORLD.accept_wrong
