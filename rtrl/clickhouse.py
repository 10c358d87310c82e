"""ClickHouse access by DSN: embedded chdb (``chdb:///dir``, the real engine in-process) or a server.

- :func:`connect` opens a client with bounded waits and errors that name the address and setting.
- :func:`migrate` applies ``schemas/migrations/*.sql`` once each, recorded in ``schema_migrations``; on a
  cluster (``clickhouse.cluster``) as rendered by :mod:`rtrl.clickhouse_cluster`, and :func:`ddl` prints that.
- :func:`verify` checks every table against the columns derived from schemas.records.
- :func:`insert` / :func:`select` move records as Arrow.

chdb holds one data folder per process; many threads in that process may share the client.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import ssl
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import clickhouse_connect
import pyarrow as pa

from rtrl.clickhouse_cluster import LOCAL, SYNC_INSERT, Cluster, cluster_of, render
from rtrl.errors import ConfigError, SchemaMismatch, ServiceUnavailable
from rtrl.files import private_dir
from rtrl.section import redact_dsn
from rtrl.settings import Settings
from schemas.erasure import DenyList
from schemas.records import (
    BatchStats,
    Checkpoint,
    DeadLetter,
    ErasedTrajectory,
    Erasure,
    EventBase,
    MicroBatch,
    Reward,
    RewardVersionRecord,
    Rollout,
    TrainStep,
    TrajectorySummary,
)
from schemas.types import columns, from_arrow, to_arrow

_log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "schemas" / "migrations"

#: table name -> record class stored in it
TABLES: dict[str, type] = {
    "events": EventBase,
    "rollouts": Rollout,
    "rewards": Reward,
    "batches": MicroBatch,
    "checkpoints": Checkpoint,
    "adapter_checkpoints": Checkpoint,
    "dead_letters": DeadLetter,
    "trajectories": TrajectorySummary,
    "train_metrics": TrainStep,
    "batch_stats": BatchStats,
    "reward_versions": RewardVersionRecord,
    "erasures": Erasure,
    "erased_trajectories": ErasedTrajectory,
}

#: what a read-only analyst may SELECT: the monitors' views, the tables they read, and the tables of
#: outcomes and decisions (not raw events, rollouts or training data). The analyst role of
#: deploy/clickhouse/security.sql grants exactly these; the embedded front's analyst user reads only these.
ANALYST_TABLES = (
    "behaviour",
    "reward_stats",
    "reward_pairs",
    "user_behaviour",
    "user_behaviour_between",
    "user_rewards_between",
    "trajectories",
    "rewards",
    "checkpoints",
    "adapter_checkpoints",
    "dead_letters",
    "train_metrics",
    "batch_stats",
    "reward_versions",
    "verdict_delays",
    "reward_arrival",
    "provisional_vs_final",
    "provisional_rewards",
    "promotions",
    "erasures",
    "secret_findings",
)

#: tables no one may alter, delete from, truncate or drop once written: the erasure audit (app/erasure.py). The
#: writer role of deploy/clickhouse/security.sql has INSERT on them only; the embedded front refuses the rest.
APPEND_ONLY_TABLES = ("erasures",)

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


#: the DSN (or a message) without its secrets: its password, ``?password=``, ``?token=`` ... (the one rule lives
#: with the settings)
redact = redact_dsn


def _prepare_chdb_dir(dsn: str) -> None:
    path = dsn[len("chdb://") :]
    if path in ("", "memory", ":memory:"):
        return
    folder = Path(path)
    try:
        private_dir(folder)  # every reward is in there: owner-only
        probe = folder / ".rtrl-write-probe"
        probe.write_text("ok")
        probe.unlink()
    except (OSError, ConfigError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).split(";")[0]
        raise ConfigError(
            f"ClickHouse data folder {folder} is not writable ({why}); "
            "fix: set clickhouse.dsn (RTRL_CLICKHOUSE__DSN) to chdb:///a/writable/folder, or data_dir to a writable folder"
        ) from None


class EngineThread:
    """A chdb client whose every call runs on one Python-created thread per process.

    chdb corrupts memory ("double free or corruption") when it is called from threads that Python
    did not create — Bytewax's worker threads — while other threads run Python (seen with
    ``bytewax.run -w 2`` and with two-process clusters). Calls from ordinary Python threads are safe,
    so all of a process's chdb calls are funnelled through one such thread.
    """

    def __init__(self, factory: Any):
        self._client = on_engine_thread(factory)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        return functools.partial(on_engine_thread, attr) if callable(attr) else attr


_ENGINE: ThreadPoolExecutor | None = None
_ENGINE_LOCK = threading.Lock()


def on_engine_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` on this process's one chdb thread (see :class:`EngineThread`) and return its result."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = ThreadPoolExecutor(1, thread_name_prefix="rtrl-chdb")
    if threading.current_thread().name.startswith("rtrl-chdb"):
        return fn(*args, **kwargs)
    return _ENGINE.submit(fn, *args, **kwargs).result()


def _folder_holder(path: str) -> str | None:
    """Who holds the chdb folder ``path`` (ClickHouse keeps an flock on its ``status`` file while it runs):
    ``"pid N"`` from that file, or None when nobody holds it. chdb's own error then only says
    ``Error initializing EmbeddedServer``; the reason goes to stderr."""
    import fcntl

    status = Path(path) / "status"
    try:
        with open(status, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                pid = re.search(rb"PID: (\d+)", f.read())
                return f"pid {int(pid[1])}" if pid else "a process"
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return None
    return None


#: the chdb DSNs this process has opened (one folder per process: see :class:`DenyWatch`)
_OPENED_CHDB: set[str] = set()


def connect(dsn: str, timeout_s: float = 10.0) -> Any:
    """A clickhouse-connect client for ``dsn``; fails within about ``timeout_s`` with a clear error."""
    if dsn.startswith("chdb://"):
        _prepare_chdb_dir(dsn)
        try:
            client: Any = EngineThread(lambda: clickhouse_connect.get_client(dsn=dsn))  # proxies a Client
            client.command("SELECT 1")
            _OPENED_CHDB.add(dsn)
            return client
        except Exception as e:  # chdb raises ProgrammingError / RuntimeError variants
            text = str(e)
            if "already initialized with path" in text:
                raise ConfigError(
                    f"this process already opened another chdb folder ({text.split('path')[-2:]}); "
                    "one process can hold one embedded ClickHouse folder: use one clickhouse.dsn per process"
                ) from None
            holder = _folder_holder(dsn[len("chdb://") :])
            if holder is not None:
                raise ServiceUnavailable(
                    f"embedded ClickHouse folder {dsn[len('chdb://') :]} is held by another process ({holder}): "
                    "one process can open a chdb folder; stop that process, or serve the folder to many "
                    "processes with `rtrl clickhouse serve` and set clickhouse.dsn to the http:// DSN it prints"
                ) from None
            raise ServiceUnavailable(
                f"embedded ClickHouse at {redact(dsn)} could not be opened: {redact(text)}"
            ) from None
    if dsn.startswith(("http://", "https://")):
        deadline = time.monotonic() + timeout_s
        ping(dsn, timeout_s)  # bounded: the client's own first query would wait send_receive_timeout, twice
        dsn, tls = split_tls(dsn)
        dsn, password = split_password_file(dsn)

        def open_client() -> Any:
            client = clickhouse_connect.get_client(
                dsn=dsn,
                password=password or "",
                connect_timeout=timeout_s,
                send_receive_timeout=max(timeout_s, 30.0),
                **tls,
            )
            client.command("SELECT 1")
            return client

        try:  # the whole check within what is left of timeout_s (a server may answer /ping, then stall)
            return _within(open_client, max(0.1, deadline - time.monotonic()))
        except Exception as e:
            if "AUTHENTICATION_FAILED" in str(e) or "Code: 516" in str(e):
                raise ConfigError(
                    f"ClickHouse server at {redact(dsn)} refused the credentials; fix: set the user in "
                    "clickhouse.dsn and its password in the file named by clickhouse.password_file"
                ) from None
            raise ServiceUnavailable(
                f"ClickHouse server at {redact(dsn)} did not answer within {timeout_s:g}s ({type(e).__name__}); "
                "fix: start it or point clickhouse.dsn (RTRL_CLICKHOUSE__DSN) at a reachable server"
            ) from None
    raise ConfigError(f"clickhouse.dsn {redact(dsn)!r} must start with chdb:// or http(s)://")


#: TLS parameters of an https DSN (what ``Settings.clickhouse_dsn`` adds from the ``clickhouse`` section)
TLS_PARAMS = ("ca_cert", "verify", "client_cert", "client_cert_key")


def split_tls(dsn: str) -> tuple[str, dict[str, Any]]:
    """``dsn`` without its TLS parameters (:data:`TLS_PARAMS`), and clickhouse-connect's arguments for them:
    for ``https://`` always ``secure=True`` (clickhouse-connect itself takes https only on ports 443/8443),
    ``verify`` a bool, the file paths checked to exist (a ConfigError naming the setting otherwise). An
    ``http://`` DSN with TLS parameters is a ConfigError; chdb takes none."""
    u = urlsplit(dsn)
    pairs = parse_qsl(u.query, keep_blank_values=True)
    found = {k: v for k, v in pairs if k in TLS_PARAMS}
    if u.scheme != "https":
        if found:
            raise ConfigError(
                f"ClickHouse DSN {redact(dsn)} has TLS parameters ({', '.join(found)}) but is not https://; fix: "
                "use the server's https:// address, or remove clickhouse.ca_cert / verify / client_cert(_key)"
            )
        return dsn, {}
    tls: dict[str, Any] = {"secure": True, "verify": found.get("verify", "true").lower() not in ("false", "0", "no")}
    for key in ("ca_cert", "client_cert", "client_cert_key"):
        path = found.get(key)
        if not path:
            continue
        if not (key == "ca_cert" and path == "certifi") and not Path(path).is_file():
            raise ConfigError(
                f"clickhouse.{key} = {path!r} is not a readable file; fix: point clickhouse.{key} "
                f"(RTRL_CLICKHOUSE__{key.upper()}) at the PEM file (e.g. a mounted Kubernetes Secret)"
                + (" or set it to 'certifi'" if key == "ca_cert" else "")
            )
        tls[key] = path
    rest = urlencode([(k, v) for k, v in pairs if k not in TLS_PARAMS])
    return urlunsplit(u._replace(query=rest)), tls


