"""Per-organisation specialisation (issue 17): a simulated world where an org's own adapter pays, and the batch
flow's routing of each org's micro-batches to its adapter stream.

Contracts checked here:

* **Org conventions** (simulator.tasks). An org with a :class:`Convention` accepts ``(global answer + shift) % 10``
  on its convention kinds and the global answer elsewhere; the prompt is the same either way. The conventions
  draw nothing from the task stream: with or without them a seed gives the same tasks (shift apart), and with
  none every task has shift 0 (the existing golden streams hold). The users' reactions and the rewards follow
  the org's answer: its users reject or revert the global answer on convention kinds and reward it elsewhere.
  Each org's held-out tasks come from a stream of their own; its eval suite scores the org's tasks plus the
  global regression guard. ``loop.specialised_orgs`` may not exceed ``loop.orgs``.
* **Routing** (flows.adapters.OrgRouter). An org not in ``adapters.orgs`` keeps today's path: its batches go to
  the shared stream unchanged. A wanted org's batches go to the shared stream only until it has sent
  ``adapters.min_samples`` samples; from then on each goes to the org's adapter stream (``adapter=org``, its
  own batch id) and, with ``shared_traffic = "all"``, a copy to the shared stream (``adapter=""``, an id derived
  from the original one, the same on every redelivery); with ``"unadapted"`` to the adapter stream only. An
  org's samples only ever appear in that org's adapter batches. The router's state survives a snapshot and
  resume. The real batch flow puts adapter batches on ``<prefix>adapter-batches``, keyed by org, and only for
  the wanted org after its threshold.
"""

from __future__ import annotations

import random
import statistics

import pytest

from rewards import compute
from rtrl.errors import ConfigError
from rtrl.settings import load_settings
from schemas.records import EditAccepted, EditPersisted
from simulator.tasks import (
    CONVENTION_TABLE,
    DIGIT0,
    KINDS,
    Convention,
    Task,
    conventions_for,
    held_out,
    outcome,
    sample_task,
    score,
)
from simulator.world import react
from tests.test_tasks_policy import Recorder

CONVENTIONS = conventions_for(3, 2)  # org-1: refactor + test shifted by 3; org-2: feature + explain by 7


# ---------------------------------------------------------------- A. a world where specialisation pays


def test_the_default_conventions_and_what_is_refused():
    """The documented default (the table's first rows, on the last orgs), and bad conventions or settings fail
    with a message naming the fix."""
    assert CONVENTIONS == {
        "org-1": Convention("org-1", ("refactor", "test"), 3),
        "org-2": Convention("org-2", ("feature", "explain"), 7),
    }
    assert conventions_for(3, 0) == {} and set(conventions_for(3, 3)) == {"org-0", "org-1", "org-2"}
    assert [c.shift for c in conventions_for(7, 7).values()] == [s for _, s in CONVENTION_TABLE] + [3, 7]
    with pytest.raises(ValueError, match="within 0..3"):
        conventions_for(3, 4)
    with pytest.raises(ValueError, match="shift"):
        Convention("o", ("bugfix",), 0)
    with pytest.raises(ValueError, match="kinds"):
        Convention("o", ("nope",), 3)
    assert load_settings(env={"RTRL_LOOP__SPECIALISED_ORGS": "3"}).loop.specialised_orgs == 3
    with pytest.raises(ConfigError, match=r"loop.specialised_orgs = 4 exceeds loop.orgs = 3.*fix"):
        load_settings(env={"RTRL_LOOP__SPECIALISED_ORGS": "4"})


def test_conventions_draw_nothing_from_the_task_stream():
    """The same seed gives the same tasks with or without conventions; only the shift differs, and only on the
    org's convention kinds; with none every shift is 0 and the prompt never shows the org."""
    plain, conv = random.Random(11), random.Random(11)
    seen = set()
    for i in range(600):
        org = f"org-{i % 3}"
        a, b = sample_task(plain, org), sample_task(conv, org, conventions=CONVENTIONS)
        assert a.shift == 0 and a.answer == a.global_answer
        want = CONVENTIONS[org].shift_for(a.kind) if org in CONVENTIONS else 0
        assert b == Task(a.task_id, org, a.kind, a.level, a.a, a.b, shift=want)
        assert b.prompt == a.prompt and b.global_answer == a.global_answer
        seen.add((org, b.kind, b.shift))
    assert ("org-1", "refactor", 3) in seen and ("org-2", "explain", 7) in seen and ("org-1", "feature", 0) in seen
    assert plain.random() == conv.random()  # both streams drew the same numbers


def test_the_global_answer_is_wrong_on_a_specialised_orgs_convention_kinds_and_right_elsewhere():
    rng = random.Random(5)
    tasks = [sample_task(rng, f"org-{i % 3}", conventions=CONVENTIONS) for i in range(900)]
    for t in tasks:
        convention = t.org_id in CONVENTIONS and t.kind in CONVENTIONS[t.org_id].kinds
        assert outcome(t, [5, DIGIT0 + t.global_answer]).correct is (not convention)
        assert outcome(t, [5, DIGIT0 + t.answer]).correct
    # a policy that knows only the global convention solves org-0 fully and the specialised orgs partly
    by_org = {
        org: score(ts := [t for t in tasks if t.org_id == org], [[5, DIGIT0 + t.global_answer] for t in ts])
        for org in ("org-0", "org-1", "org-2")
    }
    assert by_org["org-0"]["solve_rate"] == 1.0
    assert 0.45 < by_org["org-1"]["solve_rate"] < 0.75 and 0.45 < by_org["org-2"]["solve_rate"] < 0.75


