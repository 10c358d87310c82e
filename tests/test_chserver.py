"""The embedded ClickHouse as a server (devservices.chserver): clickhouse-connect's HTTP client against the real
engine in another process, several writer processes at once, compressed bodies, errors, kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import urllib.parse
import urllib.request

import clickhouse_connect
import pytest

from devservices.chserver import spawn
from rtrl import clickhouse
from schemas.records import TrainStep


def step(run_id: str, n: int) -> TrainStep:
    return TrainStep(
        run_id=run_id,
        step=n,
        policy_version=0,
        loss=0.5 * n,
        pg_loss=0.1,
        kl=0.01,
        clip_fraction=0.0,
        is_truncated_fraction=0.0,
        tokens=10 * n,
        on_policy_fraction=1.0,
        lag_histogram={"0": n},
        tokens_per_s=1.0,
        batch_ids=[f"b{n}", f"c{n}"],
        at=n,
    )


def address(dsn: str) -> str:
    """``http://host:port`` of a DSN (which names a user and a password file)."""
    u = urllib.parse.urlsplit(dsn)
    return f"http://{u.hostname}:{u.port}"


@pytest.fixture
def server(tmp_path):
    proc, dsn = spawn(tmp_path / "ch")
    yield proc, dsn, tmp_path / "ch"
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_records_round_trip_through_the_http_protocol(server):
    _, dsn, _ = server
    ch = clickhouse.setup(dsn, "rtrl", 10)  # migrations + schema verification over HTTP
    steps = [step("r", n) for n in range(1, 51)]
    assert clickhouse.insert(ch, "rtrl", "train_metrics", steps) == 50
    assert clickhouse.select(ch, "rtrl", "train_metrics", "ORDER BY step") == steps
    got = ch.query(
        "SELECT sum(tokens) FROM rtrl.train_metrics WHERE run_id = {r:String} AND step > {n:UInt32}",
        parameters={"r": "r", "n": 40},
    ).result_rows
    assert got == [(sum(10 * n for n in range(41, 51)),)]
    ch.command("DELETE FROM rtrl.train_metrics WHERE step > 10")
    assert ch.query("SELECT count() FROM rtrl.train_metrics").result_rows == [(10,)]
    with urllib.request.urlopen(f"{address(dsn)}/ping", timeout=5) as r:  # /ping needs no credentials
        assert r.read() == b"Ok.\n"


@pytest.mark.parametrize("compress", ["lz4", "zstd", "gzip", False])
def test_compressed_and_plain_request_bodies(server, compress):
    _, dsn, _ = server
    plain, password = clickhouse.split_password_file(dsn)  # the writer's token, from its owner-only file
    c = clickhouse_connect.get_client(dsn=plain, password=password, compress=compress)
    c.command("CREATE TABLE IF NOT EXISTS default.t (k UInt32, v String) ENGINE = MergeTree ORDER BY k")
    c.command("TRUNCATE TABLE default.t")
    c.insert("default.t", [[i, f"v{i}"] for i in range(1000)], column_names=["k", "v"])
    assert c.query("SELECT count(), sum(k), max(v) FROM default.t").result_rows == [(1000, 499500, "v999")]


def test_engine_errors_keep_their_code_and_message(server):
    _, dsn, _ = server
    ch = clickhouse.connect(dsn)
    with pytest.raises(Exception, match="Code: 60"):
        ch.query("SELECT * FROM default.no_such_table")
    req = urllib.request.Request(
        f"{address(dsn)}/?query=SELECT%201",
        data=b"not an insert",
        method="POST",
        headers={"X-ClickHouse-User": "rtrl_writer", "X-ClickHouse-Key": clickhouse.split_password_file(dsn)[1] or ""},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    # a syntax error is the client's: 400 with the engine's code, as ClickHouse's own server answers it
    assert e.value.code == 400 and e.value.headers["X-ClickHouse-Exception-Code"] == "62"


@pytest.mark.slow
def test_several_writer_processes_at_once(server):
    """What chdb alone cannot do: several processes writing one folder (through the server)."""
    _, dsn, _ = server
    ch = clickhouse.setup(dsn, "rtrl", 10)
    code = textwrap.dedent(f"""
        import sys
        from rtrl import clickhouse
        from tests.test_chserver import step
        ch = clickhouse.connect({dsn!r})
        for i in range(20):
            clickhouse.insert(ch, "rtrl", "train_metrics", [step(sys.argv[1], 10 * i + j) for j in range(1, 11)])
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, f"writer{w}"], cwd=os.getcwd()) for w in range(3)]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    rows = ch.query(
        "SELECT run_id, count(), uniqExact(step) FROM rtrl.train_metrics FINAL GROUP BY run_id ORDER BY run_id"
    ).result_rows
    assert rows == [(f"writer{w}", 200, 200) for w in range(3)]


@pytest.mark.slow
def test_acknowledged_inserts_survive_kill_9(server, tmp_path):
    proc, dsn, folder = server
    ch = clickhouse.setup(dsn, "rtrl", 10)
    clickhouse.insert(ch, "rtrl", "train_metrics", [step("k", n) for n in range(1, 101)])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc2, dsn2 = spawn(folder)
    try:
        ch2 = clickhouse.connect(dsn2)
        assert ch2.query("SELECT count(), sum(step) FROM rtrl.train_metrics FINAL").result_rows == [(100, 5050)]
    finally:
        proc2.kill()
        proc2.wait()
