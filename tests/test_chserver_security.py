"""The embedded ClickHouse front is safe by default (devservices/chserver/), and deploy/clickhouse/security.sql
is the same split for a real server. Every test talks real HTTP to a real front process on a free loopback port,
every statement runs on the real engine (chdb); every wait is bounded.

The front's resources under load (connections, the engine's queue, inflated bodies, temporary files), each test
with a front of its own: tests/test_chserver_resources.py; the raw HTTP helpers: tests/chserver_helpers.py."""

from __future__ import annotations

import base64
import gzip
import http.client
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.parse
import zlib
from pathlib import Path

import pytest

from devservices import chserver
from rtrl import clickhouse
from rtrl.errors import ConfigError
from tests.chserver_helpers import _threads, address, analyst, basic, request, rows, token

ROOT = Path(__file__).resolve().parent.parent
LIMITS = ["--read-timeout-s", "2", "--max-execution-time-s", "4", "--max-decompressed-bytes", str(8 << 20)]
LIMITS += ["--max-body-bytes", str(4 << 20), "--max-connections", "48", "--queue-timeout-s", "1"]


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    folder = tmp_path_factory.mktemp("front") / "ch"
    proc, dsn = chserver.spawn(folder, extra_args=LIMITS)
    ch = clickhouse.setup(dsn, "rtrl", 10)
    ch.command("INSERT INTO rtrl.checkpoints (version, status) VALUES (1, 'promoted')")
    yield proc, dsn, folder
    proc.kill()
    proc.wait(30)


# ---------------------------------------------------------------- loopback, tokens, authentication