def ssl_context(tls: dict[str, Any]) -> ssl.SSLContext:
    """The TLS context of :func:`split_tls`'s arguments, for rtrl's own requests (:func:`ping`)."""
    ca = tls.get("ca_cert")
    if ca == "certifi":
        import certifi

        ca = certifi.where()
    ctx = ssl.create_default_context(cafile=ca)
    if not tls.get("verify", True):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.get("client_cert"):
        ctx.load_cert_chain(tls["client_cert"], tls.get("client_cert_key"))
    return ctx


def split_password_file(dsn: str) -> tuple[str, str | None]:
    """``dsn`` without its ``password_file=PATH`` parameter, and the password read from that file (None
    without one): the DSN, environment and command lines then carry the path, never the secret."""
    u = urlsplit(dsn)
    pairs = parse_qsl(u.query, keep_blank_values=True)
    files = [v for k, v in pairs if k == "password_file"]
    if not files:
        return dsn, None
    try:
        password = Path(files[-1]).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"cannot read the ClickHouse password file {files[-1]} ({getattr(e, 'strerror', None) or e}); "
            "fix: point clickhouse.password_file at a readable file holding the password"
        ) from None
    rest = urlencode([(k, v) for k, v in pairs if k != "password_file"])
    return urlunsplit(u._replace(query=rest)), password


