"""Windows per task kind (pure): a kind's own deadline and allowed lateness apply once its trajectory_started
arrives, from the settings' ``flow.task_kinds`` (background: a day's deadline, a week's lateness)."""

from __future__ import annotations

import pickle

from flows.windowing import KindRules, PartitionWindows, WindowConfig
from rtrl.sections.flows import FlowSettings, TaskKindSettings
from rtrl.settings import load_settings
from schemas.records import TaskVerdict, ToolCall, TrajectoryEnded, TrajectoryStarted
from tests.test_windowing import closes, ev, feed, rejects

H, D = 3_600_000, 86_400_000


def test_settings_fill_the_kinds():
    """The default settings give background tasks a day's deadline, a week's lateness and awaits_verdict;
    other kinds use the flow's defaults."""
    cfg = WindowConfig(load_settings(env={}).flow)
    assert cfg.rules("background") == KindRules(D, 7 * D, True)
    assert cfg.rules("bugfix") == cfg.rules(None) == KindRules(H, D, False)
    assert hash(cfg) == hash(pickle.loads(pickle.dumps(cfg))) and pickle.loads(pickle.dumps(cfg)) == cfg


def test_background_verdict_two_days_late_revises_bugfix_is_too_late():
    """A background task's task_verdict two days after it ended still revises its window (revision 1, late);
    a bugfix trajectory's late event after the default day of lateness is too_late."""
    w = PartitionWindows(WindowConfig(load_settings(env={}).flow))
    t0 = 1_780_000_000_000
    out = feed(
        w,
        [
            ev(TrajectoryStarted, "bg", t0, task_kind="background"),
            ev(TrajectoryStarted, "bf", t0, task_kind="bugfix"),
            ev(TrajectoryEnded, "bf", t0 + H // 2, status="completed"),
            ev(TrajectoryEnded, "bg", t0 + H, status="completed"),
        ],
    )
    # the watermark moves on in steps (other trajectories), past both windows' deadlines and bugfix's lateness
    for i, t in enumerate(range(t0 + 2 * H, t0 + 2 * D + 2 * H, 12 * H)):
        out += feed(w, [ev(TrajectoryStarted, f"other{i}", t, task_kind="explain")])
    assert [c[:3] for c in closes(out) if c[0] in ("bg", "bf")] == [("bf", 0, "ended"), ("bg", 0, "ended")]
    late = t0 + H + 2 * D
    out = feed(
        w,
        [
            ev(TaskVerdict, "bg", late, verdict="merged", fraction=1.0, verdict_after_s=2 * 86_400.0),
            ev(ToolCall, "bf", late, tool="t", valid=True),
        ],
    )
    assert [c for c in closes(out) if c[0] in ("bg", "bf")] == [("bg", 1, "late", 3)]
    assert rejects(out) == [("too_late", "bf")]
    assert "86400000 ms" in [r.reason for r in out if not hasattr(r, "revision")][0]


def test_kind_deadline_closes_at_its_own_time_and_stale_entries_do_not():
    """A kind with a shorter deadline closes by deadline at first_ts + its deadline, even when its
    trajectory_started came after the first event; a kind with a longer one is not closed at the default
    deadline by the entry scheduled before its kind was known."""
    quick, slow = TaskKindSettings(deadline_s=0.3, allowed_lateness_s=5), TaskKindSettings(deadline_s=4)
    cfg = WindowConfig(
        FlowSettings(deadline_s=1, grace_s=0.01, allowed_lateness_s=5, task_kinds={"quick": quick, "slow": slow})
    )
    w = PartitionWindows(cfg)
    out = feed(
        w,
        [
            ev(ToolCall, "q", 0, tool="t", valid=True),
            ev(TrajectoryStarted, "q", 10, task_kind="quick"),
            ev(ToolCall, "s", 0, tool="t", valid=True),
            ev(TrajectoryStarted, "s", 20, task_kind="slow"),
            ev(TrajectoryStarted, "n", 30, task_kind="other"),
        ],
    )
    assert closes(out) == []
    assert closes(feed(w, [ev(TrajectoryStarted, "x", 299, task_kind="other")])) == []
    assert closes(feed(w, [ev(TrajectoryStarted, "y", 300, task_kind="other")])) == [("q", 0, "deadline", 2)]
    # at 1030 the default deadline of n passes; s's stale default entry (1000) must not close it
    assert [c[0] for c in closes(feed(w, [ev(TrajectoryStarted, "z", 1030, task_kind="other")]))] == ["n"]
    assert "s" in w.open
    assert ("s", 0, "deadline", 2) in closes(feed(w, [ev(TrajectoryStarted, "u", 4000, task_kind="other")]))
