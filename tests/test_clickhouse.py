"""ClickHouse on the real engine (chdb, or a server via RTRL_TEST_CLICKHOUSE_DSN): migrations,
round trips of every record, DDL/Arrow drift, schema mismatch and unusable data folders."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devservices.broker import free_port
from rtrl.clickhouse import TABLES, connect, insert, live_columns, migrate, migrations, select, verify
from rtrl.errors import ConfigError, SchemaMismatch, ServiceUnavailable
from schemas.types import arrow_schema, columns, normalized
from tests.strategies import records

# natural key of each table: rows with the same key replace each other
KEYS = {
    "events": lambda r: (r.trajectory_id, r.event_id),
    "rollouts": lambda r: r.trajectory_id,
    "rewards": lambda r: (r.trajectory_id, r.reward_version),
    "batches": lambda r: r.batch_id,
    "checkpoints": lambda r: r.version,
    "adapter_checkpoints": lambda r: (r.org, r.version),
    "dead_letters": lambda r: (r.source, r.partition, r.offset, r.kind),
    "trajectories": lambda r: r.trajectory_id,
    "train_metrics": lambda r: (r.run_id, r.step),
    "batch_stats": lambda r: r.cohort,
    "reward_versions": lambda r: r.name,
    "erasures": lambda r: (r.erasure_id, r.at, r.status),
    "erased_trajectories": lambda r: (r.erasure_id, r.trajectory_id),
}


def test_migrations_are_idempotent(ch_client, ch_db):
    """Applying migrations again applies nothing and records each version once."""
    assert migrate(ch_client, ch_db) == []
    rows = ch_client.query(f"SELECT version, count() FROM {ch_db}.schema_migrations GROUP BY version").result_rows
    assert sorted(rows) == [(m.version, 1) for m in migrations()]
    verify(ch_client, ch_db)


@pytest.mark.parametrize("table", list(TABLES))
def test_ddl_and_arrow_schema_agree(ch_client, ch_db, table):
    """The migrated table's columns equal the ones derived from schemas.records, in ClickHouse types
    and in the Arrow schema the engine returns."""
    cls = TABLES[table]
    assert live_columns(ch_client, ch_db, table) == [(c.name, c.clickhouse) for c in columns(cls)]
    engine = ch_client.query_arrow(f"SELECT * FROM {ch_db}.{table} LIMIT 0").schema
    derived = arrow_schema(cls)
    assert engine.names == derived.names
    for f in derived:
        assert normalized(engine.field(f.name).type) == normalized(f.type), f.name
        assert engine.field(f.name).nullable == f.nullable, f.name


@pytest.mark.parametrize("table", list(TABLES))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.slow
def test_every_record_round_trips_through_clickhouse(ch_client, ch_db, table, data):
    """Records inserted as Arrow and read back with FINAL are unchanged."""
    key = KEYS[table]
    recs = data.draw(st.lists(records(TABLES[table]), min_size=1, max_size=8, unique_by=key))
    ch_client.command(f"TRUNCATE TABLE {ch_db}.{table}")
    insert(ch_client, ch_db, table, recs)
    assert sorted(select(ch_client, ch_db, table, final=table != "erasures"), key=key) == sorted(recs, key=key)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recs=st.lists(records(TABLES["events"]), min_size=1, max_size=10, unique_by=KEYS["events"]))
def test_replayed_rows_replace_themselves(ch_client, ch_db, recs):
    """Inserting the same events twice (an at-least-once replay) leaves one row per event under FINAL."""
    ch_client.command(f"TRUNCATE TABLE {ch_db}.events")
    insert(ch_client, ch_db, "events", recs)
    insert(ch_client, ch_db, "events", recs)
    assert len(select(ch_client, ch_db, "events")) == len(recs)


def test_schema_mismatch_names_table_and_column(ch_client, ch_db):
    """A table that differs from the code fails verify() with the column, both types, and the fix."""
    ch_client.command(f"ALTER TABLE {ch_db}.rewards MODIFY COLUMN reward Float32")
    ch_client.command(f"ALTER TABLE {ch_db}.events ADD COLUMN surprise UInt8")
    with pytest.raises(SchemaMismatch) as err:
        verify(ch_client, ch_db)
    text = str(err.value)
    assert f"{ch_db}.rewards.reward is Float32 but code expects Float64" in text
    assert f"{ch_db}.events.surprise exists in ClickHouse but not in schemas" in text
    assert "rtrl migrate" in text


def test_missing_table_is_a_mismatch(ch_client, ch_db):
    """A dropped table is reported by name."""
    ch_client.command(f"DROP TABLE {ch_db}.checkpoints")
    with pytest.raises(SchemaMismatch, match=f"table {ch_db}.checkpoints does not exist"):
        verify(ch_client, ch_db)


def test_edited_migration_is_refused(ch_client, ch_db, tmp_path):
    """Changing an applied migration's text is refused instead of silently diverging."""
    for m in migrations():
        (tmp_path / m.name).write_text(m.sql + "\n-- edited\n")
    with pytest.raises(SchemaMismatch, match="changed after it was applied"):
        migrate(ch_client, ch_db, tmp_path)


def test_unwritable_chdb_folder_is_a_config_error(tmp_path):
    """A data folder that cannot be created names the folder and the setting to change."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="not writable.*clickhouse.dsn"):
        connect(f"chdb://{blocker}/clickhouse")


def test_unreachable_server_names_the_address():
    """An http DSN nobody listens on fails within the timeout, naming the address without the password."""
    port = free_port()
    with pytest.raises(ServiceUnavailable) as err:
        connect(f"http://default:s3cret@127.0.0.1:{port}", timeout_s=2)
    assert f"127.0.0.1:{port}" in str(err.value)
    assert "s3cret" not in str(err.value)


def test_second_chdb_folder_in_one_process_is_explained(tmp_path):
    """chdb allows one folder per process; opening a second says so instead of a cryptic engine error."""
    code = (
        "import sys; from rtrl.clickhouse import connect; from rtrl.errors import ConfigError\n"
        f"held = connect('chdb://{tmp_path}/one')\n"
        f"try:\n    connect('chdb://{tmp_path}/two')\nexcept ConfigError as e:\n    print(e); sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "one embedded ClickHouse folder" in proc.stdout
