"""Kafka against a real Kafka-protocol broker (noida-db over TCP): the local broker's lifecycle,
idempotent topics, every record through the broker unchanged, and bounded errors when it is down."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flows.kafka_io import kafka_source
from devservices.broker import LocalBroker, free_port
from rtrl.errors import ServiceUnavailable
from rtrl.kafka import check_broker, describe_topic, ensure_topics, producer_config, read_topic
from schemas.codec import JsonCodec, decode_batch, encode_batch, event_codec
from schemas.records import Checkpoint, DeadLetter, EventBase, MicroBatch, Reward, Rollout
from schemas.topics import TOPICS
from tests.strategies import records

ON_TOPIC = {"events": EventBase, "rollouts": Rollout, "rewards": Reward, "batches": MicroBatch,
            "deployments": Checkpoint, "dead_letters": DeadLetter}


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