@pytest.mark.slow
def test_binds_to_loopback_only(tmp_path, front):
    for host in ("0.0.0.0", "192.168.1.10", "::", "example.com", ""):
        with pytest.raises(ValueError, match="loopback only"):
            chserver.check_loopback(host)
    with pytest.raises(ValueError, match=r"127\.0\.0\.1 or localhost; not ::1"):  # no IPv6: says so
        chserver.check_loopback("::1")
    assert chserver.check_loopback("localhost") == "127.0.0.1"
    assert chserver.check_loopback("127.0.0.2") == "127.0.0.2"
    out = subprocess.run(
        [sys.executable, "-m", "devservices.chserver", str(tmp_path / "x"), "--host", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "loopback only" in out.stderr
    assert not (tmp_path / "x").exists()  # refused before anything was created
    assert address(front[1])[0] == "127.0.0.1"


def test_tokens_are_per_run_in_owner_only_files_and_never_in_the_dsn_or_argv(front, tmp_path):
    proc, dsn, folder = front
    auth = chserver.auth_dir_for(folder)
    assert stat.S_IMODE(auth.stat().st_mode) == 0o700
    for user in chserver.USERS:
        f = chserver.token_file(auth, user)
        assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.stat().st_uid == os.getuid()
        secret = f.read_text().strip()
        assert len(secret) >= 32 and secret not in dsn
        assert secret.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert secret.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
    assert "password_file=" in dsn and str(chserver.token_file(auth, chserver.WRITER)) in urllib.parse.unquote(dsn)
    # a new run gets new tokens; a restart of the same front (keep) keeps them
    first = chserver.ensure_tokens(tmp_path / "auth")
    assert chserver.ensure_tokens(tmp_path / "auth", fresh=False) == first
    second = chserver.ensure_tokens(tmp_path / "auth")
    assert all(second[u] != first[u] for u in chserver.USERS)


def test_requests_without_the_right_token_get_516(front):
    _, dsn, _ = front
    wrong = [
        {"user": ""},  # no credentials at all: the default user, which does not exist
        {"user": chserver.WRITER, "key": "not-the-token"},
        {"user": chserver.WRITER, "key": token(analyst(dsn))},  # the analyst's token for the writer
        {"user": "default", "key": token(dsn)},
        {"user": "nobody", "key": token(dsn)},
    ]
    for creds in wrong:
        status, code, out = request(dsn, "SELECT 1", **creds)
        assert (status, code) == (401, "516") and b"AUTHENTICATION_FAILED" in out, creds
    # ClickHouse's other ways to authenticate work; /ping stays open as on a real server
    headers = {"X-ClickHouse-User": chserver.WRITER, "X-ClickHouse-Key": token(dsn)}
    assert request(dsn, "SELECT 1", user="", headers=headers)[2] == b"1\n"
    status, code, _ = request(dsn, "SELECT 1", user="", headers=headers | {"X-ClickHouse-Key": "x"})
    assert (status, code) == (401, "516")
    host, port = address(dsn)
    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("GET", "/ping")
    assert c.getresponse().read() == b"Ok.\n"
    c.close()
    # rtrl's client reads the token from the file; a wrong one is one clear line
    bad = Path(chserver.token_file(chserver.auth_dir_for(front[2]), chserver.WRITER)).parent / "wrong.token"
    bad.write_text("nope")
    with pytest.raises(ConfigError, match="refused the credentials"):
        clickhouse.connect(dsn.split("?")[0] + "?password_file=" + str(bad), 10)
    with pytest.raises(ConfigError, match="cannot read the ClickHouse password file"):
        clickhouse.connect(dsn.split("?")[0] + "?password_file=/no/such/file", 10)


# ---------------------------------------------------------------- read-only analysts

WRITES = [
    "INSERT INTO rtrl.checkpoints (version, status) VALUES (9, 'x')",
    "insert into rtrl.checkpoints (version, status) values (9, 'x')",
    "/* just a read */ INSERT INTO rtrl.checkpoints (version) SELECT 9",
    "WITH x AS (SELECT 9 AS v) INSERT INTO rtrl.checkpoints (version) SELECT v FROM x",
    "SELECT 1; DROP TABLE rtrl.checkpoints",
    "SELECT 1 -- a comment\n; DROP TABLE rtrl.checkpoints",
    "(SELECT 1); TRUNCATE TABLE rtrl.checkpoints",
    "ALTER TABLE rtrl.checkpoints DELETE WHERE 1",
    "DELETE FROM rtrl.checkpoints WHERE 1",
    "DROP TABLE rtrl.checkpoints",
    "TRUNCATE TABLE rtrl.checkpoints",
    "CREATE TABLE rtrl.x (a Int32) ENGINE = Memory",
    "OPTIMIZE TABLE rtrl.checkpoints FINAL",
    "RENAME TABLE rtrl.checkpoints TO rtrl.gone",
    "SYSTEM FLUSH LOGS",
    "KILL QUERY WHERE 1",
    "SET readonly = 0",
    "USE system",
    "SELECT count() FROM rtrl.checkpoints SETTINGS readonly = 0",
    "SELECT count() FROM rtrl.checkpoints SETTINGS max_execution_time = 1000",
    "EXPLAIN PIPELINE INSERT INTO rtrl.checkpoints (version) SELECT 9",
]


@pytest.mark.parametrize("sql", WRITES)
def test_the_analyst_can_only_read(front, sql):
    _, dsn, _ = front
    status, code, out = request(analyst(dsn), sql, user=chserver.ANALYST)
    assert status != 200 and code in ("164", "497", "62", "452"), (status, code, out)
    assert rows(dsn, "SELECT count() FROM rtrl.checkpoints WHERE version = 1") == b"1\n"
    assert rows(dsn, "SELECT count() FROM rtrl.checkpoints WHERE version = 9") == b"0\n"


def test_the_analyst_reads_the_analyst_tables_and_nothing_else(front):
    _, dsn, _ = front
    a = clickhouse.connect(analyst(dsn), 10)  # clickhouse-connect's own client, as an analyst uses it
    for table in clickhouse.ANALYST_TABLES:
        params = {
            "reward_stats": "(rv = 'v2')",
            "user_behaviour_between": "(since_ms = 0, until_ms = 10413792000000)",
            "user_rewards_between": "(reward_version = 'v2', since_ms = 0, until_ms = 10413792000000)",
            "reward_pairs": "(a = 'v1-discard-broken', b = 'v2')",
        }
        source = f"rtrl.{table}{params.get(table, '')}"
        assert a.query(f"SELECT count() FROM {source}").result_rows[0][0] >= 0
    assert a.query("SELECT version FROM rtrl.checkpoints FINAL").result_rows == [(1,)]
    assert a.query(
        "WITH c AS (SELECT version FROM rtrl.checkpoints) SELECT count() FROM c WHERE version IN c"
    ).result_rows == [(1,)]
    assert a.query("SELECT getSetting('readonly')").result_rows == [(1,)]  # the engine enforces it too
    for sql in [
        "SELECT count() FROM rtrl.events",
        "SELECT count() FROM rtrl.rollouts",
        "select * from rtrl.checkpoints where version in (select policy_version from rtrl.batches)",
        "SELECT 1 WHERE 1 IN rtrl.events",
        "SELECT count() FROM merge('rtrl', '.*')",
        "SELECT * FROM system.query_log",
        # a CTE named like a table, in another scope, never exempts the table (qualified or not)
        "SELECT count() FROM rtrl.events WHERE 1 IN (WITH `rtrl.events` AS (SELECT 1) SELECT 1)",
        "SELECT count() FROM rtrl.events WHERE 1 IN (WITH events AS (SELECT 1) SELECT 1)",
        "WITH `rtrl.checkpoints` AS (SELECT 1) SELECT count() FROM rtrl.events",
        "WITH checkpoints AS (SELECT count() FROM rtrl.events) SELECT * FROM checkpoints",
        # schemas of other tables: DESCRIBE, SHOW CREATE and EXISTS have no JSON tree, EXPLAIN AST's text is read
        "DESCRIBE TABLE rtrl.events",
        "DESC rtrl.rollouts",
        "DESCRIBE (SELECT * FROM rtrl.events)",
        "DESCRIBE (SELECT 1 WHERE 1 IN rtrl.events)",
        "SHOW CREATE TABLE rtrl.events",
        "SHOW CREATE VIEW rtrl.events",
        "EXISTS TABLE rtrl.events",
        "SHOW CREATE TABLE `rtrl.checkpoints`",
    ]:
        status, code, out = request(analyst(dsn), sql, user=chserver.ANALYST)
        assert status != 200 and code in ("164", "497"), (sql, code, out)
    for sql in [  # unqualified, in the analyst's database: the CTE names a real table
        "SELECT count() FROM events WHERE 1 IN (WITH events AS (SELECT 1) SELECT 1)",
        "DESCRIBE events",
        "EXISTS events",
    ]:
        status, code, out = request(analyst(dsn), sql, user=chserver.ANALYST, params={"database": "rtrl"})
        assert status != 200 and code in ("164", "497"), (sql, code, out)
    # the analyst tables' schemas stay readable
    assert rows(analyst(dsn), "EXISTS TABLE rtrl.checkpoints", user=chserver.ANALYST) == b"1\n"
    assert b"version" in rows(analyst(dsn), "DESCRIBE TABLE rtrl.checkpoints", user=chserver.ANALYST)
    assert b"CREATE" in rows(
        analyst(dsn), "SHOW CREATE TABLE checkpoints", user=chserver.ANALYST, params={"database": "rtrl"}
    )


def test_readonly_in_the_url_makes_a_request_read_only(front):
    _, dsn, _ = front
    sql = "INSERT INTO rtrl.checkpoints (version, status) VALUES (5, 'x')"
    status, code, _ = request(dsn, sql, params={"readonly": "1"})
    assert (status, code) == (403, "164")
    assert rows(dsn, "SELECT getSetting('readonly')", params={"readonly": "1"}) == b"1\n"
    rows(dsn, sql)
    assert rows(dsn, "SELECT count() FROM rtrl.checkpoints WHERE version = 5") == b"1\n"
    rows(dsn, "DELETE FROM rtrl.checkpoints WHERE version = 5")


# ---------------------------------------------------------------- files and network


HOSTILE = [
    "SELECT * FROM file('/etc/passwd', LineAsString)",
    "select * from FILE('/etc/passwd', LineAsString)",
    "SELECT * FROM `file` ('/etc/passwd', LineAsString)",
    "SELECT * FROM /* c */ file\n(\n'/etc/passwd', LineAsString)",
    "SELECT file('/etc/hostname')",
    "SELECT * FROM (SELECT * FROM (SELECT * FROM file('/etc/passwd', LineAsString)))",
    "SELECT 1 WHERE 'x' IN (SELECT * FROM url('http://127.0.0.1:1/', LineAsString))",
    "SELECT * FROM url('http://127.0.0.1:1/', CSV)",
    "SELECT * FROM s3('http://127.0.0.1:1/b/k', CSV)",
    "SELECT * FROM remote('127.0.0.1:9000', system.one)",
    "SELECT * FROM mysql('127.0.0.1:3306', 'd', 't', 'u', 'p')",
    "SELECT * FROM postgresql('127.0.0.1:5432', 'd', 't', 'u', 'p')",
    "SELECT * FROM executable('x.sh', TSV, 'a String')",
    "SELECT * FROM hdfs('hdfs://127.0.0.1:1/x', CSV)",
    "SELECT * FROM view(SELECT * FROM file('/etc/passwd', LineAsString))",
    "SELECT 1 INTO OUTFILE '/tmp/rtrl-outfile-test'",
    "(SELECT 1) INTO OUTFILE '/tmp/rtrl-outfile-test' FORMAT CSV",
    "INSERT INTO FUNCTION file('/tmp/rtrl-outfile-test', TSV) SELECT 1",
    "INSERT INTO rtrl.checkpoints FROM INFILE '/etc/passwd' FORMAT LineAsString",
    "CREATE TABLE default.f (a String) ENGINE = File(TSV)",
    "CREATE TABLE default.f (a String) ENGINE = URL('http://127.0.0.1:1/', CSV)",
    "CREATE TABLE default.f (a String) ENGINE = S3('http://127.0.0.1:1/b/k', CSV)",
    "CREATE TABLE default.f AS url('http://127.0.0.1:1/', CSV, 'a String')",
    "CREATE DATABASE m ENGINE = MySQL('127.0.0.1:3306', 'd', 'u', 'p')",
    "CREATE DICTIONARY default.d (a String) PRIMARY KEY a SOURCE(FILE(path '/etc/passwd' format 'TSV')) "
    "LAYOUT(FLAT()) LIFETIME(0)",
    "ATTACH TABLE default.f FROM '/etc' (a String) ENGINE = MergeTree ORDER BY a",
    "BACKUP TABLE rtrl.checkpoints TO File('/tmp/rtrl-backup-test')",
    "SYSTEM RELOAD CONFIG",
    "DESCRIBE TABLE file('/etc/passwd', LineAsString)",
    "SELECT catboostEvaluate('/etc/passwd', 1)",
    "INSERT INTO default.k VALUES (file('/etc/hostname'))",  # an expression in VALUES data
    "INSERT INTO default.k (a) VALUES (length(file('/etc/hostname')))",
    "SELECT * FROM format(Values, 'a String', '(file(''/etc/hostname''))')",
]


@pytest.mark.parametrize("sql", HOSTILE)
def test_files_and_the_network_are_refused_for_every_user(front, sql):
    _, dsn, _ = front
    status, code, out = request(dsn, sql)  # the writer: it may write tables, never files or sockets
    assert status != 200 and code in ("497", "62", "344"), (status, code, out)
    assert b"root:" not in out
    assert not Path("/tmp/rtrl-outfile-test").exists() and not Path("/tmp/rtrl-backup-test").exists()


def test_the_internal_insert_path_still_works_and_inline_data_cannot_smuggle_a_statement(front):
    _, dsn, _ = front
    rows(dsn, "CREATE TABLE IF NOT EXISTS default.k (a Int32) ENGINE = MergeTree ORDER BY a")
    rows(dsn, "CREATE TABLE IF NOT EXISTS default.keep (a Int32) ENGINE = Memory")
    rows(dsn, "INSERT INTO default.k FORMAT TSV", body=b"1\n2\n")  # statement in the URL, data in the body
    rows(dsn, "", body=b"INSERT INTO default.k FORMAT TSV\n3\n4\n")  # statement and data in the body
    rows(dsn, "INSERT INTO default.k VALUES (5), (6)")
    rows(dsn, "", body=b"INSERT INTO default.k /* VALUES (99) */ VALUES (7)")
    for smuggle in [
        "INSERT INTO default.k VALUES (8); DROP TABLE default.keep",
        "INSERT INTO default.k FORMAT TSV\n8\n;DROP TABLE default.keep",
    ]:
        request(dsn, "", body=smuggle.encode())  # an error or a row; never the DROP
        assert rows(dsn, "EXISTS TABLE default.keep") == b"1\n"
    assert rows(dsn, "SELECT sum(a) FROM default.k WHERE a < 8") == str(sum(range(1, 8))).encode() + b"\n"
    # VALUES data too large to check as a statement is read as literals only: file() there is never run
    rows(dsn, "CREATE TABLE IF NOT EXISTS default.s (a String) ENGINE = Memory")
    big = b"INSERT INTO default.s VALUES " + b"('x'), " * 60000 + b"(file('/etc/hostname'))"
    status, code, out = request(dsn, "", body=big)
    assert (status, code) == (500, "344") and b"Interpreting expressions is disabled" in out, out[:300]
    hostname = Path("/etc/hostname").read_text().strip() if Path("/etc/hostname").exists() else "x"
    assert rows(dsn, "SELECT countIf(a != 'x') FROM default.s") == b"0\n", hostname
    rows(dsn, "", body=b"INSERT INTO default.s VALUES " + b"('y'), " * 60000 + b"('z')")  # literals: fine
    assert rows(dsn, "SELECT count() FROM default.s WHERE a IN ('y', 'z')") == b"60001\n"
    rows(dsn, "INSERT INTO default.k VALUES (toInt32(10) + 1), (20)")  # expressions in small data are checked
    assert rows(dsn, "SELECT sum(a) FROM default.k WHERE a > 10") == b"31\n"


# ---------------------------------------------------------------- isolation between clients


def test_database_and_settings_never_leak_between_requests(front):
    _, dsn, _ = front
    for sql in ["USE system", "SET max_execution_time = 3", "SET readonly = 2", "SET max_threads = 1"]:
        rows(dsn, sql)  # each only in its own request's session
        assert rows(dsn, "SELECT currentDatabase()") == b"default\n"
        assert rows(dsn, "SELECT currentDatabase()", params={"database": "rtrl"}) == b"rtrl\n"
        assert rows(dsn, "SELECT getSetting('readonly'), getSetting('max_execution_time')") == b"0\t4\n"
        assert rows(analyst(dsn), "SELECT currentDatabase()", user=chserver.ANALYST) == b"default\n"
    # two clients, interleaved: each sees its own database
    a, b = clickhouse.connect(dsn, 10), clickhouse.connect(dsn, 10)
    a.command("USE rtrl")
    assert b.query("SELECT currentDatabase()").result_rows == [("default",)]


# ---------------------------------------------------------------- limits


@pytest.mark.slow
def test_max_execution_time_is_honoured_from_the_url_and_by_default(front):
    _, dsn, _ = front
    slow = "SELECT sleepEachRow(0.5) FROM numbers(40) SETTINGS max_block_size = 1"
    t = time.monotonic()
    status, code, _ = request(dsn, slow, params={"max_execution_time": "1"})
    assert (status, code) == (500, "159") and time.monotonic() - t < 3.5
    t = time.monotonic()
    status, code, _ = request(dsn, slow, params={"max_execution_time": "1000"})  # the server's ceiling: 4 s
    assert (status, code) == (500, "159") and time.monotonic() - t < 7.5
    t = time.monotonic()
    status, code, _ = request(dsn, "SELECT count() FROM numbers(1e12)", params={"max_execution_time": "1"})
    assert (status, code) == (500, "159") and time.monotonic() - t < 4


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT sleepEachRow(0.5) FROM numbers(40) SETTINGS max_block_size = 1, max_execution_time = 0",
        "SELECT 1 SETTINGS max_execution_time = 1000",
        "SELECT 1 SETTINGS max_execution_time = '0'",
        "SELECT * FROM (SELECT 1 SETTINGS max_execution_time = 0)",
        "SELECT 1 SETTINGS timeout_overflow_mode = 'break'",
        "SELECT 1 SETTINGS max_execution_time_leaf = 0",
        "SET max_execution_time = 0",
        "INSERT INTO default.k SETTINGS max_execution_time = 0 SELECT 1",
        "CREATE VIEW default.v AS SELECT 1 SETTINGS max_execution_time = 0",
        "DESCRIBE TABLE default.k SETTINGS max_execution_time = 0",
    ],
)
def test_no_statement_lifts_the_time_cap(front, sql):
    _, dsn, _ = front
    status, code, out = request(dsn, sql)
    assert (status, code) == (400, "452") and b"caps max_execution_time at 4 s" in out, out
    # lowering it is fine
    assert rows(dsn, "SELECT getSetting('max_execution_time') SETTINGS max_execution_time = 2") == b"2\n"


