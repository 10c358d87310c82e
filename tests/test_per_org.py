"""Per-organisation specialisation (issue 17): a simulated world where an org's own adapter pays, and the batch
flow's routing of each org's micro-batches to its adapter stream.

Contracts checked here:

* **Org conventions** (simulator.tasks). An org with a :class:`Convention` accepts an edit on its convention
  kinds only after its tool ran (the default conventions: org-1 wants the tests run, org-2 a search, on the
  same kinds) and/or only ``(global answer + shift) % 10``, and the global habit elsewhere; the prompt is the
  same either way, and P(solve) counts the org's tool only. The conventions draw nothing from the task stream:
  with or without them a seed gives the same tasks (shift and tool apart), and with none every task has shift
  0 and no required tool (the existing golden streams hold). The users' reactions and the rewards follow the
  org's habit: its users reject or revert the global one on convention kinds and reward it elsewhere.
  Each org's held-out tasks come from a stream of their own; its eval suite scores the org's tasks plus the
  global regression guard. ``loop.specialised_orgs`` may not exceed ``loop.orgs``, and the loop's policy server
  asks each org's tasks under its convention.
* **Routing** (flows.adapters.OrgRouter). An org not in ``adapters.orgs`` keeps today's path: its batches go to
  the shared stream unchanged. A wanted org's batches go to the shared stream only until it has sent
  ``adapters.min_samples`` samples; from then on each goes to the org's adapter stream (``adapter=org``, its
  own batch id) and, with ``shared_traffic`` "served" (the default) or "all", a copy to the shared stream
  (``adapter=""``, an id derived from the original one, the same on every redelivery; under "served" one per
  serving adapter version); with ``"unadapted"`` to the adapter stream only. An
  org's samples only ever appear in that org's adapter batches. The router's state survives a snapshot and
  resume, and a restart of the real flow from its Bytewax recovery state. The real batch flow puts adapter
  batches on ``<prefix>adapter-batches``, keyed by org, and only for the wanted org after its threshold.

An adapter's training on what the router sends it: tests/test_per_org_training.py; the re-validation of a serving
adapter on a new base: tests/test_per_org_revalidation.py.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.adapters import OrgRouter, shared_copy_id
from flows.batching import Sample, pack
from rewards import compute
from rtrl.errors import ConfigError
from rtrl.settings import load_settings
from schemas.records import EditAccepted, EditPersisted, MicroBatch
from simulator.tasks import (
    CONVENTION_TABLE,
    DIGIT0,
    GLOBAL_HABIT,
    KINDS,
    TOOL_TOKENS,
    Convention,
    Task,
    convention_of,
    conventions_for,
    held_out,
    outcome,
    sample_task,
    score,
)
from simulator.world import react
from tests.test_batching import ro
from tests.test_tasks_policy import Recorder

CONVENTIONS = conventions_for(3, 2)  # org-1: the tests run before refactor + test edits; org-2: a search first
SHIFTED = {"org-1": Convention("org-1", ("refactor", "test"), shift=3)}  # an answer convention (not the default)
TOKEN = TOOL_TOKENS
READ_FILE = TOKEN["read_file"]


def habit(t: Task) -> int:
    """The tool token a task's org wants run before an edit on its kind (read_file where any tool will do)."""
    return TOKEN[t.tool] if t.tool else READ_FILE


# ---------------------------------------------------------------- A. a world where specialisation pays


def test_the_default_conventions_and_what_is_refused():
    """The documented default (the table's first rows, on the last orgs): tool habits that conflict on the same
    kinds; bad conventions or settings fail with a message naming the fix."""
    assert CONVENTIONS == {
        "org-1": Convention("org-1", ("refactor", "test"), tool="run_tests"),
        "org-2": Convention("org-2", ("refactor", "test"), tool="search"),
    }
    assert conventions_for(3, 0) == {} and set(conventions_for(3, 3)) == {"org-0", "org-1", "org-2"}
    assert [c.tool for c in conventions_for(7, 7).values()] == [t for _, t in CONVENTION_TABLE] + [
        "run_tests",
        "search",
    ]
    with pytest.raises(ValueError, match="within 0..3"):
        conventions_for(3, 4)
    with pytest.raises(ValueError, match="neither a shift nor a tool"):
        Convention("o", ("bugfix",))
    with pytest.raises(ValueError, match="shift 10 must be within 0..9"):
        Convention("o", ("bugfix",), 10)
    with pytest.raises(ValueError, match="tool 'grep' must be one of"):
        Convention("o", ("bugfix",), tool="grep")
    with pytest.raises(ValueError, match="kinds"):
        Convention("o", ("nope",), 3)
    assert load_settings(env={"RTRL_LOOP__SPECIALISED_ORGS": "3"}).loop.specialised_orgs == 3
    with pytest.raises(ConfigError, match=r"loop.specialised_orgs = 4 exceeds loop.orgs = 3.*fix"):
        load_settings(env={"RTRL_LOOP__SPECIALISED_ORGS": "4"})