def _within(fn: Any, timeout_s: float) -> Any:
    """``fn()``'s result, or its exception, or TimeoutError once ``timeout_s`` have passed (``fn`` then runs
    on in a daemon thread until its own socket timeouts end it)."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append((False, e))

    t = threading.Thread(target=run, name="rtrl-ch-bounded", daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        raise TimeoutError(f"no answer within {timeout_s:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def ping(dsn: str, timeout_s: float) -> None:
    """``GET /ping`` on the server of ``dsn``; ServiceUnavailable unless it answers ``Ok.`` within ``timeout_s``
    in all (connect, send and a server that accepts and then says nothing or drips bytes)."""
    u = urlsplit(dsn)
    url = f"{u.scheme}://{u.hostname}:{u.port or (8443 if u.scheme == 'https' else 8123)}/ping"
    tls = split_tls(dsn)[1]
    context = ssl_context(tls) if tls else None

    def probe() -> bytes:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:  # noqa: S310 - http(s) checked
            return r.read(64)

    try:
        got = _within(probe, timeout_s)
        if got.strip() == b"Ok.":
            return
        why = f"/ping answered {got[:20]!r}"
    except TimeoutError:
        why = "no answer"
    except urllib.error.HTTPError as e:
        why = f"HTTP {e.code} on /ping"
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLCertVerificationError):
            raise ConfigError(
                f"ClickHouse server at {redact(dsn)} presented a certificate that does not verify "
                f"({e.reason.verify_message}); fix: set clickhouse.ca_cert (RTRL_CLICKHOUSE__CA_CERT) to the PEM "
                "file of the CA that signed it (or 'certifi' for a public CA), and connect by a host name the "
                "certificate names"
            ) from None
        why = str(e.reason)
    except Exception as e:  # noqa: BLE001 - any failure of the probe is the server not answering
        why = f"{type(e).__name__}: {e}"
    raise ServiceUnavailable(
        f"ClickHouse server at {redact(dsn)} did not answer within {timeout_s:g}s ({redact(why)}); "
        "fix: start it or point clickhouse.dsn (RTRL_CLICKHOUSE__DSN) at a reachable server"
    )


def _check_name(database: str) -> str:
    if not _NAME.match(database):
        raise ConfigError(f"clickhouse.database {database!r} must be a plain identifier (letters, digits, _)")
    return database


# ---------------------------------------------------------------- migrations


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    def statements(self, database: str) -> list[str]:
        body = "\n".join(line for line in self.sql.splitlines() if not line.lstrip().startswith("--"))
        return [s.strip().replace("{db}", database) for s in body.split(";") if s.strip()]


def migrations(folder: Path = MIGRATIONS_DIR) -> list[Migration]:
    """The migrations shipped in schemas/migrations, in version order."""
    out = []
    for f in sorted(folder.glob("*.sql")):
        head = f.name.split("_", 1)[0]
        if not head.isdigit():
            raise SchemaMismatch(f"migration file {f.name} must start with a number, e.g. 0002_add_x.sql")
        out.append(Migration(int(head), f.name, f.read_text()))
    versions = [m.version for m in out]
    if len(set(versions)) != len(versions):
        raise SchemaMismatch(f"two migrations share a version in {folder}: {versions}")
    return out


def bookkeeping(database: str) -> list[str]:
    """The statements that make the database and its ``schema_migrations`` table (before any migration)."""
    db = _check_name(database)
    return [
        f"CREATE DATABASE IF NOT EXISTS {db}",
        f"CREATE TABLE IF NOT EXISTS {db}.schema_migrations "
        "(version UInt32, name String, checksum String, applied_at DateTime64(3, 'UTC')) "
        "ENGINE = ReplacingMergeTree ORDER BY version",
    ]


def ddl(database: str, cluster: Cluster | None, folder: Path = MIGRATIONS_DIR) -> str:
    """Every statement :func:`migrate` runs on an empty database, as one SQL script (``rtrl migrate --print``):
    the bookkeeping, then each migration's statements, each followed by its ``schema_migrations`` row."""
    db = _check_name(database)
    where = f"on cluster {cluster.name}" if cluster else "on a single node"
    out = [
        f"-- rtrl's ClickHouse schema for database {db} {where}: what `rtrl migrate` runs on an empty database",
        "-- (generated from schemas/migrations by rtrl.clickhouse.ddl; a migration already applied is skipped).",
    ]
    for stmt in bookkeeping(db):
        out += [s + ";" for s in render(stmt, db, cluster)]
    for m in migrations(folder):
        out.append(f"\n-- {m.name}")
        out += [s + ";" for stmt in m.statements(db) for s in render(stmt, db, cluster)]
        out.append(_record(db, m, cluster) + ";")
    return "\n".join(out) + "\n"


