"""Kafka sources for Bytewax flows: guarded against unreachable brokers, lean, and quiet when idle.

Bytewax's ``KafkaSource`` lists partitions with no deadline (about ten minutes of retries when the
broker is down), so every source is built only after :func:`rtrl.kafka.check_broker` answered
within ``kafka.timeout_s``.

:class:`PacedKafkaSource` is Bytewax's ``KafkaSource`` (same partitions, same recovery state: the
next offset per partition) with two changes to each partition's reader:

* it emits :class:`flows.processor.Message` tuples (key, value, partition, offset, record timestamp) instead of
  building a ``KafkaSourceMessage`` dataclass per message — a third of the source's cost — and,
  when asked, pairs them with their partition as the key (no ``key_on`` call per message);
* a partition with nothing to read pauses its consumer for ``idle_s`` and tells Bytewax when to
  ask again (``next_awake``). A consumer at the end of its partition otherwise re-fetches in a tight
  loop whenever the broker answers fetches at once instead of holding them for ``fetch.wait.max.ms``
  (noida-db does: one idle consumer cost ~0.4 broker + ~0.45 client CPU seconds per second). The
  price is up to ``idle_s`` of extra latency after a quiet spell.

Stopping: Bytewax has no stop call; a dataflow ends when every input reaches its end. A ``stop``
event makes every partition end at its next poll, so the dataflow closes its last epoch, the sinks
flush and the final snapshot (offsets and state) is written. A :class:`Pause` (what
:func:`stop_on_signals` returns for SIGTERM/SIGINT) is such a stop that is not the end of the input:
the flows' stateful steps keep their open windows in that snapshot instead of closing them, so a
restart continues exactly where the stopped run left off.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from bytewax.connectors.kafka import KafkaSource
from bytewax.connectors.kafka import _KafkaSourcePartition as _BytewaxPartition
from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_NOT_AVAILABLE, TopicPartition
from confluent_kafka import KafkaError as ConfluentKafkaError

from flows.processor import Message
from rtrl import metrics
from rtrl.kafka import base_config, check_broker

#: Bytewax sources need ~1000 messages per poll for throughput (the default of 1 is ~5x slower).
SOURCE_BATCH_SIZE = 1000
#: a reader pauses only after its polls have found nothing for this long without a break: long
#: enough for a fetch to come back (pausing discards a fetch in flight), and measured from the first
#: empty poll, so a worker busy elsewhere between two polls never makes a reader pause
EMPTY_WINDOW_S = 0.05

_new_message = tuple.__new__  # Message(...) without the NamedTuple's Python-level __new__


class Pause(threading.Event):
    """A stop that pauses a flow run with recovery: its sources end (so Bytewax snapshots and returns)
    but the stateful steps keep what is open for the next run (:func:`paused`)."""


def paused(stop: threading.Event | None) -> bool:
    """Whether ``stop`` is a :class:`Pause` that was set: an end of input that is not the input's end."""
    return isinstance(stop, Pause) and stop.is_set()


def stop_on_signals() -> Pause:
    """A :class:`Pause` set by SIGTERM and SIGINT (main thread only). Without it SIGTERM kills a flow
    without a final snapshot, and SIGINT raises KeyboardInterrupt inside Bytewax's run loop, which
    ends the process with exit code 1 and a Rust panic."""
    stop = Pause()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


