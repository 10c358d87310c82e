"""The SDK: validate, hash user ids, buffer in a bounded queue, produce idempotently, flush on close.

Guarantees to the caller:

- ``record()`` never blocks: it validates, encodes and appends to a bounded in-memory queue.
  When the queue is full the event is dropped, counted in ``stats().dropped`` and logged
  (rate-limited) — never silently.
- One background thread owns the confluent-kafka producer (idempotent, ``acks=all``), keyed by
  ``trajectory_id`` so a trajectory's events stay ordered on one partition. While the broker is
  down, events wait in the producer and are retried until ``delivery_timeout_s``.
- ``close()`` drains the queue and flushes; what could not be delivered is reported in the stats.
- Invalid events raise :class:`InvalidEvent` (a programming error in the caller), naming the field.
  An event time outside the sane window around the SDK's clock (``max_future_s`` ahead,
  ``max_past_s`` behind) is invalid: a stamp far ahead would otherwise reach the reward flow as a
  hostile clock. A replay of recorded traffic passes its own clock (``record(event, now_ms=...)``),
  which is also the record's Kafka timestamp.
- Each trajectory has a data-use class (:mod:`schemas.data_use`): the stricter of ``start_trajectory``'s
  ``data_use`` and the org's policy (``governance``). Nothing of a ``none`` trajectory leaves the SDK, and
  :meth:`Trajectory.rollout` publishes no tokens of a ``monitor_only`` one. Both are counted in ``stats().withheld``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from confluent_kafka import Producer

from client.hashing import hash_user
from client.screening import Screen, screen_for
from rtrl import metrics
from rtrl.kafka import KafkaConnection, connection, produce, producer_config
from rtrl.sections.client import GovernanceSettings
from schemas.codec import DEFAULT_MAX_BYTES, Invalid, JsonCodec, event_codec
from schemas.data_use import DataUse, keeps_tokens, stricter
from schemas.records import (
    ClarifyingQuestion,
    EditAccepted,
    EditPersisted,
    EditProposed,
    EditRejected,
    EventBase,
    Followup,
    Latency,
    Rollout,
    SecretFound,
    TaskCheckin,
    TaskVerdict,
    ToolCall,
    TrajectoryEnded,
    TrajectoryStarted,
)

log = logging.getLogger("rtrl.client")


class InvalidEvent(Invalid):
    """An event the SDK refused to send; ``field`` and ``reason`` say what is wrong."""


@dataclass(frozen=True)
class ClientStats:
    """Counters of one client. ``accepted = delivered + failed + pending`` once callbacks ran. ``withheld``
    counts the events and rollouts a trajectory's data-use class kept in the SDK."""

    accepted: int
    delivered: int
    failed: int
    dropped: int
    invalid: int
    pending: int
    last_error: str | None
    withheld: int = 0


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class RtrlClient:
    """Thread-safe event recorder for one process. Use as a context manager or call ``close()``."""

    def __init__(
        self,
        bootstrap: str,
        *,
        salt: str,
        topic: str = "rtrl.events",
        queue_size: int = 100_000,
        linger_ms: int = 5,
        delivery_timeout_s: float = 300.0,
        max_event_bytes: int = DEFAULT_MAX_BYTES,
        compression: str = "zstd",
        producer_overrides: dict[str, Any] | None = None,
        security: Mapping[str, str] | None = None,
        max_future_s: float = 600.0,
        max_past_s: float = 7 * 86400.0,
        rollouts_topic: str = "rtrl.rollouts",
        governance: GovernanceSettings | None = None,
    ):
        """``bootstrap``: the brokers; a :class:`rtrl.kafka.KafkaConnection` (what :meth:`from_settings` passes)
        brings its cluster's security. ``security``: librdkafka security properties for a secured cluster
        (``security.protocol``, ``sasl.*``, ``ssl.*``), e.g. ``rtrl.kafka.security_config(settings.kafka)``;
        simpler, :meth:`from_settings` with ``load_settings()`` reads them from ``RTRL_KAFKA__*``.
        ``governance``: each org's data-use policy (settings ``governance``); None lets every org's data train."""
        if len(salt) < 8:
            raise ValueError("salt must be at least 8 characters (setting sdk.salt)")
        self.topic, self.rollouts_topic = topic, rollouts_topic
        self.governance = governance or GovernanceSettings()
        #: the secret screening of rollouts (client/screening.py); the policy server sets it with its decoder
        self.screen: Screen | None = None
        self.salt = salt
        self.max_future_ms, self.max_past_ms = int(max_future_s * 1000), int(max_past_s * 1000)
        self.queue_size = queue_size
        self._codec = event_codec(max_event_bytes)
        self._rollout_codec: JsonCodec[Rollout] = JsonCodec(Rollout)
        # topic, key, value, CreateTime (0: the producer's clock)
        self._queue: collections.deque[tuple[str, bytes, bytes, int]] = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self._accepted = self._delivered = self._failed = self._dropped = self._invalid = self._withheld = 0
        self._in_producer = 0
        self._last_error: str | None = None
        self._last_drop_log = 0.0
        if security:
            bootstrap = KafkaConnection(str(bootstrap), getattr(bootstrap, "security", {}) | dict(security))
        cfg = producer_config(
            bootstrap,
            compression,
            **{
                "linger.ms": linger_ms,
                "message.timeout.ms": int(delivery_timeout_s * 1000),
                "error_cb": self._on_error,
            },
        )
        self._producer = Producer(cfg | (producer_overrides or {}))
        self._thread = threading.Thread(target=self._run, name="rtrl-client-producer", daemon=True)
        self._thread.start()

    @classmethod
    def from_settings(cls, settings: Any, bootstrap: str | None = None) -> RtrlClient:
        """A client configured from :class:`rtrl.settings.Settings` (``sdk`` and ``kafka`` sections, the
        cluster's security included)."""
        s = settings.sdk
        client = cls(
            connection(settings.kafka, bootstrap),
            salt=s.salt,
            topic=settings.topic("events"),
            queue_size=s.queue_size,
            linger_ms=s.linger_ms,
            delivery_timeout_s=s.delivery_timeout_s,
            max_event_bytes=s.max_event_bytes,
            compression=settings.kafka.compression,
            max_future_s=s.max_future_s,
            max_past_s=s.max_past_s,
            rollouts_topic=settings.topic("rollouts"),
            governance=settings.governance,
        )
        # rollouts are screened for secrets with the model folder's tokenizer (governance.secret_scanner)
        client.screen = screen_for(settings.governance.secret_scanner, settings.model.hf_path)
        return client

    # ------------------------------------------------------------ recording

    def hash_user(self, user_id: str) -> str:
        return hash_user(user_id, self.salt)

    def start_trajectory(
        self,
        *,
        org_id: str,
        user_id: str,
        task_kind: str,
        policy_version: int,
        arm: str = "control",
        trajectory_id: str | None = None,
        ts: int | None = None,
        data_use: DataUse = "train",
    ) -> Trajectory:
        """Record ``trajectory_started`` and return a handle for the trajectory's other events.

        ``data_use`` is what the product allows for this trajectory. The org's policy (``governance``) may make it
        stricter, never looser. A ``none`` trajectory's handle records nothing."""
        use = self.governance.effective(org_id, data_use)
        traj = Trajectory(
            self, trajectory_id or uuid.uuid4().hex, org_id, self.hash_user(user_id), policy_version, arm, use
        )
        traj._emit(TrajectoryStarted, ts, task_kind=task_kind, data_use=use)
        return traj

    def record_rollout(self, rollout: Rollout, *, now_ms: int | None = None, topic: str | None = None) -> bool:
        """Validate and enqueue one rollout for ``topic`` (default: the rollouts topic), keyed by its trajectory.
        False when the queue is full. Use :meth:`Trajectory.rollout`, which applies the trajectory's data-use
        class."""
        try:
            data = self._rollout_codec.encode(rollout)
        except Invalid as e:
            self._invalid += 1
            raise InvalidEvent(e.field, e.reason) from None
        stamp = 0 if now_ms is None else now_ms
        return self._enqueue(topic or self.rollouts_topic, rollout.trajectory_id.encode(), data, stamp)

    def withhold(self, data_use: str) -> bool:
        """Count one record the SDK keeps back, by why: the trajectory's data-use class, or ``secret`` (a secret
        in a rollout); False, as nothing was sent."""
        with self._lock:
            self._withheld += 1
        metrics.SDK_WITHHELD.labels(data_use).inc()
        return False

    def record(self, event: EventBase, *, now_ms: int | None = None) -> bool:
        """Validate and enqueue one event. False when it was dropped because the queue is full.

        ``now_ms`` is the producer's clock (default: the wall clock). Its event time must lie within the sane
        window around it, and it becomes the record's Kafka timestamp."""
        now = _now_ms() if now_ms is None else now_ms
        try:
            if not now - self.max_past_ms <= event.ts <= now + self.max_future_ms:
                ahead = event.ts > now
                raise Invalid(
                    "$.ts",
                    f"event time {event.ts} is {abs(event.ts - now)} ms {'ahead of' if ahead else 'behind'} the "
                    f"producer's clock {now}; the SDK accepts at most {self.max_future_ms} ms ahead and "
                    f"{self.max_past_ms} ms behind (sdk.max_future_s, sdk.max_past_s)",
                )
            data = self._codec.encode(event)
            self._codec.decode(data)
        except Invalid as e:
            self._invalid += 1
            raise InvalidEvent(e.field, e.reason) from None
        return self._enqueue(self.topic, event.trajectory_id.encode(), data, 0 if now_ms is None else now_ms)

    def _enqueue(self, topic: str, key: bytes, data: bytes, stamp: int) -> bool:
        if self._closing:
            raise RuntimeError("RtrlClient is closed")
        with self._lock:
            if len(self._queue) >= self.queue_size:
                self._dropped += 1
                since = time.monotonic()
                if since - self._last_drop_log > 10.0:
                    self._last_drop_log = since
                    log.warning("rtrl client queue full (%d events): dropped %d so far", self.queue_size, self._dropped)
                return False
            self._queue.append((topic, key, data, stamp))
            self._accepted += 1
        if not self._wake.is_set():
            self._wake.set()
        return True

    # ------------------------------------------------------------ background producer

    def _on_error(self, err: Any) -> None:
        self._last_error = str(err)

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        self._in_producer -= 1
        if err is None:
            self._delivered += 1
        else:
            self._failed += 1
            self._last_error = str(err)

    def _run(self) -> None:
        producer = self._producer
        while True:
            self._wake.wait(0.05)
            self._wake.clear()
            queue, on_delivery, n = self._queue, self._on_delivery, 0
            while queue:
                topic, key, value, stamp = queue[0]
                # waits while the producer's own queue is full (e.g. broker down), never drops
                produce(producer, topic, value, key, on_delivery, poll_s=0.05, timestamp=stamp)
                queue.popleft()
                self._in_producer += 1
                n += 1
                if n % 1000 == 0:  # serve delivery callbacks without paying for a poll per event
                    producer.poll(0)
            producer.poll(0)
            if self._closing and not self._queue:
                return

    # ------------------------------------------------------------ lifecycle

    def stats(self) -> ClientStats:
        return ClientStats(
            accepted=self._accepted,
            delivered=self._delivered,
            failed=self._failed,
            dropped=self._dropped,
            invalid=self._invalid,
            pending=len(self._queue) + self._in_producer,
            last_error=self._last_error,
            withheld=self._withheld,
        )

    def flush(self, timeout_s: float = 30.0) -> int:
        """Wait until everything accepted so far is delivered or failed; return what is still pending."""
        deadline = time.monotonic() + timeout_s
        while self._queue and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.01)
        while self._in_producer > 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker thread polls delivery callbacks
        return self.stats().pending

    def close(self, timeout_s: float = 30.0) -> ClientStats:
        """Drain, flush and stop; returns the final stats (logs an error if anything is undelivered)."""
        if not self._closing:
            self.flush(timeout_s)
            self._closing = True
            self._wake.set()
            self._thread.join(timeout=max(1.0, timeout_s))
            self._producer.flush(0.5)
        stats = self.stats()
        if stats.pending or stats.failed or stats.dropped:
            log.error(
                "rtrl client closed with %d pending, %d failed, %d dropped events (last error: %s)",
                stats.pending,
                stats.failed,
                stats.dropped,
                stats.last_error,
            )
        return stats

    def __enter__(self) -> RtrlClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Trajectory:
    """Handle for one trajectory; each method records one event (``ts`` defaults to now).

    ``data_use`` is the trajectory's class. Under ``none`` every method records nothing and returns False."""

    def __init__(
        self,
        client: RtrlClient,
        trajectory_id: str,
        org_id: str,
        user_hash: str,
        policy_version: int,
        arm: str,
        data_use: DataUse = "train",
    ):
        self.client = client
        self.trajectory_id = trajectory_id
        self.org_id = org_id
        self.user_hash = user_hash
        self.policy_version = policy_version
        self.arm = arm
        self.data_use: DataUse = data_use

    def rollout(self, rollout: Rollout, *, now_ms: int | None = None, topic: str | None = None) -> bool:
        """Publish the rollout that served this trajectory, with the trajectory's data-use class.

        No token of a ``monitor_only`` or ``none`` trajectory leaves the SDK: the rollout is withheld and counted.
        False when it was withheld or dropped."""
        if rollout.trajectory_id != self.trajectory_id or rollout.org_id != self.org_id:
            raise InvalidEvent("$.trajectory_id", "the rollout belongs to another trajectory or org than this handle")
        if not keeps_tokens(self.data_use):
            return self.client.withhold(self.data_use)
        screen = self.client.screen
        findings = screen.rollout(rollout.prompt_ids, rollout.completion_ids) if screen is not None else []
        if findings:  # kept back: the finding says where, never what; the trajectory trains nothing from now on
            for f in findings:
                metrics.SECRETS_FOUND.labels(f.detector).inc()
                self._emit(SecretFound, None, detector=f.detector, location=f.location, char_offset=f.char_offset)
            self.data_use = stricter(self.data_use, "monitor_only")
            return self.client.withhold("secret")
        ro = msgspec.structs.replace(rollout, data_use=self.data_use)
        return self.client.record_rollout(ro, now_ms=now_ms, topic=topic)

    def _emit(self, cls: type[EventBase], ts: int | None, **payload: Any) -> bool:
        if self.data_use == "none":
            return self.client.withhold(self.data_use)
        event = cls(
            event_id=uuid.uuid4().hex,
            trajectory_id=self.trajectory_id,
            ts=_now_ms() if ts is None else ts,
            org_id=self.org_id,
            user_hash=self.user_hash,
            policy_version=self.policy_version,
            arm=self.arm,
            **payload,
        )
        return self.client.record(event)

    def tool_call(self, tool: str, valid: bool, error: str | None = None, ts: int | None = None) -> bool:
        return self._emit(ToolCall, ts, tool=tool, valid=valid, error=error)

    def edit_proposed(self, lines: int, edit_id: str | None = None, ts: int | None = None) -> str:
        edit_id = edit_id or uuid.uuid4().hex
        self._emit(EditProposed, ts, edit_id=edit_id, lines=lines)
        return edit_id

    def edit_accepted(self, edit_id: str, ts: int | None = None) -> bool:
        return self._emit(EditAccepted, ts, edit_id=edit_id)

    def edit_rejected(self, edit_id: str, ts: int | None = None) -> bool:
        return self._emit(EditRejected, ts, edit_id=edit_id)

    def edit_persisted(self, edit_id: str, fraction: float, checked_after_s: float, ts: int | None = None) -> bool:
        return self._emit(EditPersisted, ts, edit_id=edit_id, fraction=fraction, checked_after_s=checked_after_s)

    def followup(
        self,
        sentiment: Literal["dissatisfied", "neutral", "satisfied"],
        question_needed: bool | None = None,
        ts: int | None = None,
    ) -> bool:
        return self._emit(Followup, ts, sentiment=sentiment, question_needed=question_needed)

    def clarifying_question(self, ts: int | None = None) -> bool:
        return self._emit(ClarifyingQuestion, ts)

    def latency(self, ttft_ms: float, total_ms: float, ts: int | None = None) -> bool:
        return self._emit(Latency, ts, ttft_ms=ttft_ms, total_ms=total_ms)

    def end(self, status: Literal["completed", "abandoned", "error"] = "completed", ts: int | None = None) -> bool:
        return self._emit(TrajectoryEnded, ts, status=status)

    def checkin(
        self, progress: float, sentiment: Literal["dissatisfied", "neutral", "satisfied"], ts: int | None = None
    ) -> bool:
        """A background task's interim check-in and the user's reaction to it (a provisional signal)."""
        return self._emit(TaskCheckin, ts, progress=progress, sentiment=sentiment)

    def verdict(
        self,
        verdict: Literal["merged", "partly_kept", "discarded"],
        fraction: float,
        verdict_after_s: float,
        ts: int | None = None,
    ) -> bool:
        """The user's verdict on a whole background task, sent when it comes (hours or days after the end): the
        reward flow revises the task's provisional reward with it."""
        return self._emit(TaskVerdict, ts, verdict=verdict, fraction=fraction, verdict_after_s=verdict_after_s)