def test_users_of_a_specialised_org_reject_or_revert_the_global_answer_and_the_reward_follows():
    """The same hard refactor task in org-0 (global convention) and org-1 (shift 3 on refactor): the global answer
    is accepted and kept by org-0's users and rejected or reverted by org-1's, and v2 rewards it in org-0 only;
    org-1's own answer earns in org-1 what the global one earns in org-0."""

    def world(org: str, digit_of, n: int = 1500):
        task = Task("t", org, "refactor", "hard", 3, 4, shift=CONVENTIONS[org].shift if org in CONVENTIONS else 0)
        out = outcome(task, [5, DIGIT0 + digit_of(task)])
        rng, rewards, kept, accepted = random.Random(1), [], [], 0
        for i in range(n):
            rec = Recorder()
            react(rec, task, out, rng, 1000, user=f"{org}-user-{i % 200}")
            accepted += any(isinstance(e, EditAccepted) for e in rec.events)
            kept += [e.fraction for e in rec.events if isinstance(e, EditPersisted)]
            rewards.append(compute(rec.events, "v2").reward)
        return accepted / n, statistics.mean(kept), statistics.mean(rewards)

    acc0, kept0, r0 = world("org-0", lambda t: t.global_answer)
    acc1, kept1, r1 = world("org-1", lambda t: t.global_answer)
    own1 = world("org-1", lambda t: t.answer)
    assert acc0 > 0.9 and kept0 > 0.85 and r0 > 0
    assert acc1 < 0.4 and kept1 < 0.5 and r1 < 0 < r0 - 0.5
    assert abs(own1[2] - r0) < 0.15  # the org's own answer is worth to it what the global one is to org-0


def test_each_org_has_held_out_tasks_of_its_own():
    """An org's held-out tasks are fixed, its own (org id, convention) and from a stream no other suite or
    training round draws from; the global held-out tasks are unchanged by the new arguments."""
    one = held_out(200, seed=7, org="org-1", conventions=CONVENTIONS)
    assert one == held_out(200, seed=7, org="org-1", conventions=CONVENTIONS)
    assert {t.org_id for t in one} == {"org-1"}
    assert all(t.shift == (3 if t.kind in ("refactor", "test") else 0) for t in one)
    assert {t.kind for t in one} == set(KINDS) and any(t.shift for t in one)
    ids = {t.task_id for t in one}
    assert not ids & {t.task_id for t in held_out(200, seed=7)}
    assert not ids & {t.task_id for t in held_out(200, seed=7, org="org-2", conventions=CONVENTIONS)}
    assert not ids & {t.task_id for t in (sample_task(random.Random(7), "org-1") for _ in range(200))}
    plain = held_out(200, seed=7, org="org-1")  # no conventions: the same tasks under the global one
    assert [replace_shift(t) for t in one] == plain
    assert held_out(50) == held_out(50, conventions=CONVENTIONS)  # the global suite ignores conventions


def replace_shift(t: Task) -> Task:
    return Task(t.task_id, t.org_id, t.kind, t.level, t.a, t.b)


def test_an_orgs_eval_suite_scores_its_convention_and_its_guard_the_global_skills(monkeypatch):
    """OrgHeldOutTasks with stand-in policies: one that knows org-1's convention solves the org's tasks and the
    guard (the global held-out tasks of the kinds org-1 shares with everyone); one that knows only the global
    convention fails the org's convention kinds but solves its other kinds and the guard."""
    import simulator.evalsuite as ev

    suite = ev.OrgHeldOutTasks("org-1", CONVENTIONS, n_tasks=120, seed=0, repeats=2)
    guard = suite.guard()
    assert suite.name == "held-out-tasks-org-1" and suite.samples == 240 and guard.name == "held-out-tasks"
    assert guard.tasks and all(t.kind not in ("refactor", "test") and t.shift == 0 for t in guard.tasks)
    assert guard.tasks == [t for t in ev.HeldOutTasks(120, 0).tasks if t.kind not in ("refactor", "test")]
    assert guard.samples == 2 * len(guard.tasks) < 240

    def policy(knows_convention: bool):
        def answer(model, tasks, *generator):
            comps = [[5, DIGIT0 + (t.answer if knows_convention else t.global_answer)] for t in tasks]
            return (comps, None) if generator else comps

        return answer

    for knows in (True, False):
        monkeypatch.setattr(ev, "greedy", policy(knows))
        monkeypatch.setattr(ev, "sample", policy(knows))
        got, on_guard = suite.evaluate(model=None), guard.evaluate(model=None)
        assert on_guard["greedy_solve_rate"] == 1.0 == on_guard["solve_rate"] == got["greedy_solve_rate_general"]
        assert got["greedy_solve_rate_convention"] == (1.0 if knows else 0.0)
        assert (got["greedy_solve_rate"] == 1.0) is knows and (got["solve_rate"] == 1.0) is knows
        assert set(on_guard) <= set(got)  # the same metric names: the gate's rules apply to both
