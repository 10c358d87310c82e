"""Kafka ``rtrl.events`` -> ClickHouse ``events``, with bad input dead-lettered.

The raw-events half of what flows/rewards will do, usable on its own (``rtrl load``) and by the
main job until the reward flow lands. Delivery: a consumer group whose offsets are committed only
after the batch is in ClickHouse (at-least-once), into a ReplacingMergeTree keyed by
(trajectory_id, event_id) — so a crash and restart re-inserts at most one batch, which replaces
itself: nothing lost, nothing double-counted under FINAL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from confluent_kafka import Consumer, Producer, TopicPartition

from rtrl import clickhouse
from rtrl.kafka import base_config, check_broker, producer_config
from schemas.codec import Invalid, JsonCodec, event_codec
from schemas.records import DeadLetter

GROUP = "rtrl-events-loader"


@dataclass
class LoadResult:
    """Messages read, events inserted, and inputs dead-lettered by one load."""

    read: int = 0
    inserted: int = 0
    dead_lettered: int = 0


def _lenient(data: bytes | None, limit: int = 4096) -> str:
    return "" if data is None else data[:limit].decode("utf-8", errors="replace")


def dead_letter(msg: Any, err: Invalid) -> DeadLetter:
    """The dead-letter record for a Kafka message that failed validation."""
    return DeadLetter(
        kind=err.kind, source=msg.topic(), partition=msg.partition(), offset=msg.offset(),
        key=None if msg.key() is None else _lenient(msg.key(), 256),
        field=err.field, reason=err.reason, payload=_lenient(msg.value()), at=time.time_ns() // 1_000_000,
    )


def load_events(
    bootstrap: str,
    events_topic: str,
    dead_letter_topic: str,
    ch: Any,
    database: str,
    *,
    max_event_bytes: int = 64 * 1024,
    batch_size: int = 5000,
    timeout_s: float = 60.0,
    on_batch: Callable[[LoadResult], None] | None = None,
) -> LoadResult:
    """Load everything up to the topic's current end, then return (offsets committed per batch)."""
    meta = check_broker(bootstrap, min(timeout_s, 10.0))
    parts = list(meta.topics[events_topic].partitions) if events_topic in meta.topics else []
    codec, dl_codec = event_codec(max_event_bytes), JsonCodec(DeadLetter)
    consumer = Consumer(
        base_config(bootstrap)
        | {"group.id": GROUP, "enable.auto.commit": False, "auto.offset.reset": "earliest", "isolation.level": "read_committed"}
    )
    producer = Producer(producer_config(bootstrap))
    result = LoadResult()
    try:
        committed = consumer.committed([TopicPartition(events_topic, p) for p in parts], timeout=timeout_s)
        ends, starts = {}, []
        for tp in committed:
            low, high = consumer.get_watermark_offsets(TopicPartition(events_topic, tp.partition), timeout=timeout_s)
            start = tp.offset if tp.offset >= 0 else low
            if high > start:
                ends[tp.partition] = high
                starts.append(TopicPartition(events_topic, tp.partition, start))
        consumer.assign(starts)
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise TimeoutError(f"loading {events_topic} did not reach its end within {timeout_s:g}s")
            msgs = [m for m in consumer.consume(batch_size, 0.5) if not m.error()]
            if not msgs:
                continue
            good, bad = [], []
            for m in msgs:
                try:
                    good.append(codec.decode(m.value()))
                except Invalid as e:
                    bad.append(dead_letter(m, e))
                if m.partition() in ends and m.offset() >= ends[m.partition()] - 1:
                    del ends[m.partition()]
            clickhouse.insert(ch, database, "events", good)
            if bad:
                clickhouse.insert(ch, database, "dead_letters", bad)
                for d in bad:
                    producer.produce(dead_letter_topic, key=d.source.encode(), value=dl_codec.encode(d))
                if producer.flush(timeout_s) != 0:
                    raise TimeoutError(f"dead letters not acknowledged by {bootstrap} within {timeout_s:g}s")
            consumer.commit(asynchronous=False)  # only after ClickHouse (and the DLQ) have the batch
            result.read += len(msgs)
            result.inserted += len(good)
            result.dead_lettered += len(bad)
            if on_batch:
                on_batch(result)
    finally:
        consumer.close()
    return result
