"""The flows' Kafka source against the real broker: every message exactly once and in order while
its readers pause during quiet spells, the recovery offset, and the end of a bounded run."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from confluent_kafka import Producer

from flows.kafka_io import kafka_source
from flows.processor import Message
from rtrl.kafka import ensure_topics, producer_config


def _drain(part, until, stop_after_s: float = 2.0) -> tuple[list[Message], int]:
    """Call next_batch as Bytewax would (never before next_awake) until ``until(seen)`` holds and the
    partition has stayed quiet for a while; return the messages and how often it paused."""
    seen, pauses, quiet_since = [], 0, None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        awake = part.next_awake()
        if awake is not None:
            time.sleep(max(0.0, (awake - datetime.now(UTC)).total_seconds()))
        try:
            batch = part.next_batch()
        except StopIteration:
            return seen, pauses
        pauses += part._paused and awake is None
        seen += batch
        if batch:
            quiet_since = None
        elif until(seen):
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > stop_after_s:
                return seen, pauses
    raise AssertionError(f"timed out with {len(seen)} messages")


def _produce_bursts(bootstrap: str, topic: str, bursts: int, per_burst: int, gap_s: float) -> list[bytes]:
    p = Producer(producer_config(bootstrap, **{"linger.ms": 0}))
    sent = []
    for b in range(bursts):
        for i in range(per_burst):
            v = f"{b}-{i}".encode()
            p.produce(topic, key=b"k", value=v, partition=0)
            sent.append(v)
        p.flush(10)
        time.sleep(gap_s)
    return sent


@pytest.mark.slow
def test_paused_readers_deliver_every_message_once_in_order(broker, topic_prefix):
    """Bursts separated by quiet spells longer than the idle backoff: the reader pauses between
    them (no fetching while idle) and still yields every message exactly once, in offset order, as
    Message tuples whose offset is the recovery state's next offset minus one."""
    ensure_topics(broker.bootstrap, topic_prefix, 2)  # the fixture made them with 2 partitions
    topic = topic_prefix + "events"
    src = kafka_source(broker.bootstrap, [topic], 5.0, tail=True, idle_s=0.05)
    part = src.build_part("events_in", f"0-{topic}", None)
    sent = _produce_bursts(broker.bootstrap, topic, bursts=4, per_burst=250, gap_s=0.4)
    seen, pauses = _drain(part, lambda s: len(s) >= len(sent))
    assert [m.value for m in seen] == sent
    assert [m.offset for m in seen] == list(range(len(sent)))
    assert all(isinstance(m, Message) and m.partition == 0 and m.key == b"k" for m in seen)
    assert part.snapshot() == len(sent)
    assert pauses >= 4  # paused in every quiet spell (and asked Bytewax to wait) rather than fetching

    more = _produce_bursts(broker.bootstrap, topic, bursts=1, per_burst=10, gap_s=0)
    again, _ = _drain(part, lambda s: len(s) >= len(more), stop_after_s=0.3)
    assert [m.value for m in again] == more  # a paused reader resumes where it left off
    part.close()


def test_resume_state_and_bounded_run(broker, topic_prefix):
    """A reader built from a recovery offset starts there; with tail=False it ends (StopIteration)
    at the end of the partition even after quiet spells; a keyed source pairs each message with its
    partition."""
    ensure_topics(broker.bootstrap, topic_prefix, 2)  # the fixture made them with 2 partitions
    topic = topic_prefix + "events"
    sent = _produce_bursts(broker.bootstrap, topic, bursts=2, per_burst=50, gap_s=0)
    src = kafka_source(broker.bootstrap, [topic], 5.0, tail=False, idle_s=0.05)
    part = src.build_part("events_in", f"0-{topic}", 60)
    seen, _ = _drain(part, lambda s: False)  # returns only on StopIteration
    assert [m.offset for m in seen] == list(range(60, len(sent)))
    assert [m.value for m in seen] == sent[60:]
    part.close()

    keyed = kafka_source(broker.bootstrap, [topic], 5.0, tail=False, idle_s=0.05, keyed=True)
    part = keyed.build_part("events_in", f"0-{topic}", 95)
    pairs, _ = _drain(part, lambda s: False)
    assert [(k, m.offset) for k, m in pairs] == [("0", o) for o in range(95, 100)]  # ready for stateful_batch
    part.close()


def test_reader_of_an_empty_partition_pauses(broker, topic_prefix):
    """A reader of a partition that never had data pauses once the broker has answered (instead of
    re-fetching forever), and picks up the first message produced later."""
    ensure_topics(broker.bootstrap, topic_prefix, 2)  # the fixture made them with 2 partitions
    topic = topic_prefix + "events"
    part = kafka_source(broker.bootstrap, [topic], 5.0, tail=True, idle_s=0.05).build_part("in", f"0-{topic}", None)
    deadline = time.monotonic() + 30
    while not part._paused and time.monotonic() < deadline:
        assert part.next_batch() == []
    assert part._paused and part.next_awake() is not None
    sent = _produce_bursts(broker.bootstrap, topic, bursts=1, per_burst=3, gap_s=0)
    seen, _ = _drain(part, lambda s: len(s) >= 3, stop_after_s=0.3)
    assert [m.value for m in seen] == sent and seen[0].offset == 0
    part.close()
