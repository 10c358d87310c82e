"""Kafka against a real Kafka-protocol broker (noida-db over TCP): the local broker's lifecycle,
idempotent topics checked against partitions and replicas, every record through the broker unchanged,
bounded errors when it is down, and produce() waiting on a full producer queue."""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rtrl.kafka
from devservices.broker import LocalBroker, free_port
from flows.kafka_io import kafka_source
from rtrl.errors import ConfigError, SchemaMismatch, ServiceUnavailable
from rtrl.kafka import base_config, check_broker, describe_topic, ensure_topics, produce, producer_config, read_topic
from schemas.codec import JsonCodec, decode_batch, encode_batch, event_codec
from schemas.records import Checkpoint, DeadLetter, EventBase, MicroBatch, Reward, Rollout
from schemas.topics import TOPICS, TopicSpec
from tests.strategies import records

ON_TOPIC = {
    "events": EventBase,
    "rollouts": Rollout,
    "rewards": Reward,
    "batches": MicroBatch,
    "deployments": Checkpoint,
    "dead_letters": DeadLetter,
}


def test_local_broker_lifecycle(tmp_path):
    """up() starts noida-db on a free loopback port and waits until it answers; a second up() on the
    same folder reuses it; down() stops it so the address no longer answers."""
    b = LocalBroker(tmp_path / "b")
    bootstrap = b.up()
    assert bootstrap.startswith("127.0.0.1:")
    assert check_broker(bootstrap, 5).topics is not None
    assert LocalBroker(tmp_path / "b").up() == bootstrap
    b.down()
    with pytest.raises(ServiceUnavailable, match=bootstrap):
        check_broker(bootstrap, 1)
    b.down()  # idempotent


def test_topics_are_created_idempotently_with_their_specs(broker, topic_prefix):
    """ensure_topics creates every topic once, with its partitions and retention; a rerun creates none."""
    assert ensure_topics(broker.bootstrap, topic_prefix, 2) == []
    for spec in TOPICS:
        info = describe_topic(broker.bootstrap, topic_prefix + spec.name)
        assert info["partitions"] == (spec.partitions or 2)
        assert info["retention.ms"] == str(spec.retention_ms)
        assert info["cleanup.policy"] == spec.cleanup_policy
        assert info["replication_factor"] == 1


def _encode(topic: str, record) -> bytes:
    if topic == "batches":
        return encode_batch(record)
    return (event_codec() if topic == "events" else JsonCodec(ON_TOPIC[topic])).encode(record)


def _decode(topic: str, data: bytes):
    if topic == "batches":
        return decode_batch(data)
    return (event_codec() if topic == "events" else JsonCodec(ON_TOPIC[topic])).decode(data)


@pytest.mark.parametrize("topic", list(ON_TOPIC))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.slow
def test_every_record_round_trips_through_the_broker(broker, topic, data):
    """Records produced with their codec by an idempotent producer come back from the broker unchanged
    and in order per partition."""
    prefix = f"rt{free_port()}."
    ensure_topics(broker.bootstrap, prefix, 2)
    recs = data.draw(st.lists(records(ON_TOPIC[topic]), min_size=1, max_size=10))
    p = Producer(producer_config(broker.bootstrap))
    for r in recs:
        p.produce(prefix + topic, value=_encode(topic, r), key=b"k")
    assert p.flush(10) == 0
    got = [_decode(topic, m.value()) for m in read_topic(broker.bootstrap, prefix + topic, timeout_s=20)]
    assert got == recs


@pytest.mark.slow
def test_unreachable_broker_is_reported_with_its_address():
    """A broker nobody listens on fails within kafka.timeout_s, naming the address and the setting."""
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(ServiceUnavailable, match=f"{addr}.*kafka.bootstrap"):
        check_broker(addr, timeout_s=1)
    with pytest.raises(ServiceUnavailable, match=addr):
        ensure_topics(addr, "x.", 1, timeout_s=1)


def test_bytewax_source_is_guarded(broker, topic_prefix):
    """The Bytewax KafkaSource is built only after the broker answered (it would retry for ~10 minutes);
    an unreachable broker or missing topic is a clear error instead."""
    with pytest.raises(ServiceUnavailable, match="did not answer"):
        kafka_source(f"127.0.0.1:{free_port()}", ["rtrl.events"], timeout_s=1)
    with pytest.raises(ServiceUnavailable, match="do not exist"):
        kafka_source(broker.bootstrap, [topic_prefix + "nope"], timeout_s=5)
    src = kafka_source(broker.bootstrap, [topic_prefix + "events"], timeout_s=5)
    assert src.list_parts() == [f"0-{topic_prefix}events", f"1-{topic_prefix}events"]