def _record(db: str, m: Migration, cluster: Cluster | None) -> str:
    sync = f" {SYNC_INSERT}" if cluster else ""  # visible through the Distributed table when the call returns
    return f"INSERT INTO {db}.schema_migrations{sync} VALUES ({m.version}, '{m.name}', '{m.checksum}', now64(3))"


def _engine(client: Any, db: str, table: str) -> str:
    rows = client.query(
        "SELECT engine FROM system.tables WHERE database = {db:String} AND name = {t:String}",
        parameters={"db": db, "t": table},
    ).result_rows
    return str(rows[0][0]) if rows else ""


def migrate(client: Any, database: str, folder: Path = MIGRATIONS_DIR, cluster: Cluster | None = None) -> list[int]:
    """Apply pending migrations once each; return the versions applied now (idempotent).

    With ``cluster`` each statement is rendered for it (:func:`rtrl.clickhouse_cluster.render`) and runs from
    this one node: DDL ON CLUSTER reaches every node, ``schema_migrations`` is itself replicated and read and
    written through its Distributed table, so every node sees the same applied versions. A database laid out
    for the other kind is a ConfigError naming the setting: single node on a cluster's database only when
    migrations are pending (a job that does not know the cluster may still verify and use it)."""
    db = _check_name(database)
    if cluster is None:
        for stmt in bookkeeping(db):
            client.command(stmt)
        on_cluster = _engine(client, db, "schema_migrations") == "Distributed"
    else:
        on_cluster = False
        engine = _engine(client, db, "schema_migrations")
        if engine not in ("", "Distributed"):
            raise ConfigError(
                f"ClickHouse database {db} was migrated for a single node ({db}.schema_migrations is {engine}) but "
                f"clickhouse.cluster = {cluster.name!r}; fix: empty clickhouse.cluster, or migrate into a new "
                "clickhouse.database and copy the data (a layout change is a data migration, not DDL)"
            )
        if engine == "":  # only then: ON CLUSTER needs every node up, and this runs at every job's start
            for stmt in bookkeeping(db):
                for s in render(stmt, db, cluster):
                    client.command(s)
    applied = {
        int(v): (n, c)
        for v, n, c in client.query(f"SELECT version, name, checksum FROM {db}.schema_migrations FINAL").result_rows
    }
    pending = [m.name for m in migrations(folder) if m.version not in applied]
    if on_cluster and pending:  # applied, they would make single-node tables on this node only
        raise ConfigError(
            f"ClickHouse database {db} was migrated for a cluster (its tables are Distributed) and migrations "
            f"{', '.join(pending)} are pending, but this migration runs without clickhouse.cluster; fix: set "
            "clickhouse.cluster (RTRL_CLICKHOUSE__CLUSTER) to that cluster's name and run `rtrl migrate`"
        )
    done = []
    for m in migrations(folder):
        if m.version in applied:
            if applied[m.version][1] != m.checksum:
                raise SchemaMismatch(
                    f"migration {m.name} was changed after it was applied to database {db}; "
                    "fix: restore it and put the change in a new migration file"
                )
            continue
        for stmt in m.statements(db):
            for s in render(stmt, db, cluster):
                client.command(s)
        client.command(_record(db, m, cluster))
        done.append(m.version)
    return done


