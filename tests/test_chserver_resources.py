"""The embedded ClickHouse front's resources stay bounded under load, on fronts started with the limits checked.

Connections past the bound are answered at once with no thread started; a writer's statements go before queued
analyst scans, whose time cap is short and cannot be raised; bombs waiting for the engine hold at most the
inflated-body byte budget; a stopped (even a killed) front leaves no temporary folder. Each test starts a front of
its own (the two queue tests share one), so none of them waits on tests/test_chserver_security.py's.
"""

from __future__ import annotations

import gzip
import http.client
import re
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from devservices import chserver
from rtrl import clickhouse
from tests.chserver_helpers import _threads, address, analyst, basic, request, rows


@pytest.mark.slow
def test_connections_are_bounded(tmp_path):
    proc, dsn = chserver.spawn(tmp_path / "ch", extra_args=["--max-connections", "4", "--read-timeout-s", "2"])
    try:
        host, port = address(dsn)
        base = _threads(proc.pid)
        idle = [socket.create_connection((host, port), timeout=10) for _ in range(4)]
        time.sleep(0.3)
        busy = []
        for _ in range(6):  # past the bound: answered 503 / code 202 at once, no thread started
            s = socket.create_connection((host, port), timeout=10)
            busy.append(s.recv(4096))
            s.close()
        assert all(b.startswith(b"HTTP/1.1 503") and b"Exception-Code: 202" in b for b in busy)
        assert _threads(proc.pid) <= base + 4
        for s in idle:  # the idle ones are cut off at the read limit; then clients are served again
            assert s.recv(16) == b""
            s.close()
        time.sleep(0.3)
        assert rows(dsn, "SELECT 7") == b"7\n"
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.slow
def test_a_kept_alive_connection_may_idle_past_the_header_deadline(tmp_path):
    """A client's pool keeps a connection between requests: idle past the header deadline (1 s here) but within
    the read limit (4 s), its next request is answered on it, so a pooled connection never closes under a request
    being sent (an insert cannot be retried). Idle past the read limit, it is closed; a request's line and headers
    still must arrive within the header deadline from their first byte."""
    proc, dsn = chserver.spawn(tmp_path / "ch", extra_args=["--header-timeout-s", "1", "--read-timeout-s", "4"])
    try:
        host, port = address(dsn)
        auth = {"Authorization": basic(dsn).decode().split(": ", 1)[1].strip()}
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            kept = None
            for _ in range(2):
                conn.request("GET", "/?query=SELECT%207", headers=auth)
                answer = conn.getresponse()
                assert (answer.status, answer.read()) == (200, b"7\n")
                kept = kept or conn.sock
                assert conn.sock is kept  # the same connection, kept alive
                time.sleep(2.0)  # past the header deadline, within the read limit
            time.sleep(3.0)  # 5 s idle in all: past the read limit
            assert kept is not None and kept.recv(16) == b""
        finally:
            conn.close()
        with socket.create_connection((host, port), timeout=10) as s:  # a slow client: half a request line
            s.sendall(b"GET /?query=SEL")
            time.sleep(2.0)
            assert s.recv(16) == b""
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.slow
def test_a_stopped_front_leaves_no_temporary_folder(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the child's temporary folders
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # spawn's own (the ready file)
    proc, dsn = chserver.spawn(tmp_path / "ch")
    try:
        assert not list(tmp.glob("rtrl-chserver-ready-*"))  # removed once the DSN is read
        rows(dsn, "CREATE TABLE default.t (a Int32) ENGINE = Memory")
        rows(dsn, "INSERT INTO default.t FORMAT TSV", body=b"1\n")  # through the spool folder
        assert not list(tmp.iterdir())  # the spool is inside the (owner-only) folder, not in TMPDIR
        assert (tmp_path / "ch" / "rtrl-spool").is_dir()
    finally:
        proc.kill()  # even a front killed with SIGKILL: the next start empties its spool
        proc.wait(30)
    (tmp_path / "ch" / "rtrl-spool" / "left-by-the-killed-one.TSV").write_bytes(b"1\n")
    proc, dsn = chserver.spawn(tmp_path / "ch")
    try:
        assert list((tmp_path / "ch" / "rtrl-spool").iterdir()) == []
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert not [p for p in tmp.iterdir() if p.name.startswith("rtrl-chserver")], list(tmp.iterdir())


# ---------------------------------------------------------------- writers before analysts (issue 40, point 4)

SCAN = "SELECT count() FROM numbers(1e12)"  # runs until the analyst's time cap stops it (code 159)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """A front whose queue outwaits several analyst scans (3 s each at most)."""
    folder = tmp_path_factory.mktemp("roomy") / "ch"
    proc, dsn = chserver.spawn(folder, extra_args=["--queue-timeout-s", "30", "--analyst-max-execution-time-s", "3"])
    clickhouse.setup(dsn, "rtrl", 10)
    yield dsn
    proc.kill()
    proc.wait(30)


@pytest.mark.slow
def test_the_analysts_time_cap_is_short_and_cannot_be_raised(roomy):
    """The analyst's statements get the analyst's cap by default; asking for more is refused."""
    a = analyst(roomy)
    assert chserver.Limits().analyst_max_execution_time_s <= 30 < chserver.Limits().queue_timeout_s + 1
    assert rows(a, "SELECT getSetting('max_execution_time')", user=chserver.ANALYST) == b"3\n"
    assert rows(roomy, "SELECT getSetting('max_execution_time')") == b"300\n"  # the writer's is the server's
    low = {"max_execution_time": "1"}
    assert rows(a, "SELECT getSetting('max_execution_time')", user=chserver.ANALYST, params=low) == b"1\n"
    status, code, out = request(a, "SELECT 1", user=chserver.ANALYST, params={"max_execution_time": "600"})
    assert (status, code) == (400, "452") and b"above the analyst's cap of 3 s" in out, out
    status, code, out = request(a, "SELECT 1 SETTINGS max_execution_time = 60", user=chserver.ANALYST)
    assert (status, code) == (400, "452") and b"caps max_execution_time at 3 s" in out, out
    status, code, _ = request(a, SCAN, user=chserver.ANALYST)
    assert (status, code) == (500, "159")  # stopped at the cap (the engine's TIMEOUT_EXCEEDED)


@pytest.mark.slow
def test_a_writer_goes_before_queued_analyst_scans(roomy):
    """With one analyst scan running and two queued, the writer's statements run right after the running one."""
    done: list[tuple[str, int, str | None]] = []
    lock = threading.Lock()

    def run(name: str, dsn: str, sql: str, **kw) -> None:
        status, code, _ = request(dsn, sql, timeout=60, **kw)
        with lock:
            done.append((name, status, code))

    a = analyst(roomy)
    rows(roomy, "CREATE TABLE IF NOT EXISTS default.ingest (a Int32) ENGINE = MergeTree ORDER BY a")
    threads = [
        threading.Thread(target=run, args=(f"scan{i}", a, SCAN), kwargs={"user": chserver.ANALYST}) for i in range(3)
    ]
    threads.append(threading.Thread(target=run, args=("insert", roomy, "INSERT INTO default.ingest VALUES (1)")))
    threads.append(threading.Thread(target=run, args=("select", roomy, "SELECT 1")))
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.6 if i == 0 else 0.3)  # scan0 holds the engine; scan1 and scan2 queue before the writer
    for t in threads:
        t.join(60)
    order = [name for name, _, _ in done]
    assert len(order) == 5 and order[0] == "scan0" and set(order[1:3]) == {"insert", "select"}, done
    assert order[3:] == ["scan1", "scan2"], done  # the analysts keep their own order
    assert all(status == 200 for name, status, _ in done if name in ("insert", "select")), done
    assert all((status, code) == (500, "159") for name, status, code in done if name.startswith("scan")), done
    assert rows(roomy, "SELECT count() FROM default.ingest") == b"1\n"


