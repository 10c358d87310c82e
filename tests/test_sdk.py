"""The client SDK against the real broker: validation, hashing, keying, bounded queue, flush on close,
and the broker going down and coming back."""

from __future__ import annotations

import threading

import msgspec
import pytest

from client import InvalidEvent, RtrlClient, hash_user
from devservices.broker import LocalBroker, free_port
from rtrl.kafka import ensure_topics, read_topic
from rtrl.sections.simulator import SimulatorSettings
from schemas.codec import event_codec
from schemas.records import EditPersisted, event_type
from simulator.drive import drive
from simulator.generate import generate

SALT = "test-salt-123"


def _events(bootstrap: str, topic: str):
    codec = event_codec()
    return [(m.key(), codec.decode(m.value()), m.value()) for m in read_topic(bootstrap, topic, timeout_s=30)]


def test_trajectory_api_emits_valid_keyed_hashed_events(broker, topic_prefix):
    """Every helper records one valid event keyed by trajectory_id, in order; the raw user id never
    leaves the process, only its salted hash."""
    topic = topic_prefix + "events"
    with RtrlClient(broker.bootstrap, salt=SALT, topic=topic) as c:
        t = c.start_trajectory(
            org_id="acme", user_id="alice@example.com", task_kind="bugfix", policy_version=4, arm="b"
        )
        t.tool_call("grep", valid=True)
        t.tool_call("apply_patch", valid=False, error="patch does not apply")
        t.clarifying_question()
        t.followup("neutral", question_needed=True)
        edit = t.edit_proposed(lines=12)
        t.edit_accepted(edit)
        t.edit_rejected(t.edit_proposed(lines=3))
        t.latency(ttft_ms=320.0, total_ms=4100.0)
        t.end("completed")
        t.edit_persisted(edit, fraction=0.75, checked_after_s=600.0)
    got = _events(broker.bootstrap, topic)
    assert [event_type(e) for _, e, _ in got] == [
        "trajectory_started",
        "tool_call",
        "tool_call",
        "clarifying_question",
        "followup",
        "edit_proposed",
        "edit_accepted",
        "edit_proposed",
        "edit_rejected",
        "latency",
        "trajectory_ended",
        "edit_persisted",
    ]
    assert {k for k, _, _ in got} == {t.trajectory_id.encode()}
    assert {e.user_hash for _, e, _ in got} == {hash_user("alice@example.com", SALT)}
    assert all(b"alice" not in raw for _, _, raw in got)
    assert {(e.org_id, e.policy_version, e.arm) for _, e, _ in got} == {("acme", 4, "b")}
    assert len({e.event_id for _, e, _ in got}) == len(got)


def test_invalid_events_are_refused_with_the_field(broker, topic_prefix):
    """An event that would fail the flow's validation is refused at the source, naming the field."""
    with RtrlClient(broker.bootstrap, salt=SALT, topic=topic_prefix + "events") as c:
        t = c.start_trajectory(org_id="acme", user_id="u", task_kind="bugfix", policy_version=0)
        with pytest.raises(InvalidEvent) as err:
            t.edit_persisted("e", fraction=1.5, checked_after_s=1.0)
        assert err.value.field == "$.fraction"
        with pytest.raises(InvalidEvent):
            t.edit_proposed(lines=-1)
        assert c.stats().invalid == 2
    assert len(_events(broker.bootstrap, topic_prefix + "events")) == 1


@pytest.mark.slow
def test_full_queue_drops_and_counts_without_blocking():
    """With the broker unreachable and a tiny queue, record() keeps returning at once: events beyond the
    bound are dropped and counted (accepted + dropped = recorded), never silently lost or blocking."""
    c = RtrlClient(
        f"127.0.0.1:{free_port()}",
        salt=SALT,
        queue_size=5,
        delivery_timeout_s=1,
        producer_overrides={"queue.buffering.max.messages": 10},
    )
    t = c.start_trajectory(org_id="acme", user_id="u", task_kind="bugfix", policy_version=0)
    results = [t.tool_call("grep", valid=True) for _ in range(2000)]
    s = c.stats()
    assert results.count(False) == s.dropped > 0
    assert s.accepted + s.dropped == 2001
    final = c.close(timeout_s=3)
    assert final.delivered == 0
    assert final.failed + final.pending == final.accepted
    assert final.last_error is not None


def test_close_flushes_everything(broker, topic_prefix):
    """close() right after recording still delivers every accepted event exactly once."""
    topic = topic_prefix + "events"
    c = RtrlClient(broker.bootstrap, salt=SALT, topic=topic)
    for i in range(300):
        c.start_trajectory(org_id="o", user_id=f"u{i}", task_kind="test", policy_version=1).end()
    s = c.close()
    assert (s.accepted, s.delivered, s.failed, s.pending, s.dropped) == (600, 600, 0, 0, 0)
    assert len({e.event_id for _, e, _ in _events(broker.bootstrap, topic)}) == 600


def test_concurrent_callers_lose_nothing(broker, topic_prefix):
    """Many threads recording at once: every event is counted and delivered once."""
    topic = topic_prefix + "events"
    with RtrlClient(broker.bootstrap, salt=SALT, topic=topic) as c:

        def work(n):
            for i in range(100):
                c.start_trajectory(org_id="o", user_id=f"u{n}-{i}", task_kind="test", policy_version=0)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        [th.start() for th in threads]
        [th.join() for th in threads]
    assert c.stats().delivered == 400
    assert len(_events(broker.bootstrap, topic)) == 400


@pytest.mark.slow
def test_broker_down_then_back_loses_and_duplicates_nothing(tmp_path):
    """Events recorded while the broker is stopped wait in the producer and are delivered once it is back;
    the idempotent producer adds no duplicates."""
    b = LocalBroker(tmp_path / "b")
    b.up()
    try:
        ensure_topics(b.bootstrap, "rtrl.", 2)
        c = RtrlClient(b.bootstrap, salt=SALT, topic="rtrl.events")
        for i in range(50):
            c.start_trajectory(org_id="o", user_id=f"a{i}", task_kind="test", policy_version=0)
        assert c.flush(20) == 0
        b.down()
        for i in range(50):
            assert c.start_trajectory(org_id="o", user_id=f"b{i}", task_kind="test", policy_version=0)
        assert c.stats().pending > 0
        b.up()
        s = c.close(timeout_s=60)
        assert (s.delivered, s.failed, s.pending) == (100, 0, 0)
        got = _events(b.bootstrap, "rtrl.events")
        assert len(got) == 100 and len({e.event_id for _, e, _ in got}) == 100
    finally:
        b.down()


def test_simulator_drives_the_sdk_into_the_broker(broker, topic_prefix):
    """The simulator's emissions (duplicates included) all reach the topic through the SDK, unchanged."""
    topic = topic_prefix + "events"
    emissions = generate(SimulatorSettings(trajectories=60, seed=7, duplicate_rate=0.05), SALT)
    with RtrlClient(broker.bootstrap, salt=SALT, topic=topic) as c:
        result = drive(c, emissions)
    assert (result.accepted, result.dropped) == (len(emissions), 0)
    got = [e for _, e, _ in _events(broker.bootstrap, topic)]
    enc = msgspec.json.encode
    assert sorted(map(enc, got)) == sorted(enc(em.event) for em in emissions)
    assert any(isinstance(e, EditPersisted) for e in got)