@pytest.mark.slow
def test_the_wait_for_the_engine_is_bounded(front):
    _, dsn, _ = front
    slow: list = []
    sleeper = threading.Thread(
        target=lambda: slow.append(request(dsn, "SELECT sleepEachRow(0.5) FROM numbers(6) SETTINGS max_block_size = 1"))
    )
    sleeper.start()
    try:
        time.sleep(0.7)
        t = time.monotonic()
        status, code, out = request(dsn, "SELECT 1")  # the engine is busy for 3 s; the queue waits 1 s
        took = time.monotonic() - t
    finally:
        sleeper.join(30)
    assert (status, code) == (503, "202") and b"TOO_MANY_SIMULTANEOUS_QUERIES" in out, out
    assert 0.8 < took < 2.5, took
    assert slow and slow[0][0] == 200
    assert rows(dsn, "SELECT 1") == b"1\n"


def test_request_body_size_is_capped(front):
    _, dsn, _ = front
    host, port = address(dsn)
    auth = basic(dsn)
    s = socket.create_connection((host, port), timeout=10)
    try:  # announces 1 GiB, sends nothing: refused at once, nothing read
        s.sendall(b"POST /?query=SELECT%201 HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 1073741824\r\n\r\n")
        head = s.recv(4096)
    finally:
        s.close()
    assert head.startswith(b"HTTP/1.1 413") and b"X-ClickHouse-Exception-Code: 307" in head
    chunked = b"POST /?query=SELECT%201 HTTP/1.1\r\nHost: x\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n"
    s = socket.create_connection((host, port), timeout=10)
    try:  # chunked: refused as soon as the chunks announced pass the cap
        s.sendall(chunked)
        s.sendall(b"100000\r\n" + bytes(1 << 20) + b"\r\n" + b"40000000\r\n")  # 1 MiB, then 1 GiB announced
        head = s.recv(4096)
    finally:
        s.close()
    assert head.startswith(b"HTTP/1.1 413") and b"X-ClickHouse-Exception-Code: 307" in head
    for bad in [b"-1", b"-0", b"+10", b"0x10", b"zz", b"1 0", b"", b"1" * 20]:  # int(b"-1", 16) == -1: read to EOF
        s = socket.create_connection((host, port), timeout=10)
        try:  # the client keeps its socket open: a read to EOF would hang until the read limit
            s.sendall(chunked + bad + b"\r\n" + bytes(100))
            t = time.monotonic()
            head = s.recv(4096)
        finally:
            s.close()
        assert head.startswith(b"HTTP/1.1 400") and time.monotonic() - t < 1.5, (bad, head[:200])
    s = socket.create_connection((host, port), timeout=10)
    try:  # chunk extensions are allowed (and ignored)
        s.sendall(chunked.replace(b"SELECT%201", b"") + b"8;name=value\r\nSELECT 5\r\n0\r\n\r\n")
        head = b""
        for _ in range(20):  # the reply may come in several pieces
            head += s.recv(4096)
            if head.endswith(b"\n5\n"):
                break
    finally:
        s.close()
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n5\n"), head
    assert rows(dsn, "SELECT 1") == b"1\n"