def live_columns(client: Any, database: str, table: str) -> list[tuple[str, str]]:
    """(name, ClickHouse type) of a table as the engine reports it, in order."""
    rows = client.query(
        "SELECT name, type FROM system.columns WHERE database = {db:String} AND table = {t:String} ORDER BY position",
        parameters={"db": database, "t": table},
    ).result_rows
    return [(n, t) for n, t in rows]


def verify(client: Any, database: str, cluster: Cluster | None = None) -> None:
    """Raise SchemaMismatch naming every table/column that differs from schemas.records; on a ``cluster``
    the tables of those names must be Distributed and their ``_local`` tables (on this node) replicated,
    both with the same columns."""
    problems = []
    for table, cls in TABLES.items():
        expected = {c.name: c.clickhouse for c in columns(cls)}
        for name in (table, table + LOCAL) if cluster else (table,):
            problems += _differences(client, database, name, expected)
        if cluster:
            kinds = (_engine(client, database, table), _engine(client, database, table + LOCAL))
            if kinds[0] and kinds[0] != "Distributed":
                problems.append(f"{database}.{table} is {kinds[0]}, not Distributed over {table}{LOCAL}")
            if kinds[1] and not kinds[1].startswith("Replicated"):
                problems.append(f"{database}.{table}{LOCAL} is {kinds[1]}, not a Replicated*MergeTree")
    if problems:
        raise SchemaMismatch(
            "ClickHouse schema differs from schemas/: "
            + "; ".join(problems)
            + ". Fix: run `rtrl migrate`, or add a migration in schemas/migrations that makes them agree"
        )


def _differences(client: Any, database: str, table: str, expected: dict[str, str]) -> list[str]:
    live = dict(live_columns(client, database, table))
    if not live:
        return [f"table {database}.{table} does not exist"]
    problems = []
    for name, typ in expected.items():
        if name not in live:
            problems.append(f"{database}.{table}.{name} is missing (code expects {typ})")
        elif live[name] != typ:
            problems.append(f"{database}.{table}.{name} is {live[name]} but code expects {typ}")
    for name in live.keys() - expected.keys():
        problems.append(f"{database}.{table}.{name} exists in ClickHouse but not in schemas/records.py")
    return problems


