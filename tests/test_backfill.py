"""The Beam backfill (flows.backfill, ``rtrl backfill``) against the streaming reward flow.

Stream = batch: the reward flow runs on the real broker and writes the real ClickHouse engine and the
Parquet archive; the backfill replays that archive on the FnApiRunner (two worker processes) and must
give exactly the final rewards the stream wrote, every trajectory and every component, and insert
nothing when loaded. A property test checks the same on random event sets through both paths (the
flow in-process). Bad archive files and rows are dead letters naming the file and the row.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flows import backfill as bf
from flows import reward_flow
from flows.processor import Message
from flows.sinks import with_coords, write_archive
from rtrl import clickhouse
from rtrl.errors import ConfigError
from rtrl.sections.simulator import SimulatorSettings
from rtrl.settings import load_settings
from schemas.codec import event_codec
from schemas.records import EventBase, Reward
from schemas.types import to_arrow
from simulator.generate import generate
from tests.test_reward_flow import _produce

SALT = "backfill-test-salt"
#: a short deadline and lateness so the simulator's hours-late persistence checks revise rewards (2-4 h)
#: or come too late (4-12 h) within one run
WINDOWS = {"RTRL_FLOW__DEADLINE_S": "120", "RTRL_FLOW__ALLOWED_LATENESS_S": "14400"}
V3 = {
    "v3-broken-harsher": {
        "parent": "v2",
        "reason": "broken calls cost double",
        "author": "test",
        "weights": {"w_broken": 0.5},
    }
}


def _env(broker, prefix, ch_dsn, ch_db, data_dir, **extra) -> dict[str, str]:
    return (
        {
            "RTRL_SDK__SALT": SALT,
            "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
            "RTRL_KAFKA__TOPIC_PREFIX": prefix,
            "RTRL_CLICKHOUSE__DSN": ch_dsn,
            "RTRL_CLICKHOUSE__DATABASE": ch_db,
            "RTRL_FLOW__TAIL": "false",
            "RTRL_DATA_DIR": str(data_dir),
            "RTRL_REWARDS__VERSIONS": "v2,v1-discard-broken",
            "RTRL_REWARDS__DEFINE": json.dumps(V3),
        }
        | WINDOWS
        | extra
    )


def _final(rewards: list[Reward]) -> dict[str, dict]:
    """The final reward of each trajectory (highest revision), every field but the wall-clock stamp."""
    out: dict[str, Reward] = {}
    for r in rewards:
        if r.trajectory_id not in out or r.revision > out[r.trajectory_id].revision:
            out[r.trajectory_id] = r
    return {t: msgspec.structs.asdict(msgspec.structs.replace(r, emitted_at=0)) for t, r in out.items()}


def _out_rewards(result: bf.BackfillResult) -> list[Reward]:
    return bf._read_out(result.out, "rewards", Reward)


@pytest.fixture(scope="module")
def streamed(broker, ch_dsn, ch_client, tmp_path_factory):
    """The reward flow over a simulator run with duplicates, reordering and late checks, on 3 partitions."""
    from devservices.broker import free_port
    from rtrl.kafka import ensure_topics

    prefix, data = f"bf{free_port()}.", tmp_path_factory.mktemp("backfill")
    db = f"bf{free_port()}"
    clickhouse.migrate(ch_client, db)
    ensure_topics(broker.bootstrap, prefix, 3)
    codec = event_codec()
    sim = SimulatorSettings(trajectories=400, seed=5, duplicate_rate=0.04, reorder_rate=0.05, late_check_rate=0.3)
    emissions = generate(sim, SALT)
    _produce(
        broker.bootstrap,
        prefix + "events",
        [(e.event.trajectory_id.encode(), codec.encode(e.event)) for e in emissions],
    )
    settings = load_settings(env=_env(broker, prefix, ch_dsn, db, data))
    run_main(reward_flow.build_flow(settings))
    yield settings, db
    ch_client.command(f"DROP DATABASE IF EXISTS {db}")


@pytest.mark.slow
def test_backfill_of_the_live_version_equals_the_stream(streamed, ch_client):
    """Every trajectory, every component: the backfill's final rewards are the stream's, loading them inserts
    nothing, and its window rules refuse the same events (duplicates, too late)."""
    settings, db = streamed
    stream = clickhouse.select(ch_client, db, "rewards", "WHERE reward_version = 'v2'")
    revised = [r for r in stream if r.revision > 0]
    assert len(stream) > 300 and revised, "the run must have revisions for this test to mean anything"
    result = bf.backfill(settings, "v2", client=ch_client, workers=2)
    assert _final(_out_rewards(result)) == _final(stream)
    assert result.written["rewards"] == 0 and result.unchanged["rewards"] == len(_out_rewards(result))
    stream_dead = Counter(
        k
        for (k,) in ch_client.query(f"SELECT kind FROM {db}.dead_letters FINAL WHERE source LIKE '%events'").result_rows
    )
    assert stream_dead["duplicate"] > 0 and stream_dead["too_late"] > 0
    assert {k: result.counts[f"dead:{k}"] for k in stream_dead} == dict(stream_dead)
    archived = sum(pq.read_table(f).num_rows for f in (settings.data_path / "archive" / "events").glob("*/*.parquet"))
    assert result.counts["events"] == result.counts["replayed"] == archived  # every archived event, each once


@pytest.mark.slow
def test_a_new_version_backfills_idempotently_and_by_range(streamed, ch_client):
    """A version defined as data (rewards.define) is scored over the archive: a second run changes nothing;
    a sub-range gives the same rewards for the trajectories that start in it."""
    settings, db = streamed
    name = "v3-broken-harsher"
    first = bf.backfill(settings, name, client=ch_client, workers=1)

    def rows():
        return ch_client.query(f"SELECT count() FROM {db}.rewards WHERE reward_version = '{name}'").result_rows[0][0]

    n = rows()
    assert first.written["rewards"] == n > 300
    stored = {
        r.trajectory_id: r for r in clickhouse.select(ch_client, db, "rewards", f"WHERE reward_version = '{name}'")
    }
    v2 = {r.trajectory_id: r for r in clickhouse.select(ch_client, db, "rewards", "WHERE reward_version = 'v2'")}
    broken = [t for t, r in v2.items() if r.components["broken_tool_calls"] < 0]
    assert broken and all(
        stored[t].components["broken_tool_calls"] == 2 * v2[t].components["broken_tool_calls"] for t in broken
    )
    again = bf.backfill(settings, name, client=ch_client, workers=2)
    assert again.written == {"rewards": 0, "dead_letters": 0} and rows() == n
    firsts = sorted(r.first_event_ts for r in stored.values())
    lo, hi = firsts[len(firsts) // 3], firsts[2 * len(firsts) // 3]
    part = bf.backfill(settings, name, lo, hi, client=ch_client, workers=1)
    got = _final(_out_rewards(part))
    assert got and got == {
        t: r for t, r in _final(list(stored.values())).items() if lo <= stored[t].first_event_ts < hi
    }
    assert part.written["rewards"] == 0


def test_unknown_version_and_bad_range_are_config_errors(streamed, ch_client):
    settings, _ = streamed
    with pytest.raises(ConfigError, match="--reward-version"):
        bf.backfill(settings, "v9", client=ch_client)
    with pytest.raises(ConfigError, match="--to"):
        bf.backfill(settings, "v2", 10, 5, client=ch_client)


def test_rtrl_backfill_command(streamed, ch_client, monkeypatch, capsys):
    """`rtrl backfill --reward-version V --from T1 --to T2 -w N` as a user types it: the plan, then one summary
    line; run over everything already loaded it writes nothing."""
    from datetime import UTC, datetime

    from app.cli import main

    settings, db = streamed
    env = {
        "RTRL_SDK__SALT": SALT,
        "RTRL_KAFKA__BOOTSTRAP": settings.kafka.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": settings.kafka.topic_prefix,
        "RTRL_CLICKHOUSE__DSN": settings.clickhouse.dsn,
        "RTRL_CLICKHOUSE__DATABASE": db,
        "RTRL_DATA_DIR": str(settings.data_path),
        "RTRL_REWARDS__VERSIONS": "v2,v1-discard-broken",
        "RTRL_REWARDS__DEFINE": json.dumps(V3),
        "COLUMNS": "200",
    } | WINDOWS
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    stream = clickhouse.select(ch_client, db, "rewards", "WHERE reward_version = 'v2'")
    first = min(r.first_event_ts for r in stream)
    day = datetime.fromtimestamp(first / 1000, UTC).strftime("%Y-%m-%d")  # the ISO form a user types
    capsys.readouterr()
    assert main(["backfill", "--reward-version", "v2", "--from", day, "--to", str(first + 10**9), "-w", "1"]) == 0
    out = capsys.readouterr().out
    assert f"backfill v2 ({bf.registry(settings)['v2'].checksum[:12]})" in " ".join(out.split())
    assert re.search(r"ClickHouse: 0 rewards written, [\d,]+ unchanged", " ".join(out.split())), out
    assert main(["backfill", "--reward-version", "v9"]) == 2  # an unknown version: one error line, no run
    with pytest.raises(SystemExit) as bad:  # argparse's usage error: one line, exit code 2
        main(["backfill", "--reward-version", "v2", "--from", "9" * 20])
    assert bad.value.code == 2 and "after the year 9999" in capsys.readouterr().err


# ---------------------------------------------------------------- bad files and rows


def _archive_events(n: int, seed: int) -> pa.Table:
    codec = event_codec()
    sim = SimulatorSettings(trajectories=n, seed=seed, duplicate_rate=0.0)
    events = [codec.decode(codec.encode(e.event)) for e in generate(sim, SALT)]
    return with_coords(to_arrow(events, EventBase), [(0, i) for i in range(len(events))])


def _backfill_v2(tmp_path, archive, ch_client, ch_db) -> bf.BackfillResult:
    """The backfill of v2 over ``archive`` on one worker, into the test's database."""
    settings = load_settings(
        env={
            "RTRL_SDK__SALT": SALT,
            "RTRL_DATA_DIR": str(tmp_path),
            "RTRL_FLOW__ARCHIVE_DIR": str(archive),
            "RTRL_CLICKHOUSE__DATABASE": ch_db,
        }
    )
    return bf.backfill(settings, "v2", client=ch_client, workers=1)