@pytest.mark.slow
def test_unauthenticated_bodies_are_never_read(front):
    proc, dsn, _ = front
    host, port = address(dsn)
    for auth in [b"", b"Authorization: Basic " + base64.b64encode(b"rtrl_writer:wrong") + b"\r\n"]:
        s = socket.create_connection((host, port), timeout=10)
        try:  # announces 3 MiB (under the cap) and sends none of it: refused from the headers, at once
            s.sendall(b"POST /?query=SELECT%201 HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 3145728\r\n\r\n")
            t = time.monotonic()
            head = s.recv(4096)
        finally:
            s.close()
        assert head.startswith(b"HTTP/1.1 401") and b"X-ClickHouse-Exception-Code: 516" in head, head
        assert b"Connection: close" in head and time.monotonic() - t < 1.5
    # a client that never finishes its headers is cut off at the header deadline (here the read limit, 2 s)
    s = socket.create_connection((host, port), timeout=10)
    try:
        s.sendall(b"POST /?query=SELECT%201 HTTP/1.1\r\nHost: x\r\n")
        t = time.monotonic()
        assert s.recv(4096) == b"" and time.monotonic() - t < 4
    finally:
        s.close()
    assert rows(dsn, "SELECT 1") == b"1\n"


def test_gzip_and_deflate_bodies_with_several_members_are_read_whole(front):
    _, dsn, _ = front
    rows(dsn, "CREATE TABLE IF NOT EXISTS default.m (a Int32) ENGINE = Memory")
    rows(dsn, "TRUNCATE TABLE default.m")
    for encoding, body in [
        ("gzip", gzip.compress(b"1\n2\n") + gzip.compress(b"3\n")),
        ("deflate", zlib.compress(b"4\n") + zlib.compress(b"5\n6\n")),
    ]:
        rows(dsn, "INSERT INTO default.m FORMAT TSV", body=body, headers={"Content-Encoding": encoding})
    assert rows(dsn, "SELECT count(), sum(a) FROM default.m") == b"6\t21\n"
    status, code, _ = request(  # cut short: an error, never fewer rows
        dsn,
        "INSERT INTO default.m FORMAT TSV",
        body=gzip.compress(b"7\n8\n")[:-4],
        headers={"Content-Encoding": "gzip"},
    )
    assert (status, code) == (400, "354")
    assert chserver.decompress(gzip.compress(b"a") * 3, "gzip") == b"aaa"
    assert rows(dsn, "SELECT count() FROM default.m") == b"6\n"