@pytest.mark.parametrize("conventions", [CONVENTIONS, SHIFTED], ids=["tools", "shift"])
def test_conventions_draw_nothing_from_the_task_stream(conventions):
    """The same seed gives the same tasks with or without conventions; only the shift and the required tool
    differ, and only on the org's convention kinds; with none every task has shift 0 and no required tool, and
    the prompt never shows the org."""
    plain, conv = random.Random(11), random.Random(11)
    seen = set()
    for i in range(600):
        org = f"org-{i % 3}"
        a, b = sample_task(plain, org), sample_task(conv, org, conventions=conventions)
        assert a.shift == 0 and a.tool is None and a.answer == a.global_answer
        c = conventions.get(org)
        if c is None or a.kind not in c.kinds:  # the majority's habit (read the file first) on its kinds
            c = GLOBAL_HABIT if a.kind in GLOBAL_HABIT.kinds else None
        want = (c.shift_for(a.kind), c.tool_for(a.kind)) if c else (0, None)
        assert c == convention_of(org, a.kind, conventions)
        assert b == Task(a.task_id, org, a.kind, a.level, a.a, a.b, shift=want[0], tool=want[1])
        assert b.prompt == a.prompt and b.global_answer == a.global_answer
        seen.add((org, b.kind, b.shift, b.tool))
    assert ("org-1", "feature", 0, None) in seen and ("org-0", "refactor", 0, "read_file") in seen
    if conventions is CONVENTIONS:
        assert ("org-1", "refactor", 0, "run_tests") in seen and ("org-2", "test", 0, "search") in seen
    else:
        assert ("org-1", "refactor", 3, None) in seen and ("org-2", "test", 0, "read_file") in seen
    assert plain.random() == conv.random()  # both streams drew the same numbers


def test_the_global_habit_fails_a_specialised_orgs_convention_kinds_and_passes_elsewhere():
    """The right answer after read_file (a habit any org-0 user accepts) fails on a specialised org's convention
    kinds (the org wants another tool run first) and passes elsewhere; the org's own tool with the right answer
    passes everywhere, and so does nothing else on its convention kinds (neither a wrong answer after it, nor
    the other specialised org's tool)."""
    rng = random.Random(5)
    tasks = [sample_task(rng, f"org-{i % 3}", conventions=CONVENTIONS) for i in range(900)]
    for t in tasks:
        convention = t.org_id in CONVENTIONS and t.kind in CONVENTIONS[t.org_id].kinds
        assert outcome(t, [READ_FILE, DIGIT0 + t.answer]).correct is (not convention)
        assert outcome(t, [habit(t), DIGIT0 + t.answer]).correct
        assert not outcome(t, [habit(t), DIGIT0 + (t.answer + 1) % 10]).correct
        if convention:
            other = next(c.tool for o, c in CONVENTIONS.items() if o != t.org_id)
            assert not outcome(t, [TOKEN[str(other)], DIGIT0 + t.answer]).correct
    # a policy that knows only the global habit solves org-0 fully and the specialised orgs partly
    by_org = {
        org: score(ts := [t for t in tasks if t.org_id == org], [[READ_FILE, DIGIT0 + t.answer] for t in ts])
        for org in ("org-0", "org-1", "org-2")
    }
    assert by_org["org-0"]["solve_rate"] == 1.0
    assert 0.45 < by_org["org-1"]["solve_rate"] < 0.75 and 0.45 < by_org["org-2"]["solve_rate"] < 0.75
    # the same with a shifted answer: the global answer fails on the convention kinds
    for t in (sample_task(rng, "org-1", conventions=SHIFTED) for _ in range(200)):
        assert outcome(t, [READ_FILE, DIGIT0 + t.global_answer]).correct is (t.kind not in ("refactor", "test"))