# ---------------------------------------------------------------- the inflated-body budget (issue 40, point 3)


def _status_kib(pid: int, field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert m
    return int(m.group(1))


@pytest.mark.slow
def test_inflated_bodies_waiting_for_the_engine_stay_within_the_byte_budget(tmp_path):
    """Bombs queued behind a slow statement hold at most the budget, inflated; the rest wait or get 503.
    Each bomb is a 48 MiB statement from a few KiB: the engine refuses it (too long) once its turn comes."""
    budget, cap, each = 128 << 20, 64 << 20, 48 << 20
    log = tmp_path / "front.log"
    args = ["--max-decompressed-bytes", str(cap), "--max-inflated-bytes", str(budget), "--queue-timeout-s", "20"]
    proc, dsn = chserver.spawn(tmp_path / "ch", log=log, extra_args=args + ["--analyst-max-execution-time-s", "4"])
    try:
        bomb = gzip.compress(b"SELECT 1" + b" " * (each - 8), 6)
        assert len(bomb) < 1 << 20
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # resets the front's peak resident set (VmHWM)
        before = _status_kib(proc.pid, "VmRSS")
        slow = threading.Thread(target=request, args=(analyst(dsn), SCAN), kwargs={"user": chserver.ANALYST})
        slow.start()  # holds the engine for 4 s
        time.sleep(0.5)
        got: list[tuple[int, str | None, bytes]] = []

        def send() -> None:
            got.append(request(dsn, "", body=bomb, headers={"Content-Encoding": "gzip"}, timeout=90))

        bombs = [threading.Thread(target=send) for _ in range(12)]
        for t in bombs:
            t.start()
        for t in bombs + [slow]:
            t.join(90)
        grew = (_status_kib(proc.pid, "VmHWM") - before) << 10
        assert len(got) == 12 and {(s, c) for s, c, _ in got} <= {(400, "62"), (503, "202")}, got
        assert any(b"Max query size exceeded" in out for _, _, out in got)  # the engine's turn came: refused
        # all 12 inflated at once would be 576 MiB; the budget holds 128 MiB of them (plus the allocator's slack)
        assert grew < budget + 2 * cap, grew >> 20
        # every reservation came back: a body needing the whole per-body cap still finds room at once
        status, code, out = request(dsn, "", body=gzip.compress(b"SELECT 7"), headers={"Content-Encoding": "gzip"})
        assert (status, out) == (200, b"7\n"), (code, out)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    m = re.search(rb"held at most (\d+) bytes at once \(of (\d+)\)", log.read_bytes())
    assert m and int(m.group(2)) == budget and each <= int(m.group(1)) <= budget, log.read_bytes()[-500:]


def test_the_byte_budget_waits_bounded_and_always_balances():
    """A reservation that does not fit waits at most its timeout; releases wake the waiters."""
    b = chserver.ByteBudget(100)
    assert b.reserve(60, 1) and not b.reserve(60, 0.2) and b.held == 60
    t = threading.Timer(0.2, b.release, args=(60,))
    t.start()
    assert b.reserve(100, 10)  # woken by the release
    t.join()
    b.release(100)
    assert (b.held, b.peak) == (0, 100)