# ---------------------------------------------------------------- a real cluster: replicas, existing topics


def _prefix() -> str:
    return f"rc{free_port()}."


def _exists(bootstrap: str, topic: str) -> bool:
    return topic in check_broker(bootstrap, 5).topics


def test_existing_topics_that_differ_are_reported_not_ignored(broker, topic_prefix):
    """Topics that exist with other partitions or another replication factor are a SchemaMismatch listing
    every differing topic, wanted vs found, and the fix; the fixed-partition topics (deployments,
    dead_letters) name schemas/topics.py instead of kafka.partitions."""
    with pytest.raises(SchemaMismatch) as e:
        ensure_topics(broker.bootstrap, topic_prefix, 4)
    msg = str(e.value)
    for name in ("events", "rollouts", "rewards", "batches"):
        assert f"topic {topic_prefix}{name} has 2 partitions, kafka.partitions wants 4; fix: add partitions" in msg
    assert "deployments" not in msg and "dead_letters" not in msg

    with pytest.raises(
        SchemaMismatch,
        match="has 2 partitions, kafka.partitions wants 1; fix: set kafka.partitions "
        "to 2.*Kafka can only add partitions",
    ):
        ensure_topics(broker.bootstrap, topic_prefix, 1)

    one = TopicSpec("deployments", "Checkpoint", "version", -1, partitions=3)
    with pytest.raises(SchemaMismatch, match=rf"{topic_prefix}deployments has 1 partitions, schemas/topics.py wants 3"):
        ensure_topics(broker.bootstrap, topic_prefix, 2, specs=(one,))

    with pytest.raises(SchemaMismatch) as e:
        ensure_topics(broker.bootstrap, topic_prefix, 2, replication_factor=2)
    assert str(e.value).count("has replication factor 1, kafka.replication_factor wants 2") == len(TOPICS)


def test_a_mismatch_creates_nothing(broker):
    """With one existing topic differing, the missing ones are not created either: nothing half-done."""
    prefix = _prefix()
    events, rollouts = TOPICS[0], TOPICS[1]
    assert ensure_topics(broker.bootstrap, prefix, 2, specs=(events,)) == [prefix + "events"]
    with pytest.raises(SchemaMismatch, match="events has 2 partitions"):
        ensure_topics(broker.bootstrap, prefix, 3, specs=(events, rollouts))
    assert not _exists(broker.bootstrap, prefix + "rollouts")


def test_existing_matching_topics_pass(broker, topic_prefix):
    """Topics with the wanted partitions and replication factor pass; describe_topic reports both and the
    broker's min.insync.replicas (1, its default, since rtrl leaves the default in place at 1)."""
    assert ensure_topics(broker.bootstrap, topic_prefix, 2, replication_factor=1, min_insync_replicas=1) == []
    info = describe_topic(broker.bootstrap, topic_prefix + "events")
    assert (info["partitions"], info["replication_factor"], info["min.insync.replicas"]) == (2, 1, "1")


def test_replication_factor_beyond_the_brokers_is_a_clear_error(broker, monkeypatch):
    """Replication factor 3 on the one-broker local cluster: a ConfigError naming kafka.replication_factor and
    the broker count, before anything is created; and when the metadata listed enough brokers but the
    broker refuses (INVALID_REPLICATION_FACTOR, e.g. brokers left meanwhile) the same error, carrying the
    broker's words. The topics are asked for with min.insync.replicas set (it is > 1)."""
    prefix = _prefix()
    with pytest.raises(
        ConfigError,
        match=rf"kafka.replication_factor = 3 but the cluster at {broker.bootstrap} "
        r"has 1 broker\(s\).*at most 1",
    ):
        ensure_topics(broker.bootstrap, prefix, 2, replication_factor=3, min_insync_replicas=2)
    assert not _exists(broker.bootstrap, prefix + "events")

    real_check = rtrl.kafka.check_broker

    def three_brokers(bootstrap, timeout_s=10.0):
        meta = real_check(bootstrap, timeout_s)
        meta.brokers = {**meta.brokers, 1001: None, 1002: None}  # as if two more had been registered
        return meta

    asked: list = []

    class SpyAdmin(rtrl.kafka.AdminClient):
        def create_topics(self, new_topics, **kw):
            asked.extend(new_topics)
            return super().create_topics(new_topics, **kw)

    monkeypatch.setattr(rtrl.kafka, "check_broker", three_brokers)
    monkeypatch.setattr(rtrl.kafka, "AdminClient", SpyAdmin)
    with pytest.raises(
        ConfigError,
        match=r"kafka.replication_factor = 3 .*has 3 broker\(s\) registered "
        r"\(broker: .*only 1 broker",
    ):
        ensure_topics(broker.bootstrap, prefix, 2, replication_factor=3, min_insync_replicas=2)
    assert {(t.replication_factor, t.config["min.insync.replicas"]) for t in asked} == {(3, "2")}
    assert not _exists(broker.bootstrap, prefix + "events")