def _bomb(encoding: str, size: int = 256 << 20) -> bytes:
    """``size`` zero bytes compressed, built a MiB at a time (the test never holds them inflated)."""
    zero = bytes(1 << 20)
    if encoding in ("gzip", "deflate"):
        c = zlib.compressobj(9, zlib.DEFLATED, 31 if encoding == "gzip" else 15)
        return b"".join(c.compress(zero) for _ in range(size >> 20)) + c.flush()
    if encoding == "zstd":
        import zstandard

        z = zstandard.ZstdCompressor().compressobj()
        return b"".join(z.compress(zero) for _ in range(size >> 20)) + z.flush()
    import lz4.frame

    l4 = lz4.frame.LZ4FrameCompressor()
    return l4.begin() + b"".join(l4.compress(zero) for _ in range(size >> 20)) + l4.flush()


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "zstd", "lz4"])
def test_a_decompression_bomb_is_refused_after_at_most_the_limit(front, encoding):
    _, dsn, _ = front
    bomb = _bomb(encoding)
    assert len(bomb) < 4 << 20  # passes the body cap: only the inflated size can stop it
    status, code, out = request(
        dsn, "INSERT INTO default.k FORMAT TSV", body=bomb, headers={"Content-Encoding": encoding}
    )
    assert (status, code) == (413, "307"), out
    assert rows(dsn, "SELECT 1") == b"1\n"  # the front is fine
    # in process: inflating stops at the limit (peak memory about the limit, not 256 MiB)
    tracemalloc.start()
    try:
        with pytest.raises(chserver.RequestError, match="TOO_MANY_BYTES"):
            chserver.decompress(bomb, encoding, 8 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, peak
    assert chserver.decompress(gzip.compress(b"1\n2\n"), "gzip", 8 << 20) == b"1\n2\n"


@pytest.mark.slow
def test_forty_slow_clients_are_cut_off_and_do_not_starve_the_others(front):
    proc, dsn, _ = front
    host, port = address(dsn)
    base = _threads(proc.pid)
    slow = []
    for _ in range(40):
        s = socket.create_connection((host, port), timeout=10)  # authenticated: their bodies are read
        s.sendall(b"POST /?query=SELECT%201 HTTP/1.1\r\nHost: x\r\n" + basic(dsn) + b"Content-Length: 1000\r\n\r\n")
        slow.append(s)
    t0 = time.monotonic()
    closed: set[int] = set()
    for tick in range(16):  # a byte every 0.5 s each, for up to 8 s (the read limit is 2 s)
        for i, s in enumerate(slow):
            if i in closed:
                continue
            try:
                s.sendall(b"x")
                s.settimeout(0.001)
                if s.recv(4096) == b"":
                    closed.add(i)
            except (BlockingIOError, TimeoutError):
                pass
            except OSError:
                closed.add(i)
        if tick == 1:  # meanwhile, an ordinary client is served at once
            t = time.monotonic()
            assert rows(dsn, "SELECT 42") == b"42\n" and time.monotonic() - t < 1.5
            assert _threads(proc.pid) <= base + 48 + 2
        if len(closed) == len(slow):
            break
        time.sleep(0.5)
    took = time.monotonic() - t0
    for s in slow:
        s.close()
    assert len(closed) == 40 and took < 6, (len(closed), took)


# ---------------------------------------------------------------- a real server's security (deploy/)

SECURITY_SQL = ROOT / "deploy" / "clickhouse" / "security.sql"


def test_the_deploy_sql_parses_on_the_engine_and_grants_the_analyst_the_fronts_tables(front):
    _, dsn, _ = front
    ch = clickhouse.connect(dsn, 10)
    statements = clickhouse.Migration(0, SECURITY_SQL.name, SECURITY_SQL.read_text()).statements("rtrl")
    canonical = [
        ch.query("SELECT formatQuerySingleLine({q:String})", parameters={"q": s}).result_rows[0][0] for s in statements
    ]
    kinds = {re.match(r"(CREATE \w+( PROFILE)?|GRANT|REVOKE)", c).group(0) for c in canonical}  # type: ignore[union-attr]
    assert kinds == {"CREATE SETTINGS PROFILE", "CREATE ROLE", "GRANT", "REVOKE", "CREATE USER", "CREATE QUOTA"}
    # the append-only tables (the erasure audit): the writer role may insert, never alter or truncate
    revoked = {
        m.group(1)
        for c in canonical
        if (m := re.fullmatch(r"REVOKE ALTER, TRUNCATE ON rtrl\.(\w+) FROM rtrl_writer_role", c))
    }
    both = {t + suffix for t in clickhouse.APPEND_ONLY_TABLES for suffix in ("", "_local")}  # a cluster's node tables
    assert revoked == both, [c for c in canonical if c.startswith("REVOKE")]
    analyst_grants = {
        m.group(1) for c in canonical if (m := re.fullmatch(r"GRANT SELECT ON rtrl\.(\w+) TO rtrl_analyst_role", c))
    }
    assert analyst_grants == set(clickhouse.ANALYST_TABLES)
    assert not [
        c for c in canonical if c.startswith("GRANT") and c.endswith("TO rtrl_analyst_role") and " SELECT ON " not in c
    ]
    profile = next(c for c in canonical if "PROFILE IF NOT EXISTS `rtrl_analyst_profile`" in c)
    assert "readonly = 1" in profile and "max_execution_time" in profile and "max_memory_usage" in profile
    assert any(c.startswith("CREATE QUOTA") and "TO rtrl_analyst_role" in c for c in canonical)
    assert all("sha256_password BY 'CHANGE_ME" in c for c in canonical if c.startswith("CREATE USER"))


def test_the_analyst_grants_applied_where_the_embedded_engine_can(front, tmp_path):
    """chdb has no access control to apply them to: its one user (``default`` from users_xml, the only user
    directory) may not CREATE ROLE/USER/SETTINGS PROFILE/QUOTA (code 497, shown below) and a session cannot
    switch user. So the front applies them: its analyst user has the profile's readonly = 1 and a
    max_execution_time, reads only the granted tables, and cannot write (test_the_analyst_can_only_read)."""
    code = (
        "import chdb, sys\n"
        "c = chdb.connect(sys.argv[1])\n"
        "for s in ['CREATE ROLE IF NOT EXISTS rtrl_analyst_role', 'CREATE USER IF NOT EXISTS u']:\n"
        "    try:\n"
        "        c.query(s); print('applied')\n"
        "    except Exception as e:\n"
        "        print(str(e).split('.')[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ch")], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:2] == ["Code: 497", "Code: 497"], out.stdout + out.stderr
    _, dsn, _ = front
    a = analyst(dsn)
    got = rows(a, "SELECT getSetting('readonly'), getSetting('max_execution_time')", user=chserver.ANALYST)
    assert got == b"1\t4\n"
    for table in clickhouse.TABLES:
        status, code_, _ = request(a, f"SELECT count() FROM rtrl.{table}", user=chserver.ANALYST)
        assert (status == 200) == (table in clickhouse.ANALYST_TABLES), (table, code_)
        status, code_, _ = request(a, f"INSERT INTO rtrl.{table} SELECT * FROM rtrl.{table}", user=chserver.ANALYST)
        assert (status, code_) == (403, "164"), table