def setup(dsn: str, database: str, timeout_s: float = 10.0, cluster: Cluster | None = None) -> Any:
    """Connect, migrate and verify: what every job does before touching ClickHouse (``cluster``: the
    ``clickhouse.cluster`` settings, :func:`rtrl.clickhouse_cluster.cluster_of`)."""
    client = connect(dsn, timeout_s)
    migrate(client, database, cluster=cluster)
    verify(client, database, cluster)
    return client


def setup_from(settings: Settings) -> Any:
    """:func:`setup` as ``settings`` configure it: the DSN, database, timeout and cluster (``clickhouse.*``)."""
    ch = settings.clickhouse
    return setup(settings.clickhouse_dsn, ch.database, ch.timeout_s, cluster_of(ch))


# ---------------------------------------------------------------- records in and out


def insert(client: Any, database: str, table: str, records: list) -> int:
    """Insert records as one Arrow batch; returns the row count."""
    if not records:
        return 0
    return insert_table(client, database, table, to_arrow(records, TABLES[table]))


def insert_table(client: Any, database: str, table: str, data: pa.Table) -> int:
    """Insert an Arrow table already in the table's derived schema."""
    client.insert_arrow(f"{_check_name(database)}.{table}", data)
    return data.num_rows


def select(client: Any, database: str, table: str, where: str = "", final: bool = True) -> list:
    """Read records back from a table (``FINAL`` collapses replaced rows)."""
    sql = f"SELECT * FROM {_check_name(database)}.{table}{' FINAL' if final else ''} {where}"
    return from_arrow(client.query_arrow(sql), TABLES[table])


# ---------------------------------------------------------------- the deny list of erased subjects


def deny_list(client: Any, database: str) -> DenyList:
    """Every subject ``rtrl erase`` has listed in ``erasures`` (from its first row, before any deletion) and their
    trajectories."""
    db = _check_name(database)
    subjects = client.query(f"SELECT DISTINCT subject_kind, subject FROM {db}.erasures").result_rows
    ids = client.query_arrow(f"SELECT DISTINCT trajectory_id FROM {db}.erased_trajectories")
    return DenyList(
        users=frozenset(s for k, s in subjects if k == "user"),
        orgs=frozenset(s for k, s in subjects if k == "org"),
        trajectories=frozenset(ids.column("trajectory_id").to_pylist()) if ids.num_rows else frozenset(),
    )


class DenyWatch:
    """The deny list as a consumer sees it: read at its first use, then at most every ``refresh_s`` seconds
    (``governance.deny_refresh_s``).

    Until its first read succeeds, a consumer holds: a failed read is retried with backoff for ``patience_s``
    seconds, then :class:`rtrl.errors.ServiceUnavailable` names the setting. A consumer never processes data it
    could not check. After that, a failed read keeps the last list, logs why and is tried again at the next
    refresh, so a ClickHouse outage never stops a consumer. A database without the ``erasures`` table yet has
    erased nobody.

    An embedded engine (``chdb://``) is read only once this process has opened it for its own work: one process
    holds a chdb folder, and the watch must never take it from the process's sink or from another process of a
    cluster. Processes that share the embedded engine reach it through `rtrl clickhouse serve` (an http DSN)."""

    def __init__(self, dsn: str, database: str, timeout_s: float, refresh_s: float, patience_s: float = 300.0):
        self._args, self._refresh_s, self._patience_s = (dsn, database, timeout_s), refresh_s, patience_s
        self._client: Any = None
        self._list = DenyList()
        self._at = -float("inf")
        self._read_once = False
        self._lock = threading.Lock()

    def _read(self) -> DenyList | None:
        dsn, database, timeout_s = self._args
        if self._client is None:
            if dsn.startswith("chdb://") and dsn not in _OPENED_CHDB:
                return None  # not this process's to open (yet): asked again at the next use
            self._client = connect(dsn, timeout_s)
        if not self._client.command(f"EXISTS TABLE {_check_name(database)}.erasures"):
            return DenyList()
        return deny_list(self._client, database)

    def current(self) -> DenyList:
        """The list, read again when it is older than the refresh interval."""
        if time.monotonic() - self._at < self._refresh_s:
            return self._list
        with self._lock:
            if time.monotonic() - self._at >= self._refresh_s:
                read = self._first() if not self._read_once else self._again()
                if read is None:
                    return self._list
                self._list, self._at, self._read_once = read, time.monotonic(), True
        return self._list

    def _again(self) -> DenyList | None:
        try:
            return self._read()
        except Exception as e:  # noqa: BLE001 - the last list stands; the next refresh tries again
            _log.warning("the deny list of erased subjects was not read (%s); the last one stands", e)
            self._client = None
            return self._list

    def _first(self) -> DenyList | None:
        """The first read, retried with backoff for ``patience_s``: a consumer holds until it knows whom to skip."""
        deadline, delay = time.monotonic() + self._patience_s, 0.5
        while True:
            try:
                return self._read()
            except Exception as e:  # noqa: BLE001 - any failure: retried, then reported with the setting to fix
                self._client = None
                if time.monotonic() + delay > deadline:
                    raise ServiceUnavailable(
                        f"the deny list of erased subjects (`rtrl erase`) could not be read from clickhouse.dsn "
                        f"{redact_dsn(self._args[0])} in {self._patience_s:g}s ({type(e).__name__}: {e}); a consumer "
                        "does not process data it cannot check against it. Fix: make ClickHouse reachable at "
                        "clickhouse.dsn, then restart"
                    ) from None
                _log.warning("the deny list of erased subjects was not read (%s); holding, retry in %.1fs", e, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)