def test_min_insync_above_replication_factor_is_a_config_error():
    """More in-sync replicas than replicas could never acknowledge an acks=all write: refused before the
    broker is contacted (the address is unreachable on purpose), naming the setting and the fix."""
    with pytest.raises(
        ConfigError,
        match=r"kafka.min_insync_replicas = 3 must be between 1 and "
        r"kafka.replication_factor = 2.*fix: set kafka.min_insync_replicas",
    ):
        ensure_topics(f"127.0.0.1:{free_port()}", "x.", 1, replication_factor=2, min_insync_replicas=3)


def test_noida_keeps_min_insync_replicas_but_does_not_enforce_it(broker, topic_prefix):
    """noida-db (0.2.3) stores a topic's min.insync.replicas and reports it (describe_topic shows it), so an
    existing topic below kafka.min_insync_replicas is reported by ensure_topics. It does not enforce it:
    with min.insync.replicas 2 on a one-replica topic an acks=all write is still acknowledged, where a real
    Kafka broker answers NOT_ENOUGH_REPLICAS, so durability under acks=all is not testable locally."""
    topic = topic_prefix + "isr2"
    admin = AdminClient(base_config(broker.bootstrap))
    admin.create_topics([NewTopic(topic, 1, 1, config={"min.insync.replicas": "2"})])[topic].result(10)
    info = describe_topic(broker.bootstrap, topic)
    assert (info["replication_factor"], info["min.insync.replicas"]) == (1, "2")

    p = Producer(producer_config(broker.bootstrap))  # acks=all
    errors: list = []
    p.produce(topic, value=b"v", on_delivery=lambda err, _m: errors.append(err))
    assert p.flush(10) == 0 and errors == [None]  # a real broker: NOT_ENOUGH_REPLICAS

    # existing topics at the broker's min.insync.replicas 1 fall short of kafka.min_insync_replicas = 2
    with pytest.raises(SchemaMismatch) as e:
        ensure_topics(broker.bootstrap, topic_prefix, 2, replication_factor=2, min_insync_replicas=2)
    msg = str(e.value)
    assert (
        f"topic {topic_prefix}events has min.insync.replicas 1, kafka.min_insync_replicas wants 2; fix: "
        f"kafka-configs.sh --alter --entity-type topics --entity-name {topic_prefix}events" in msg
    )


# ---------------------------------------------------------------- produce with backpressure


def test_produce_waits_for_room_and_drops_nothing(broker, topic_prefix):
    """A producer whose queue holds 2 messages: produce() waits (serving delivery callbacks) instead of
    raising BufferError, and every message arrives once, in order."""
    topic = topic_prefix + "events"
    p = Producer(producer_config(broker.bootstrap, **{"queue.buffering.max.messages": 2}))
    delivered: list = []
    for i in range(60):
        assert produce(p, topic, str(i).encode(), b"k", lambda err, m: delivered.append(err), poll_s=0.01)
    assert p.flush(10) == 0
    assert delivered == [None] * 60
    assert [m.value() for m in read_topic(broker.bootstrap, topic, timeout_s=20)] == [
        str(i).encode() for i in range(60)
    ]


def test_produce_gives_up_only_when_stopped():
    """Broker unreachable and the queue full: produce() keeps polling until ``stop`` (a callable or an
    Event) says so, then returns False without producing; with room it produces whatever ``stop`` says."""
    p = Producer(producer_config(f"127.0.0.1:{free_port()}", **{"queue.buffering.max.messages": 1, "log_level": 0}))
    done = threading.Event()
    done.set()
    assert produce(p, "t", b"1", stop=done)  # room in the queue: produced although stopped
    asked = []
    assert not produce(p, "t", b"2", poll_s=0.01, stop=lambda: asked.append(1) or len(asked) >= 3)
    assert len(asked) == 3 and len(p) == 1
    assert not produce(p, "t", b"3", poll_s=0.01, stop=done)
    p.purge()
