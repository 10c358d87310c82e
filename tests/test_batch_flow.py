"""The batch flow on the real broker and the real ClickHouse engine: rollouts + rewards from Kafka to
packed micro-batches on rtrl.batches, counters in ClickHouse, bad input dead-lettered."""

from __future__ import annotations

import pytest
from bytewax.testing import run_main
from confluent_kafka import Producer

from flows.batch_flow import build_flow
from rtrl.kafka import ensure_topics, producer_config, read_topic
from rtrl.settings import load_settings
from schemas.codec import JsonCodec, decode_batch
from schemas.records import DeadLetter, Reward, Rollout
from tests.test_batching import ro, rw


def _produce(bootstrap: str, topic: str, items: list[tuple[bytes, bytes]]) -> None:
    p = Producer(producer_config(bootstrap))
    for key, value in items:
        p.produce(topic, key=key, value=value)
    assert p.flush(30) == 0


def _world():
    """Two cohorts; groups of two and singletons; one stale rollout, one without a reward, one reward
    without a rollout, one reward of another version."""
    rollouts = [
        ro("a1", group="ga", size=2, at=1000),
        ro("a2", group="ga", size=2, at=1000),
        ro("s1", group="gs1", at=1010),
        ro("s2", group="gs2", at=1020),
        ro("old", group="go", version=0, at=1030),
        ro("v3", group="gv", version=3, at=1040),
        ro("nor", group="gn", at=1050),
        ro("b1", group="gb", size=2, at=1000, org="p", kind="test"),
        ro("b2", group="gb", size=2, at=1001, org="p", kind="test"),
    ]
    rewards = [
        rw("a1", 1.0, at=1100),
        rw("a2", 0.0, at=1101),
        rw("s1", 0.5, at=1102),
        rw("s2", 1.5, at=1103),
        rw("old", 1.0, at=1104),
        rw("v3", 1.0, at=1105, policy=3),
        rw("ghost", 1.0, at=1106),
        rw("a1", 0.7, at=1107, version="v1-discard-broken"),
        rw("b1", -1.0, at=1100, org="p", kind="test"),
        rw("b2", 1.0, at=1100, org="p", kind="test"),
    ]
    return rollouts, rewards


@pytest.mark.slow
def test_batch_flow_end_to_end(broker, topic_prefix, ch_dsn, ch_client, ch_db, tmp_path):
    """Every joined, fresh-enough sample lands in exactly one micro-batch with its advantage; the
    stale one and the unmatched ones are counted in ClickHouse; a malformed rollout and a mistyped reward
    are dead-lettered with their reasons."""
    ensure_topics(broker.bootstrap, topic_prefix, 2)
    rollouts, rewards = _world()
    rc, wc = JsonCodec(Rollout), JsonCodec(Reward)
    _produce(
        broker.bootstrap,
        topic_prefix + "rollouts",
        [(r.trajectory_id.encode(), rc.encode(r)) for r in rollouts] + [(b"x", b"{not json")],
    )
    _produce(
        broker.bootstrap,
        topic_prefix + "rewards",
        [(r.trajectory_id.encode(), wc.encode(r)) for r in rewards] + [(b"y", b'{"trajectory_id": 5}')],
    )
    env = {
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        "RTRL_CLICKHOUSE__DSN": ch_dsn,
        "RTRL_CLICKHOUSE__DATABASE": ch_db,
        "RTRL_BATCHING__TAIL": "false",
        "RTRL_BATCHING__SEQ_LEN": "16",
        "RTRL_BATCHING__ROWS": "2",
        "RTRL_TRAIN__MAX_POLICY_LAG": "1",
        "RTRL_TRAIN__MAX_DELAYED_LAG": "0",  # the stale sample is dropped (the delayed path: test_delayed_path)
        "RTRL_DATA_DIR": str(tmp_path),
    }
    run_main(build_flow(load_settings(env=env)))

    batches = [decode_batch(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "batches")]
    adv = {}
    for b in batches:
        assert len(b.token_ids) <= 2 and b.seq_len == 16
        for i, sid in enumerate(b.sample_ids):
            row, col = next(
                (r, c) for r, seg in enumerate(b.segment_ids) for c, s in enumerate(seg) if s == i and b.loss_mask[r][c]
            )
            assert sid not in adv, f"{sid} packed twice"
            adv[sid] = b.advantages[row][col]

    def q(sql):
        return ch_client.query(sql.format(db=ch_db)).result_rows

    stats = {
        r[0]: r[1:] for r in q("SELECT cohort, samples, counts, lag_accepted, lag_dropped FROM {db}.batch_stats FINAL")
    }
    assert set(stats) == {"o/bugfix", "p/test"}
    # cohort o: the serving version is the newest rollout version seen so far, so which of its samples
    # are too stale depends on arrival order; every joined sample is either packed once or counted
    samples, counts, accepted, dropped = stats["o/bugfix"]
    assert counts == {"unmatched_rollout": 1, "unmatched_reward": 1, "other_reward_version": 1}  # nor, ghost, v1
    assert sum(accepted.values()) == samples == len([s for s in adv if s in {"a1", "a2", "s1", "s2", "old", "v3"}])
    assert samples + sum(dropped.values()) == 6 and "v3" in adv and "nor" not in adv and "ghost" not in adv
    assert all(int(lag) > 1 for lag in dropped) and all(int(lag) <= 1 for lag in accepted)
    # cohort p: both samples fresh, one group of two: reward minus the group mean
    assert stats["p/test"][0] == 2 and stats["p/test"][2] == {"0": 2} and (adv["b1"], adv["b2"]) == (-1.0, 1.0)

    dead = [
        JsonCodec(DeadLetter).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "dead_letters")
    ]
    assert sorted((d.kind, d.source) for d in dead) == [
        ("invalid", topic_prefix + "rewards"),
        ("malformed", topic_prefix + "rollouts"),
    ]
    assert sorted(q("SELECT kind, source FROM {db}.dead_letters FINAL")) == sorted((d.kind, d.source) for d in dead)
    assert "trajectory_id" in next(d.field + d.reason for d in dead if d.kind == "invalid")
