"""Per-trajectory windows of one partition (pure): when windows close, revisions for late events,
and every rejection kind. Times are event times in ms; the watermark is the largest seen."""

from __future__ import annotations

import pickle

from flows.windowing import Closed, PartitionWindows, Rejected, WindowConfig
from rtrl.sections.flows import FlowSettings
from schemas.records import (
    EditAccepted,
    EditPersisted,
    EditProposed,
    ToolCall,
    TrajectoryEnded,
    TrajectoryStarted,
)

CFG = WindowConfig(FlowSettings(deadline_s=1, grace_s=0.01, allowed_lateness_s=5, max_future_s=100, task_kinds={}))
ENV = dict(org_id="o", user_hash="0" * 32, policy_version=1, arm="control")
_n = iter(range(10**9))


def ev(cls, tid, ts, eid=None, **kw):
    return cls(event_id=eid or f"e{next(_n)}", trajectory_id=tid, ts=ts, **ENV, **kw)


def feed(w: PartitionWindows, events):
    out = []
    for i, e in enumerate(events):
        out += w.ingest(e, i)
    return out


def closes(out):
    return [(c.trajectory_id, c.revision, c.close_reason, len(c.events)) for c in out if isinstance(c, Closed)]


def rejects(out):
    return [(r.kind, r.trajectory_id) for r in out if isinstance(r, Rejected)]


def test_ended_window_closes_after_grace():
    """A started, ended trajectory with no accepted edits closes ('ended') once the watermark passes end + grace."""
    w = PartitionWindows(CFG)
    out = feed(
        w, [ev(TrajectoryStarted, "a", 0, task_kind="bugfix"), ev(TrajectoryEnded, "a", 100, status="completed")]
    )
    assert closes(out) == []
    out = feed(w, [ev(TrajectoryStarted, "b", 115, task_kind="bugfix")])
    assert closes(out) == [("a", 0, "ended", 2)]


def test_pending_persistence_check_holds_the_window_until_it_arrives():
    """An accepted edit keeps the window open after the end until its check arrives (or the deadline)."""
    w = PartitionWindows(CFG)
    out = feed(
        w,
        [
            ev(TrajectoryStarted, "a", 0, task_kind="x"),
            ev(EditProposed, "a", 10, edit_id="d", lines=3),
            ev(EditAccepted, "a", 20, edit_id="d"),
            ev(TrajectoryEnded, "a", 30, status="completed"),
            ev(TrajectoryStarted, "b", 500, task_kind="x"),
        ],
    )
    assert closes(out) == []
    out = feed(
        w,
        [
            ev(EditPersisted, "a", 600, edit_id="d", fraction=0.5, checked_after_s=0.58),
            ev(TrajectoryStarted, "c", 700, task_kind="x"),
        ],
    )
    assert closes(out) == [("a", 0, "ended", 5)]


def test_deadline_closes_a_window_whose_check_never_came():
    """Without its check, a trajectory closes by deadline once the watermark passes first_ts + deadline."""
    w = PartitionWindows(CFG)
    feed(
        w,
        [
            ev(TrajectoryStarted, "a", 0, task_kind="x"),
            ev(EditAccepted, "a", 20, edit_id="d"),
            ev(TrajectoryEnded, "a", 30, status="completed"),
        ],
    )
    assert closes(feed(w, [ev(TrajectoryStarted, "b", 999, task_kind="x")])) == []
    assert ("a", 0, "deadline", 3) in closes(feed(w, [ev(TrajectoryStarted, "c", 1000, task_kind="x")]))


def test_late_event_within_lateness_makes_a_new_revision():
    """An event for a closed window within the allowed lateness re-closes it as revision 1 ('late') with all events."""
    w = PartitionWindows(CFG)
    feed(
        w,
        [
            ev(TrajectoryStarted, "a", 0, task_kind="x"),
            ev(EditAccepted, "a", 20, edit_id="d"),
            ev(TrajectoryEnded, "a", 30, status="completed"),
            ev(TrajectoryStarted, "b", 1500, task_kind="x"),
        ],
    )
    out = feed(w, [ev(EditPersisted, "a", 3000, edit_id="d", fraction=1.0, checked_after_s=3.0)])
    assert closes(out)[0] == ("a", 1, "late", 4)
    out = feed(w, [ev(ToolCall, "a", 3100, tool="t", valid=True)])
    assert closes(out)[0] == ("a", 2, "late", 5)


