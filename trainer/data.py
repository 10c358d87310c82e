"""Streamed input of the trainer: micro-batches from Kafka ``rtrl.batches`` for one data-parallel rank.

- **Partitions are divided among DP ranks**: rank ``r`` of ``dp`` reads partitions ``p`` with
  ``p % dp == r`` by explicit assignment (no consumer-group rebalancing can move them mid-step).
- **Offsets belong to checkpoints.** The stream starts from the offsets stored in the checkpoint being
  resumed (else from the beginning). :meth:`BatchStream.position` is what the next checkpoint must
  store; :meth:`BatchStream.commit` commits it to the consumer group only after the optimizer step
  that used the batches (for lag monitoring — the checkpoint stays the source of truth), so a resumed
  run neither skips nor repeats a micro-batch.
- **Invalid micro-batches** (not Arrow IPC, wrong schema, ragged rows, corrupted bytes of any kind, a
  shape or token ids outside the model's ``limits``) are dead-lettered to ``rtrl.dead_letters`` with
  the reason and skipped; their offsets still advance. Decoding raises nothing but ``Invalid``. A batch refused
  for a sample's data-use class (kind ``data_use``), or for a sample of an erased subject (kind ``erased``, the
  ``deny`` list of `rtrl erase`), is dead-lettered without its payload: its tokens stay nowhere.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from rtrl import metrics
from rtrl.errors import ServiceUnavailable
from rtrl.kafka import base_config, check_broker, producer_config
from schemas.codec import Invalid, JsonCodec, dead_letter
from schemas.erasure import DenySource
from schemas.records import DeadLetter
from trainer.batch import Batch, BatchLimits, to_batch

GROUP = "rtrl-trainer"


class BatchStream:
    """Micro-batches of the partitions owned by one DP rank, resumable from stored offsets."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        dead_letter_topic: str,
        dp_rank: int = 0,
        dp_size: int = 1,
        start: dict[str, int] | None = None,
        timeout_s: float = 10.0,
        limits: BatchLimits | None = None,
        deny: DenySource | None = None,
    ):
        self.limits, self.deny = limits, deny
        meta = check_broker(bootstrap, timeout_s)
        if topic not in meta.topics:
            raise ServiceUnavailable(f"topic {topic} does not exist on {bootstrap}; fix: run `rtrl topics`")
        self.topic, self.dead_letter_topic = topic, dead_letter_topic
        self.partitions = sorted(p for p in meta.topics[topic].partitions if p % dp_size == dp_rank)
        if not self.partitions:
            raise ValueError(f"{topic} has {len(meta.topics[topic].partitions)} partitions: too few for dp={dp_size}")
        start = start or {}
        self.next = {p: int(start.get(f"{topic}/{p}", 0)) for p in self.partitions}
        self.committed = dict(self.next)
        self.consumer = Consumer(
            base_config(bootstrap)
            | {
                "group.id": GROUP,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "enable.partition.eof": False,
            }
        )
        self.consumer.assign([TopicPartition(topic, p, self.next[p]) for p in self.partitions])
        self.producer = Producer(producer_config(bootstrap))
        self.dead_letters = 0
        self._codec: JsonCodec[DeadLetter] = JsonCodec(DeadLetter)

    def position(self) -> dict[str, int]:
        """Next offset to read per ``topic/partition``: store it in the checkpoint."""
        return {f"{self.topic}/{p}": o for p, o in sorted(self.next.items())}

    def get(self, timeout_s: float = 30.0) -> Batch | None:
        """The next valid micro-batch, or None when none arrived within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.consumer.poll(min(0.5, max(0.01, deadline - time.monotonic())))
            if msg is None or msg.error():
                continue
            p, off, value = msg.partition(), msg.offset(), msg.value()
            assert p is not None and off is not None  # set on every consumed message
            self.next[p] = off + 1
            try:
                if value is None:  # a null (tombstone) message: dead-lettered like any malformed payload
                    raise Invalid("$", "empty message (null value)", "malformed")
                batch = to_batch(value, p, off, self.limits)
                self._check_erased(batch)
                return batch
            except Invalid as e:
                self._dead_letter(msg, e)
        return None

    def _check_erased(self, batch: Batch) -> None:
        """Refuse a batch holding a sample of an erased subject (`rtrl erase`), made before its erasure."""
        if self.deny is None:
            return
        deny = self.deny.current()
        for i, sid in enumerate(batch.sample_ids):
            if deny.denies(sid):
                metrics.ERASED_SKIPPED.labels(consumer="trainer").inc()
                raise Invalid(f"$.sample_ids[{i}]", f"sample {sid} belongs to an erased subject (rtrl erase)", "erased")

    def _dead_letter(self, msg: Any, err: Invalid) -> None:

        dl = dead_letter(
            err.kind,
            err.field,
            err.reason,
            self.topic,
            msg.partition(),
            msg.offset(),
            msg.key(),
            b"" if err.kind in ("data_use", "erased") else msg.value(),  # a refused sample's tokens are kept nowhere
            time.time_ns() // 1_000_000,
        )
        self.producer.produce(self.dead_letter_topic, key=self.topic.encode(), value=self._codec.encode(dl))
        if self.producer.flush(30) != 0:
            raise ServiceUnavailable(f"dead letter for {self.topic}/{msg.partition()}@{msg.offset()} not acknowledged")
        self.dead_letters += 1
        metrics.DEAD_LETTERS.labels("trainer", err.kind).inc()

    def committed_position(self) -> dict[str, int]:
        """The position as of the last :meth:`commit` (or the start): where a next run continues
        without skipping micro-batches read for a step that was not taken."""
        return {f"{self.topic}/{p}": o for p, o in sorted(self.committed.items())}

    def commit(self) -> None:
        """Commit the current position to the consumer group (call after the optimizer step)."""
        self.committed = dict(self.next)
        self.consumer.commit(
            offsets=[TopicPartition(self.topic, p, o) for p, o in self.next.items()], asynchronous=False
        )

    def close(self) -> None:
        self.consumer.close()
        self.producer.flush(10)
