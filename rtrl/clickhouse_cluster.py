"""rtrl's ClickHouse migrations rendered for a cluster (``clickhouse.cluster``): a pure function of the text.

On a single node (``clickhouse.cluster`` empty) the migrations run as written. On a cluster each statement
becomes what a ClickHouse operator expects:

- ``CREATE TABLE db.x (...) ENGINE = FooMergeTree(args) ...`` becomes ``db.x_local ON CLUSTER c`` with engine
  ``ReplicatedFooMergeTree('<clickhouse.replica_path>', '<clickhouse.replica_name>', args)`` on every node, and
  ``db.x ON CLUSTER c AS db.x_local ENGINE = Distributed(c, db, x_local, cityHash64(<key>))``: the table of the
  name every reader and writer uses is the Distributed one, with the same columns.
- ``ALTER TABLE db.x <column change>`` runs ON CLUSTER on ``db.x_local`` and on ``db.x`` (a Distributed
  table needs the column too); any other ALTER on ``db.x_local`` only.
- ``CREATE VIEW`` runs ON CLUSTER and reads the Distributed tables (they carry the names); a JOIN in a view
  becomes ``GLOBAL`` JOIN, so its right side is read whole once rather than per shard.
- ``CREATE MATERIALIZED VIEW db.v TO db.y AS SELECT .. FROM db.x`` runs ON CLUSTER between the local tables
  (``db.x_local`` to ``db.y_local``): an insert fires it on the shard that stores the row, so ``x`` and ``y``
  must share their sharding key (checked here).
- ``INSERT INTO db.y SELECT ...`` (a seed) runs once, through the Distributed tables, synchronously.
- ``CREATE DATABASE`` runs ON CLUSTER.

Sharding keys (:data:`SHARD_KEYS`): rows that a ReplacingMergeTree collapses share its whole ORDER BY key,
so a key made of leading ORDER BY columns puts them on one shard and ``SELECT ... FINAL`` through the
Distributed table (FINAL runs on each shard) collapses them as on one node. A table without a key here is
refused, so a new table's migration makes its author choose one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rtrl.errors import ConfigError, SchemaMismatch

#: the suffix of the per-node tables under each Distributed table
LOCAL = "_local"

#: Keeper path of each replicated table: ``{shard}`` and ``{replica}`` are each server's <macros>;
#: ``{database}`` and ``{table}`` ClickHouse fills in itself (the ``_local`` table's name).
DEFAULT_REPLICA_PATH = "/clickhouse/tables/{shard}/{database}/{table}"
DEFAULT_REPLICA_NAME = "{replica}"

#: table -> the columns its Distributed table shards by (cityHash64 of them); each a prefix of the table's
#: ORDER BY, so rows a ReplacingMergeTree must collapse land on one shard. Why each:
SHARD_KEYS: dict[str, tuple[str, ...]] = {
    # one trajectory's events, rollout, rewards, summary and provisional rewards on one shard: the views'
    # joins on trajectory_id then meet rows of one shard, and provisional_rewards_mv writes next to its source
    "events": ("trajectory_id",),
    "rollouts": ("trajectory_id",),
    "rewards": ("trajectory_id",),
    "trajectories": ("trajectory_id",),
    "provisional_rewards": ("trajectory_id",),
    # one row per key: the whole key spreads evenly
    "batches": ("batch_id",),
    "dead_letters": ("source", "partition", "offset"),
    "train_metrics": ("run_id", "step"),
    "batch_stats": ("cohort",),
    "reward_versions": ("name",),
    "adapter_checkpoints": ("org", "version"),
    # one erasure's audit rows and trajectories on one shard (read whole through the Distributed tables)
    "erasures": ("erasure_id",),
    "erased_trajectories": ("erasure_id", "trajectory_id"),
    # a checkpoint's statuses and its promotion on one shard: promotions_mv writes next to its source
    "checkpoints": ("version",),
    "promotions": ("version",),
    # rtrl's own bookkeeping of applied migrations (read whole through the Distributed table)
    "schema_migrations": ("version",),
}

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: column changes a Distributed table takes too (CLEAR COLUMN clears data: only the local tables hold any)
_COLUMN_CHANGE = re.compile(r"^(ADD|DROP|MODIFY|RENAME|COMMENT)\s+COLUMN\b", re.I)
#: the JOIN forms the GLOBAL rewrite knows; others (ARRAY JOIN, ANY/ALL/ASOF/SEMI/ANTI, CROSS, PASTE) are refused
_JOINS = re.compile(r"\b(?:(?:INNER|LEFT|RIGHT|FULL)\s+)?(?:OUTER\s+)?JOIN\b", re.I)
_OTHER_JOINS = re.compile(r"\b(?:ARRAY|ANY|ALL|ASOF|SEMI|ANTI|CROSS|PASTE|LEFT\s+ARRAY)\s+(?:\w+\s+)?JOIN\b", re.I)
#: the synchronous-insert setting (its old name, which servers from 23.10 on keep as an alias)
SYNC_INSERT = "SETTINGS insert_distributed_sync = 1"


@dataclass(frozen=True)
class Cluster:
    """Where and how rtrl's tables are laid out on a ClickHouse cluster (the ``clickhouse.cluster*`` settings)."""

    name: str
    replica_path: str = DEFAULT_REPLICA_PATH
    replica_name: str = DEFAULT_REPLICA_NAME

    def __post_init__(self) -> None:
        check(self.name, self.replica_path, self.replica_name)


