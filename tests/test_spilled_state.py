"""Windows beyond the memory budget live in SQLite (flows.spill) and change no output: the same events give
the same closes and rejections with or without spilling, after a restore from a snapshot, and after a
kill -9 of the real reward flow; memory stays within the budget; a missing or foreign state file is a
clear error. The store is the real SQLite file; the flow test runs on the real broker and ClickHouse."""

from __future__ import annotations

import pickle
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flows.windowing as windowing
from devservices.broker import free_port
from flows.spill import KEEP_GENERATIONS, SqliteStore, StateError, partition_file
from flows.windowing import MemoryStore, PartitionWindows, WindowConfig
from rtrl.kafka import ensure_topics
from rtrl.sections.flows import FlowSettings, TaskKindSettings
from rtrl.sections.simulator import SimulatorSettings
from schemas.records import (
    EditAccepted,
    EditPersisted,
    TaskVerdict,
    ToolCall,
    TrajectoryEnded,
    TrajectoryStarted,
)
from simulator.generate import generate
from tests.test_reward_flow import _dump, _env, _flow_cmd, _produce, _run_then_kill, reference  # noqa: F401  # reference: fixture

CFG = WindowConfig(
    FlowSettings(
        deadline_s=1,
        grace_s=0.01,
        allowed_lateness_s=2,
        max_future_s=5,
        task_kinds={
            "quick": TaskKindSettings(deadline_s=0.3, allowed_lateness_s=1),
            "slow": TaskKindSettings(deadline_s=3, allowed_lateness_s=4, awaits_verdict=True),
        },
    )
)
ENV = dict(org_id="o", user_hash="0" * 32, policy_version=1, arm="control")
TYPES = [TrajectoryStarted, ToolCall, TrajectoryEnded, EditAccepted, EditPersisted, TaskVerdict]


def make(cls, tid: str, ts: int, eid: str):
    extra: dict = {
        TrajectoryStarted: lambda: {"task_kind": ["quick", "slow", "bugfix"][len(eid) % 3]},
        ToolCall: lambda: {"tool": "t", "valid": True},
        TrajectoryEnded: lambda: {"status": "completed"},
        EditAccepted: lambda: {"edit_id": f"d{len(tid) % 2}"},
        EditPersisted: lambda: {"edit_id": f"d{len(tid) % 2}", "fraction": 0.5, "checked_after_s": 1.0},
        TaskVerdict: lambda: {"verdict": "merged", "fraction": 1.0, "verdict_after_s": 1.0},
    }[cls]()
    return cls(event_id=eid, trajectory_id=tid, ts=ts, **ENV, **extra)


@st.composite
def streams(draw):
    """Random partition streams: a few trajectories, every event type, times that jump both ways, duplicates."""
    n_tids, ts, out = draw(st.integers(1, 15)), 0, []
    for i in range(draw(st.integers(1, 120))):
        tid = "t" * draw(st.integers(1, 3)) + str(draw(st.integers(0, n_tids - 1)))
        ts = max(0, ts + draw(st.integers(-400, 600)))
        if out and draw(st.integers(0, 9)) == 0:  # a duplicate of an earlier event
            out.append(out[draw(st.integers(0, len(out) - 1))])
            continue
        out.append(make(draw(st.sampled_from(TYPES)), tid, ts, "e" * draw(st.integers(1, 3)) + str(i)))
    return out


def run(w: PartitionWindows, events, start: int = 0) -> list:
    out = []
    for i, e in enumerate(events, start=start):
        out += w.ingest(e, i)
    return out


def spilled(tmp: Path, budget: int, name: str = "p0.sqlite") -> PartitionWindows:
    return PartitionWindows(CFG, store=SqliteStore.fresh(tmp / name), budget_bytes=budget)


# ---------------------------------------------------------------- (1) spilled == in memory


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=streams(), budget=st.sampled_from([1, 1500, 4000]), chunk=st.sampled_from([1, 2, 512]))
@pytest.mark.slow
def test_spilled_windows_give_the_same_outputs(events, budget, chunk):
    """Any stream gives identical Closed/Rejected outputs (values and order, flush included) with a tiny budget
    (most windows in the SQLite file or the in-memory reference store, read back a few rows at a time)
    as with every window in memory."""
    memory = PartitionWindows(CFG)
    expected = run(memory, events) + memory.flush()
    old, windowing.CHUNK = windowing.CHUNK, chunk
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for w in (spilled(Path(tmp), budget), PartitionWindows(CFG, store=MemoryStore(), budget_bytes=budget)):
                assert run(w, events) + w.flush() == expected
    finally:
        windowing.CHUNK = old