# ---------------------------------------------------------------- query parameters (issue 40, point 2)

# (statement, its parameters): an Identifier parameter names a table, a database or a column around the check
IDENTIFIER_PARAMETERS = [
    ("SELECT event_id, user_hash, org_id FROM rtrl.{t:Identifier}", {"t": "events"}),
    ("SELECT name FROM system.{t:Identifier}", {"t": "tables"}),
    ("SELECT count() FROM {d:Identifier}.{t:Identifier}", {"d": "rtrl", "t": "events"}),
    ("SELECT count() FROM {d:Identifier}.events", {"d": "rtrl"}),
    ("SELECT count() FROM {t:Identifier}", {"t": "events"}),  # in the request's database (rtrl below)
    ("SELECT count() FROM {t:Identifier} FINAL", {"t": "rollouts"}),
    ("SELECT count() FROM rtrl.checkpoints JOIN rtrl.{t:Identifier} USING (version)", {"t": "batches"}),
    ("SELECT 1 WHERE 'e' IN rtrl.{t:Identifier}", {"t": "events"}),
    ("SELECT * FROM view(SELECT event_id FROM rtrl.{t:Identifier})", {"t": "events"}),
    ("EXPLAIN SELECT * FROM rtrl.{t:Identifier}", {"t": "events"}),
    ("DESCRIBE TABLE rtrl.{t:Identifier}", {"t": "events"}),
    ("SHOW CREATE TABLE rtrl.{t:Identifier}", {"t": "events"}),
    ("EXISTS TABLE {d:Identifier}.{t:Identifier}", {"d": "rtrl", "t": "events"}),
    ("SHOW TABLES FROM {d:Identifier}", {"d": "system"}),
    ("SELECT {c:Identifier} FROM rtrl.checkpoints", {"c": "version"}),
    ("SELECT count() FROM rtrl.{t:Identifier}", {"t": "checkpoints"}),  # even an analyst table: no exception
]
# every other type ClickHouse knows, where a name goes: the engine's parser refuses it (a syntax error, 400)
OTHER_TYPES_AS_NAMES = [
    (f"SELECT count() FROM {where}{{t:{kind}}}", {"t": name})
    for kind in ("String", "LowCardinality(String)", "Nullable(String)", "FixedString(6)", "Nullable(Identifier)")
    for where, name in (("", "rtrl.events"), ("rtrl.", "events"))
]
# String parameters read by functions that take a table, database or dictionary name: refused by the name
NAMING_FUNCTIONS = [
    ("SELECT count() FROM merge({d:String}, {r:String})", {"d": "rtrl", "r": "^events$"}),
    ("SELECT count() FROM remote({h:String}, rtrl.events)", {"h": "127.0.0.1"}),
    ("SELECT count() FROM cluster({c:String}, {d:String}, {t:String})", {"c": "default", "d": "rtrl", "t": "events"}),
    ("SELECT dictGet({d:String}, 'org_id', 1)", {"d": "rtrl.events"}),
    ("SELECT dictHas({d:String}, 1)", {"d": "rtrl.events"}),
    ("SELECT joinGet({t:String}, 'org_id', 'e')", {"t": "rtrl.events"}),
    ("SELECT hasColumnInTable({d:String}, {t:String}, 'user_hash')", {"d": "rtrl", "t": "events"}),
]