def check(name: str, replica_path: str, replica_name: str) -> None:
    """ConfigError naming the setting and the fix when the cluster settings cannot make valid DDL."""
    if not _NAME.match(name):
        raise ConfigError(
            f"clickhouse.cluster = {name!r} is not a cluster name (letters, digits and _, not starting with a "
            "digit); fix: set clickhouse.cluster (RTRL_CLICKHOUSE__CLUSTER) to the name of a cluster in the "
            "servers' <remote_servers>, or empty for a single node"
        )
    for setting, value in (("replica_path", replica_path), ("replica_name", replica_name)):
        if not value or "'" in value or "\\" in value:
            raise ConfigError(
                f"clickhouse.{setting} = {value!r} must be non-empty, without quotes or backslashes; fix: set "
                f"clickhouse.{setting} (RTRL_CLICKHOUSE__{setting.upper()}) or leave it at its default"
            )
    if "{table}" not in replica_path or ("{shard}" not in replica_path):
        raise ConfigError(
            f"clickhouse.replica_path = {replica_path!r} must contain {{shard}} and {{table}} (else shards or "
            "tables would share one Keeper path); fix: leave it at its default "
            f"{DEFAULT_REPLICA_PATH!r} or keep both macros in it"
        )


def cluster_of(clickhouse: Any) -> Cluster | None:
    """The cluster of a ``ClickHouseSettings`` section, None for a single node (``clickhouse.cluster`` empty)."""
    if not clickhouse.cluster:
        return None
    return Cluster(clickhouse.cluster, clickhouse.replica_path, clickhouse.replica_name)