def deny_watch(settings: Settings) -> DenyWatch:
    """:class:`DenyWatch` as ``settings`` configure it (``clickhouse.*``, ``governance.deny_refresh_s``)."""
    ch = settings.clickhouse
    return DenyWatch(settings.clickhouse_dsn, ch.database, ch.timeout_s, settings.governance.deny_refresh_s)


def ttl_expression(column: str, days: float) -> str:
    """The TTL of a table whose rows live ``days`` from ``column`` (rounded to the second)."""
    return f"toDateTime({column}) + toIntervalSecond({round(days * 86400)})"


def current_ttl(client: Any, database: str, table: str) -> str:
    """The table's TTL expression as ClickHouse reports it, empty when it has none."""
    db = _check_name(database)
    rows = client.query(
        "SELECT create_table_query FROM system.tables WHERE database = {d:String} AND name = {t:String}",
        parameters={"d": db, "t": table + LOCAL if _engine(client, db, table) == "Distributed" else table},
    ).result_rows
    match = re.search(r"\bTTL (.+?)(?: SETTINGS |$)", rows[0][0], flags=re.S) if rows else None
    return match[1].strip() if match else ""


def apply_retention(
    client: Any,
    database: str,
    days: dict[str, float],
    retained: dict[str, str],
    cluster: Cluster | None = None,
    dry_run: bool = False,
) -> dict[str, str]:
    """Make each table's TTL follow ``days`` (table -> days, 0 = forever) counted from its column in ``retained``.

    Only a table whose TTL differs is altered, so applying the same settings again costs nothing. ClickHouse then
    deletes the expired rows of the altered tables (``materialize_ttl_after_modify``) and of every table as its
    parts merge. Returns table -> what was done ("kept", "ttl N days", "ttl removed"); ``dry_run`` alters nothing."""
    db = _check_name(database)
    done = {}
    for table, column in retained.items():
        want = days.get(table, 0.0)
        have = current_ttl(client, db, table)
        if want > 0:
            expr = ttl_expression(column, want)
            if _same_ttl(have, expr):
                done[table] = "kept"
                continue
            stmt = f"ALTER TABLE {db}.{table} MODIFY TTL {expr}"
            done[table] = f"ttl {want:g} days"
        else:
            if not have:
                done[table] = "kept"
                continue
            stmt = f"ALTER TABLE {db}.{table} REMOVE TTL"
            done[table] = "ttl removed"
        for s in (render(stmt, db, cluster) if cluster is not None else [stmt]) if not dry_run else []:
            client.command(s)
    return done


def _same_ttl(have: str, want: str) -> bool:
    """Whether ClickHouse's spelling of a TTL is ``want`` (it may add spaces or rename the interval function)."""

    def canon(x: str) -> str:
        return re.sub(r"\s+", "", x).replace("toIntervalSecond", "").lower()

    return canon(have) == canon(want)
