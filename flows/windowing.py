"""Per-trajectory windows for one Kafka partition: a pure, deterministic state machine.

**The clock.** Each partition has its own event-time watermark: the largest event time seen on it,
but never past the partition's *record clock*, the largest Kafka record timestamp seen on it.
That timestamp is the broker's append time (``rtrl.events`` is created with ``LogAppendTime``) or
the producer's clock. So an event stamped ahead cannot move the clock for the honest events after
it: one more than ``max_skew_ms`` ahead of its record's timestamp is rejected as ``future``, and
one within the skew opens its own window but advances the clock only to the record clock. Input
without record timestamps (in-process runs, archives written before they were kept) falls back to
the old bound: ``max_future_ms`` ahead of the watermark.
Nothing reads the wall clock, so the output is a function of the partition's message sequence
alone (record timestamps are part of it). Stopping the flow for hours and restarting it, or
replaying after a crash, changes no result, and neither does how Bytewax batches messages or how
many workers run. A trajectory's events share its Kafka key, so they all live on one partition
and see one clock. The price: an idle partition's windows close only when newer data arrives on
it, or at end of input.

**When a window closes** (per trajectory, from its first event ``first_ts``):

- *ended*: it has ended, every accepted edit's persistence check has arrived, and the watermark
  passed ``ended_ts + grace`` (time for events overtaken in delivery);
- *deadline*: the watermark passed ``first_ts + deadline`` (or the input ended).

A closed window is kept until the watermark passes ``first_ts + deadline + allowed_lateness``.
An event arriving for it meanwhile re-closes it as a new ``revision`` (close reason *late*).
Later events for it, events older than the retention horizon, duplicates, events far ahead of
the watermark (a hostile clock), and the events of trajectories that never started are rejected
with a dead-letter kind and reason — never silently dropped.

**Task kinds.** ``WindowConfig.kinds`` (``flow.task_kinds``) gives a task kind its own deadline and allowed lateness
(minutes for an interactive bugfix, days for a background task judged by a verdict long after it
ended). A window's kind is known once its ``trajectory_started`` arrives; from then on its deadline,
retention and tombstone horizons are its kind's (before that, the defaults). A deadline that moves
pushes a new schedule entry; entries are checked against the window's current due time when they
come up, so a stale one never closes a window early.

**Bounded state.** With a :class:`ColdStore` and ``budget_bytes`` > 0, the windows kept in memory
(open, closed-but-retained, tombstones) are bounded: when their estimated size passes the budget,
the least recently touched are moved to the store in one batch (down to 80% of the budget), with
the due times that drive them (ready, deadline, retention horizon, tombstone expiry, first event) as
keys. An event for a trajectory not in memory reloads its window from the store. When the watermark
moves, the store's due entries are merged with the in-memory schedules in (due time, trajectory id)
order - the order without a store - so spilling changes no output, only where state lives. This
module stays free of I/O: the store is injected (:class:`MemoryStore` here, the SQLite one in
:mod:`flows.spill`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, NamedTuple, Protocol

from rtrl.sections.flows import FlowSettings
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
class KindRules:
    """Event-time rules of one task kind (milliseconds), resolved against the defaults."""

    deadline_ms: int
    allowed_lateness_ms: int
    awaits_verdict: bool = False  # the kind ends with the user's task_verdict (read by the processor)

    @property
    def retention_ms(self) -> int:
        return self.deadline_ms + self.allowed_lateness_ms


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


@dataclass(frozen=True, eq=False)
class WindowConfig:
    """Event-time rules of the reward windows: the ``flow`` section, read in milliseconds.

    The milliseconds and the per-kind rules are computed once, on first use, and kept.
    Two configs are equal when their rules are, whatever the flow's other settings (sinks, snapshots).
    A config pickled before it held the section carries the same names, so it still compares and reads.
    """

    flow: FlowSettings = field(default_factory=FlowSettings)

    @cached_property
    def deadline_ms(self) -> int:
        return _ms(self.flow.deadline_s)

    @cached_property
    def grace_ms(self) -> int:
        return _ms(self.flow.grace_s)

    @cached_property
    def allowed_lateness_ms(self) -> int:
        return _ms(self.flow.allowed_lateness_s)

    @cached_property
    def max_future_ms(self) -> int:
        """How far ahead of the watermark an event may be, for input without record timestamps."""
        return _ms(self.flow.max_future_s)

    @cached_property
    def max_skew_ms(self) -> int:
        """How far ahead of its Kafka record's timestamp (the broker's or producer's clock) an event may be."""
        return _ms(self.flow.max_clock_skew_s)

    @cached_property
    def kinds(self) -> tuple[tuple[str, KindRules], ...]:
        """``(task kind, rules)`` by name; a kind's unset times are the flow's."""
        f = self.flow
        return tuple(
            (
                name,
                KindRules(
                    _ms(f.deadline_s if k.deadline_s is None else k.deadline_s),
                    _ms(f.allowed_lateness_s if k.allowed_lateness_s is None else k.allowed_lateness_s),
                    k.awaits_verdict,
                ),
            )
            for name, k in sorted(f.task_kinds.items())
        )

    @property
    def verdict_kinds(self) -> tuple[str, ...]:
        """The task kinds that end with the user's verdict."""
        return tuple(name for name, rules in self.kinds if rules.awaits_verdict)

    @property
    def retention_ms(self) -> int:
        return self.deadline_ms + self.allowed_lateness_ms

    @cached_property
    def default_rules(self) -> KindRules:
        return KindRules(self.deadline_ms, self.allowed_lateness_ms, False)

    @cached_property
    def _by_kind(self) -> dict[str, KindRules]:
        return dict(self.kinds)

    def rules(self, kind: str | None) -> KindRules:
        """The rules of task kind ``kind`` (the defaults for None or a kind not listed)."""
        if kind is None or not self.kinds:
            return self.default_rules
        return self._by_kind.get(kind, self.default_rules)

    def _key(self) -> tuple:
        return (
            self.deadline_ms,
            self.grace_ms,
            self.allowed_lateness_ms,
            self.max_future_ms,
            self.kinds,
            self.max_skew_ms,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WindowConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


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
        "kind",
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
        self.kind: str | None = None  # the task kind of its first trajectory_started
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
            if self.kind is None:
                self.kind = event.task_kind  # type: ignore[attr-defined]  # t is TrajectoryStarted
        elif t is TrajectoryEnded:
            self.ended_ts = event.ts if self.ended_ts is None else max(self.ended_ts, event.ts)
        elif t is EditAccepted:
            self.accepted = (self.accepted or set()) | {event.edit_id}  # type: ignore[attr-defined]  # t is EditAccepted
        elif t is EditPersisted:
            self.persisted = (self.persisted or set()) | {event.edit_id}  # type: ignore[attr-defined]  # t is EditPersisted

    @property
    def complete(self) -> bool:
        return self.ended_ts is not None and (not self.accepted or self.accepted <= (self.persisted or set()))


# ---------------------------------------------------------------- the cold store

#: the state of a window in the cold store
ColdState = Literal["open", "closed", "tomb"]
#: the due-time keys of a cold row: ready (complete, closes at end + grace), deadline (open), retention
#: (closed: becomes a tombstone), expiry (tombstone: forgotten), first (open: the end of input's order)
DUE_KEYS = ("ready", "deadline", "retention", "expiry", "first")
DueKey = Literal["ready", "deadline", "retention", "expiry", "first"]


class Cold(NamedTuple):
    """One window (or tombstone) out of memory, with the due times that drive it (None: not due by that key)."""

    tid: str
    state: ColdState
    value: Any  # the window (open, closed), None for a tombstone (its expiry is ``expiry``)
    ready: int | None
    deadline: int | None
    retention: int | None
    expiry: int | None
    first: int | None


class ColdStore(Protocol):
    """Where windows live when they are not in memory. Every method sees only live rows; ``take`` and
    ``take_due`` remove what they return (the window is in memory again)."""

    def __len__(self) -> int: ...

    def put(self, rows: Sequence[Cold]) -> None:
        """Add rows (their trajectory ids are not in the store)."""

    def take(self, tid: str) -> Cold | None:
        """Remove and return the row of ``tid``, if any."""

    def take_due(self, key: DueKey, until: int, limit: int) -> list[Cold]:
        """Remove and return up to ``limit`` rows whose ``key`` is at most ``until``, in (key, tid) order."""

    def min_due(self, key: DueKey) -> int | None:
        """The smallest ``key`` of any row (None: no row has one); asked before every :meth:`take_due`, so cache it."""


class MemoryStore:
    """A :class:`ColdStore` in a dict: the reference the SQLite store is tested against (no I/O)."""

    def __init__(self) -> None:
        self.rows: dict[str, Cold] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def put(self, rows: Sequence[Cold]) -> None:
        for r in rows:
            assert r.tid not in self.rows, r.tid
            self.rows[r.tid] = r

    def take(self, tid: str) -> Cold | None:
        return self.rows.pop(tid, None)

    def take_due(self, key: DueKey, until: int, limit: int) -> list[Cold]:
        due: list[tuple[int, str]] = []
        for r in self.rows.values():
            t = getattr(r, key)
            if t is not None and t <= until:
                due.append((t, r.tid))
        return [self.rows.pop(tid) for _, tid in sorted(due)[:limit]]

    def min_due(self, key: DueKey) -> int | None:
        return min((t for r in self.rows.values() if (t := getattr(r, key)) is not None), default=None)


#: estimated bytes in memory of a window, of each of its events, and of a tombstone, with their schedule
#: entries and bookkeeping (measured with tracemalloc by bench/spill_state.py)
WINDOW_BYTES = 850
EVENT_BYTES = 300
TOMBSTONE_BYTES = 230
#: rows read from the store per step when the watermark makes many of them due at once
CHUNK = 512


@dataclass
class PartitionWindows:
    """All trajectory windows of one partition. Feed events in partition order with :meth:`ingest`.

    With ``store`` and ``budget_bytes`` > 0 the in-memory part is bounded (see the module docstring);
    ``store`` alone (budget 0) still serves the windows it holds but takes no new ones."""

    config: WindowConfig = field(default_factory=WindowConfig)
    partition: int = -1  # the Kafka partition these windows belong to (for dead letters)
    watermark: int | None = None
    record_clock: int | None = None  # the largest Kafka record timestamp seen: the watermark never passes it
    open: dict[str, _Window] = field(default_factory=dict)
    closed: dict[str, _Window] = field(default_factory=dict)
    tombstones: dict[str, int] = field(default_factory=dict)
    store: ColdStore | None = None
    budget_bytes: int = 0
    _deadlines: list[tuple[int, str]] = field(default_factory=list)
    _ready: list[tuple[int, str, int]] = field(default_factory=list)
    _retention: list[tuple[int, str]] = field(default_factory=list)
    _expiry: list[tuple[int, str]] = field(default_factory=list)
    _lru: dict[str, None] = field(default_factory=dict)  # in-memory ids, least recently touched first
    _hot_events: int = 0  # events held by the windows in memory (while spilling)

    # ------------------------------------------------------------ input

    def ingest(self, event: EventBase, offset: int, record_ts: int | None = None) -> list[Closed | Rejected]:
        """Apply one event; return the windows it closed and whether it was rejected. ``record_ts`` is its Kafka
        record's timestamp in ms (None or negative: unknown)."""
        cfg, tid = self.config, event.trajectory_id
        if record_ts is not None and record_ts >= 0:
            if self.record_clock is None or record_ts > self.record_clock:
                self.record_clock = record_ts
            if self.watermark is not None and self.watermark > self.record_clock:
                self.watermark = self.record_clock  # a clock a hostile event moved before this bound existed
            if event.ts > record_ts + cfg.max_skew_ms:
                return [self._future(event, offset, f"its Kafka record's timestamp {record_ts}", cfg.max_skew_ms)]
        elif self.watermark is not None and event.ts > self.watermark + cfg.max_future_ms:
            return [self._future(event, offset, f"the partition's watermark {self.watermark}", cfg.max_future_ms)]
        wm = self.watermark
        spilling = self.store is not None
        if spilling:
            self._reload(tid)
        out: list[Closed | Rejected] = []
        if tid in self.tombstones:
            out.append(
                self._too_late(tid, offset, event, "its window expired (closed longer than the allowed lateness)")
            )
        elif tid in self.closed:
            w = self.closed[tid]
            if event.event_id in w.ids:
                out.append(Rejected("duplicate", f"duplicate event_id {event.event_id}", tid, offset, event))
            elif event.ts > w.first_ts + cfg.rules(w.kind).retention_ms:
                out.append(
                    self._too_late(tid, offset, event, "its event time is past the window's allowed lateness", w.kind)
                )
            else:
                w.add(event, offset)
                self._hot_events += 1
                w.revision += 1
                out.append(Closed(tid, w.revision, "late", tuple(w.events)))
        elif tid in self.open:
            w = self.open[tid]
            if event.event_id in w.ids:
                out.append(Rejected("duplicate", f"duplicate event_id {event.event_id}", tid, offset, event))
            else:
                kind = w.kind
                w.add(event, offset)
                self._hot_events += 1
                if w.kind is not kind and cfg.kinds:  # the kind is known now: its deadline may differ
                    heapq.heappush(self._deadlines, (self._deadline(w), tid))
                self._schedule(tid, w)
        elif wm is not None and event.ts < wm - self._new_retention(event):
            out.append(self._too_late(tid, offset, event, "it is older than the retention horizon of its window"))
        else:
            w = _Window(event.ts)
            w.add(event, offset)
            self._hot_events += 1
            self.open[tid] = w
            heapq.heappush(self._deadlines, (self._deadline(w), tid))
            self._schedule(tid, w)
        if spilling:
            self._touch(tid)
        clock = event.ts if self.record_clock is None else min(event.ts, self.record_clock)
        if wm is None or clock > wm:
            self.watermark = clock
        out.extend(self._advance())
        if spilling:
            self._evict_if_over()
        return out

    def flush(self) -> list[Closed | Rejected]:
        """End of input: close every open window by deadline (in first-event order)."""
        out: list[Closed | Rejected] = []
        order = [(w.first_ts, tid) for tid, w in self.open.items()]
        heapq.heapify(order)
        load = lambda r: heapq.heappush(order, (r.value.first_ts, r.tid))  # noqa: E731
        self._run(order, "first", 2**63 - 1, self._first_due, out, load)
        return out

    # ------------------------------------------------------------ internals

    def _future(self, event: EventBase, offset: int, clock: str, bound_ms: int) -> Rejected:
        why = f"event time {event.ts} is more than {bound_ms} ms ahead of {clock}"
        return Rejected("future", why, event.trajectory_id, offset, event)

    def _deadline(self, w: _Window) -> int:
        return w.first_ts + self.config.rules(w.kind).deadline_ms

    def _horizon(self, w: _Window) -> int:
        return w.first_ts + self.config.rules(w.kind).retention_ms

    def _new_retention(self, event: EventBase) -> int:
        kind = event.task_kind if type(event) is TrajectoryStarted else None  # type: ignore[attr-defined]
        return self.config.rules(kind).retention_ms

    def _too_late(self, tid: str, offset: int, event: EventBase, why: str, kind: str | None = None) -> Rejected:
        return Rejected(
            "too_late",
            f"later than the allowed lateness of {self.config.rules(kind).allowed_lateness_ms} ms: {why}",
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
            self._hot_events -= len(w.events)
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
        heapq.heappush(self._retention, (self._horizon(w), tid))
        return [Closed(tid, 0, reason, tuple(w.events))]

    def _advance(self) -> list[Closed | Rejected]:
        wm = self.watermark
        out: list[Closed | Rejected] = []
        if wm is None:  # no event yet (only ingest calls this, after setting the watermark): nothing is due
            return out
        # each schedule is run only when something may be due (the common case is nothing)
        if (self._ready and self._ready[0][0] <= wm) or self._cold_due("ready", wm):
            self._run(self._ready, "ready", wm, self._ready_due, out)
        if (self._deadlines and self._deadlines[0][0] <= wm) or self._cold_due("deadline", wm):
            self._run(self._deadlines, "deadline", wm, self._deadline_due, out)
        if (self._retention and self._retention[0][0] < wm) or self._cold_due("retention", wm - 1):
            self._run(self._retention, "retention", wm - 1, self._retention_due, out)
        if (self._expiry and self._expiry[0][0] < wm) or self._cold_due("expiry", wm - 1):
            self._run(self._expiry, "expiry", wm - 1, self._expiry_due, out)
        return out

    def _cold_due(self, key: DueKey, until: int) -> bool:
        store = self.store
        if store is None or not len(store):
            return False
        m = store.min_due(key)
        return m is not None and m <= until

    def _ready_due(self, entry: tuple[int, str, int], out: list[Closed | Rejected]) -> None:
        w = self.open.get(entry[1])
        if w is not None and w.seq == entry[2] and w.complete:
            out.extend(self._close(entry[1], "ended"))

    def _deadline_due(self, entry: tuple[int, str], out: list[Closed | Rejected]) -> None:
        w = self.open.get(entry[1])
        if w is not None and entry[0] == self._deadline(w):  # a moved deadline leaves a stale entry
            out.extend(self._close(entry[1], "deadline"))

    def _first_due(self, entry: tuple[int, str], out: list[Closed | Rejected]) -> None:
        w = self.open.get(entry[1])
        if w is not None and w.first_ts == entry[0]:
            out.extend(self._close(entry[1], "deadline"))

    def _retention_due(self, entry: tuple[int, str], out: list[Closed | Rejected]) -> None:
        horizon, tid = entry
        w = self.closed.get(tid)
        if w is not None and horizon == self._horizon(w):
            del self.closed[tid]
            self._hot_events -= len(w.events)
            self.tombstones[tid] = horizon + self.config.rules(w.kind).allowed_lateness_ms
            heapq.heappush(self._expiry, (self.tombstones[tid], tid))

    def _expiry_due(self, entry: tuple[int, str], out: list[Closed | Rejected]) -> None:
        if self.tombstones.get(entry[1]) == entry[0]:
            del self.tombstones[entry[1]]
            self._lru.pop(entry[1], None)

    def _run(
        self,
        heap: list[Any],
        key: DueKey,
        until: int,
        act: Callable[[Any, list[Closed | Rejected]], None],
        out: list[Closed | Rejected],
        loaded: Callable[[Cold], None] | None = None,
    ) -> None:
        """Act on every entry of one schedule due by ``until`` (inclusive), in (due, tid) order: the heap's and,
        merged in, the cold store's (read ``CHUNK`` rows at a time, loaded into memory as they come up)."""
        store = self.store
        while True:
            bound = None
            if self._cold_due(key, until):
                assert store is not None
                rows = store.take_due(key, until, CHUNK)
                for r in rows:
                    self._load(r)
                    if loaded is not None:
                        loaded(r)
                if len(rows) == CHUNK:  # more may be due: act only up to the last row read, then read on
                    last = rows[-1]
                    bound = (getattr(last, key), last.tid)
            while heap and heap[0][0] <= until and (bound is None or (heap[0][0], heap[0][1]) <= bound):
                act(heapq.heappop(heap), out)
            if bound is None:
                return
            self._evict_if_over()

    # ------------------------------------------------------------ spilling

    def _estimate(self) -> int:
        return (
            (len(self.open) + len(self.closed)) * WINDOW_BYTES
            + self._hot_events * EVENT_BYTES
            + len(self.tombstones) * TOMBSTONE_BYTES
        )

    def _touch(self, tid: str) -> None:
        lru = self._lru
        if tid in self.open or tid in self.closed or tid in self.tombstones:
            lru.pop(tid, None)
            lru[tid] = None

    def _reload(self, tid: str) -> None:
        """Bring ``tid``'s window back from the store (one indexed lookup) if it is there, not in memory."""
        store = self.store
        if store is None or not len(store) or tid in self.open or tid in self.closed or tid in self.tombstones:
            return
        row = store.take(tid)
        if row is not None:
            self._load(row)

    def _load(self, r: Cold) -> None:
        tid = r.tid
        if r.state == "tomb":
            assert r.expiry is not None
            self.tombstones[tid] = r.expiry
            heapq.heappush(self._expiry, (r.expiry, tid))
        else:
            w: _Window = r.value
            self._hot_events += len(w.events)
            if r.state == "open":
                self.open[tid] = w
                heapq.heappush(self._deadlines, (self._deadline(w), tid))
                if w.complete:
                    assert w.ended_ts is not None
                    heapq.heappush(self._ready, (w.ended_ts + self.config.grace_ms, tid, w.seq))
            else:
                self.closed[tid] = w
                heapq.heappush(self._retention, (self._horizon(w), tid))
        self._lru[tid] = None

    def _evict_if_over(self) -> None:
        if self.store is None or self.budget_bytes <= 0 or self._estimate() <= self.budget_bytes:
            return
        self.evict(int(self.budget_bytes * 0.8))

    def evict(self, target_bytes: int = 0) -> int:
        """Move the least recently touched windows to the store until the estimate is at most ``target_bytes``;
        returns how many moved."""
        store = self.store
        assert store is not None, "evict needs a store"
        size, rows, grace = self._estimate(), [], self.config.grace_ms
        for tid in self._lru:
            if size <= target_bytes:
                break
            if tid in self.open:
                w = self.open.pop(tid)
                ready = w.ended_ts + grace if w.complete and w.ended_ts is not None else None
                rows.append(Cold(tid, "open", w, ready, self._deadline(w), None, None, w.first_ts))
            elif tid in self.closed:
                w = self.closed.pop(tid)
                rows.append(Cold(tid, "closed", w, None, None, self._horizon(w), None, None))
            else:
                expiry = self.tombstones.pop(tid)
                rows.append(Cold(tid, "tomb", None, None, None, None, expiry, None))
                size -= TOMBSTONE_BYTES
                continue
            self._hot_events -= len(w.events)
            size -= WINDOW_BYTES + len(w.events) * EVENT_BYTES
        for r in rows:
            del self._lru[r.tid]
        if rows:
            store.put(rows)
            # entries of evicted windows are skipped when they come up (not in memory) and a reloaded window
            # pushes its own; rebuilding only once they dominate keeps the schedules bounded at a constant cost
            # per evicted window
            hot = len(self.open) + len(self.closed) + len(self.tombstones)
            if len(self._ready) + len(self._deadlines) + len(self._retention) + len(self._expiry) > 2 * hot + CHUNK:
                self._rebuild()
        return len(rows)

    def reschedule(self) -> None:
        """Recompute every in-memory schedule from :attr:`config` (after the config was replaced on a resume)."""
        self._rebuild()

    def _rebuild(self) -> None:
        """The schedules of what is still in memory only (in place: a running :meth:`_run` holds them)."""
        g = self.config.grace_ms
        self._ready[:] = [
            (w.ended_ts + g, t, w.seq) for t, w in self.open.items() if w.complete and w.ended_ts is not None
        ]
        self._deadlines[:] = [(self._deadline(w), t) for t, w in self.open.items()]
        self._retention[:] = [(self._horizon(w), t) for t, w in self.closed.items()]
        self._expiry[:] = [(e, t) for t, e in self.tombstones.items()]
        heapq.heapify(self._ready)
        for h in (self._deadlines, self._retention, self._expiry):
            heapq.heapify(h)

    @property
    def estimated_bytes(self) -> int:
        """Estimated bytes of the windows and tombstones in memory (what ``budget_bytes`` bounds)."""
        return self._estimate()

    @property
    def open_count(self) -> int:
        """Open windows in memory (those in the store not counted)."""
        return len(self.open)

    @property
    def hot_count(self) -> int:
        """Windows and tombstones in memory."""
        return len(self.open) + len(self.closed) + len(self.tombstones)