def _matching(text: str, start: int) -> int:
    """The index just past the parenthesis closing the one at ``text[start]`` (quotes respected)."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'`\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise SchemaMismatch(f"unbalanced parentheses in migration statement: {text[:200]}")


def _flat(text: str) -> str:
    """``text`` without its parenthesised parts (nested ones too)."""
    while True:
        flat = re.sub(r"\([^()]*\)", "", text)
        if flat == text:
            return flat
        text = flat


def _not_understood(stmt: str, why: str) -> SchemaMismatch:
    return SchemaMismatch(
        f"cannot render this migration statement for clickhouse.cluster ({why}): {stmt[:300]!r}; fix: write it in "
        "a shape rtrl.clickhouse_cluster.render knows (CREATE TABLE/VIEW/MATERIALIZED VIEW/DATABASE, ALTER TABLE, "
        "INSERT INTO .. SELECT) or teach render the new shape, with a test in tests/test_cluster_ddl.py"
    )


def shard_key(table: str, stmt: str = "") -> str:
    """``cityHash64(<SHARD_KEYS[table]>)``; SchemaMismatch naming the fix for a table without one."""
    if table not in SHARD_KEYS:
        raise _not_understood(
            stmt or table,
            f"table {table} has no sharding key: add it to SHARD_KEYS in rtrl/clickhouse_cluster.py, a prefix of "
            "its ORDER BY so rows it collapses land on one shard",
        )
    return f"cityHash64({', '.join(SHARD_KEYS[table])})"


def render(stmt: str, database: str, cluster: Cluster | None) -> list[str]:
    """The statements that apply ``stmt`` (one migration statement, ``{db}`` already ``database``) on
    ``cluster``; ``[stmt]`` unchanged for a single node (``cluster`` None)."""
    if cluster is None:
        return [stmt]
    c, db = cluster.name, re.escape(database)
    on = f"ON CLUSTER {c}"

    m = re.match(rf"CREATE\s+DATABASE\s+(IF\s+NOT\s+EXISTS\s+)?{db}\s*$", stmt, re.I)
    if m:
        return [f"{stmt} {on}"]

    m = re.match(rf"CREATE\s+TABLE\s+(IF\s+NOT\s+EXISTS\s+)?{db}\.(\w+)\s+", stmt, re.I)
    if m:
        return _create_table(stmt, m, database, cluster)

    m = re.match(rf"ALTER\s+TABLE\s+{db}\.(\w+)\s+", stmt, re.I)
    if m:
        table, rest = m[1], stmt[m.end() :]
        local = f"ALTER TABLE {database}.{table}{LOCAL} {on} {rest}"
        if not _COLUMN_CHANGE.match(rest):
            return [local]
        if "," in _flat(rest):
            raise _not_understood(stmt, "one column change per ALTER on a cluster")
        return [local, f"ALTER TABLE {database}.{table} {on} {rest}"]

    m = re.match(rf"CREATE\s+VIEW\s+(IF\s+NOT\s+EXISTS\s+)?{db}\.(\w+)\s+AS\s", stmt, re.I)
    if m:
        body = stmt[m.end() :]
        if _OTHER_JOINS.search(body):
            raise _not_understood(stmt, "a view's joins on a cluster: [INNER|LEFT|RIGHT|FULL] [OUTER] JOIN only")
        body = _JOINS.sub(
            lambda j: j[0] if body[: j.start()].rstrip().upper().endswith("GLOBAL") else f"GLOBAL {j[0]}", body
        )
        return [f"CREATE VIEW {m[1] or ''}{database}.{m[2]} {on} AS {body}"]

    m = re.match(
        rf"CREATE\s+MATERIALIZED\s+VIEW\s+(IF\s+NOT\s+EXISTS\s+)?{db}\.(\w+)\s+TO\s+{db}\.(\w+)\s+AS\s", stmt, re.I
    )
    if m:
        body = stmt[m.end() :]
        sources = set(re.findall(rf"\b{db}\.(\w+)", body))
        if len(sources) != 1:
            raise _not_understood(stmt, "a materialized view on a cluster reads exactly one table")
        (source,) = sources
        if shard_key(source, stmt) != shard_key(m[3], stmt):
            raise _not_understood(
                stmt,
                f"{source} and {m[3]} shard by different keys, so the view would write rows away from their "
                "shard: give them one key in SHARD_KEYS",
            )
        body = re.sub(rf"\b{db}\.{source}\b", f"{database}.{source}{LOCAL}", body)
        return [f"CREATE MATERIALIZED VIEW {m[1] or ''}{database}.{m[2]} {on} TO {database}.{m[3]}{LOCAL} AS {body}"]

    m = re.match(rf"INSERT\s+INTO\s+{db}\.(\w+)\s+(SELECT\s.*)$", stmt, re.I | re.S)
    if m:
        return [f"INSERT INTO {database}.{m[1]} {SYNC_INSERT} {m[2]}"]

    raise _not_understood(stmt, "an unknown kind of statement")


def _create_table(stmt: str, m: re.Match[str], database: str, cluster: Cluster) -> list[str]:
    c, table = cluster.name, m[2]
    engine = re.search(r"\bENGINE\s*=\s*(\w+)\s*", stmt[m.end() :])
    if engine is None:
        raise _not_understood(stmt, "CREATE TABLE without ENGINE")
    kind = engine[1]
    if not kind.endswith("MergeTree") or kind.startswith("Replicated"):
        raise _not_understood(stmt, f"engine {kind}: only plain *MergeTree tables are made replicated")
    body = stmt[m.end() : m.end() + engine.start()].strip()
    after = m.end() + engine.end()
    args = ""
    if after < len(stmt) and stmt[after] == "(":
        close = _matching(stmt, after)
        args, after = stmt[after + 1 : close - 1].strip(), close
    rest = stmt[after:].strip()
    like = re.fullmatch(rf"AS\s+{re.escape(database)}\.(\w+)", body, re.I)
    if like:
        body = f"AS {database}.{like[1]}{LOCAL}"
    elif not body.startswith("("):
        raise _not_understood(stmt, "CREATE TABLE with neither a column list nor AS another table")
    replicated = ", ".join([f"'{cluster.replica_path}'", f"'{cluster.replica_name}'"] + ([args] if args else []))
    key = shard_key(table, stmt)
    exists = "IF NOT EXISTS " if m[1] else ""
    return [
        f"CREATE TABLE {exists}{database}.{table}{LOCAL} ON CLUSTER {c}\n{body}\n"
        f"ENGINE = Replicated{kind}({replicated})" + (f"\n{rest}" if rest else ""),
        f"CREATE TABLE {exists}{database}.{table} ON CLUSTER {c} AS {database}.{table}{LOCAL}\n"
        f"ENGINE = Distributed({c}, {database}, {table}{LOCAL}, {key})",
    ]