@pytest.mark.slow
def test_simulator_stream_spilled_equals_in_memory(tmp_path):
    """The simulator's stream (duplicates, reordering, late checks) through a 30 kB budget: the same outputs,
    with most windows on disk at any time and read back when an event or the clock needs them."""
    events = [e.event for e in generate(SimulatorSettings(trajectories=1500, seed=3, late_check_rate=0.2), "salt")]
    cfg = WindowConfig(FlowSettings(deadline_s=600, allowed_lateness_s=3600, task_kinds={}))
    memory, w = (
        PartitionWindows(cfg),
        PartitionWindows(cfg, store=SqliteStore.fresh(tmp_path / "p"), budget_bytes=30_000),
    )
    expected = run(memory, events) + memory.flush()
    got, peak = [], 0
    for i, e in enumerate(events):
        got += w.ingest(e, i)
        peak = max(peak, len(w.store))  # type: ignore[arg-type]
    assert peak > 1000
    assert got + w.flush() == expected


# ---------------------------------------------------------------- (2) restore from a snapshot, roll back, replay


@pytest.mark.parametrize("committed_later", [False, True])
@pytest.mark.slow
def test_restore_from_snapshot_rolls_back_and_replays_identically(tmp_path, committed_later):
    """Pickle the windows (a Bytewax snapshot) mid-stream, go on processing (and, in one case, take another
    snapshot whose commit the crash outruns), crash, restore from the first pickle: the file rolls back to it
    and replaying the rest gives exactly the uninterrupted outputs."""
    events = [e.event for e in generate(SimulatorSettings(trajectories=400, seed=8, late_check_rate=0.3), "salt")]
    cfg = WindowConfig(FlowSettings(deadline_s=600, allowed_lateness_s=1800, task_kinds={}))
    memory = PartitionWindows(cfg)
    expected = run(memory, events) + memory.flush()
    for n, cut in enumerate((50, len(events) // 3, len(events) - 20)):
        w = PartitionWindows(cfg, store=SqliteStore.fresh(tmp_path / f"p{n}"), budget_bytes=8_000)
        first = run(w, events[:cut])
        snap = pickle.dumps(w)
        run(w, events[cut : cut + 500])  # lost in the crash
        if committed_later:
            pickle.dumps(w)
        w.store.close()  # type: ignore[union-attr]  # the crash: the open transaction is lost
        restored = pickle.loads(snap)
        restored.store.resume()
        assert first + run(restored, events[cut:], start=cut) + restored.flush() == expected


def test_dead_rows_are_purged_only_generations_later(tmp_path):
    """A row taken out stays (dead) for KEEP_GENERATIONS snapshots, so an older snapshot can still revive it;
    a resume from further back than the file keeps is refused."""
    w = PartitionWindows(CFG, store=SqliteStore.fresh(tmp_path / "p"), budget_bytes=1)
    run(w, [make(TrajectoryStarted, "a", 0, "e1"), make(TrajectoryStarted, "b", 1, "e2")])
    old = pickle.dumps(w)
    run(w, [make(ToolCall, "a", 2, "e3")])  # a is read back: its row dies
    for i in range(KEEP_GENERATIONS + 1):  # epochs with writes end: the flow's snapshot() checkpoints each
        run(w, [make(TrajectoryStarted, f"n{i}", 3 + i, f"n{i}")])
        w.store.checkpoint()  # type: ignore[union-attr]
    db = sqlite3.connect(tmp_path / "p")
    assert db.execute("SELECT count(*) FROM windows WHERE died IS NOT NULL").fetchone()[0] == 0
    w.store.close()  # type: ignore[union-attr]
    with pytest.raises(StateError, match="holds generations"):
        pickle.loads(old).store.resume()


# ---------------------------------------------------------------- (3) kill -9 of the real flow, state spilled


def _files(state: Path) -> list[Path]:
    return sorted(state.glob("partition-*.sqlite"))


def _count(db: Path, sql: str) -> int:
    """A count from a SQLite file another process may be writing; 0 while it is not there or not yet readable."""
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as c:
            return int(c.execute(sql).fetchone()[0])
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_kill_9_and_restart_with_spilled_state_equals_uninterrupted(broker, tmp_path, reference):  # noqa: F811
    """The reward flow with a 20 kB budget per partition (most windows in SQLite), killed with -9 mid-stream and
    restarted from its recovery folder: rewards, trajectories and dead letters equal an uninterrupted run's
    (which kept everything in memory) exactly."""
    phase1, phase2, expected = reference
    prefix = f"spill{free_port()}."
    ensure_topics(broker.bootstrap, prefix, 4)
    recovery = tmp_path / "recovery"
    recovery.mkdir()
    subprocess.run([sys.executable, "-m", "bytewax.recovery", str(recovery), "1"], check=True, timeout=60)
    _produce(broker.bootstrap, prefix + "events", phase1)
    spill = {"RTRL_FLOW__STATE_MEMORY_MB": "0.02"}
    state = tmp_path / "state" / "rewards"

    def spilled_and_snapshotted() -> bool:
        """Bytewax committed a snapshot, and the state files hold committed rows: the restart resumes from them."""
        committed = _count(recovery / "part-0.sqlite3", "SELECT count(*) FROM commits")
        return committed > 0 and sum(_count(f, "SELECT count(*) FROM windows") for f in _files(state)) > 100

    _run_then_kill(
        recovery,
        _env(broker.bootstrap, prefix, tmp_path, tail=True) | spill,
        broker.bootstrap,
        prefix + "rewards",
        ready=spilled_and_snapshotted,
    )
    files = _files(state)
    assert files, "the flow spilled nothing"
    _produce(broker.bootstrap, prefix + "events", phase2)
    second = subprocess.run(
        _flow_cmd(recovery),
        env=_env(broker.bootstrap, prefix, tmp_path, tail=False) | spill,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert _files(state) == files  # the restart resumed the files of the killed run
    rows = sum(_count(f, "SELECT count(*) FROM windows") for f in files)
    assert rows > 100  # the closed windows' retention outlives the input: most are still on disk
    assert _dump(tmp_path) == expected


# ---------------------------------------------------------------- (4) memory is bounded


def test_memory_stays_within_the_budget(tmp_path):
    """Through 3,000 never-ending trajectories with a 40 kB budget, the estimate of what is in memory never
    exceeds the budget after an event, a few dozen windows stay in memory, and the store holds the rest;
    the end of input closes all of them (read back in chunks) as it would from memory."""
    budget, cfg = 40_000, WindowConfig(FlowSettings(deadline_s=10**6, task_kinds={}))
    w, memory = (
        PartitionWindows(cfg, store=SqliteStore.fresh(tmp_path / "p"), budget_bytes=budget),
        PartitionWindows(cfg),
    )
    peak = 0
    for i in range(3000):
        for j, cls in enumerate((TrajectoryStarted, ToolCall, ToolCall)):
            e = make(cls, f"t{i}", i * 10 + j, f"e{i}.{j}")
            assert w.ingest(e, 3 * i + j) == [] == memory.ingest(e, 3 * i + j)
            assert w._estimate() <= budget
            peak = max(peak, w.hot_count)
    assert peak <= budget // (windowing.WINDOW_BYTES + 3 * windowing.EVENT_BYTES) + 1
    assert w.hot_count + len(w.store) == 3000  # type: ignore[arg-type]
    assert w.flush() == memory.flush()


# ---------------------------------------------------------------- (5) a missing or bad state file


def _snapshot(tmp_path: Path) -> bytes:
    w = PartitionWindows(CFG, store=SqliteStore.fresh(partition_file(tmp_path, 0)), budget_bytes=1)
    run(w, [make(TrajectoryStarted, "a", 0, "e1"), make(TrajectoryStarted, "b", 1, "e2")])
    snap = pickle.dumps(w)
    w.store.close()  # type: ignore[union-attr]
    return snap


def test_missing_state_file_is_a_clear_error(tmp_path):
    snap = _snapshot(tmp_path)
    partition_file(tmp_path, 0).unlink()
    with pytest.raises(StateError, match=r"partition-0.sqlite is missing.*flow.state_dir"):
        pickle.loads(snap).store.resume()


def test_corrupt_or_foreign_state_file_is_a_clear_error(tmp_path):
    snap = _snapshot(tmp_path)
    path = partition_file(tmp_path, 0)
    for f in path.parent.glob(path.name + "-*"):
        f.unlink()
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(StateError, match="cannot be read.*flow.state_dir|flow.state_dir.*cannot be read"):
        pickle.loads(snap).store.resume()
    SqliteStore.fresh(path).close()  # a fresh start of another run over the same folder
    with pytest.raises(StateError, match="belongs to another run"):
        pickle.loads(snap).store.resume()


def test_state_dir_on_another_volume_is_refused(tmp_path):
    """`rtrl flow rewards` and the loop's part refuse a flow.state_dir on another volume than the recovery folder."""
    from app.flow_state import check_state_volume
    from app.parts import FLOW
    from rtrl.errors import ConfigError
    from rtrl.settings import load_settings

    rewards = FLOW["rewards"]

    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second volume here")
    with tempfile.TemporaryDirectory(dir=shm) as other:
        env = {"RTRL_DATA_DIR": str(tmp_path), "RTRL_FLOW__STATE_MEMORY_MB": "64", "RTRL_FLOW__STATE_DIR": other}
        with pytest.raises(ConfigError, match="another volume.*flow.state_dir|flow.state_dir.*another volume"):
            check_state_volume(load_settings(env=env), rewards)
    check_state_volume(load_settings(env={"RTRL_DATA_DIR": str(tmp_path), "RTRL_FLOW__STATE_MEMORY_MB": "64"}), rewards)
