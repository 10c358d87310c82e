"""ClickHouse cluster DDL (``clickhouse.cluster``): every migration rendered for a cluster parses with ClickHouse's
own parser and has the cluster layout; a single node's statements are today's; and the cluster DDL runs on a real
engine (chdb with a one-shard cluster on localhost), with only ON CLUSTER and the Replicated engines taken out
(they need ClickHouse Keeper and the DDL worker of a server, which chdb has not: the errors are asserted below)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rtrl.clickhouse import APPEND_ONLY_TABLES, TABLES, bookkeeping, ddl, migrations
from rtrl.clickhouse_cluster import LOCAL, SHARD_KEYS, Cluster, render
from rtrl.errors import ConfigError, SchemaMismatch
from rtrl.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_SQL = ROOT / "deploy" / "clickhouse" / "cluster.sql"
EXAMPLE = "rtrl_cluster"  # the cluster name deploy/clickhouse/cluster.sql is rendered for
DB = "rtrl"
CLUSTER = Cluster(EXAMPLE)


def _all_rendered(cluster: Cluster | None = CLUSTER) -> list[str]:
    out = [s for stmt in bookkeeping(DB) for s in render(stmt, DB, cluster)]
    for m in migrations():
        out += [s for stmt in m.statements(DB) for s in render(stmt, DB, cluster)]
    return out


def test_single_node_statements_are_todays():
    """clickhouse.cluster empty: every statement is the migration's own text, the bookkeeping as before."""
    assert load_settings(env={}).clickhouse.cluster == ""
    assert bookkeeping(DB) == [
        "CREATE DATABASE IF NOT EXISTS rtrl",
        "CREATE TABLE IF NOT EXISTS rtrl.schema_migrations "
        "(version UInt32, name String, checksum String, applied_at DateTime64(3, 'UTC')) "
        "ENGINE = ReplacingMergeTree ORDER BY version",
    ]
    for m in migrations():
        for stmt in m.statements(DB):
            assert render(stmt, DB, None) == [stmt]


def _format(client, sql: str) -> str:
    return client.query("SELECT formatQuery({q:String})", parameters={"q": sql}).result_rows[0][0]


def _tables_read(client, sql: str) -> set[str]:
    ast = "\n".join(r[0] for r in client.query("EXPLAIN AST " + sql).result_rows)
    return set(re.findall(r"TableIdentifier (\S+)", ast))


def test_every_cluster_statement_parses_and_has_the_cluster_layout(ch_client):
    """All 22 migrations rendered for a cluster: ClickHouse's parser (formatQuery, EXPLAIN AST) accepts each
    statement; every DDL runs ON CLUSTER; each MergeTree table is a Replicated one with the Keeper path and
    replica under a Distributed table of the table's name sharded by SHARD_KEYS (a prefix of its ORDER BY);
    views read the Distributed tables, materialized views the local ones."""
    rendered = _all_rendered()
    assert len(migrations()) >= 22 and len(rendered) > 100
    local_tables: dict[str, list[str] | None] = {}
    distributed: dict[str, str] = {}
    views_read: set[str] = set()
    for sql in rendered:
        text = _format(ch_client, sql)  # raises on anything ClickHouse cannot parse
        if text.startswith("INSERT"):
            assert "insert_distributed_sync = 1" in text and "ON CLUSTER" not in text
            continue
        assert f"ON CLUSTER {EXAMPLE}" in text, text
        if m := re.match(rf"CREATE TABLE IF NOT EXISTS {DB}\.(\w+) ON CLUSTER", text):
            engine = re.search(r"ENGINE = (\w+)\((.*?)\)(?:\n|$)", text, re.S)
            assert engine is not None, text
            if m[1].endswith(LOCAL):
                assert engine[1].startswith("Replicated") and engine[1].endswith("MergeTree"), text
                assert engine[2].startswith("'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"), text
                order = re.search(r"ORDER BY \(?([\w, ]+)\)?", text)
                local_tables[m[1][: -len(LOCAL)]] = [c.strip() for c in order[1].split(",")] if order else None
            else:
                assert engine[1] == "Distributed", text
                key = ", ".join(SHARD_KEYS[m[1]])
                assert engine[2] == f"{EXAMPLE}, {DB}, {m[1]}{LOCAL}, cityHash64({key})", text
                assert f"AS {DB}.{m[1]}{LOCAL}" in text
                distributed[m[1]] = key
        elif text.startswith("CREATE VIEW"):
            read = _tables_read(ch_client, sql)  # none for a view over a parameterized view
            assert not any(t.endswith(LOCAL) for t in read), (read, text)
            views_read |= read
            assert not re.search(r"(?<!GLOBAL )(INNER |LEFT )JOIN", text), text
        elif text.startswith("CREATE MATERIALIZED VIEW"):
            assert re.search(rf"TO {DB}\.\w+{LOCAL}\s", text), text
            read = _tables_read(ch_client, sql)
            assert read and all(t.endswith(LOCAL) for t in read), (read, text)
        elif text.startswith("ALTER TABLE"):
            assert re.match(rf"ALTER TABLE {DB}\.\w+ ON CLUSTER", text), text
    assert {f"{DB}.trajectories", f"{DB}.rewards", f"{DB}.promotions", f"{DB}.provisional_rewards"} <= views_read
    # the adapter_checkpoints table is made AS checkpoints: its ORDER BY is its own
    assert set(distributed) == set(local_tables) >= set(TABLES) | {"schema_migrations"}
    for table, order in local_tables.items():
        if order is not None:  # rows a ReplacingMergeTree collapses share the sharding columns
            assert list(SHARD_KEYS[table]) == order[: len(SHARD_KEYS[table])], (table, order)
    # every column change reaches the local and the Distributed table
    alters = [s for s in rendered if s.startswith("ALTER TABLE")]
    assert len(alters) % 2 == 0 and alters
    for local, dist in zip(alters[::2], alters[1::2], strict=True):
        assert local.replace(f"{LOCAL} ON CLUSTER", " ON CLUSTER", 1) == dist