def _with_params(params: dict[str, str]) -> dict[str, str]:
    return {"database": "rtrl"} | {f"param_{k}": v for k, v in params.items()}


@pytest.mark.parametrize("sql,params", IDENTIFIER_PARAMETERS)
def test_an_identifier_query_parameter_is_refused_for_the_analyst(front, sql, params):
    """The analyst's Identifier parameters are refused before the engine substitutes them."""
    _, dsn, _ = front
    status, code, out = request(analyst(dsn), sql, user=chserver.ANALYST, params=_with_params(params))
    assert (status, code) == (403, "497") and b"query parameter {" in out and b":Identifier} is refused" in out, out


def test_the_writer_may_use_identifier_query_parameters(front):
    """The same statements are real ones: the writer (who may read every table) runs them."""
    _, dsn, _ = front
    for sql, params in IDENTIFIER_PARAMETERS[:5] + IDENTIFIER_PARAMETERS[10:11]:
        status, code, out = request(dsn, sql, params=_with_params(params))
        assert status == 200, (sql, code, out)


@pytest.mark.parametrize("sql,params", OTHER_TYPES_AS_NAMES + NAMING_FUNCTIONS)
def test_no_other_query_parameter_names_a_table_for_the_analyst(front, sql, params):
    """A parameter of another type cannot stand where a name goes, and naming functions are refused."""
    _, dsn, _ = front
    status, code, out = request(analyst(dsn), sql, user=chserver.ANALYST, params=_with_params(params))
    if "FROM {t:" in sql or "FROM rtrl.{t:" in sql:
        assert (status, code) == (400, "62") and b"Syntax error" in out, out
    else:
        assert status == 403 and code in ("164", "497"), out
        assert b"is not available to read-only users" in out or b"is refused by the embedded" in out, out
    assert b"user_hash" not in out


