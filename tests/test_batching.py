"""The batch flow's pure logic: join, staleness filter, advantages, packing (flows/batching.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.batching import (
    BatchBuilder,
    BatchConfig,
    Sample,
    group_advantages,
    pack,
    rows_needed,
)
from rtrl.sections.client import GovernanceSettings
from rtrl.sections.flows import BatchingSettings, FlowSettings
from rtrl.sections.trainer import AdapterSettings, TrainSettings
from schemas.records import Reward, Rollout


def config(
    reward_version: str = "v2",
    *,
    train: TrainSettings | None = None,
    governance: GovernanceSettings | None = None,
    adapters: AdapterSettings | None = None,
    **batching,
) -> BatchConfig:
    """A builder config with these ``batching`` settings: no delayed path, no verdict kinds, unless given."""
    return BatchConfig(
        reward_version,
        BatchingSettings(**batching),
        train or TrainSettings(max_delayed_lag=0),
        FlowSettings(task_kinds={}),
        governance or GovernanceSettings(),
        adapters or AdapterSettings(),
    )


def ro(
    tid: str,
    group: str = "g",
    size: int = 1,
    version: int = 1,
    prompt: int = 2,
    completion: int = 3,
    at: int = 1000,
    org: str = "o",
    kind: str = "bugfix",
) -> Rollout:
    return Rollout(
        trajectory_id=tid,
        policy_version=version,
        group_id=group,
        group_size=size,
        org_id=org,
        task_kind=kind,
        prompt_ids=list(range(1, prompt + 1)),
        completion_ids=list(range(10, 10 + completion)),
        behaviour_logprobs=[-0.5] * completion,
        loss_mask=[1] * completion,
        created_at=at,
    )


def rw(
    tid: str,
    reward: float,
    at: int = 1000,
    version: str = "v2",
    revision: int = 0,
    policy: int = 1,
    org: str = "o",
    kind: str = "bugfix",
) -> Reward:
    return Reward(
        trajectory_id=tid,
        policy_version=policy,
        reward_version=version,
        revision=revision,
        reward=reward,
        components={"total": reward},
        flags=[],
        close_reason="ended",
        org_id=org,
        arm="control",
        task_kind=kind,
        n_events=3,
        event_counts={"tool_call": 1},
        first_event_ts=at - 10,
        last_event_ts=at,
        emitted_at=at,
    )


def test_group_advantages_are_reward_minus_group_mean():
    assert group_advantages([1.0, 0.0, -1.0, 2.0]) == [0.5, -0.5, -1.5, 1.5]
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]  # no signal, no std normalisation blow-up


def test_pack_lays_out_prompt_completion_and_padding():
    a, b, c = (
        Sample(ro("a", prompt=2, completion=3), 1.0, 0, advantage=0.5),
        Sample(ro("b", prompt=1, completion=4), 0.0, 0, advantage=-0.5),
        Sample(ro("c", prompt=2, completion=2), 0.0, 0, advantage=0.25),
    )
    mb = pack([a, b, c], seq_len=10, created_at=7)
    # first fit: a (5) + b (5) fill row 0; c (4) opens row 1
    assert mb.token_ids == [[1, 2, 10, 11, 12, 1, 10, 11, 12, 13], [1, 2, 10, 11, 0, 0, 0, 0, 0, 0]]
    assert mb.loss_mask == [[0, 0, 1, 1, 1, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert mb.advantages[0] == [0, 0, 0.5, 0.5, 0.5, 0, -0.5, -0.5, -0.5, -0.5]
    assert mb.behaviour_logprobs[1] == [0, 0, -0.5, -0.5, 0, 0, 0, 0, 0, 0]
    assert mb.segment_ids == [[0] * 5 + [1] * 5, [2] * 4 + [-1] * 6]
    assert mb.sample_ids == ["a", "b", "c"] and mb.policy_versions == [1, 1, 1] and mb.created_at == 7
    assert pack([a, b, c], 10, 7).batch_id == mb.batch_id != pack([b, a, c], 10, 7).batch_id
    with pytest.raises(ValueError, match="seq_len"):
        pack([a], seq_len=4, created_at=0)


def test_join_in_either_order_and_group_relative_advantages():
    bb = BatchBuilder(config(flush_s=0.1), serving_version=1)
    assert bb.add_rollout(ro("t1", group="g", size=2)) == []
    assert bb.add_reward(rw("t2", 0.0)) == []  # reward before its rollout
    assert bb.add_reward(rw("t1", 1.0)) == []
    assert bb.add_rollout(ro("t2", group="g", size=2)) == []  # group complete, not yet old enough
    out = bb.advance_to(1000 + 100)
    assert len(out) == 1
    mb = out[0]
    assert mb.sample_ids == ["t1", "t2"]
    assert [mb.advantages[0][2], mb.advantages[0][7]] == [0.5, -0.5]
    assert bb.lag_counts == {0: 2} and not bb.counts


def test_singletons_use_the_cohort_running_baseline():
    bb = BatchBuilder(config(flush_s=0, baseline_alpha=0.5), serving_version=1)
    first = bb.add_rollout(ro("a")) + bb.add_reward(rw("a", 1.0))
    second = bb.add_rollout(ro("b")) + bb.add_reward(rw("b", 0.0))
    third = bb.add_rollout(ro("c")) + bb.add_reward(rw("c", 1.0))
    adv = [out[0].advantages[0][2] for out in (first, second, third)]
    assert adv == [0.0, -1.0, 0.5]  # baseline: 1.0 (first reward), then 0.5, then 0.25 -> 1 - 0.5
    assert bb.baseline == 0.75


def test_unmatched_sides_wait_then_are_counted():
    bb = BatchBuilder(config(join_wait_s=0.5), serving_version=1)
    bb.add_rollout(ro("lonely", at=1000))
    bb.add_reward(rw("orphan", 1.0, at=1200))
    bb.advance_to(1500)
    assert not bb.counts  # still within the wait
    bb.advance_to(1501)
    assert bb.counts["unmatched_rollout"] == 1 and bb.counts["unmatched_reward"] == 0
    bb.advance_to(1701)
    assert bb.counts["unmatched_reward"] == 1
    assert bb.add_reward(rw("lonely", 1.0, at=1800)) == [] and bb.counts["unmatched_reward"] == 1  # waits anew


def test_stale_samples_are_dropped_and_counted_per_lag():
    bb = BatchBuilder(config(train=TrainSettings(max_policy_lag=1, max_delayed_lag=0), flush_s=0), serving_version=3)
    for tid, v in (("old", 1), ("ok", 2), ("fresh", 3)):
        bb.add_rollout(ro(tid, version=v))
        bb.add_reward(rw(tid, 1.0, policy=v))
    assert bb.dropped_lag == {2: 1} and bb.lag_counts == {1: 1, 0: 1}
    bb.set_serving_version(2)  # an older announcement never lowers the serving version
    assert bb.serving_version == 3


def test_other_versions_revisions_and_duplicates_are_not_trained():
    bb = BatchBuilder(config("v2", flush_s=0), serving_version=1)
    bb.add_reward(rw("a", 1.0, version="v1-discard-broken"))
    bb.add_rollout(ro("a"))
    bb.add_reward(rw("a", 1.0, revision=1))
    assert bb.rollouts  # still waiting for a v2 revision-0 reward
    out = bb.add_reward(rw("a", 1.0))
    assert len(out) == 1
    bb.add_rollout(ro("a"))
    bb.add_reward(rw("a", 1.0))
    assert bb.counts == {"other_reward_version": 1, "later_revision_or_duplicate": 2, "duplicate_rollout": 1}


def test_full_batches_are_emitted_without_waiting():
    bb = BatchBuilder(config(seq_len=10, rows=2, flush_s=10**6), serving_version=1)
    out = []
    for i in range(5):  # 5 samples of 5 tokens: 2 per row, 4 per batch
        out += bb.add_rollout(ro(f"t{i}", prompt=2, completion=3)) + bb.add_reward(rw(f"t{i}", float(i)))
    assert [len(b.sample_ids) for b in out] == [4]
    assert [len(b.sample_ids) for b in bb.flush()] == [1]


def test_too_long_rollouts_are_counted():
    bb = BatchBuilder(config(seq_len=4), serving_version=1)
    bb.add_rollout(ro("big", prompt=2, completion=3))
    assert bb.counts["too_long"] == 1 and not bb.rollouts


@st.composite
def streams(draw):
    """Rollouts (in groups, some versions stale) and their rewards (some missing), interleaved."""
    items, t = [], 1000
    for g in range(draw(st.integers(1, 8))):
        size = draw(st.integers(1, 4))
        for i in range(size):
            tid = f"g{g}-{i}"
            t += draw(st.integers(0, 50))
            items.append(
                (
                    "rollout",
                    ro(
                        tid,
                        group=f"g{g}",
                        size=size,
                        version=draw(st.integers(0, 3)),
                        prompt=draw(st.integers(1, 6)),
                        completion=draw(st.integers(1, 10)),
                        at=t,
                    ),
                )
            )
            if draw(st.booleans()) or draw(st.booleans()):
                items.append(("reward", rw(tid, draw(st.floats(-2, 2)), at=t + draw(st.integers(0, 30)))))
    order = draw(st.permutations(range(len(items))))
    return [items[i] for i in order]


def _run(items, cfg):
    bb = BatchBuilder(cfg, serving_version=3)
    out = []
    for kind, x in items:
        out += bb.add_rollout(x) if kind == "rollout" else bb.add_reward(x)
    return bb, out + bb.flush()


@settings(max_examples=60, deadline=None)
@given(streams(), st.integers(12, 24), st.integers(1, 3))
def test_every_accepted_sample_is_packed_exactly_once(items, seq_len, rows):
    cfg = config(
        train=TrainSettings(max_policy_lag=2, max_delayed_lag=0),
        seq_len=seq_len,
        rows=rows,
        join_wait_s=0.04,
        group_wait_s=0.02,
        flush_s=0.03,
    )
    bb, batches = _run(items, cfg)
    packed = [sid for b in batches for sid in b.sample_ids]
    assert len(packed) == len(set(packed)) == sum(bb.lag_counts.values())
    rollouts = {x.trajectory_id: x for k, x in items if k == "rollout"}
    rewarded = {x.trajectory_id for k, x in items if k == "reward"}
    assert set(packed) <= rewarded
    assert all(3 - rollouts[s].policy_version <= 2 for s in packed)
    for b in batches:
        assert 1 <= len(b.token_ids) <= rows and rows_needed(
            [len(rollouts[s].prompt_ids) + len(rollouts[s].completion_ids) for s in b.sample_ids], seq_len
        ) == len(b.token_ids)
        assert sum(map(sum, b.loss_mask)) == sum(sum(rollouts[s].loss_mask) for s in b.sample_ids)
    assert _run(items, cfg)[1] == batches  # deterministic: same input, same batches and ids


@pytest.mark.parametrize(
    "bad",
    [
        dict(seq_len=1),
        dict(rows=0),
        dict(baseline_alpha=0.0),
        dict(baseline_alpha=1.5),
        dict(join_wait_s=-1),
    ],
)
def test_batch_config_refuses_impossible_shapes(bad):
    with pytest.raises(ValueError):
        config(**bad)