def test_solve_probability_counts_only_the_tool_the_org_wants():
    """P(solve) sums over the first tokens after which a right edit is accepted: every one for a task with no
    required tool, the org's tool alone for one with (the greedy and sampled scores agree)."""
    import torch

    from app.serving import loop_model_config
    from simulator.policy import _logits, solve_probability
    from trainer.model import build_model, init_parallel

    s = load_settings(env={})
    cfg = loop_model_config(s)[0]
    init_parallel(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    task = Task("t", "org-1", "refactor", "easy", 4, 2)
    free, bound = solve_probability(model, [task, replace(task, tool="run_tests")])

    with torch.no_grad():
        p_first = torch.softmax(_logits(model, torch.tensor([task.prompt]))[:, -1], dim=-1)[0]
        after = torch.softmax(_logits(model, torch.tensor([task.prompt + [TOKEN["run_tests"]]]))[:, -1], dim=-1)[0]
    assert bound == pytest.approx(float(p_first[TOKEN["run_tests"]] * after[DIGIT0 + 4]), rel=1e-4)
    assert 0 < bound < free


@pytest.mark.parametrize(
    "own,convention",
    [(lambda t: (habit(t), t.answer), CONVENTIONS), (lambda t: (READ_FILE, t.answer), SHIFTED)],
    ids=["tools", "shift"],
)
def test_users_of_a_specialised_org_reject_or_revert_the_global_habit_and_the_reward_follows(own, convention):
    """The same hard refactor task in org-0 (global convention) and org-1 (its convention on refactor): the
    global habit (the global answer after read_file) is accepted and kept by org-0's users and rejected or
    reverted by org-1's, and v2 rewards it in org-0 only; org-1's own habit earns in org-1 about what the global
    one earns in org-0."""

    def world(org: str, act, n: int = 1500):
        task = sample_task(random.Random(0), org, conventions=convention)
        task = replace(task, kind="refactor", level="hard", a=3, b=4)
        c = convention.get(org)
        task = replace(task, shift=c.shift_for("refactor") if c else 0, tool=c.tool_for("refactor") if c else None)
        tool, digit = act(task)
        out = outcome(task, [tool, DIGIT0 + digit])
        rng, rewards, kept, accepted = random.Random(1), [], [], 0
        for i in range(n):
            rec = Recorder()
            react(rec, task, out, rng, 1000, user=f"{org}-user-{i % 200}")
            accepted += any(isinstance(e, EditAccepted) for e in rec.events)
            kept += [e.fraction for e in rec.events if isinstance(e, EditPersisted)]
            result = compute(rec.events, "v2")
            assert result is not None  # v2 scores every trajectory
            rewards.append(result.reward)
        return accepted / n, statistics.mean(kept), statistics.mean(rewards)

    acc0, kept0, r0 = world("org-0", lambda t: (READ_FILE, t.global_answer))
    acc1, kept1, r1 = world("org-1", lambda t: (READ_FILE, t.global_answer))
    own1 = world("org-1", own)
    assert acc0 > 0.9 and kept0 > 0.85 and r0 > 0
    assert acc1 < 0.4 and kept1 < 0.5 and r1 < 0 < r0 - 0.5
    assert abs(own1[2] - r0) < 0.15  # the org's own habit is worth to it about what the global one is to org-0


def test_each_org_has_held_out_tasks_of_its_own():
    """An org's held-out tasks are fixed, its own (org id, convention) and from a stream no other suite or
    training round draws from; the global held-out tasks are unchanged by the new arguments."""
    one = held_out(200, seed=7, org="org-1", conventions=CONVENTIONS)
    assert one == held_out(200, seed=7, org="org-1", conventions=CONVENTIONS)
    assert {t.org_id for t in one} == {"org-1"}
    assert all(t.tool == ("run_tests" if t.kind in ("refactor", "test") else None) and t.shift == 0 for t in one)
    assert {t.kind for t in one} == set(KINDS) and any(t.tool for t in one)
    ids = {t.task_id for t in one}
    assert not ids & {t.task_id for t in held_out(200, seed=7)}
    assert not ids & {t.task_id for t in held_out(200, seed=7, org="org-2", conventions=CONVENTIONS)}
    assert not ids & {t.task_id for t in (sample_task(random.Random(7), "org-1") for _ in range(200))}
    plain = held_out(200, seed=7, org="org-1")  # no conventions: the same tasks under the global one
    assert [global_form(t) for t in one] == plain
    assert held_out(50) == held_out(50, conventions=CONVENTIONS)  # the global suite ignores conventions


def global_form(t: Task) -> Task:
    return Task(t.task_id, t.org_id, t.kind, t.level, t.a, t.b)


def test_an_orgs_eval_suite_scores_its_convention_and_its_guard_the_global_skills(monkeypatch):
    """OrgHeldOutTasks with stand-in policies: one that knows org-1's convention solves the org's tasks and the
    guard (the global held-out tasks of the kinds org-1 shares with everyone); one that knows only the global
    convention fails the org's convention kinds but solves its other kinds and the guard."""
    import simulator.evalsuite as ev

    suite = ev.OrgHeldOutTasks("org-1", CONVENTIONS, n_tasks=120, seed=0, repeats=2)
    guard = suite.guard()
    assert suite.name == "held-out-tasks-org-1" and suite.samples == 240 and guard.name == "held-out-tasks"
    assert guard.tasks and all(t.kind not in ("refactor", "test") and t.tool is None for t in guard.tasks)
    assert guard.tasks == [t for t in ev.HeldOutTasks(120, 0).tasks if t.kind not in ("refactor", "test")]
    assert guard.samples == 2 * len(guard.tasks) < 240

    def policy(knows_convention: bool):
        def answer(model, tasks, *generator):
            comps = [[habit(t) if knows_convention else READ_FILE, DIGIT0 + t.answer] for t in tasks]
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


# ---------------------------------------------------------------- B. per-org routing in the batch flow

ORGS = ("o0", "o1", "o2", "o3")


def batch(org: str, n: int, first: int = 0, version: str = "v2") -> MicroBatch:
    """A micro-batch of ``n`` of ``org``'s samples (trajectory ids ``<org>-<i>``), packed by the flow's own code;
    advantages alternate +1 / -1 (so a trainer has something to learn)."""
    samples = [
        Sample(ro(f"{org}-{i}", group=f"g{org}-{i}", org=org), 1.0, 0, advantage=1.0 if i % 2 else -1.0)
        for i in range(first, first + n)
    ]
    return pack(samples, seq_len=64, created_at=1000, reward_version=version)


def test_an_org_goes_to_its_adapter_stream_once_it_passed_the_threshold():
    """Counted over the batches before: below min_samples the batch goes to the shared stream as it is; from the
    threshold on to the adapter stream, plus (shared_traffic all) a copy with a derived id to the shared one."""
    r = OrgRouter("o0", min_samples=5)
    b1, b2, b3, b4 = (batch("o0", 2, first=2 * i) for i in range(4))
    assert r.route(b1) == [b1] and r.route(b2) == [b2] and r.route(b3) == [b3]  # 0, 2, 4 samples before
    assert r.samples == 6 and r.adapted
    out = r.route(b4)  # 6 samples before: adapted
    assert [(b.adapter, b.batch_id) for b in out] == [("o0", b4.batch_id), ("", shared_copy_id(b4.batch_id))]
    assert all(b.sample_ids == b4.sample_ids and b.token_ids == b4.token_ids for b in out)
    assert OrgRouter("o0", min_samples=0).route(b1)[0].adapter == "o0"  # threshold 0: adapted from the first


def test_unadapted_shared_traffic_sends_an_adapted_orgs_batches_to_its_adapter_only():
    r = OrgRouter("o1", min_samples=2, shared_traffic="unadapted")
    b1, b2 = batch("o1", 2), batch("o1", 2, first=2)
    assert r.route(b1) == [b1]
    assert [(b.adapter, b.batch_id) for b in r.route(b2)] == [("o1", b2.batch_id)]
    with pytest.raises(ValueError, match="shared_traffic"):
        OrgRouter("o1", 2, shared_traffic="some")  # type: ignore[arg-type]


def test_ids_are_a_function_of_the_batch_and_other_reward_versions_do_not_count():
    """The same batch routes to the same ids in any router (a redelivery is a duplicate the trainer drops); a
    shared copy's id is not the original's; batches of another reward version carry the same samples again and
    do not count toward the threshold."""
    b = batch("o0", 3)
    assert shared_copy_id(b.batch_id) == shared_copy_id(b.batch_id) != b.batch_id
    assert OrgRouter("o0", 0).route(b) == OrgRouter("o0", 0).route(b)
    r = OrgRouter("o0", min_samples=3, reward_version="v2")
    r.route(batch("o0", 3, version="v1-discard-broken"))
    assert r.samples == 0 and not r.adapted
    r.route(b)
    assert r.samples == 3 and r.adapted


def test_the_router_resumes_from_its_snapshot_under_the_current_settings():
    r = OrgRouter("o2", min_samples=4)
    r.route(batch("o2", 3))
    state = r.snapshot()
    assert state == {"org": "o2", "samples": 3}
    b = batch("o2", 2, first=3)
    assert OrgRouter.resume(state, "o2", 4).route(b) == r.route(b) == [b]  # 3 < 4: shared
    assert OrgRouter.resume(state, "o2", 3).route(b)[0].adapter == "o2"  # a lower threshold now: adapted
    assert OrgRouter.resume(None, "o2", 4).samples == 0


def _route(routers: dict, wants, min_samples: int, traffic: str, org: str, b: MicroBatch) -> list[MicroBatch]:
    if not wants(org):
        return [b]
    router = routers.setdefault(org, OrgRouter(org, min_samples, traffic, "v2"))  # type: ignore[arg-type]
    return router.route(b)


@settings(max_examples=60, deadline=None)
@given(
    traffic=st.lists(st.tuples(st.sampled_from(ORGS), st.integers(1, 6)), min_size=1, max_size=40),
    wanted=st.sampled_from([("o0",), ("o0", "o2"), ("*",), ()]),
    min_samples=st.integers(0, 12),
    shared=st.sampled_from(["all", "unadapted", "served"]),
    cut=st.integers(0, 40),
)
def test_an_orgs_samples_only_ever_reach_its_own_adapter(traffic, wanted, min_samples, shared, cut):
    """Random traffic of several orgs: an adapter batch holds only its org's samples and only a wanted org has
    one; every sample reaches the shared stream once unless its org is adapted under "unadapted", and an adapted
    org's samples reach its adapter once; ids never repeat within a stream; a snapshot and resume anywhere
    routes exactly as an uninterrupted router."""
    from rtrl.sections.trainer import AdapterSettings

    wants = AdapterSettings(orgs=list(wanted)).wants
    seen: dict[str, int] = {}
    batches = []
    for org, n in traffic:
        batches.append((org, batch(org, n, first=seen.get(org, 0))))
        seen[org] = seen.get(org, 0) + n
    routers: dict[str, OrgRouter] = {}
    out = [_route(routers, wants, min_samples, shared, org, b) for org, b in batches]
    # the same traffic, the routers snapshotted and resumed after `cut` batches
    resumed: dict[str, OrgRouter] = {}
    again = []
    for i, (org, b) in enumerate(batches):
        if i == cut:
            resumed = {o: OrgRouter.resume(r.snapshot(), o, min_samples, shared, "v2") for o, r in resumed.items()}
        again.append(_route(resumed, wants, min_samples, shared, org, b))
    assert again == out

    shared_ids, adapter_ids, on_shared, on_adapter = set(), set(), [], {o: [] for o in ORGS}
    for (org, original), sent in zip(batches, out):
        for b in sent:
            assert b.token_ids == original.token_ids and b.sample_ids == original.sample_ids
            if b.adapter:
                assert b.adapter == org and wants(org) and all(s.startswith(f"{org}-") for s in b.sample_ids)
                assert b.batch_id not in adapter_ids
                adapter_ids.add(b.batch_id)
                on_adapter[org] += b.sample_ids
            else:
                assert b.batch_id not in shared_ids
                shared_ids.add(b.batch_id)
                on_shared += b.sample_ids
    for org in ORGS:
        mine = [f"{org}-{i}" for i in range(seen.get(org, 0))]
        if not wants(org):
            assert on_adapter[org] == [] and all(s in on_shared for s in mine)
            continue
        assert len(on_adapter[org]) == len(set(on_adapter[org]))  # once each
        # what preceded the threshold: the shared stream only
        before, count = [], 0
        for o, b in batches:
            if o == org and count < min_samples:
                before += b.sample_ids
            count += len(b.sample_ids) if o == org else 0
        assert sorted(on_adapter[org]) == sorted(set(mine) - set(before))
        want_shared = mine if shared in ("all", "served") else before
        assert sorted(s for s in on_shared if s.startswith(f"{org}-")) == sorted(want_shared)


def test_served_shared_traffic_splits_a_batch_per_serving_adapter_version():
    """``shared_traffic = "served"`` routes like "all" (the adapter batch, and the shared copy with the same id
    as "all" gives it when one policy served every sample), and splits a batch that several adapter versions
    served into one shared copy per version: each trains only its version's samples (the others padding), has a
    stable id of its own, and names the org only when an adapter served it. A micro-batch names one org's adapter
    versions; another org's adapter-served samples in it (colliding cohort keys) take the delayed path."""
    from flows.adapters import split_by_adapter_version, split_mixed

    def sample(tid: str, served: int, org: str = "o1", delayed: bool = False) -> Sample:
        r = msgspec.structs.replace(ro(tid, "g", org=org), adapter_version=served)
        return Sample(r, 1.0, 0, advantage=0.5, delayed=delayed)

    mixed = pack([sample("a", 2), sample("b", 0, delayed=True), sample("c", 2), sample("d", 3)], 16, 1)
    assert mixed.served_org == "o1" and mixed.adapter_versions == [2, 0, 2, 3]
    out = OrgRouter("o1", 0, "served").route(mixed)
    assert [b.adapter for b in out] == ["o1", "", "", ""] and out[0] == replace_adapter(mixed, "o1")
    by_version = {tuple(b.adapter_versions) or (0,): b for b in out[1:]}
    base, a2, a3 = by_version[(0,)], by_version[(2, 2)], by_version[(3,)]
    assert base.sample_ids == ["b"] and base.served_org == "" and base.delayed == [True]
    assert a2.sample_ids == ["a", "c"] and a2.served_org == "o1" and a2.delayed == []
    assert a3.sample_ids == ["d"] and len({b.batch_id for b in out}) == 4
    assert [b.batch_id for b in split_by_adapter_version(mixed)] == [b.batch_id for b in out[1:]]  # stable
    for b in out[1:]:  # the shape stays; only the kept samples' tokens are trained and indexed
        assert len(b.token_ids) == len(mixed.token_ids) and b.seq_len == mixed.seq_len
        assert {g for r in b.segment_ids for g in r} == set(range(len(b.sample_ids))) | {-1}
        trained = sum(m for r in b.loss_mask for m in r)
        assert trained == 3 * len(b.sample_ids)  # ro(): 3 completion tokens each
    one = pack([sample("e", 2), sample("f", 2)], 16, 1)
    served, everything = OrgRouter("o1", 0, "served").route(one), OrgRouter("o1", 0, "all").route(one)
    assert served == everything
    # an org not routed to an adapter (under min_samples here; the flow does the same for one not in
    # adapters.orgs): its mixed batch goes to the shared stream split too, one policy's as it is
    assert OrgRouter("o1", 100, "served").route(mixed) == split_mixed(mixed) == split_by_adapter_version(mixed)
    assert OrgRouter("o1", 100, "served").route(one) == split_mixed(one) == [one]
    assert OrgRouter("o1", 100, "all").route(mixed) == [mixed]
    # two orgs' adapter-served samples in one batch (colliding cohort keys): the first org's keep their versions,
    # the other's train on the delayed path, never as the base alone's and never stopping the flow
    two = pack([sample("g", 1, "o2"), sample("h", 1, "o1"), sample("i", 0, "o2")], 16, 1)
    assert (two.served_org, two.adapter_versions, two.delayed) == ("o1", [0, 1, 0], [True, False, False])


def replace_adapter(b: MicroBatch, org: str) -> MicroBatch:
    return msgspec.structs.replace(b, adapter=org)


@pytest.mark.slow  # ~3 s on 2 cores: the real batch flow on the local broker
def test_the_batch_flow_sends_a_wanted_orgs_batches_to_its_adapter_topic_after_its_threshold(
    broker, topic_prefix, ch_dsn, ch_db, tmp_path
):
    """The real batch flow over TCP on the local broker: org ``a`` (wanted, threshold 6 samples) and org ``b``
    (not wanted, half its samples served by an adapter version), two kinds each, singleton groups. Adapter batches
    are on ``adapter-batches`` only, keyed ``a``, with ``adapter="a"`` and only a's samples, none before a's
    threshold; every a sample is trained by the shared policy too (shared_traffic served, the default: the
    adapter batches' copies under derived ids, one policy served each here), b's batches are as before but split
    per serving policy."""
    from bytewax.testing import run_main

    from flows.batch_flow import build_flow, summary
    from flows.counts import FlowCounts
    from rtrl.kafka import read_topic
    from schemas.codec import JsonCodec, decode_batch
    from schemas.records import Reward, Rollout
    from tests.test_batch_flow import _produce
    from tests.test_batching import rw

    rollouts, rewards = [], []
    for org in ("a", "b"):
        for i in range(12):
            tid, kind = f"{org}-{i}", ("bugfix", "test")[i % 2]
            r = ro(tid, group=f"g{tid}", org=org, kind=kind, at=1000 + i)
            # b, not wanted, was served by an adapter version (dropped from adapters.orgs since) every other time
            # in each cohort: each of its micro-batches holds one sample of each policy
            rollouts.append(msgspec.structs.replace(r, adapter_version=1) if org == "b" and i % 4 < 2 else r)
            rewards.append(rw(tid, float(i % 3), at=1100 + i, org=org, kind=kind))
    rc, wc = JsonCodec(Rollout), JsonCodec(Reward)
    _produce(broker.bootstrap, topic_prefix + "rollouts", [(r.trajectory_id.encode(), rc.encode(r)) for r in rollouts])
    _produce(broker.bootstrap, topic_prefix + "rewards", [(r.trajectory_id.encode(), wc.encode(r)) for r in rewards])
    env = {
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        "RTRL_CLICKHOUSE__DSN": ch_dsn,
        "RTRL_CLICKHOUSE__DATABASE": ch_db,
        "RTRL_BATCHING__TAIL": "false",
        "RTRL_BATCHING__SEQ_LEN": "10",  # two 5-token samples per row
        "RTRL_BATCHING__ROWS": "1",
        "RTRL_ADAPTERS__ORGS": "a",
        "RTRL_ADAPTERS__MIN_SAMPLES": "6",
        "RTRL_DATA_DIR": str(tmp_path),
    }
    from prometheus_client import REGISTRY

    def metric(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = {k: metric(k) for k in ("rtrl_batches_total",)} | {"read": metric("rtrl_events_total", flow="batches")}
    lag0 = metric("rtrl_batch_samples_total", lag="0")
    counts = FlowCounts()
    run_main(build_flow(load_settings(env=env), counts=counts))
    # its metrics moved as the summary's counters did: inputs read, micro-batches sent, samples by policy lag
    c = counts.snapshot()
    assert metric("rtrl_events_total", flow="batches") - before["read"] == len(rollouts) + len(rewards)
    assert metric("rtrl_batches_total") - before["rtrl_batches_total"] == c["batches"] > 0
    assert metric("rtrl_batch_samples_total", lag="0") - lag0 == c["sent"]  # ro(): policy version 1, serving 1

    adapter_msgs = list(read_topic(broker.bootstrap, topic_prefix + "adapter-batches"))
    shared = [decode_batch(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "batches")]
    adapted = [decode_batch(m.value()) for m in adapter_msgs]
    assert adapted and {m.key() for m in adapter_msgs} == {b"a"}
    assert f"; {len(adapted)} batches to org adapters)" in summary(counts)
    assert all(b.adapter == "a" and all(s.startswith("a-") for s in b.sample_ids) for b in adapted)
    assert all(b.adapter == "" for b in shared)
    on_adapter = [s for b in adapted for s in b.sample_ids]
    a_shared = [s for b in shared for s in b.sample_ids if s.startswith("a-")]
    b_shared = [s for b in shared for s in b.sample_ids if s.startswith("b-")]
    assert sorted(b_shared) == sorted(f"b-{i}" for i in range(12))  # not wanted: shared only, once
    # one serving policy per shared batch (an unwanted org's mixed batches split too): b's a1 ones name it
    assert all(len(set(b.adapter_versions or [0])) == 1 for b in shared)
    b_served = {s for b in shared if b.adapter_versions for s in b.sample_ids}
    assert b_served == {f"b-{i}" for i in range(12) if i % 4 < 2}
    assert all(b.served_org == "b" for b in shared if b.adapter_versions and b.sample_ids[0].startswith("b-"))
    assert sorted(a_shared) == sorted(f"a-{i}" for i in range(12))  # all traffic trains the shared policy
    assert len(set(on_adapter)) == len(on_adapter) and 0 < len(on_adapter) <= 12 - 6
    # before the threshold a's batches went to the shared stream as they were; after it, as copies
    copies = {shared_copy_id(b.batch_id) for b in adapted}
    assert copies <= {b.batch_id for b in shared}
    before = [s for b in shared if b.batch_id not in copies for s in b.sample_ids if s.startswith("a-")]
    assert sorted(before + on_adapter) == sorted(f"a-{i}" for i in range(12)) and len(before) >= 6


@pytest.mark.slow  # ~10 s on 2 cores: a policy model and its completions server
def test_the_loops_policy_server_asks_specialised_orgs_tasks_under_their_convention(broker, topic_prefix, monkeypatch):
    """loop.specialised_orgs reaches the policy server (app.serving.policy_server): the tasks it serves carry their
    org's required tool on the org's convention kinds and none elsewhere; the prompts do not show it."""
    import simulator.serve as serve
    from app.serving import loop_model_config, policy_server
    from client.sdk import RtrlClient
    from tests.test_policy_server import _announce, _refresh
    from trainer.model import init_parallel

    settings = load_settings(
        env={"RTRL_KAFKA__TOPIC_PREFIX": topic_prefix, "RTRL_LOOP__SPECIALISED_ORGS": "2", "RTRL_LOOP__RATE": "1"}
    )
    init_parallel(loop_model_config(settings)[0])
    asked: list[Task] = []
    real_outcome = serve.outcome
    monkeypatch.setattr(serve, "outcome", lambda task, completion: asked.append(task) or real_outcome(task, completion))
    with RtrlClient.from_settings(settings, bootstrap=broker.bootstrap) as client:
        server = policy_server(settings, broker.bootstrap, client, seed=2)
        try:
            assert server.conventions == CONVENTIONS
            _announce(broker.bootstrap, topic_prefix + "deployments", 0, "promoted")
            assert _refresh(server, lambda model, path: None) == 0
            server.serve(60, group_size=1)
        finally:
            server.close()
    assert len(asked) == 60 and {t.org_id for t in asked} == {"org-0", "org-1", "org-2"}
    for t in asked:
        c = convention_of(t.org_id, t.kind, CONVENTIONS)
        assert t.tool == (c.tool if c else None)
    assert {t.tool for t in asked} == {None, "read_file", "run_tests", "search"}


def test_the_routers_count_survives_a_restart_of_the_flow_from_its_recovery_state(tmp_path):
    """The batch flow in-process with Bytewax recovery, stopped (end of input) after org a's first 6 samples and
    resumed for its next 6: with a threshold of 6 the first run sends a's batches to the shared stream only and
    the resumed run all of them to a's adapter, because the route_adapters step resumed the count."""
    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.testing import TestingSink, TestingSource, run_main

    from flows.batch_flow import build_flow
    from flows.processor import Message
    from schemas.codec import JsonCodec, decode_batch
    from schemas.records import Reward, Rollout
    from tests.test_batching import rw

    rc, wc = JsonCodec(Rollout), JsonCodec(Reward)
    rollouts, rewards = [], []
    for i in range(12):
        if i == 6:  # the first run ends here; the second resumes after it
            rollouts.append(TestingSource.EOF())
            rewards.append(TestingSource.EOF())
        tid = f"a-{i}"
        rollouts.append(Message(tid.encode(), rc.encode(ro(tid, group=f"g{tid}", org="a", at=1000 + i)), 0, i))
        rewards.append(Message(tid.encode(), wc.encode(rw(tid, float(i % 3), at=1100 + i, org="a")), 0, i))
    env = {
        "RTRL_BATCHING__SEQ_LEN": "10",
        "RTRL_BATCHING__ROWS": "1",
        "RTRL_ADAPTERS__ORGS": "a",
        "RTRL_ADAPTERS__MIN_SAMPLES": "6",
        "RTRL_DATA_DIR": str(tmp_path),
    }
    settings = load_settings(env=env)
    (tmp_path / "recovery").mkdir()
    init_db_dir(tmp_path / "recovery", 1)
    runs = []
    for _ in range(2):
        kafka: list = []
        flow = build_flow(
            settings,
            sources={"rollouts": TestingSource(rollouts), "rewards": TestingSource(rewards)},
            sinks={"kafka": TestingSink(kafka), "clickhouse": TestingSink([])},
        )
        run_main(flow, recovery_config=RecoveryConfig(str(tmp_path / "recovery")))
        runs.append([(topic, decode_batch(value)) for _, batch in kafka for topic, _, value in batch])
    first, second = runs
    assert sorted(s for _, b in first for s in b.sample_ids) == [f"a-{i}" for i in range(6)]
    assert all(topic == settings.topic("batches") and not b.adapter for topic, b in first)
    assert {s for _, b in second for s in b.sample_ids} == {f"a-{i}" for i in range(6, 12)}  # resumed, not replayed
    adapted = [b for topic, b in second if topic == settings.topic("adapter-batches")]
    assert all(b.adapter == "a" for b in adapted)
    copies = sorted(b.batch_id for topic, b in second if topic == settings.topic("batches"))
    assert copies == sorted(shared_copy_id(b.batch_id) for b in adapted)  # served (one policy served each): copies only
    assert sorted(s for b in adapted for s in b.sample_ids) == sorted(f"a-{i}" for i in range(6, 12))


#: what the main job recorded of its per-org adapters (tests/test_analyst_queries.py's per-org test reads its run
#: with it): adapter decisions, train steps with their sample ids, each trajectory's org
ADAPTER_DUMP = """
import json, sys
from rtrl import clickhouse

ch = clickhouse.connect(sys.argv[1])
cks = ch.query("SELECT org, version, parent, base_version, status, reason, path, eval_results "
               "FROM rtrl.adapter_checkpoints FINAL ORDER BY org, version").result_rows
steps = ch.query("SELECT adapter, run_id, sample_ids FROM rtrl.train_metrics FINAL").result_rows
orgs = dict(ch.query("SELECT trajectory_id, org_id FROM rtrl.trajectories FINAL").result_rows)
shared = ch.query("SELECT count() FROM rtrl.checkpoints FINAL WHERE org != ''").result_rows[0][0]
print(json.dumps({"checkpoints": [[o, v, p, b, s, r, path, dict(e)] for o, v, p, b, s, r, path, e in cks],
                  "steps": [[a, run, list(ids)] for a, run, ids in steps], "orgs": orgs, "shared_with_org": shared}))
"""