def test_honest_parameterised_analyst_queries_still_work(front):
    """Parameters that carry values work for the analyst, on the analyst's tables and views."""
    _, dsn, _ = front
    a = analyst(dsn)
    got = rows(
        a,
        "SELECT count() FROM rtrl.checkpoints WHERE version = {v:UInt32}",
        user=chserver.ANALYST,
        params={"param_v": "1"},
    )
    assert got == b"1\n"
    got = rows(
        a,
        "SELECT count() FROM rtrl.behaviour WHERE org_id = {o:String}",
        user=chserver.ANALYST,
        params={"param_o": "o1"},
    )
    assert got == b"0\n"
    params = {"param_rv": "v2", "param_o": "*"}
    sql = "SELECT count() FROM rtrl.reward_stats(rv = {rv:String}) WHERE org_id = {o:String}"
    assert rows(a, sql, user=chserver.ANALYST, params=params).strip().isdigit()
    sql = "SELECT {s:String} AS s, {n:Array(UInt8)} AS n, '{t:Identifier}' AS text"
    got = rows(a, sql, user=chserver.ANALYST, params={"param_s": "a", "param_n": "[1,2]"})
    assert got == b"a\t[1,2]\t{t:Identifier}\n"  # a parameter's text inside a string literal is only text
    c = clickhouse.connect(a, 10)  # clickhouse-connect's own client binds its parameters the same way
    assert c.query(
        "SELECT version FROM rtrl.checkpoints WHERE status = {s:String}", parameters={"s": "promoted"}
    ).result_rows == [(1,)]


# ---------------------------------------------------------------- not HTTP (issue 40)


@pytest.mark.parametrize(
    "raw",
    [
        b"hello\r\n\r\n",
        b"GET /\r\n\r\n",
        b"GET /?query=SELECT%201\r\n\r\n",
        b"\x16\x03\x01\x00\xa5 \xff\xfe garbage\r\n\r\n",
    ]
    + [b"a b c d e\r\n\r\n", b"SELECT 1 FORMAT TSV\r\n\r\n", b"GET / HTTP/2.0\r\n\r\n", b"\r\n"],
)
def test_a_request_that_is_not_http_gets_a_status_line_or_a_clean_close(front, raw):
    """Whatever comes in, the reply starts with a status line, or the connection just closes."""
    _, dsn, _ = front
    s = socket.create_connection(address(dsn), timeout=10)
    try:
        s.sendall(raw)
        reply = b""
        for _ in range(20):
            piece = s.recv(4096)
            if not piece:
                break
            reply += piece
    finally:
        s.close()
    assert reply == b"" or re.match(rb"HTTP/1\.1 (400|505) ", reply), reply[:200]
    if raw.strip():
        assert reply.startswith(b"HTTP/1.1 "), reply[:200]
        assert b"\r\nConnection: close\r\n" in reply and b"X-ClickHouse-Exception-Code: 1000" in reply
    assert rows(dsn, "SELECT 1") == b"1\n"