def test_corrupt_file_schema_drift_and_bad_rows_are_dead_letters(tmp_path, ch_client, ch_db):
    """A corrupt file, a file missing a required column, a retyped column that casts, and bad rows: each is a
    dead letter naming the file (and the row), and everything else is scored."""
    archive = tmp_path / "archive"
    good = _archive_events(30, 1)
    write_archive(archive, good)
    day = sorted(p.name for p in archive.iterdir())[0]
    (archive / day / "part-corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    pq.write_table(good.drop_columns(["trajectory_id"]).slice(0, 5), archive / day / "part-nocolumn.parquet")
    retyped = good.slice(0, 3).set_column(
        good.schema.get_field_index("lines"), "lines", good.column("lines").slice(0, 3).cast(pa.int64())
    )
    pq.write_table(retyped, archive / day / "part-retyped.parquet")
    bad_rows = good.slice(0, 4)
    bad_rows = bad_rows.set_column(
        bad_rows.schema.get_field_index("type"),
        "type",
        pa.array(["exfiltrate", *bad_rows.column("type").to_pylist()[1:]]),
    )
    ids = bad_rows.column("user_hash").to_pylist()
    bad_rows = bad_rows.set_column(
        bad_rows.schema.get_field_index("user_hash"), "user_hash", pa.array([ids[0], "not-a-hash", *ids[2:]])
    )
    pq.write_table(bad_rows, archive / day / "part-badrows.parquet")
    result = _backfill_v2(tmp_path, archive, ch_client, ch_db)
    dead = clickhouse.select(ch_client, ch_db, "dead_letters", "WHERE startsWith(source, 'backfill:v2 ')")
    for d in dead:  # the file: whole in the key, and in the source (its tail where the path is long)
        assert d.source == f"backfill:v2 {d.key}" or (
            len(d.source) == 128 and d.source.startswith("backfill:v2 …") and d.key.endswith(d.source[13:])
        ), (d.source, d.key)
    by_file = {(d.key.rsplit("/", 1)[-1], d.offset): d for d in dead}  # the row is the offset
    assert "cannot read Parquet" in by_file[("part-corrupt.parquet", -1)].reason
    assert "trajectory_id is missing" in by_file[("part-nocolumn.parquet", -1)].reason
    assert (
        by_file[("part-badrows.parquet", 0)].field == "$.type"
        or "exfiltrate" in by_file[("part-badrows.parquet", 0)].reason
    )
    assert (
        "row 1" in by_file[("part-badrows.parquet", 1)].reason
        and by_file[("part-badrows.parquet", 1)].field == "$.user_hash"
    )
    assert not [d for d in dead if (d.key or "").endswith("part-retyped.parquet")]  # cast without loss: used
    assert result.counts["files"] == 5
    assert {r.trajectory_id for r in _out_rewards(result)} == set(good.column("trajectory_id").to_pylist())
    # the retyped file's rows and the bad file's valid rows repeat the good file's offsets: each event counts once
    assert result.counts["replayed"] == good.num_rows


# ---------------------------------------------------------------- property: stream = batch on random event sets


@st.composite
def event_sets(draw):
    """Simulated trajectories with random duplicate, reorder and late-check rates, spread over partitions."""
    n = draw(st.integers(5, 40))
    sim = SimulatorSettings(
        trajectories=n,
        seed=draw(st.integers(0, 10_000)),
        duplicate_rate=draw(st.floats(0, 0.2)),
        reorder_rate=draw(st.floats(0, 0.3)),
        late_check_rate=draw(st.floats(0, 0.6)),
        orgs=2,
        users_per_org=3,
    )
    emissions = generate(sim, SALT)
    lost = draw(st.sets(st.integers(0, len(emissions) - 1), max_size=len(emissions) // 10))  # never_started, gaps
    return [e for i, e in enumerate(emissions) if i not in lost], draw(st.integers(1, 3))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=event_sets())
@pytest.mark.slow
def test_property_stream_equals_batch(data, tmp_path_factory, ch_client, ch_db):
    emissions, partitions = data
    tmp = tmp_path_factory.mktemp("prop")
    settings = load_settings(
        env={"RTRL_SDK__SALT": SALT, "RTRL_DATA_DIR": str(tmp), "RTRL_CLICKHOUSE__DATABASE": ch_db} | WINDOWS
    )
    codec, offsets, items = event_codec(), Counter(), []
    for e in emissions:
        key = e.event.trajectory_id.encode()
        p = zlib.crc32(key) % partitions
        items.append((str(p), Message(key, codec.encode(e.event), p, offsets[p])))
        offsets[p] += 1
    kafka, ch = [], []
    flow = reward_flow.build_flow(
        settings,
        sources={"events": TestingSource(items, batch_size=7)},
        sinks={"clickhouse": TestingSink(ch), "kafka": TestingSink(kafka)},
    )
    run_main(flow)
    located = [row for _, (table, rows) in ch if table == "events" for row in rows]
    write_archive(
        tmp / "archive" / "events", with_coords(to_arrow([e for e, _ in located], EventBase), [c for _, c in located])
    )
    stream = [r for _, (table, rows) in ch if table == "rewards" for r in rows]
    result = bf.backfill(settings, "v2", client=ch_client, workers=1)
    assert stream and _final(_out_rewards(result)) == _final(stream)


def test_long_paths_missing_coordinates_and_two_histories_are_dead_letters(tmp_path, ch_client, ch_db):
    """A dead letter's source stays a valid label under a long archive path (the whole path in its key); rows
    without Kafka coordinates and an offset holding two different events (an archive of two topic histories)
    are dead letters with the reason, and the run goes on."""
    good = _archive_events(30, seed=3)
    archive = tmp_path / ("a" * 90) / "archive"
    write_archive(archive, good)
    day = next(archive.glob("date=*"))
    corrupt = day / "part-corrupt.parquet"
    corrupt.write_bytes(b"PAR1 not really parquet")
    other = _archive_events(4, seed=99)  # another history of the topic: other events at offsets the good file holds
    pq.write_table(other, day / "part-other-history.parquet")
    nocoords = good.slice(0, 2).set_column(
        good.schema.get_field_index("kafka_offset"), "kafka_offset", pa.array([None, -1], pa.int64())
    )
    pq.write_table(nocoords, day / "part-nocoords.parquet")
    result = _backfill_v2(tmp_path, archive, ch_client, ch_db)
    dead = clickhouse.select(ch_client, ch_db, "dead_letters", "WHERE startsWith(source, 'backfill:v2')")
    assert all(len(d.source) <= 128 for d in dead)
    unreadable = [d for d in dead if d.key == str(corrupt)]
    assert (
        unreadable
        and "cannot read Parquet" in unreadable[0].reason
        and unreadable[0].source.endswith("corrupt.parquet")
    )
    assert sum("no Kafka partition and offset" in d.reason for d in dead) == 2
    assert sum("two histories" in d.reason for d in dead) == other.num_rows
    assert result.counts["files"] >= 3 and result.counts["rewards"] > 0