def test_the_committed_cluster_sql_is_what_rtrl_migrate_print_makes():
    """`RTRL_CLICKHOUSE__CLUSTER=rtrl_cluster rtrl migrate --print > deploy/clickhouse/cluster.sql`: the
    command needs no server, and the committed file is what it prints now."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env |= {"RTRL_CLICKHOUSE__CLUSTER": EXAMPLE, "RTRL_CLICKHOUSE__DSN": "http://127.0.0.1:9/"}  # never reached
    run = subprocess.run(
        [sys.executable, "-m", "app.cli", "migrate", "--print"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == ddl(DB, CLUSTER)
    assert CLUSTER_SQL.read_text() == run.stdout, (
        f"{CLUSTER_SQL} is stale: run `RTRL_CLICKHOUSE__CLUSTER={EXAMPLE} rtrl migrate --print > {CLUSTER_SQL}`"
    )
    single = subprocess.run(
        [sys.executable, "-m", "app.cli", "migrate", "--print"],
        cwd=ROOT,
        env=env | {"RTRL_CLICKHOUSE__CLUSTER": ""},
        capture_output=True,
        text=True,
    )
    assert single.returncode == 0 and "ON CLUSTER" not in single.stdout and "Distributed" not in single.stdout


@pytest.mark.parametrize("bad", ["my-cluster", "1st", "c x", "c'; DROP"])
def test_a_bad_cluster_name_is_a_config_error_naming_the_setting_and_the_fix(bad):
    with pytest.raises(ConfigError) as e:
        load_settings(env={"RTRL_CLICKHOUSE__CLUSTER": bad})
    assert "clickhouse.cluster" in str(e.value) and "fix:" in str(e.value) and "remote_servers" in str(e.value)
    with pytest.raises(ConfigError, match=r"clickhouse\.cluster .*fix: set clickhouse\.cluster"):
        Cluster(bad)


def test_a_replica_path_without_shard_or_table_is_refused():
    with pytest.raises(ConfigError, match=r"clickhouse\.replica_path.*\{shard\} and \{table\}.*fix:"):
        load_settings(env={"RTRL_CLICKHOUSE__CLUSTER": "c", "RTRL_CLICKHOUSE__REPLICA_PATH": "/ch/{shard}/x"})
    assert load_settings(env={"RTRL_CLICKHOUSE__REPLICA_PATH": "/ch/x"}).clickhouse.cluster == ""  # unused alone


def test_a_new_table_without_a_sharding_key_is_refused():
    stmt = f"CREATE TABLE IF NOT EXISTS {DB}.fresh (k String) ENGINE = ReplacingMergeTree ORDER BY k"
    with pytest.raises(SchemaMismatch, match="add it to SHARD_KEYS"):
        render(stmt, DB, CLUSTER)
    with pytest.raises(SchemaMismatch, match="unknown kind of statement"):
        render(f"DROP TABLE {DB}.events", DB, CLUSTER)


#: run in its own process (chdb opens one data folder per process): a chdb with a one-shard, one-replica cluster
#: on localhost (is_local through tcp_port, so prefer_localhost_replica reads and writes the local tables)
_ENGINE_SCRIPT = textwrap.dedent(
    r"""
    import json, re, sys, uuid
    from pathlib import Path

    import clickhouse_connect

    from rtrl import clickhouse
    from rtrl.clickhouse_cluster import Cluster, render
    from rtrl.errors import ConfigError, SchemaMismatch
    from schemas.records import Reward

    folder, name = Path(sys.argv[1]), sys.argv[2]
    config = folder / "cluster.xml"
    config.write_text(f'''<clickhouse><tcp_port>19000</tcp_port>
      <remote_servers><{name}><shard><replica><host>localhost</host><port>19000</port></replica></shard></{name}>
      <two_shards><shard><replica><host>127.0.0.1</host><port>1</port></replica></shard>
      <shard><replica><host>127.0.0.2</host><port>1</port></replica></shard></two_shards>
      </remote_servers><macros><shard>01</shard><replica>r1</replica></macros></clickhouse>''')
    client = clickhouse_connect.get_client(
        interface="chdb", path=str(folder / "data"), chdb_options={"config-file": str(config)}
    )
    out = {}

    def attempt(sql):
        try:
            client.command(sql)
            return "ran"
        except Exception as e:
            return str(e).splitlines()[0]

    cluster = Cluster(name)
    rendered = clickhouse.ddl("probe", cluster).split(";\n")
    out["on_cluster"] = attempt(rendered[0].split("\n")[-1])  # CREATE DATABASE probe ON CLUSTER
    client.command("CREATE DATABASE IF NOT EXISTS probe")
    out["replicated"] = attempt(re.sub(r" ON CLUSTER \w+", "", rendered[1]))  # schema_migrations_local
    out["clusters"] = client.query(
        "SELECT shard_num, replica_num, is_local FROM system.clusters WHERE cluster = {c:String}",
        parameters={"c": name},
    ).result_rows

    class Neutralised:
        '''The real engine; each DDL without ON CLUSTER and with the plain MergeTree for the Replicated one.'''

        def __init__(self, client):
            self.client = client

        def command(self, sql, *args, **kwargs):
            sql = re.sub(r" ON CLUSTER \w+", "", sql)
            sql = re.sub(r"\bReplicated(\w*MergeTree)\('[^']*', '[^']*'(, )?", r"\1(", sql)
            return self.client.command(sql, *args, **kwargs)

        def __getattr__(self, attr):
            return getattr(self.client, attr)

    ch = Neutralised(client)
    out["applied"] = clickhouse.migrate(ch, "rtrl", cluster=cluster)
    out["again"] = clickhouse.migrate(ch, "rtrl", cluster=cluster)
    out["engines"] = dict(client.query(
        "SELECT name, engine FROM system.tables WHERE database = 'rtrl' AND name IN ('rewards', 'rewards_local')"
    ).result_rows)
    clickhouse.verify(client, "rtrl")  # the tables of today's names: Distributed, today's columns
    try:
        clickhouse.verify(client, "rtrl", cluster)
        out["verify_cluster"] = []
    except SchemaMismatch as e:
        out["verify_cluster"] = str(e).split(": ", 1)[1].split(". Fix:")[0].split("; ")
    try:
        clickhouse.migrate(client, "rtrl", folder=Path(sys.argv[3]))  # one migration more, no cluster given
    except ConfigError as e:
        out["single_node_on_cluster"] = str(e)
    out["single_node_verified"] = clickhouse.migrate(client, "rtrl")  # none pending: a job may use it

    def reward(tid, revision, value, provisional=False):
        return Reward(
            trajectory_id=tid, policy_version=1, reward_version="v2", revision=revision, reward=value,
            components={}, flags=[], close_reason="ended", org_id="o", arm="a", task_kind="edit", n_events=1,
            event_counts={}, first_event_ts=0, last_event_ts=0, emitted_at=revision, provisional=provisional,
        )

    # through the Distributed table, as the sinks write: a replayed and a revised reward
    clickhouse.insert(client, "rtrl", "rewards", [reward("t1", 1, 0.1, True), reward("t2", 1, 0.5)])
    clickhouse.insert(client, "rtrl", "rewards", [reward("t1", 2, 0.9), reward("t2", 1, 0.5)])
    out["raw_rows"] = client.query("SELECT count() FROM rtrl.rewards_local").result_rows[0][0]
    out["final"] = sorted(
        (r.trajectory_id, r.revision, r.reward) for r in clickhouse.select(client, "rtrl", "rewards")
    )
    out["provisional"] = client.query(
        "SELECT trajectory_id, revision FROM rtrl.provisional_rewards FINAL"
    ).result_rows
    views = {
        "behaviour": "rtrl.behaviour",
        "reward_stats": "rtrl.reward_stats(rv = 'v2')",
        "user_behaviour": "rtrl.user_behaviour",
        "user_rewards_between": "rtrl.user_rewards_between(reward_version = 'v2', since_ms = 0, until_ms = 1)",
        "reward_pairs": "rtrl.reward_pairs(a = 'v2', b = 'v1')",
        "verdict_delays": "rtrl.verdict_delays",
        "reward_arrival": "rtrl.reward_arrival",
        "provisional_vs_final": "rtrl.provisional_vs_final",
    }
    out["views"] = {k: attempt(f"SELECT * FROM {v} FORMAT Null") for k, v in views.items()}
    out["provisional_vs_final"] = client.query(
        "SELECT final_rewards, revised_from_provisional FROM rtrl.provisional_vs_final"
    ).result_rows

    # two shards nobody serves: a query is analysed (where a double-distributed JOIN is refused), then it fails
    # to connect. The rendered view (GLOBAL JOIN) gets to connecting; without GLOBAL it is refused.
    wide = Cluster("two_shards")
    statements = clickhouse.bookkeeping("wide") + [s for m in clickhouse.migrations() for s in m.statements("wide")]
    for sql in (sql for stmt in statements for sql in render(stmt, "wide", wide)):
        if not sql.startswith("INSERT"):  # the seed reads the cluster: nothing answers
            ch.command(sql)
    view = client.query(
        "SELECT as_select FROM system.tables WHERE database = 'wide' AND name = 'user_rewards_between'"
    ).result_rows[0][0]
    client.command("CREATE VIEW wide.without_global AS " + view.replace("GLOBAL ", ""))
    args = "(reward_version = 'v2', since_ms = 0, until_ms = 1)"
    out["two_shards_global"] = attempt(f"SELECT * FROM wide.user_rewards_between{args} FORMAT Null")
    out["two_shards_without_global"] = attempt(f"SELECT * FROM wide.without_global{args} FORMAT Null")
    print("RESULT " + json.dumps(out, default=str))
    """
)


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_the_cluster_ddl_runs_on_a_real_engine(tmp_path):
    """chdb with a one-shard cluster on localhost: ON CLUSTER and Replicated*MergeTree are refused (no DDL worker,
    no Keeper in an embedded engine); the same DDL with only those two parts taken out migrates every
    migration, verify passes on the Distributed tables of today's names and their _local tables (all but
    the engine), inserts through the Distributed tables collapse with FINAL, the materialized view fills the
    local table and every view answers. On two shards nobody serves, a rendered view's GLOBAL JOIN passes
    ClickHouse's analysis and fails only connecting, and the same view without GLOBAL is refused."""
    extra = tmp_path / "migrations"
    extra.mkdir()
    for m in migrations():
        (extra / m.name).write_text(m.sql)
    (extra / "9999_more.sql").write_text("ALTER TABLE {db}.rewards ADD COLUMN IF NOT EXISTS x UInt8;\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", _ENGINE_SCRIPT, str(tmp_path), EXAMPLE, str(extra)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    # what cannot run here, and why
    assert "Replicated DDL queries are disabled" in out["on_cluster"], out["on_cluster"]
    assert "Can't create replicated table without ZooKeeper" in out["replicated"], out["replicated"]
    assert out["clusters"] == [[1, 1, 1]]
    # what ran
    assert out["applied"] == [m.version for m in migrations()] and out["again"] == []
    assert out["engines"] == {"rewards": "Distributed", "rewards_local": "ReplacingMergeTree"}
    engine = lambda t: "MergeTree" if t in APPEND_ONLY_TABLES else "ReplacingMergeTree"  # noqa: E731  # an audit keeps every row
    assert out["verify_cluster"] == [f"rtrl.{t}{LOCAL} is {engine(t)}, not a Replicated*MergeTree" for t in TABLES], (
        "verify: only the engines taken out here differ"
    )
    assert "migrated for a cluster" in out["single_node_on_cluster"]
    assert "fix: set clickhouse.cluster" in out["single_node_on_cluster"]
    assert out["single_node_verified"] == []
    assert out["raw_rows"] >= 3  # the replay and the revision are stored ...
    assert out["final"] == [["t1", 2, 0.9], ["t2", 1, 0.5]]  # ... and FINAL through Distributed collapses them
    assert out["provisional"] == [["t1", 1]]
    assert out["views"] == dict.fromkeys(out["views"], "ran") and len(out["views"]) == 8
    assert out["provisional_vs_final"] == [[2, 1]]
    # on two shards the rendered view's GLOBAL JOIN passes analysis (then nothing answers); without it, refused
    assert out["two_shards_global"].startswith("Code: 279. DB::Exception: All connection tries failed")
    assert out["two_shards_without_global"].startswith(
        "Code: 288. DB::Exception: Double-distributed IN/JOIN subqueries is denied"
    ), out["two_shards_without_global"]


def test_the_flows_clickhouse_sinks_migrate_for_the_configured_cluster():
    """The reward and batch flows' ClickHouse sinks set up (migrate, verify) with the cluster the settings name."""
    from flows import batch_flow, reward_flow
    from rtrl.clickhouse_cluster import Cluster
    from rtrl.settings import Settings

    s = Settings().updated({"clickhouse.cluster": "rtrl_cluster"})
    for outputs in (reward_flow.service_outputs(s, "127.0.0.1:9"), batch_flow.service_outputs(s, "127.0.0.1:9")):
        cluster = outputs["clickhouse"].args[-1]
        assert isinstance(cluster, Cluster) and cluster.name == "rtrl_cluster"
    assert reward_flow.service_outputs(Settings(), "127.0.0.1:9")["clickhouse"].args[-1] is None


def test_join_forms_the_rewrite_does_not_know_are_refused_and_clear_column_stays_local():
    """GLOBAL goes before a plain join (once); ARRAY JOIN and the ANY/ALL/ASOF/SEMI/ANTI kinds are refused rather
    than rewritten into invalid SQL; CLEAR COLUMN (data) goes to the local tables only."""
    from rtrl.clickhouse_cluster import Cluster, render
    from rtrl.errors import SchemaMismatch

    c = Cluster("c")
    view = "CREATE VIEW rtrl.v AS SELECT * FROM rtrl.a {} rtrl.b USING (x)"
    for join in ("LEFT JOIN", "GLOBAL LEFT JOIN"):
        assert render(view.format(join), "rtrl", c) == [
            "CREATE VIEW rtrl.v ON CLUSTER c AS SELECT * FROM rtrl.a GLOBAL LEFT JOIN rtrl.b USING (x)"
        ]
    for join in ("LEFT ANY JOIN", "ANY LEFT JOIN", "ASOF JOIN", "CROSS JOIN"):
        with pytest.raises(SchemaMismatch, match="joins on a cluster"):
            render(view.format(join), "rtrl", c)
    with pytest.raises(SchemaMismatch, match="joins on a cluster"):
        render("CREATE VIEW rtrl.v AS SELECT * FROM rtrl.a ARRAY JOIN arr", "rtrl", c)
    assert render("ALTER TABLE rtrl.rewards CLEAR COLUMN x", "rtrl", c) == [
        "ALTER TABLE rtrl.rewards_local ON CLUSTER c CLEAR COLUMN x"
    ]