class _PacedPartition(_BytewaxPartition):
    """One Kafka partition's reader: lean messages, paused while there is nothing to read."""

    def __init__(
        self, *args, idle_s: float, timeout_s: float, key: str | None, stop: threading.Event | None = None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self._stop = stop
        self._idle_s = idle_s
        self._key = key
        self._tp = [TopicPartition(self._topic, self._part_idx)]
        if self._offset < 0:  # start from a concrete offset: a logical one (beginning/end) is
            # resolved again after each pause, which held back the first fetch for seconds
            low, high = self._consumer.get_watermark_offsets(self._tp[0], timeout=timeout_s)
            self._offset = low if self._offset == OFFSET_BEGINNING else high
            self._consumer.assign([TopicPartition(self._topic, self._part_idx, self._offset)])
        self._paused = False
        self._empty_since: float | None = None
        self._awake: datetime | None = None
        # the flow's name as the other metrics give it: "rewards" for the step rtrl_rewards.events_in
        step = str(self._metrics_labels["step_id"])
        flow = step.split(".", 1)[0].removeprefix("rtrl_") if "." in step else step
        where = {"flow": flow, "topic": self._topic, "partition": str(self._part_idx)}
        self._lag, self._polled = metrics.CONSUMER_LAG.labels(**where), metrics.CONSUMER_POLLED.labels(**where)
        self._lag_at = 0.0

    def next_awake(self) -> datetime | None:
        return self._awake

    def _caught_up(self) -> bool:
        """Whether the last fetch response showed nothing beyond what was read. Before any response
        (connecting, looking up the start offset) the answer is no: pausing then would restart that."""
        try:
            _, high = self._consumer.get_watermark_offsets(self._tp[0], cached=True)
        except Exception:  # noqa: BLE001 - no cached watermarks yet
            return False
        if high < 0:
            return False
        return self._offset >= high

    def _record_lag(self, now: float) -> None:
        """``rtrl_consumer_lag``: messages between the next unread offset and the partition's end, from the
        watermark of the last fetch response (no request of its own), at most every half second."""
        if now - self._lag_at < 0.5:
            return
        self._lag_at = now
        self._polled.set_to_current_time()  # a reader that stops polling (a stuck worker) shows as stale
        try:
            _, high = self._consumer.get_watermark_offsets(self._tp[0], cached=True)
        except Exception:  # noqa: BLE001 - no fetch response yet
            return
        if high >= 0:
            self._lag.set(max(0, high - self._offset))

    def next_batch(self) -> list:
        if self._eof or (self._stop is not None and self._stop.is_set()):
            raise StopIteration()
        self._record_lag(time.monotonic())
        if self._paused:  # woken up: fetch again
            self._consumer.resume(self._tp)
            # seeking to the next unread offset wakes the fetcher now (a bare resume waited ~1 s)
            self._consumer.seek(TopicPartition(self._topic, self._part_idx, self._offset))
            self._paused, self._awake, self._empty_since = False, None, None
        msgs = self._consumer.consume(self._batch_size, 0.001)
        if not msgs:
            now = time.monotonic()
            if self._empty_since is None:
                self._empty_since = now
            elif now - self._empty_since >= EMPTY_WINDOW_S and self._caught_up():
                self._consumer.pause(self._tp)  # librdkafka resumes from the next unread offset
                self._paused = True
                self._awake = datetime.now(UTC) + timedelta(seconds=self._idle_s)
            return []
        self._empty_since = None
        batch: list = []  # Messages, or (key, Message) pairs when keyed
        last: int | None = None
        for msg in msgs:
            error = msg.error()
            if error is not None:
                if error.code() == ConfluentKafkaError._PARTITION_EOF:
                    self._eof = True  # StopIteration on the next call, after this batch
                    break
                if self._raise_on_errors:
                    raise RuntimeError(f"error consuming from Kafka topic {self._topic!r}: {error}")
                continue
            last = msg.offset()
            kind, stamp = msg.timestamp()  # kind 0: the record has none
            record_ts = stamp if kind != TIMESTAMP_NOT_AVAILABLE else None
            batch.append(_new_message(Message, (msg.key(), msg.value(), self._part_idx, last, record_ts)))
        if self._key is not None:  # already keyed for a stateful step: saves a key_on call per message
            batch = [(self._key, m) for m in batch]
        if last is not None:
            self._offset = last + 1  # the recovery state: resume from the next message
        return batch


class PacedKafkaSource(KafkaSource):
    """Bytewax's ``KafkaSource`` whose partitions emit :class:`Message` and pause when idle."""

    def __init__(
        self,
        *args,
        idle_s: float = 0.1,
        timeout_s: float = 10.0,
        keys: Mapping[int, str] | None = None,
        stop: threading.Event | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self._idle_s, self._timeout_s, self._keys, self._stop = idle_s, timeout_s, keys, stop

    def build_part(self, step_id: str, for_part: str, resume_state: int | None) -> _PacedPartition:
        idx, topic = for_part.split("-", 1)
        if topic not in self._topics:
            raise ValueError(f"recovery state is for topic {topic!r}, not {self._topics}; use a new recovery directory")
        config = {  # self._add_config: base_config's (the security), see kafka_source
            "group.id": "BYTEWAX_IGNORED",  # offsets live in Bytewax's recovery state, not a group
            "enable.auto.commit": "false",
            "bootstrap.servers": ",".join(self._brokers),
            "enable.partition.eof": str(not self._tail),
            "statistics.interval.ms": 1000,
        } | self._add_config
        return _PacedPartition(
            step_id,
            config,
            topic,
            int(idx),
            self._starting_offset,
            resume_state,
            self._batch_size,
            self._raise_on_errors,
            idle_s=self._idle_s,
            timeout_s=self._timeout_s,
            key=None if self._keys is None else self._keys.get(int(idx), idx),
            stop=self._stop,
        )


def kafka_source(
    bootstrap: str,
    topics: list[str],
    timeout_s: float = 10.0,
    tail: bool = True,
    idle_s: float = 0.1,
    keyed: bool = False,
    stop: threading.Event | None = None,
    keys: Mapping[int, str] | None = None,
) -> PacedKafkaSource:
    """A source over ``topics`` after checking, within ``timeout_s``, that they exist. With ``keyed``
    it emits ``(key, Message)`` pairs, ready for a stateful step keyed by partition: the key is ``keys[partition]``
    (a cluster's, from :func:`flows.routing.balanced_keys`, spreads the partitions over its workers), else
    ``str(partition)``. Setting
    ``stop`` ends every partition at its next poll, so a tailing flow run in-process finishes cleanly
    (its sinks flush and it returns) - Bytewax itself has no stop call."""
    meta = check_broker(bootstrap, timeout_s)
    missing = [t for t in topics if t not in meta.topics]
    if missing:
        from rtrl.errors import ServiceUnavailable

        raise ServiceUnavailable(f"topics {missing} do not exist on {bootstrap}; fix: run `rtrl topics` first")
    return PacedKafkaSource(
        [str(bootstrap)],
        topics,
        tail=tail,
        batch_size=SOURCE_BATCH_SIZE,
        idle_s=idle_s,
        timeout_s=timeout_s,
        keys=(dict(keys) if keys else {}) if keyed else None,
        stop=stop,
        # base_config: the cluster's security (a KafkaConnection's) and the logger; Bytewax adds add_config to
        # its partition-listing AdminClient too, build_part to each partition's consumer
        add_config=base_config(bootstrap)
        | {
            "socket.connection.setup.timeout.ms": str(int(timeout_s * 1000)),
            # Each partition has its own consumer. Bounded prefetch and few, large, long-polled
            # fetches keep four consumers from out-fetching the worker (bench/RESULTS.md: 7.8k ->
            # 35k events/s on 2 cores); a 16 MB prefetch with 8 MB fetches halved throughput again.
            "queued.max.messages.kbytes": "4096",
            "fetch.min.bytes": "1048576",
            "max.partition.fetch.bytes": "4194304",
            "fetch.wait.max.ms": "500",
            # Bytewax asks each consumer for librdkafka's statistics JSON every second only to
            # export a consumer-lag gauge; building and parsing it is pure overhead here
            "statistics.interval.ms": "0",
        },
    )
