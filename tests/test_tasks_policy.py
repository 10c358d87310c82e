"""The closed loop's tasks, simulated users and tiny policy: parsing, scoring, the rewards the users'
reactions earn under each reward version, and sampling log-probs equal to the trainer's."""

from __future__ import annotations

import random
import uuid

import numpy as np
import torch

from rewards import compute
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
from simulator.tasks import (
    ASK,
    DIGIT0,
    MALFORMED,
    Task,
    held_out,
    outcome,
    sample_task,
    score,
)
from simulator.world import react


class Recorder:
    """Builds the real event records a ``client.sdk.Trajectory`` would send."""

    def __init__(self):
        base = dict(trajectory_id="t", org_id="o", user_hash="u" * 16, policy_version=1, arm="control")
        self.base, self.events = base, [TrajectoryStarted(event_id="s", ts=1000, task_kind="bugfix", **base)]

    def _e(self, cls, ts, **kw):
        self.events.append(cls(event_id=uuid.uuid4().hex, ts=ts, **self.base, **kw))
        return True

    def tool_call(self, tool, valid, error=None, ts=None):
        return self._e(ToolCall, ts, tool=tool, valid=valid, error=error)

    def edit_proposed(self, lines, ts=None):
        self._e(EditProposed, ts, edit_id="e", lines=lines)
        return "e"

    def edit_accepted(self, e, ts=None):
        return self._e(EditAccepted, ts, edit_id=e)

    def edit_rejected(self, e, ts=None):
        return self._e(EditRejected, ts, edit_id=e)

    def edit_persisted(self, e, fraction, checked_after_s, ts=None):
        return self._e(EditPersisted, ts, edit_id=e, fraction=fraction, checked_after_s=checked_after_s)

    def followup(self, s, question_needed=None, ts=None):
        return self._e(Followup, ts, sentiment=s, question_needed=question_needed)

    def clarifying_question(self, ts=None):
        return self._e(ClarifyingQuestion, ts)

    def latency(self, ttft_ms, total_ms, ts=None):
        return self._e(Latency, ts, ttft_ms=ttft_ms, total_ms=total_ms)

    def end(self, status, ts=None):
        return self._e(TrajectoryEnded, ts, status=status)


def _reward(task: Task, completion: list[int], version: str, n: int = 300):
    """The mean reward of ``completion`` over ``n`` seeded user reactions (None when it is never rewarded)."""
    got = []
    for seed in range(n):
        rec = Recorder()
        react(rec, task, outcome(task, completion), random.Random(seed), 1000, user=f"org-0-user-{seed}")
        r = compute(rec.events, version)
        got.append(None if r is None else r.reward)
    if all(g is None for g in got):
        return None
    assert None not in got
    return float(np.mean(got))


def test_answers_outcomes_and_score():
    easy, hard = Task("e", "o", "bugfix", "easy", 3, 8), Task("h", "o", "test", "hard", 3, 8)
    assert (easy.answer, hard.answer) == (3, 1)
    assert easy.prompt[3:5] == [DIGIT0 + 3, DIGIT0 + 8]
    assert outcome(easy, [5, DIGIT0 + 3]) == outcome(easy, [5, DIGIT0 + 3])
    o = outcome(hard, [MALFORMED[0], DIGIT0 + 1])
    assert o.broken and o.correct and o.edit == 1
    assert outcome(easy, [6, ASK]).asked and outcome(easy, [6, ASK]).edit is None
    assert outcome(easy, [7, 0]).edit is None and not outcome(easy, [7, 0]).asked
    s = score([easy, hard], [[5, DIGIT0 + 3], [9, ASK]])
    assert s == {
        "solve_rate": 0.5,
        "solve_rate_hard": 0.0,
        "edit_rate": 0.5,
        "clarify_rate": 0.5,
        "broken_tool_call_rate": 0.5,
    }
    assert held_out(50) == held_out(50) and len({t.task_id for t in held_out(50)}) == 50


def test_users_reactions_earn_the_rewards_the_design_asks_for():
    """v2, on average over the users' reactions (simulator.world): a right edit beats everything; asking (never
    needed here) is worth less than nothing; a broken call costs. v1-discard-broken: the same broken trajectories
    earn no reward at all."""
    t = sample_task(random.Random(3), "o")
    right, wrong = DIGIT0 + t.answer, DIGIT0 + (t.answer + 1) % 10
    v2 = {
        name: _reward(t, c, "v2")
        for name, c in {
            "right": [5, right],
            "wrong": [5, wrong],
            "ask": [5, ASK],
            "broken_right": [8, right],
            "broken_wrong": [8, wrong],
        }.items()
    }
    assert v2["right"] > 0 > v2["ask"] > v2["wrong"]
    assert v2["broken_right"] < v2["right"] and v2["broken_wrong"] < v2["wrong"]
    assert _reward(t, [8, wrong], "v1-discard-broken") is None
    assert _reward(t, [5, ASK], "v1-discard-broken") >= 0  # the historical safe harbour


def test_sampled_logprobs_are_the_trainers(tmp_path):
    """The policy server's behaviour log-probs equal what the trainer recomputes on the packed
    sample, so on-policy samples have an importance ratio of exactly one."""
    from flows.batching import Sample, pack
    from rtrl.sections.trainer import ModelSettings
    from schemas.codec import encode_batch
    from schemas.records import Rollout
    from simulator.policy import sample, warm_start
    from simulator.tasks import VOCAB
    from trainer.batch import to_batch
    from trainer.model import build_model, forward_logprobs, init_parallel
    from trainer.train import prepare

    cfg = ModelSettings.tiny(vocab_size=VOCAB, seq_length=32)
    init_parallel(cfg)
    model = build_model(cfg)
    rng = random.Random(0)
    tasks = [sample_task(rng, "o") for _ in range(6)]
    first = warm_start(model, tasks, steps=3)
    assert warm_start(model, tasks, steps=20) < first
    comps, lps = sample(model, tasks, torch.Generator().manual_seed(1))
    samples = [
        Sample(
            Rollout(
                trajectory_id=f"t{i}",
                policy_version=0,
                group_id="g",
                org_id="o",
                task_kind=t.kind,
                prompt_ids=t.prompt,
                completion_ids=c,
                behaviour_logprobs=lp,
                loss_mask=[1, 1],
                created_at=1,
            ),
            0.0,
            0,
        )
        for i, (t, c, lp) in enumerate(zip(tasks, comps, lps))
    ]
    p = prepare(to_batch(encode_batch(pack(samples, 32, 0)), 0, 0), 0, 0)
    with torch.no_grad():
        again = forward_logprobs(model, p.tokens, p.positions, p.targets, p.attention_mask)
    m = p.loss_mask.bool()
    assert m.sum() == 12
    np.testing.assert_allclose(again[m].numpy(), p.behaviour[m].numpy(), atol=1e-5)
