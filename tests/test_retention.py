"""Retention (issue 38, point 2): each ClickHouse table's TTL follows `retention.tables` with no migration, and the
Parquet archive's old days are deleted, tested with back-dated data on the real engine and a real archive.

Checkpoints and the model registry keep the newest versions, the serving one and its rollback targets. The flows'
state goes once nothing uses it: a real reward flow's recovery snapshot and spill files, back-dated, are kept while
a snapshot refers to them or a flow holds them, and deleted after `retention.state_days` otherwise.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import zlib
from collections import Counter
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.testing import TestingSink, TestingSource, run_main

from app.parts import FLOW, FLOWS
from app.retention import hold, prune_at_start, prune_state
from flows import reward_flow
from flows.processor import Message
from flows.sinks import prune_archive, read_archive, with_coords, write_archive
from flows.spill import SqliteStore, StateError, partition_file
from rtrl import clickhouse
from rtrl.errors import ConfigError
from rtrl.sections.app import RETAINED_TABLES
from rtrl.sections.simulator import SimulatorSettings
from rtrl.settings import load_settings
from schemas.codec import event_codec
from schemas.records import Checkpoint, TrajectoryStarted
from schemas.types import to_arrow
from simulator.generate import generate
from tests.test_monitors import short_reward

ROOT = Path(__file__).resolve().parent.parent
DAY = 86_400_000


def _now() -> int:
    return time.time_ns() // 1_000_000


def _event(tid: str, ts: int) -> TrajectoryStarted:
    return TrajectoryStarted(
        event_id=f"e-{tid}", trajectory_id=tid, ts=ts, org_id="o", user_hash="0" * 32, policy_version=1, arm="a",
        task_kind="bugfix",
    )  # fmt: skip


def test_the_settings_name_a_retention_for_every_table_that_holds_users_data():
    """Every table holding users' data or what was derived from it has a default retention; an unknown table or
    a negative number of days is refused, naming the setting."""
    tables = load_settings(env={}).retention.tables
    assert set(tables) == set(RETAINED_TABLES) and all(d > 0 for d in tables.values())
    assert tables["events"] == 90 and tables["dead_letters"] == 30 and tables["rollouts"] == 7
    over = load_settings(env={"RTRL_RETENTION__TABLES": '{"events": 0, "rewards": 30}'}).retention.tables
    assert over["events"] == 0 and over["rewards"] == 30 and over["trajectories"] == 365  # the rest keep defaults
    for bad in ('{"checkpoints": 1}', '{"events": -1}'):
        with pytest.raises(ConfigError, match="retention.tables"):
            load_settings(env={"RTRL_RETENTION__TABLES": bad})


def test_ttls_follow_the_setting_and_delete_what_is_older(ch_client, ch_db):
    """On the real engine, with back-dated rows: after `apply_retention`, a merge deletes the events and rewards
    older than their retention and keeps the younger ones. Applying the same settings again alters nothing; a
    longer retention replaces the TTL, and 0 removes it, with no migration."""
    now = _now()
    clickhouse.insert(ch_client, ch_db, "events", [_event("old", now - 100 * DAY), _event("young", now - DAY)])
    rewards = [
        msgspec.structs.replace(short_reward("old", 1, "v2", 1.0), emitted_at=now - 400 * DAY),
        msgspec.structs.replace(short_reward("young", 1, "v2", 1.0), emitted_at=now - 300 * DAY),
    ]
    clickhouse.insert(ch_client, ch_db, "rewards", rewards)
    days = load_settings(env={}).retention.tables
    done = clickhouse.apply_retention(ch_client, ch_db, days, RETAINED_TABLES)
    assert done["events"] == "ttl 90 days" and done["rewards"] == "ttl 365 days"
    for table in ("events", "rewards"):
        ch_client.command(f"OPTIMIZE TABLE {ch_db}.{table} FINAL")

    def ids(table: str) -> list[str]:
        return sorted(r[0] for r in ch_client.query(f"SELECT trajectory_id FROM {ch_db}.{table}").result_rows)

    assert ids("events") == ["young"] and ids("rewards") == ["young"]
    assert set(clickhouse.apply_retention(ch_client, ch_db, days, RETAINED_TABLES).values()) == {"kept"}
    longer = clickhouse.apply_retention(ch_client, ch_db, days | {"events": 120.0}, RETAINED_TABLES)
    assert longer["events"] == "ttl 120 days" and longer["rewards"] == "kept"
    assert "10368000" in clickhouse.current_ttl(ch_client, ch_db, "events")  # 120 days in seconds
    removed = clickhouse.apply_retention(ch_client, ch_db, {t: 0.0 for t in RETAINED_TABLES}, RETAINED_TABLES)
    assert set(removed.values()) == {"ttl removed"} and clickhouse.current_ttl(ch_client, ch_db, "events") == ""
    dry = clickhouse.apply_retention(ch_client, ch_db, days, RETAINED_TABLES, dry_run=True)
    assert dry["events"] == "ttl 90 days" and clickhouse.current_ttl(ch_client, ch_db, "events") == ""


def test_the_archive_keeps_its_young_days_and_deletes_the_old(tmp_path):
    """The archive's day folders older than `retention.archive_days` go, whole; a younger day and a folder the
    archive did not write stay; days 0 keeps everything; a dry run deletes nothing."""
    now = _now()
    events = [_event("old", now - 100 * DAY), _event("edge", now - 89 * DAY), _event("young", now - DAY)]
    write_archive(tmp_path, with_coords(to_arrow(events, clickhouse.TABLES["events"]), [(0, i) for i in range(3)]))
    (tmp_path / "notes").mkdir()
    assert len(list(tmp_path.glob("date=*"))) == 3
    assert prune_archive(tmp_path, 0, now) == [] and prune_archive(tmp_path, 90, now, dry_run=True)
    assert len(list(tmp_path.glob("date=*"))) == 3
    gone = prune_archive(tmp_path, 90, now)
    assert len(gone) == 1 and (tmp_path / "notes").is_dir()
    assert sorted(read_archive(tmp_path).column("trajectory_id").to_pylist()) == ["edge", "young"]


@pytest.mark.slow
def test_rtrl_retention_apply_on_a_data_folder(tmp_path):
    """`rtrl retention apply --dry-run` says what it would do and changes nothing; `rtrl retention apply` sets the
    TTLs and deletes the archive's old days, then says the TTLs are current."""
    now = _now()
    archive = tmp_path / "archive" / "events"
    old = [_event("old", now - 200 * DAY)]
    write_archive(archive, with_coords(to_arrow(old, clickhouse.TABLES["events"]), [(0, 0)]))
    abandoned = tmp_path / "recovery" / "batches"  # a batch flow's recovery folder, stopped 8 days ago
    abandoned.mkdir(parents=True)
    init_db_dir(abandoned, 1)
    _age(abandoned, 8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {"RTRL_DATA_DIR": str(tmp_path)}

    def rtrl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "app.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )

    dry = rtrl("retention", "apply", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would set events ttl 90 days" in dry.stdout and "would delete 1 day(s)" in dry.stdout
    assert "flow state: would delete 1 recovery folder(s)" in dry.stdout
    assert list(archive.glob("date=*")) and abandoned.exists()
    done = rtrl("retention", "apply")
    assert done.returncode == 0, done.stderr
    assert "set events ttl 90 days" in done.stdout and "delete 1 day(s)" in done.stdout
    assert "flow state: delete 1 recovery folder(s)" in done.stdout
    assert not list(archive.glob("date=*")) and not abandoned.exists()
    again = rtrl("retention", "apply")
    assert again.returncode == 0 and "nothing (TTLs current)" in again.stdout and "delete 0 day(s)" in again.stdout


def _checkpoint(version: int, parent: int | None, status: str, at: int, path: str) -> Checkpoint:
    return Checkpoint(
        version=version, parent=parent, created_at=at, steps=1, samples=1, tokens=1, eval_results={}, status=status,
        reason="", kafka_offsets={}, path=path,
    )  # fmt: skip


def test_checkpoints_keep_the_newest_the_serving_version_and_its_rollback_targets(ch_client, ch_db, tmp_path):
    """On the real engine and real folders: the newest versions, the serving one (v6, re-promoted by a rollback of
    v7) and its nearest promoted ancestors stay; every other version's checkpoint and registry export go. A dry run
    deletes nothing, a checkpoint outside the data folder is never touched, and 0 keeps every version."""
    from app.retention import kept, prune_checkpoints

    settings = load_settings(env={"RTRL_DATA_DIR": str(tmp_path / "data"), "RTRL_CLICKHOUSE__DATABASE": ch_db})
    ckpts, registry = tmp_path / "data" / "loop" / "checkpoints", tmp_path / "data" / "registry"
    decisions = [  # version, parent, latest status, decided at
        (0, None, "promoted", 0), (1, 0, "promoted", 1), (2, 1, "rejected", 2), (3, 1, "promoted", 3),
        (4, 3, "rejected", 4), (5, 3, "promoted", 5), (6, 5, "promoted", 99), (7, 6, "rolled_back", 98),
        (8, 6, "rejected", 8), (9, 6, "rejected", 9), (10, 6, "rejected", 10), (11, 6, "rejected", 11),
    ]  # fmt: skip
    rows = []
    for v, parent, status, at in decisions:
        folder = (tmp_path / "elsewhere" if v == 8 else ckpts) / f"v{v}"
        (folder / "weights").mkdir(parents=True)
        if status in ("promoted", "rolled_back"):
            (registry / f"v{v}").mkdir(parents=True)
        rows.append(_checkpoint(v, parent, status, at, str(folder)))
    clickhouse.insert(ch_client, ch_db, "checkpoints", rows)
    latest = {c.version: c for c in rows}
    assert kept(latest, 3, 2) == {3, 5, 6, 9, 10, 11} and kept(latest, 0, 2) == set(latest)
    assert 6 in kept(latest, 1, 0)  # the serving version, however old
    env = {"RTRL_RETENTION__CHECKPOINTS_KEEP": "3", "RTRL_RETENTION__ROLLBACK_VERSIONS": "2"}
    settings = load_settings(env={"RTRL_DATA_DIR": str(tmp_path / "data"), "RTRL_CLICKHOUSE__DATABASE": ch_db} | env)
    assert prune_checkpoints(settings, ch_client, dry_run=True) == [0, 1, 2, 4, 7]
    assert len(list(ckpts.iterdir())) == 11
    assert prune_checkpoints(settings, ch_client) == [0, 1, 2, 4, 7]
    assert sorted(p.name for p in ckpts.iterdir()) == ["v10", "v11", "v3", "v5", "v6", "v9"]
    assert sorted(p.name for p in registry.iterdir()) == ["v3", "v5", "v6"]
    assert (tmp_path / "elsewhere" / "v8").exists()  # not the data folder's: never ours to delete
    assert prune_checkpoints(settings, ch_client) == []


# ---------------------------------------------------------------- the flows' recovery and spill state


def _age(path: Path, days: float) -> None:
    """Back-date ``path`` (each file in it, for a folder) by ``days``."""
    then = time.time() - days * 86_400
    for f in [path, *path.rglob("*")] if path.is_dir() else [path, *path.parent.glob(path.name + "-*")]:
        os.utime(f, (then, then))


def _reward_flow_run(settings, recovery: Path) -> None:
    """The reward flow on 40 simulated trajectories over 2 partitions, with Bytewax recovery in ``recovery`` and
    a memory budget small enough that its windows spill to SQLite files."""
    codec, items, offsets = event_codec(), [], Counter()
    for e in generate(SimulatorSettings(trajectories=40, seed=5, duplicate_rate=0.0), "retention-salt"):
        p = zlib.crc32(e.event.trajectory_id.encode()) % 2
        items.append((str(p), Message(e.event.trajectory_id.encode(), codec.encode(e.event), p, offsets[p])))
        offsets[p] += 1
    flow = reward_flow.build_flow(
        settings,
        sources={"events": TestingSource(items)},
        sinks={"clickhouse": TestingSink([]), "kafka": TestingSink([])},
    )
    run_main(flow, recovery_config=RecoveryConfig(str(recovery), backup_interval=timedelta(0)))


def test_flow_state_is_kept_while_used_and_deleted_after_its_retention(tmp_path):
    """With a real recovery snapshot and its spill files, all back-dated a month: the files the snapshot refers to,
    a file another process holds and a young file stay; an old file nothing uses goes, and so does an abandoned
    recovery folder. The flow then resumes from what was kept. Once stopped, its state goes too."""
    settings = load_settings(
        env={"RTRL_DATA_DIR": str(tmp_path), "RTRL_FLOW__STATE_MEMORY_MB": "0.002", "RTRL_SDK__SALT": "retention-salt"}
    )
    recovery, batches = tmp_path / "recovery" / "rewards", tmp_path / "recovery" / "batches"
    state = Path(settings.state_root)
    for folder in (recovery, batches):
        folder.mkdir(parents=True)
        init_db_dir(folder, 1)
    _reward_flow_run(settings, recovery)
    live = sorted(state.glob("partition-*.sqlite"))
    assert len(live) == 2, "the flow spilled nothing"

    def dead(run: str, days: float) -> Path:
        path = partition_file(state, 0, run)
        SqliteStore.fresh(path).close()
        _age(path, days)
        return path

    old, young = dead("a" * 12, 8), dead("b" * 12, 1)
    held = partition_file(state, 1, "c" * 12)  # open in another process, as a running flow holds its file
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from flows.spill import SqliteStore; s = SqliteStore.fresh(sys.argv[1]); "
         "print('ready', flush=True); sys.stdin.read()", str(held)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        other = state / "notes.txt"
        other.write_text("not a state file")
        for path in (*live, held, other, recovery, batches):
            _age(path, 30)
        before = sorted(p.name for p in state.iterdir())
        now = time.time()
        with hold(recovery):  # the reward flow runs on its recovery folder
            assert prune_state(settings, now, FLOWS, dry_run=True) == ([batches], [old])
            assert sorted(p.name for p in state.iterdir()) == before and batches.exists()
            assert prune_state(settings, now, FLOWS) == ([batches], [old])
        assert not batches.exists() and not old.exists() and not old.with_name(old.name + "-wal").exists()
        assert all(p.exists() for p in (*live, young, held, other, recovery))
    finally:
        holder.communicate("", timeout=30)
    _age(held, 30)  # its holder wrote it as it closed
    with hold(recovery):
        assert prune_state(settings, time.time(), FLOWS) == ([], [held])  # nothing holds it any more

    _reward_flow_run(settings, recovery)  # resumes from the kept snapshot and its spill files
    assert sorted(state.glob("partition-*.sqlite")) == sorted([*live, young])  # no fresh file: it resumed
    again = dead("d" * 12, 8)
    assert prune_at_start(settings, FLOW["rewards"]) == [again]  # as a reward flow does at its start
    assert not again.exists() and all(p.exists() for p in (*live, young))

    gc.collect()  # the in-process run's stores, as a stopped flow's process lets go of its files
    for path in (*live, recovery):  # the flow stopped a month ago: its folder and files go
        _age(path, 30)
    assert prune_state(settings, time.time(), FLOWS) == ([recovery], live)
    assert not recovery.exists() and sorted(p.name for p in state.iterdir()) == sorted(
        p.name
        for p in (young, young.with_name(young.name + "-wal"), young.with_name(young.name + "-shm"), other)
        if p.exists()
    )


def test_spill_files_are_kept_when_part_of_a_clusters_recovery_store_is_elsewhere(tmp_path):
    """Bytewax files a snapshot on any partition of a cluster's recovery store. A process with its own volume sees
    only its partition, so it cannot know a spill file unused: nothing is deleted, and the command says why."""
    settings = load_settings(env={"RTRL_DATA_DIR": str(tmp_path)})
    recovery = tmp_path / "recovery" / "rewards" / "process-1"
    recovery.mkdir(parents=True)
    init_db_dir(recovery, 2)
    (recovery / "part-0.sqlite3").unlink()  # process 0's partition is on its own volume
    state = Path(settings.state_root)
    old = partition_file(state, 1, "e" * 12)
    SqliteStore.fresh(old).close()
    _age(old, 30)
    with hold(recovery):
        with pytest.raises(StateError, match=r"partitions \[1\] of a store of 2"):
            prune_state(settings, time.time(), FLOWS)
    assert prune_at_start(settings, FLOW["rewards"]) == [] and old.exists()