def test_events_later_than_the_allowed_lateness_are_rejected():
    """Past first_ts + deadline + lateness, an event for the trajectory is rejected as too_late, both while the
    closed window is retained (by its event time) and after eviction (by tombstone)."""
    w = PartitionWindows(CFG)
    feed(
        w,
        [
            ev(TrajectoryStarted, "a", 0, task_kind="x"),
            ev(TrajectoryEnded, "a", 5, status="completed"),
            ev(TrajectoryStarted, "b", 100, task_kind="x"),
        ],
    )
    assert rejects(feed(w, [ev(ToolCall, "a", 6001, tool="t", valid=True)])) == [("too_late", "a")]
    feed(w, [ev(TrajectoryStarted, "c", 6100, task_kind="x")])  # watermark past a's retention: evicted
    assert "a" not in w.closed and "a" in w.tombstones
    assert rejects(feed(w, [ev(ToolCall, "a", 50, tool="t", valid=True)])) == [("too_late", "a")]


def test_duplicates_are_rejected_open_or_closed():
    """A repeated event_id is rejected as a duplicate whether its window is open or already closed."""
    w = PartitionWindows(CFG)
    start = ev(TrajectoryStarted, "a", 0, task_kind="x")
    out = feed(w, [start, start])
    assert rejects(out) == [("duplicate", "a")]
    end = ev(TrajectoryEnded, "a", 5, status="completed")
    feed(w, [end, ev(TrajectoryStarted, "b", 100, task_kind="x")])
    assert rejects(feed(w, [end])) == [("duplicate", "a")]


def test_trajectory_that_never_started_is_dead_lettered_at_close():
    """Events of a trajectory with no trajectory_started produce no reward: each is rejected as never_started."""
    w = PartitionWindows(CFG)
    feed(w, [ev(ToolCall, "ghost", 0, tool="t", valid=False), ev(TrajectoryEnded, "ghost", 5, status="error")])
    out = feed(w, [ev(TrajectoryStarted, "b", 1001, task_kind="x")])
    assert closes(out) == [] and rejects(out) == [("never_started", "ghost")] * 2
    assert rejects(feed(w, [ev(TrajectoryStarted, "ghost", 1002, task_kind="x")])) == [("too_late", "ghost")]


def test_hostile_future_timestamps_do_not_move_the_clock():
    """An event far ahead of the watermark is rejected and does not close anyone's window."""
    w = PartitionWindows(CFG)
    feed(w, [ev(TrajectoryStarted, "a", 0, task_kind="x")])
    out = feed(w, [ev(ToolCall, "a", 10**9, tool="t", valid=True)])
    assert rejects(out) == [("future", "a")] and w.watermark == 0 and "a" in w.open


def test_old_new_trajectory_is_too_late():
    """A first event older than the retention horizon cannot open a window."""
    w = PartitionWindows(CFG)
    feed(w, [ev(TrajectoryStarted, "a", 100_000, task_kind="x")])
    assert rejects(feed(w, [ev(TrajectoryStarted, "old", 1, task_kind="x")])) == [("too_late", "old")]


def test_flush_closes_everything_open():
    """End of input closes every open window by deadline."""
    w = PartitionWindows(CFG)
    feed(w, [ev(TrajectoryStarted, "a", 0, task_kind="x"), ev(TrajectoryStarted, "b", 1, task_kind="x")])
    assert closes(w.flush()) == [("a", 0, "deadline", 1), ("b", 0, "deadline", 1)]
    assert w.open == {}


def test_snapshot_and_restore_mid_stream_changes_nothing():
    """Pickling the state after any prefix and continuing from the copy gives the same outputs as not stopping."""
    events = []
    for i in range(30):
        t = f"t{i}"
        events += [
            ev(TrajectoryStarted, t, i * 100, task_kind="x"),
            ev(EditAccepted, t, i * 100 + 5, edit_id="d"),
            ev(TrajectoryEnded, t, i * 100 + 9, status="completed"),
        ]
        if i % 3 == 0:
            events.append(ev(EditPersisted, t, i * 100 + 50, edit_id="d", fraction=0.3, checked_after_s=0.05))
    reference = PartitionWindows(CFG)
    expected = feed(reference, events) + reference.flush()
    for cut in (1, 17, 45, len(events) - 1):
        w = PartitionWindows(CFG)
        first = feed(w, events[:cut])
        w = pickle.loads(pickle.dumps(w))
        rest = []
        for i, e in enumerate(events[cut:], start=cut):
            rest += w.ingest(e, i)
        assert first + rest + w.flush() == expected
