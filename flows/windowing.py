"""Per-trajectory windows for one Kafka partition: a pure, deterministic state machine.

**The clock.** Each partition has its own event-time watermark: the largest event time seen on it.
Nothing reads the wall clock, so the output is a function of the partition's message sequence
alone — stopping the flow for hours and restarting it (or replaying after a crash) changes no
result, and neither does how Bytewax batches messages or how many workers run. A trajectory's
events share its Kafka key, so they all live on one partition and see one clock. The price: an
idle partition's windows close only when newer data arrives on it, or at end of input.

**When a window closes** (per trajectory, from its first event ``first_ts``):

- *ended*: it has ended, every accepted edit's persistence check has arrived, and the watermark
  passed ``ended_ts + grace`` (time for events overtaken in delivery);
- *deadline*: the watermark passed ``first_ts + deadline`` (or the input ended).

A closed window is kept until the watermark passes ``first_ts + deadline + allowed_lateness``.
An event arriving for it meanwhile re-closes it as a new ``revision`` (close reason *late*).
Later events for it, events older than the retention horizon, duplicates, events far ahead of
the watermark (a hostile clock), and the events of trajectories that never started are rejected
with a dead-letter kind and reason — never silently dropped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from schemas.records import (
    CloseReason,
    DeadLetterKind,
    EditAccepted,
    EditPersisted,
    EventBase,
    TrajectoryEnded,
    TrajectoryStarted,
)


@dataclass(frozen=True)
class WindowConfig:
    """Event-time rules of the reward windows (milliseconds)."""

    deadline_ms: int = 3_600_000
    grace_ms: int = 10_000
    allowed_lateness_ms: int = 86_400_000
    max_future_ms: int = 86_400_000

    @property
    def retention_ms(self) -> int:
        return self.deadline_ms + self.allowed_lateness_ms


@dataclass(frozen=True, slots=True)
class Closed:
    """A window (re)closed: all of its distinct events so far."""

    trajectory_id: str
    revision: int
    close_reason: CloseReason
    events: tuple[EventBase, ...]


@dataclass(frozen=True, slots=True)
class Rejected:
    """An event refused by the windowing rules (``kind`` is a DeadLetter kind)."""

    kind: DeadLetterKind
    reason: str
    trajectory_id: str
    offset: int
    event: EventBase


class _Window:
    __slots__ = (
        "first_ts",
        "ended_ts",
        "started",
        "accepted",
        "persisted",
        "ids",
        "events",
        "offsets",
        "revision",
        "seq",
    )

    def __init__(self, first_ts: int):
        self.first_ts = first_ts
        self.ended_ts: int | None = None
        self.started = False
        self.accepted: set[str] | None = None  # created on first use: most windows never need them
        self.persisted: set[str] | None = None
        self.ids: set[str] = set()
        self.events: list[EventBase] = []
        self.offsets: list[int] = []
        self.revision = -1  # -1 while open
        self.seq = 0  # bumps invalidate stale heap entries

    def add(self, event: EventBase, offset: int) -> None:
        self.ids.add(event.event_id)
        self.events.append(event)
        self.offsets.append(offset)
        t = type(event)  # records are final classes: identity is cheaper than isinstance
        if t is TrajectoryStarted:
            self.started = True
        elif t is TrajectoryEnded:
            self.ended_ts = event.ts if self.ended_ts is None else max(self.ended_ts, event.ts)
        elif t is EditAccepted:
            self.accepted = (self.accepted or set()) | {event.edit_id}  # type: ignore[attr-defined]  # t is EditAccepted
        elif t is EditPersisted:
            self.persisted = (self.persisted or set()) | {event.edit_id}  # type: ignore[attr-defined]  # t is EditPersisted

    @property
    def complete(self) -> bool:
        return self.ended_ts is not None and (not self.accepted or self.accepted <= (self.persisted or set()))


@dataclass
class PartitionWindows:
    """All trajectory windows of one partition. Feed events in partition order with :meth:`ingest`."""

    config: WindowConfig = field(default_factory=WindowConfig)
    partition: int = -1  # the Kafka partition these windows belong to (for dead letters)
    watermark: int | None = None
    open: dict[str, _Window] = field(default_factory=dict)
    closed: dict[str, _Window] = field(default_factory=dict)
    tombstones: dict[str, int] = field(default_factory=dict)
    _deadlines: list[tuple[int, str]] = field(default_factory=list)
    _ready: list[tuple[int, str, int]] = field(default_factory=list)
    _retention: list[tuple[int, str]] = field(default_factory=list)
    _expiry: list[tuple[int, str]] = field(default_factory=list)

    # ------------------------------------------------------------ input

    def ingest(self, event: EventBase, offset: int) -> list[Closed | Rejected]:
        """Apply one event; return the windows it closed and whether it was rejected."""
        cfg, tid, wm = self.config, event.trajectory_id, self.watermark
        if wm is not None and event.ts > wm + cfg.max_future_ms:
            return [
                Rejected(
                    "future",
                    f"event time {event.ts} is more than {cfg.max_future_ms} ms ahead of the "
                    f"partition's watermark {wm}",
                    tid,
                    offset,
                    event,
                )
            ]
        out: list[Closed | Rejected] = []
        if tid in self.tombstones:
            out.append(
                self._too_late(tid, offset, event, "its window expired (closed longer than the allowed lateness)")
            )
        elif tid in self.closed:
            w = self.closed[tid]
            if event.event_id in w.ids:
                out.append(Rejected("duplicate", f"duplicate event_id {event.event_id}", tid, offset, event))
            elif event.ts > w.first_ts + cfg.retention_ms:
                out.append(self._too_late(tid, offset, event, "its event time is past the window's allowed lateness"))
            else:
                w.add(event, offset)
                w.revision += 1
                out.append(Closed(tid, w.revision, "late", tuple(w.events)))
        elif tid in self.open:
            w = self.open[tid]
            if event.event_id in w.ids:
                out.append(Rejected("duplicate", f"duplicate event_id {event.event_id}", tid, offset, event))
            else:
                w.add(event, offset)
                self._schedule(tid, w)
        elif wm is not None and event.ts < wm - cfg.retention_ms:
            out.append(self._too_late(tid, offset, event, "it is older than the retention horizon of its window"))
        else:
            w = _Window(event.ts)
            w.add(event, offset)
            self.open[tid] = w
            heapq.heappush(self._deadlines, (w.first_ts + cfg.deadline_ms, tid))
            self._schedule(tid, w)
        if wm is None or event.ts > wm:
            self.watermark = event.ts
        out.extend(self._advance())
        return out

    def flush(self) -> list[Closed | Rejected]:
        """End of input: close every open window by deadline (in first-event order)."""
        out: list[Closed | Rejected] = []
        for tid in sorted(self.open, key=lambda t: (self.open[t].first_ts, t)):
            out.extend(self._close(tid, "deadline"))
        return out

    # ------------------------------------------------------------ internals

    def _too_late(self, tid: str, offset: int, event: EventBase, why: str) -> Rejected:
        return Rejected(
            "too_late",
            f"later than the allowed lateness of {self.config.allowed_lateness_ms} ms: {why}",
            tid,
            offset,
            event,
        )

    def _schedule(self, tid: str, w: _Window) -> None:
        if w.complete:
            assert w.ended_ts is not None  # complete implies ended
            w.seq += 1
            heapq.heappush(self._ready, (w.ended_ts + self.config.grace_ms, tid, w.seq))

    def _close(self, tid: str, reason: CloseReason) -> list[Closed | Rejected]:
        w = self.open.pop(tid)
        if not w.started:
            self.tombstones[tid] = w.first_ts + 2 * self.config.retention_ms
            heapq.heappush(self._expiry, (self.tombstones[tid], tid))
            return [
                Rejected(
                    "never_started",
                    "its trajectory never sent trajectory_started before the window closed",
                    tid,
                    off,
                    e,
                )
                for off, e in zip(w.offsets, w.events)
            ]
        w.revision = 0
        self.closed[tid] = w
        heapq.heappush(self._retention, (w.first_ts + self.config.retention_ms, tid))
        return [Closed(tid, 0, reason, tuple(w.events))]

    def _advance(self) -> list[Closed | Rejected]:
        wm = self.watermark
        out: list[Closed | Rejected] = []
        if wm is None:  # no event yet (only ingest calls this, after setting the watermark): nothing is due
            return out
        while self._ready and self._ready[0][0] <= wm:
            _, tid, seq = heapq.heappop(self._ready)
            w = self.open.get(tid)
            if w is not None and w.seq == seq and w.complete:
                out.extend(self._close(tid, "ended"))
        while self._deadlines and self._deadlines[0][0] <= wm:
            _, tid = heapq.heappop(self._deadlines)
            if tid in self.open:
                out.extend(self._close(tid, "deadline"))
        while self._retention and self._retention[0][0] < wm:
            horizon, tid = heapq.heappop(self._retention)
            if self.closed.pop(tid, None) is not None:
                self.tombstones[tid] = horizon + self.config.allowed_lateness_ms
                heapq.heappush(self._expiry, (self.tombstones[tid], tid))
        while self._expiry and self._expiry[0][0] < wm:
            expiry, tid = heapq.heappop(self._expiry)
            if self.tombstones.get(tid) == expiry:
                del self.tombstones[tid]
        return out

    @property
    def open_count(self) -> int:
        return len(self.open)
