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
    from rtrl.settings import AdapterSettings

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


def test_a_rollout_records_its_serving_adapter_version_and_old_rollouts_decode_as_the_base():
    """A rollout's ``adapter_version`` (0 = the shared policy alone) round-trips through its JSON codec and its
    Arrow/ClickHouse columns; a producer's rollout from before the field (no key) decodes with 0, a negative one
    is Invalid."""
    from schemas.codec import Invalid, JsonCodec
    from schemas.types import columns, from_arrow, to_arrow

    r = msgspec.structs.replace(ro("t1", "g1", org="o0"), adapter_version=3)
    codec = JsonCodec(type(r))
    assert codec.decode(codec.encode(r)) == r and r.adapter_version == 3
    assert from_arrow(to_arrow([r], type(r)), type(r)) == [r]
    assert {c.name: c.clickhouse for c in columns(type(r))}["adapter_version"] == "Int64"
    raw = msgspec.json.decode(codec.encode(r))
    del raw["adapter_version"]
    assert codec.decode(msgspec.json.encode(raw)) == msgspec.structs.replace(r, adapter_version=0)
    with pytest.raises(Invalid, match="adapter_version"):
        codec.decode(msgspec.json.encode(raw | {"adapter_version": -1}))


def test_a_micro_batch_carries_each_samples_serving_adapter_version_to_the_trainer():
    """``pack`` puts each sample's ``Rollout.adapter_version`` in ``MicroBatch.adapter_versions`` (sample order;
    empty when every sample was served by the base alone); it survives the Arrow wire format and reaches
    ``trainer.batch.Batch`` as an int64 array (None for all 0). A wrong length is refused, and a batch from a
    producer before the field (no column) decodes as served by the base alone."""
    import numpy as np
    import pyarrow as pa

    from schemas.codec import decode_batch, encode_batch
    from trainer.batch import to_batch

    def sample(tid: str, served: int) -> Sample:
        return Sample(msgspec.structs.replace(ro(tid, "g", org="o0"), adapter_version=served), 1.0, 0, advantage=0.5)

    mixed = pack([sample("a", 2), sample("b", 0), sample("c", 3)], seq_len=16, created_at=1)
    assert mixed.adapter_versions == [2, 0, 3]
    assert decode_batch(encode_batch(mixed)) == mixed
    b = to_batch(encode_batch(mixed), 0, 0)
    assert b.adapter_versions is not None and b.adapter_versions.dtype == np.int64
    assert b.adapter_versions.tolist() == [2, 0, 3]
    base = pack([sample("a", 0), sample("b", 0)], seq_len=16, created_at=1)
    assert base.adapter_versions == [] and to_batch(encode_batch(base), 0, 0).adapter_versions is None
    assert pack([sample("a", 2), sample("b", 0)], seq_len=16, created_at=1).batch_id == base.batch_id  # same ids
    with pytest.raises(ValueError, match="adapter_versions"):
        msgspec.structs.replace(mixed, adapter_versions=[1])
    from trainer.dedup import drop_samples

    assert drop_samples(b, [True, False, True]).adapter_versions.tolist() == [2, 3]  # stays one per sample
    table = pa.ipc.open_stream(encode_batch(mixed)).read_all().drop_columns(["adapter_versions", "served_org"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    old = decode_batch(sink.getvalue().to_pybytes())
    assert old.adapter_versions == [] and old.served_org == "" and old.sample_ids == mixed.sample_ids
    assert mixed.served_org == "o0" and base.served_org == ""
    with pytest.raises(ValueError, match="served_org"):
        msgspec.structs.replace(mixed, served_org="")


def test_a_retired_orgs_next_candidate_starts_from_the_retired_weights_and_a_rollback_starts_fresh():
    """``AdapterLedger.start``: an org's next candidate trains from the adapter serving it (when valid on the
    base); after a refused re-validation retired it, from the retired version's weights (until a new promotion);
    after a rollback by hand to the base alone, from a fresh adapter. The retired version survives the ledger's
    state, and an older state without it loads."""
    from evalgate.adapters import AdapterLedger

    ledger = AdapterLedger()
    a1 = ledger.add("o0", 0, "p1")
    assert ledger.start("o0", 0) is None  # nothing promoted: fresh
    ledger.decide("o0", 1, True)
    assert ledger.start("o0", 0) is a1 and ledger.start("o0", 1) is None  # not valid on another base
    a2 = ledger.revalidate(a1, 1)
    ledger.decide("o0", a2.version, False)
    assert ledger.retire("o0") is a1 and ledger.serving("o0") is None
    assert ledger.start("o0", 1) is a1 and ledger.start("o0", 1).path == a2.path == "p1"
    again = AdapterLedger.from_state(msgspec.json.decode(msgspec.json.encode(ledger.state())))
    assert again.retired == {"o0": 1} and again.start("o0", 1).path == "p1"
    a3 = ledger.add("o0", 1, "p3", parent=a1.version)
    ledger.decide("o0", a3.version, True)
    assert ledger.retired == {} and ledger.start("o0", 1) is a3
    ledger.add("o1", 0, "q1")
    ledger.decide("o1", 1, True)
    ledger.rollback("o1")
    assert ledger.start("o1", 0) is None  # rolled back by hand: those weights are not wanted
    old = {k: v for k, v in ledger.state().items() if k != "retired"}
    assert AdapterLedger.from_state(old).retired == {}


def test_an_adapter_trains_the_samples_another_policy_served_on_the_delayed_path():
    """A sample whose serving adapter version (``Batch.adapter_versions``) holds other weights than those the
    org's candidate starts from is marked delayed, so ``trainer.train.prepare`` gives the loss its tokens as
    delayed (truncated importance weights, no clip): the base alone's samples for a candidate starting from
    trained weights, another adapter's; a re-validated version holds its parent's weights (on-policy). A fresh
    adapter is on-policy for the base alone's samples only. A sample the batch flow already marked stays marked."""
    import numpy as np

    from app.adapters import off_policy_delayed
    from evalgate.adapters import AdapterLedger
    from schemas.codec import encode_batch
    from trainer.batch import to_batch
    from trainer.train import prepare

    ledger = AdapterLedger()
    a1 = ledger.add("o0", 0, "p1")
    ledger.decide("o0", 1, True)
    a2 = ledger.revalidate(a1, 1)  # a1's weights on base 1
    ledger.decide("o0", a2.version, True)
    a3 = ledger.add("o0", 1, "p3", parent=2)  # retrained: other weights
    ledger.decide("o0", a3.version, False)
    served = [0, 1, 2, 3, 9]  # 9: a version this ledger does not know

    def make(delayed: list[bool] | None = None):
        samples = [
            Sample(msgspec.structs.replace(ro(f"t{i}", "g", org="o0"), adapter_version=a), 1.0, 0, advantage=0.5)
            for i, a in enumerate(served)
        ]
        for s, d in zip(samples, delayed or []):
            s.delayed = d
        return to_batch(encode_batch(pack(samples, seq_len=32, created_at=1)), 0, 0)

    b = make()
    from_a2 = off_policy_delayed(b, ledger, "o0", a2)
    assert from_a2.delayed.tolist() == [True, False, False, True, True]
    assert off_policy_delayed(b, ledger, "o0", None).delayed.tolist() == [False, True, True, True, True]
    assert off_policy_delayed(make([False, True]), ledger, "o0", a1).delayed.tolist() == [True, True, False, True, True]
    p = prepare(from_a2, policy_version=1, max_policy_lag=1, max_delayed_lag=4)
    seg = from_a2.segment_ids[:, 1:]
    expected = np.isin(seg, [0, 3, 4]) & (p.loss_mask.numpy() > 0)
    assert p.delayed is not None and np.array_equal(p.delayed.numpy() & (p.loss_mask.numpy() > 0), expected)
    assert expected.any() and (p.loss_mask.numpy()[np.isin(seg, [1, 2])] > 0).any()
    on = pack([Sample(ro("u", "g", org="o0"), 1.0, 0)], seq_len=32, created_at=1)
    batch_on = to_batch(encode_batch(on), 0, 0)
    assert off_policy_delayed(batch_on, ledger, "o0", None) is batch_on  # nothing to mark


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


def test_the_shared_trainer_loads_each_serving_adapter_version_and_names_the_one_that_served_a_batch(tmp_path, caplog):
    """``app.adapters.ServedThrough`` (the main job's ``served_by`` under ``shared_traffic = "served"``) loads, into
    the shared trainer's model, every adapter version that served on a base within the lag window (promoted, or
    rolled back since; a re-validated version shares its parent's weights and name), with the saved weights;
    unloads those out of the window; names the one that served a micro-batch (None: the base alone, or a version
    it does not hold); and trains a batch that several versions served through the base alone, with a warning."""
    import torch

    from app.adapters import ServedThrough
    from evalgate.adapters import AdapterLedger
    from schemas.codec import encode_batch
    from simulator.tasks import VOCAB
    from trainer import lora
    from trainer.batch import to_batch
    from trainer.config import ModelConfig
    from trainer.model import build_model, init_parallel

    cfg = ModelConfig.tiny(vocab_size=VOCAB, seq_length=64)
    init_parallel(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    saved = {}
    for i, tag in enumerate(("w1", "w3")):  # two trained adapters' weights (non-zero B)
        lora.add_adapter(model, tag, lora.LoraConfig(rank=4), seed=i)
        with torch.no_grad():
            for p in lora.adapter_parameters(model, tag):
                p.copy_(torch.randn(p.shape) * 0.1)
        saved[tag] = (str(lora.save_adapter(tmp_path / tag, model, tag, 1, "v0")), lora.adapter_state_dict(model, tag))
        lora.remove_adapter(model, tag)
    ledger = AdapterLedger()
    a1 = ledger.add("o1", 0, saved["w1"][0])
    ledger.decide("o1", 1, True)
    a2 = ledger.revalidate(a1, 1)
    ledger.decide("o1", a2.version, True)
    ledger.add("o1", 1, saved["w3"][0], parent=2)
    ledger.decide("o1", 3, False)  # rejected: never served
    served = ServedThrough(model)
    served.sync(ledger, oldest_base=0)
    w1 = ServedThrough.name(saved["w1"][0])
    assert lora.adapter_names(model) == [w1] and served.names == {("o1", 1): w1, ("o1", 2): w1}
    assert all(torch.equal(v, saved["w1"][1][k]) for k, v in lora.adapter_state_dict(model, w1).items())

    def wire(*versions: int):
        samples = [
            Sample(msgspec.structs.replace(ro(f"t{i}", "g", org="o1"), adapter_version=v), 1.0, 0)
            for i, v in enumerate(versions)
        ]
        return to_batch(encode_batch(pack(samples, 16, 1)), 0, 0)

    assert served(wire(2, 2)) == w1 and served(wire(1)) == w1 and served(wire(0, 0)) is None
    assert served(wire(3)) is None  # rejected, never loaded: the base alone (with a warning)
    with caplog.at_level("WARNING", logger="app.adapters"):
        assert served(wire(0, 2)) is None  # several versions (not split by the flow): the base alone, never a stop
    assert "several adapter versions of org 'o1' served (a0, a2;" in caplog.text
    served.sync(ledger, oldest_base=2)  # both versions' bases are out of the lag window
    assert lora.adapter_names(model) == [] and served(wire(2)) is None


def test_old_payloads_without_the_adapter_field_still_decode():
    """A micro-batch from a producer before this field (no adapter column) decodes with adapter ""; so do a
    TrainStep's JSON without the key and a batch of another era's column set (a required column still missing
    is Invalid)."""
    import pyarrow as pa

    from schemas.codec import Invalid, JsonCodec, decode_batch, encode_batch
    from schemas.records import TrainStep

    b = msgspec.structs.replace(batch("o0", 2), adapter="o0")
    assert decode_batch(encode_batch(b)) == b
    table = pa.ipc.open_stream(encode_batch(b)).read_all()

    def ipc(t: pa.Table) -> bytes:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, t.schema) as w:
            w.write_table(t)
        return sink.getvalue().to_pybytes()

    old = decode_batch(ipc(table.drop_columns(["adapter"])))
    assert old.adapter == "" and old.sample_ids == b.sample_ids
    with pytest.raises(Invalid, match="token_ids"):
        decode_batch(ipc(table.drop_columns(["token_ids"])))
    step = TrainStep(
        run_id="r",
        step=1,
        policy_version=0,
        loss=0.0,
        pg_loss=0.0,
        kl=0.0,
        clip_fraction=0.0,
        is_truncated_fraction=0.0,
        tokens=1,
        on_policy_fraction=1.0,
        lag_histogram={},
        tokens_per_s=1.0,
        batch_ids=["b"],
        at=1,
        adapter="o0",
    )
    codec = JsonCodec(TrainStep)
    raw = msgspec.json.decode(codec.encode(step))
    del raw["adapter"]
    assert codec.decode(msgspec.json.encode(raw)).adapter == "" and codec.decode(codec.encode(step)) == step


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


def test_an_adapter_runs_learning_rate_and_kl_weight_come_from_the_adapters_section():
    """adapters.lr, adapters.kl_coef and adapters.kl_estimator set an adapter run's learning rate, KL weight and
    KL estimator (to the base alone); 0 (or '') = train.lr, loss.kl_coef and loss.kl_estimator; the shared
    policy's run never takes them."""
    from trainer.config import TrainConfig

    s = load_settings(env={"RTRL_ADAPTERS__LR": "0.002", "RTRL_ADAPTERS__KL_COEF": "0.2", "RTRL_LOSS__KL_COEF": "0.03"})
    adapter, shared = TrainConfig.from_settings(s, adapter="org-1"), TrainConfig.from_settings(s)
    assert (adapter.lr, adapter.loss.kl_coef) == (0.002, 0.2)
    assert (shared.lr, shared.loss.kl_coef) == (s.train.lr, 0.03)
    assert (adapter.loss.kl_estimator, shared.loss.kl_estimator) == ("full", "k3")  # the defaults
    plain = TrainConfig.from_settings(load_settings(env={"RTRL_ADAPTERS__KL_COEF": "0"}), adapter="org-1")
    assert (plain.lr, plain.loss.kl_coef) == (load_settings(env={}).train.lr, load_settings(env={}).loss.kl_coef)
    k3 = load_settings(env={"RTRL_ADAPTERS__KL_ESTIMATOR": "", "RTRL_LOSS__KL_ESTIMATOR": "full"})
    assert TrainConfig.from_settings(k3, adapter="org-1").loss.kl_estimator == "full"  # '' = loss.kl_estimator
    k3 = load_settings(env={"RTRL_ADAPTERS__KL_ESTIMATOR": "k3"})
    assert TrainConfig.from_settings(k3, adapter="org-1").loss.kl_estimator == "k3"
    with pytest.raises(ConfigError, match="adapters.kl_estimator"):
        load_settings(env={"RTRL_ADAPTERS__KL_ESTIMATOR": "exact"})
    with pytest.raises(ConfigError, match="adapters.kl_coef"):
        load_settings(env={"RTRL_ADAPTERS__KL_COEF": "-1"})


def test_an_adapter_trains_on_its_orgs_batches_only_and_the_base_stays_frozen(tmp_path):
    """The trainer's adapter mode (``TrainConfig.adapter``) reads the adapter stream, which holds several orgs'
    batches, and trains one org's adapter on that org's batches only: the sample ids in its train_metrics rows are
    exactly that org's, the base and the other org's adapter are unchanged bit for bit, and its checkpoints are
    adapter checkpoints a second run resumes from. The shared run trains the shared batches only."""
    import torch

    from schemas.codec import encode_batch
    from simulator.tasks import VOCAB
    from trainer import lora
    from trainer.batch import to_batch
    from trainer.config import ModelConfig, TrainConfig
    from trainer.factory import Policy
    from trainer.model import build_model, init_parallel
    from trainer.train import MemorySource, train

    routers = {o: OrgRouter(o, 0) for o in ("o1", "o2")}
    routed: list[MicroBatch] = []
    for k in range(3):
        for org in ("o0", "o1", "o2"):
            b = batch(org, 4, first=4 * k)
            routed += routers[org].route(b) if org in routers else [b]
    wire = [to_batch(encode_batch(mb), 0, i) for i, mb in enumerate(routed)]
    assert {b.adapter for b in wire} == {"", "o1", "o2"}
    cfg = ModelConfig.tiny(vocab_size=VOCAB, seq_length=64)
    init_parallel(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    for org in ("o1", "o2"):
        lora.add_adapter(model, org, lora.LoraConfig(rank=4))
    base = {k: v.clone() for k, v in model.state_dict().items() if v is not None}  # (megatron keeps None extra states)
    o2 = lora.adapter_state_dict(model, "o2")
    o1 = lora.adapter_state_dict(model, "o1")
    tc = TrainConfig(
        adapter="o1",
        adapter_base="v1",
        micro_batches_per_step=1,
        max_steps=2,
        idle_timeout_s=0.01,
        checkpoint_dir=str(tmp_path / "o1"),
        checkpoint_every=1,
        lr=1e-2,
    )
    steps = train(Policy(model, None, version=1), lambda _: MemorySource(wire), tc)
    steps += train(Policy(model, None, version=1), lambda off: MemorySource(wire, off), replace(tc, max_steps=10))
    assert [st.step for st in steps] == [1, 2, 3] and {st.adapter for st in steps} == {"o1"}
    assert {s for st in steps for s in st.sample_ids} == {f"o1-{i}" for i in range(12)}
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items() if v is not None)
    assert all(torch.equal(v, o2[k]) for k, v in lora.adapter_state_dict(model, "o2").items())
    assert any(not torch.equal(v, o1[k]) for k, v in lora.adapter_state_dict(model, "o1").items())
    assert lora.active_adapter(model) is None  # train() leaves no adapter active
    assert lora.read_adapter_checkpoint(lora.latest_adapter(tmp_path / "o1"))["base"] == "v1"
    # the shared policy: the shared stream only (every org's samples, one policy served each), adapter ""
    shared, reference = build_model(cfg), build_model(cfg)
    tc = TrainConfig(micro_batches_per_step=1, max_steps=100, idle_timeout_s=0.01)
    steps = train(Policy(shared, reference, version=1), lambda _: MemorySource(wire), replace(tc, resume=False))
    assert {st.adapter for st in steps} == {""} and len(steps) == 9
    ids = [s for st in steps for s in st.sample_ids]
    assert sorted(ids) == sorted(f"{o}-{i}" for o in ("o0", "o1", "o2") for i in range(12))


def test_updates_per_step_reuse_a_step_and_the_base_can_train_through_the_serving_adapter(tmp_path):
    """``train.updates_per_step`` (``adapters.updates_per_step`` for adapter runs, 4 by default) takes several
    optimizer updates on each step's micro-batches: the step's figures are its first update's (what one update
    gives), its samples are recorded once, and the weights move on. ``Hooks.served_by`` trains the shared
    policy on a micro-batch through the adapter that served it, frozen: the base then ends exactly where a run
    with that adapter active throughout ends, not where the base alone would, and the adapter is unchanged."""
    import torch

    from schemas.codec import encode_batch
    from simulator.tasks import VOCAB
    from trainer import lora
    from trainer.batch import to_batch
    from trainer.config import ModelConfig, TrainConfig
    from trainer.factory import Policy
    from trainer.model import build_model, init_parallel
    from trainer.train import Hooks, MemorySource, train

    s = load_settings(env={"RTRL_TRAIN__UPDATES_PER_STEP": "2"})
    assert TrainConfig.from_settings(s).updates_per_step == 2
    assert TrainConfig.from_settings(s, adapter="o1").updates_per_step == 4  # adapters.updates_per_step's default
    s = load_settings(env={"RTRL_TRAIN__UPDATES_PER_STEP": "2", "RTRL_ADAPTERS__UPDATES_PER_STEP": "0"})
    assert TrainConfig.from_settings(s, adapter="o1").updates_per_step == 2  # 0 = train.updates_per_step
    with pytest.raises(ConfigError, match="train.updates_per_step"):
        load_settings(env={"RTRL_TRAIN__UPDATES_PER_STEP": "0"})

    wire = [to_batch(encode_batch(batch("o1", 4, first=4 * k)), 0, k) for k in range(2)]
    cfg = ModelConfig.tiny(vocab_size=VOCAB, seq_length=64)
    init_parallel(cfg)

    def fresh() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(0)
        model, reference = build_model(cfg), build_model(cfg)
        lora.add_adapter(model, "o1", lora.LoraConfig(rank=4), seed=1)
        state = lora.adapter_state_dict(model, "o1")
        g = torch.Generator().manual_seed(2)
        lora.load_adapter_state_dict(
            model,
            "o1",
            {k: 0.2 * torch.randn(v.shape, generator=g) if k.endswith("B") else v for k, v in state.items()},
        )
        for p in lora.adapter_parameters(model, "o1"):
            p.requires_grad_(False)
        return model, reference

    def base(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in model.state_dict().items() if v is not None}

    tc = TrainConfig(micro_batches_per_step=1, max_steps=10, idle_timeout_s=0.01, lr=1e-2)
    start, _ = fresh()
    runs = {}
    for k in (1, 3):
        model, reference = fresh()
        steps = train(
            Policy(model, reference, version=1),
            lambda _: MemorySource(wire),
            replace(replace(tc, updates_per_step=k), resume=False),
        )
        runs[k] = (steps, base(model))
    (one, w1), (three, w3) = runs[1], runs[3]
    assert len(one) == len(three) == 2 and [s.sample_ids for s in one] == [s.sample_ids for s in three]
    assert one[0].loss == three[0].loss and one[0].kl == three[0].kl  # the first update: the same weights
    moved = {k: (w1[k] - base(start)[k]).norm() for k in w1}, {k: (w3[k] - base(start)[k]).norm() for k in w3}
    assert sum(moved[1].values()) > sum(moved[0].values())  # three updates a step move the weights further

    adapter0 = lora.adapter_state_dict(start, "o1")
    through, reference = fresh()
    via = train(
        Policy(through, reference, version=1),
        lambda _: MemorySource(wire),
        replace(tc, resume=False),
        Hooks(served_by=lambda b: "o1"),
    )
    # train_metrics says so: every trained token of these steps went through the serving adapter, none without it
    assert [s.served_through_tokens for s in via] == [s.tokens for s in via] and all(s.tokens for s in via)
    assert all(s.served_through_tokens == 0 for s in one)
    active, reference = fresh()
    with lora.activate(active, "o1"):
        train(Policy(active, reference, version=1), lambda _: MemorySource(wire), replace(tc, resume=False))
    alone, reference = fresh()
    train(Policy(alone, reference, version=1), lambda _: MemorySource(wire), replace(tc, resume=False))
    assert lora.active_adapter(through) is None  # train() leaves no adapter active
    assert all(torch.equal(v, base(active)[k]) for k, v in base(through).items())
    assert any(not torch.equal(v, base(alone)[k]) for k, v in base(through).items())
    assert all(torch.equal(v, adapter0[k]) for k, v in lora.adapter_state_dict(through, "o1").items())
    # None from served_by: the base alone, whatever adapter the caller left active
    none, reference = fresh()
    with lora.activate(none, "o1"):
        plain = train(
            Policy(none, reference, version=1),
            lambda _: MemorySource(wire),
            replace(tc, resume=False),
            Hooks(served_by=lambda b: None),
        )
    assert all(torch.equal(v, base(alone)[k]) for k, v in base(none).items())
    assert all(s.served_through_tokens == 0 for s in plain)
    with pytest.raises(ValueError, match="shared policy"):
        train(
            Policy(through, None, version=1),
            lambda _: MemorySource(wire),
            replace(tc, adapter="o1"),
            Hooks(served_by=lambda b: "o1"),
        )
    # with checkpoints (the trainer as a process of its own): the serving adapters on the model are not the
    # base's, so neither its optimizer nor its checkpoints hold them, and a resumed run goes on from the checkpoint
    saved, reference = fresh()
    ck = replace(tc, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1, max_steps=1)
    first = train(
        Policy(saved, reference, version=1), lambda _: MemorySource(wire), ck, Hooks(served_by=lambda b: "o1")
    )
    resumed, reference = fresh()
    more = train(
        Policy(resumed, reference, version=1),
        lambda _: MemorySource(wire),
        replace(ck, max_steps=2),
        Hooks(served_by=lambda b: "o1"),
    )
    assert [s.step for s in first] == [1] and [s.step for s in more] == [2]
    assert [s.sample_ids for s in first + more] == [s.sample_ids for s in one]  # each batch once, in order
    assert all(torch.equal(v, base(through)[k]) for k, v in base(resumed).items())  # as the uninterrupted run


def test_an_org_the_base_alone_served_trains_its_kept_adapter_weights_on_the_delayed_path():
    """The experiment's adapters arm keeps a retired org's last promoted weights for its next candidate, while the
    base alone serves the org: its samples then come from another policy than the adapter that trains on them. Such
    batches are marked delayed (truncated importance weights, no PPO clip: the clip would drop every
    negative-advantage token the adapter already made rarer, the base's habit on the org's convention tasks, and
    the adapter would drift back to the base). An org its adapter serves, or whose adapter never trained, stays on
    the PPO path; the shared copies never change."""
    import torch

    from app.per_org import Experiment, _Adapters, _settings, arm_settings
    from app.serving import loop_model_config
    from trainer.model import build_model, init_parallel

    exp = Experiment(eval_tasks=8, repeats=1)
    s = arm_settings(_settings(None), exp)
    cfg = loop_model_config(s)[0]
    init_parallel(cfg)
    torch.manual_seed(0)
    ad = _Adapters(build_model(cfg), s, exp, exp.conventions)
    org = ad.orgs[0]
    ad.routers = {o: OrgRouter(o, 0) for o in ad.orgs}  # adapted from the first sample
    first = iter(range(0, 1000, 4))

    def routed() -> tuple[list[MicroBatch], list[MicroBatch]]:
        shared, streams = ad.route([(org, batch(org, 4, first=next(first))), ("org-0", batch("org-0", 4, first=0))])
        return shared, streams[org]

    def delayed(bs: list[MicroBatch]) -> list[list[bool]]:
        return [list(b.delayed) for b in bs]

    shared, mine = routed()  # no adapter trained yet: the base alone served, and the adapter is the base
    assert delayed(mine) == [[]] and delayed(shared) == [[], []]
    v = ad.ledger.add(org, 1, "memory:test", None)
    ad.ledger.decide(org, v.version, True)
    ad.weights[org] = 1
    shared, mine = routed()  # its adapter served the org: on-policy for the adapter
    assert ad.serving(org) is not None and delayed(mine) == [[]] and delayed(shared) == [[], []]
    ad.ledger.retire(org)
    shared, mine = routed()  # retired: the base alone served, the adapter trains on from its promoted weights
    assert ad.serving(org) is None and delayed(mine) == [[True] * 4] and delayed(shared) == [[], []]
    assert mine[0].adapter == org and mine[0].sample_ids == shared[0].sample_ids


def _b_norm(state: dict) -> float:
    return float(sum(v.pow(2).sum() for k, v in state.items() if k.endswith("lora_B")) ** 0.5)


def test_the_experiment_rescales_a_refused_revalidation_before_it_retires_the_adapter():
    """The experiment's re-validation on a new base (as the main job's): a serving adapter the gate refuses is
    judged again at each of ``adapters.revalidate_scales`` of its effect (its lora_B times the factor); the first
    that passes serves as a new ledger version ("rescaled"), in the serving slot and as the org's next candidate's
    start. When none passes the org is retired and its slot keeps the weights it served with. (The gate stands in
    here as a rule on the judged adapter's lora_B norm: what is checked is which weights are judged and kept.)"""
    import torch

    from app.per_org import Experiment, _Adapters, _serving_slot, _settings, arm_settings
    from app.serving import loop_model_config
    from evalgate.gate import Decision
    from tests.test_adapters import randomize_b
    from trainer import lora
    from trainer.model import build_model, init_parallel

    exp = Experiment(eval_tasks=8, repeats=1, revalidate_scales=(0.5, 0.25))
    s = arm_settings(_settings(None), exp)
    assert s.adapters.revalidate_scales == [0.5, 0.25]
    cfg = loop_model_config(s)[0]
    init_parallel(cfg)
    torch.manual_seed(0)
    ad = _Adapters(build_model(cfg), s, exp, exp.conventions)
    org, slot = ad.orgs[0], _serving_slot(ad.orgs[0])
    randomize_b(ad.model, slot, seed=3)
    trained = lora.adapter_state_dict(ad.model, slot)
    lora.load_adapter_state_dict(ad.model, org, trained)
    v = ad.ledger.add(org, 1, "memory:test")
    ad.ledger.decide(org, v.version, True)
    ad.weights[org] = 1
    limit = {"norm": 0.6 * _b_norm(trained)}
    judged: list[float] = []

    def decide(org_: str, candidate: str, serving: str, version: int, training: list) -> Decision:
        n = _b_norm(lora.adapter_state_dict(ad.model, slot))
        judged.append(round(n / _b_norm(trained), 4))
        return Decision(n <= limit["norm"], f"norm {n:.3f}")

    ad.decide = decide  # type: ignore[method-assign]
    said = ad.revalidate(2)[org]
    assert judged == [1.0, 0.5] and len(said) == 2, said
    assert (
        said[0].startswith("v2 refused at re-validation on base v2")
        and said[1] == "v1 -> v3 rescaled to 0.5 on base v2"
    )
    now = ad.ledger.serving(org)
    assert now is not None and (now.version, now.base_version, now.parent) == (3, 2, 1)  # each try: a1's child
    half = {k: v * 0.5 if k.endswith("lora_B") else v for k, v in trained.items()}
    for name in (slot, org):  # served, and where the next candidate trains on from
        assert all(torch.equal(t, half[k]) for k, t in lora.adapter_state_dict(ad.model, name).items())
    assert ad.serving(org) == slot

    limit["norm"] = 0.1 * _b_norm(trained)  # the next base: no fraction passes
    judged.clear()
    said = ad.revalidate(3)[org]
    assert judged == [0.5, 0.25, 0.125] and said[-1] == "v3 retired on base v3", said
    assert [x.split(" (")[0] for x in said[:-1]] == [
        "v4 refused at re-validation on base v3",
        "v5 refused at re-validation at 0.5 times its effect on base v3",
        "v6 refused at re-validation at 0.25 times its effect on base v3",
    ]
    assert ad.ledger.serving(org) is None and ad.ledger.retired[org] == 3 and ad.serving(org) is None
    assert all(torch.equal(t, half[k]) for k, t in lora.adapter_state_dict(ad.model, slot).items())


def test_the_main_job_rescales_a_refused_revalidation_saves_it_and_announces_every_try(tmp_path):
    """``OrgAdapters.revalidate`` (the main job): a serving adapter refused on the new base is judged again at each
    of ``adapters.revalidate_scales`` of its effect; each try is a version announced with its decision (candidate,
    then rejected or promoted, with ``org``, version and ``base_version``). The passing one is saved with the
    scaled weights (loadable, its path its own), becomes what serves the org and the weights its next candidate
    starts from; the samples its unscaled parent served are then another policy's (the delayed path). When none
    passes, the org is retired and the serving version announced rolled back; a restart after a kill mid-way goes
    on with the next fraction. (The gate stands in as a rule on the judged adapter's lora_B norm.)"""
    import torch

    from app.adapters import OrgAdapters
    from app.loop import loop_gate_rules
    from app.loop_config import loop_settings
    from app.serving import loop_model_config
    from evalgate.adapters import AdapterLedger
    from evalgate.gate import Decision
    from rtrl.settings import load_settings
    from simulator.tasks import conventions_for
    from tests.test_adapters import randomize_b
    from trainer import lora

    s = loop_settings(
        load_settings(
            env={
                "RTRL_ADAPTERS__ORGS": "org-2",
                "RTRL_ADAPTERS__REVALIDATE_SCALES": "0.5,0.25",
                "RTRL_LOOP__EVAL_TASKS": "8",
                "RTRL_DATA_DIR": str(tmp_path),
            }
        )
    )
    cfg, precision = loop_model_config(s)
    announced = []
    ad = OrgAdapters(
        s, "", None, cfg, precision, tmp_path / "adapters", conventions_for(4, 2), loop_gate_rules(s),
        announced.append, lambda cks: None, lambda st: None,
    )  # fmt: skip
    ad.base_version = 1
    lora.add_adapter(ad.model, "org-2", ad.lora, seed=0)
    randomize_b(ad.model, "org-2", seed=3)
    trained = lora.adapter_state_dict(ad.model, "org-2")
    path = lora.save_adapter(tmp_path / "adapters" / "org-2" / "a1", ad.model, "org-2", 1, "v1")
    v1 = ad.ledger.add("org-2", 1, str(path))
    ad.ledger.decide("org-2", v1.version, True)
    limit = {"norm": 0.6 * _b_norm(trained)}

    def judge(org: str, name: str, serving: dict, training: list) -> tuple[dict, Decision]:
        n = _b_norm(lora.adapter_state_dict(ad.model, name))
        return {"solve_rate": n}, Decision(n <= limit["norm"], f"norm {n:.3f}")

    ad._judge = judge  # type: ignore[method-assign]
    ad.base_version = 2
    out = ad.revalidate()
    assert [(d.version, d.status) for d in out] == [(2, "rejected"), (3, "promoted")], out
    assert all(d.revalidation and d.org == "org-2" and d.base_version == 2 for d in out)
    assert "next: 0.5 times its effect" in out[0].reason and "at 0.5 times a1's effect" in out[1].reason
    a3 = ad.ledger.serving("org-2")
    assert a3 is not None and a3.version == 3 and a3.parent == 1 and a3.path != v1.path
    lora.load_adapter(a3.path, ad.model, "check", restore_rng=False)  # saved with the scaled weights
    half = {k: v * 0.5 if k.endswith("lora_B") else v for k, v in trained.items()}
    assert all(torch.equal(t, half[k]) for k, t in lora.adapter_state_dict(ad.model, "check").items())
    assert ad.ledger.start("org-2", 2) is a3
    assert not ad.ledger.same_weights("org-2", 1, a3) and ad.ledger.same_weights("org-2", 3, a3)
    by_version = {}
    for ck in announced:
        by_version.setdefault(ck.version, []).append(ck.status)
        assert ck.org == "org-2" and ck.base_version == 2
    assert by_version == {2: ["candidate", "rejected"], 3: ["candidate", "promoted"]}

    # the next base: no fraction passes; a kill after the first try, and a restart from the saved ledger, go on
    # with the next fraction (the first try is not judged again)
    announced.clear()
    limit["norm"] = 0.1 * _b_norm(trained)
    ad.base_version = 3
    judged: list[float] = []

    class Killed(Exception):
        pass

    def judge_then_die(org: str, name: str, serving: dict, training: list) -> tuple[dict, Decision]:
        judged.append(round(_b_norm(lora.adapter_state_dict(ad.model, name)) / _b_norm(trained), 4))
        if len(judged) == 2:
            raise Killed
        return judge(org, name, serving, training)

    ad._judge = judge_then_die  # type: ignore[method-assign]
    with pytest.raises(Killed):
        ad.revalidate()
    ad.ledger = AdapterLedger.from_state(msgspec.json.decode(msgspec.json.encode(ad.ledger.state())))
    ad._judge = judge  # type: ignore[method-assign]
    out = ad.revalidate()
    assert judged == [0.5, 0.25]  # before the kill: a3 as it was, then half of it (not recorded)
    assert [(d.version, d.status) for d in out] == [(5, "rejected"), (6, "rejected")], out
    assert "at 0.25 times a3's effect" in out[-1].reason
    assert ad.ledger.serving("org-2") is None and ad.ledger.retired == {"org-2": 3}
    assert [(ck.version, ck.status) for ck in announced if ck.status == "rolled_back"] == [(3, "rolled_back")]
    assert [ck.version for ck in announced if ck.status == "rejected"] == [4, 5, 6]


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
