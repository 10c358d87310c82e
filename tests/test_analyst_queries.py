"""Analysts can start in five minutes: on a finished main job (A/B mode, both reward versions, a client that
sent a few malformed events), every SQL block of monitors/ANALYST_QUERIES.md returns rows when the read-only
analyst runs it through the embedded ClickHouse front; the steps of its "Connect" section work as written
(`rtrl clickhouse serve`, curl, clickhouse-connect, rtrl's DSN, chdb and its one-process rule); and
examples/analyst.py prints its tables and writes its PNG, through the front and with chdb.
(The same blocks on synthetic rows, with figures checked: tests/test_monitors.py.)"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_loop import USERS_IN_BOTH_ARMS, _dump, _small_loop
from tests.test_monitors import analyst_queries

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # one small main job (~1-3 min on 2 cores)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "monitors" / "ANALYST_QUERIES.md"
EXAMPLE = ROOT / "examples" / "analyst.py"
#: what a misbehaving client sends to rtrl.events while the loop runs: the reward flow dead-letters each by kind
JUNK = {
    "malformed": b"{not json",
    "unknown_type": b'{"type": "teleport", "event_id": "junk-2"}',
    "invalid": b'{"type": "tool_call", "event_id": "junk-3", "trajectory_id": "junk"}',
}
#: the port the documentation uses; the tests substitute a free one
DOC_PORT = "8123"


def _env(**extra: str) -> dict[str, str]:
    """This environment without rtrl's settings, ``rtrl`` on PATH (the virtualenv's), unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env | {"PYTHONUNBUFFERED": "1"} | extra


def _connect_section() -> str:
    text = DOC.read_text()
    return text.split("\n## Connect\n", 1)[1].split("\n## ", 1)[0]


def _blocks(language: str) -> list[str]:
    """The ```language blocks of the Connect section, in order."""
    return re.findall(rf"```{language}\n(.*?)```", _connect_section(), flags=re.S)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """A folder holding a finished small main job in ``.rtrl`` (the default data folder when run from it):
    A/B mode, rewards v2 and v1-discard-broken, per-org adapters, and the JUNK events produced once the job had
    started."""
    from confluent_kafka import Producer

    from rtrl.kafka import producer_config

    root = tmp_path_factory.mktemp("analyst")
    env = _env(
        **_small_loop(root / ".rtrl"),
        RTRL_LOOP__AB_SHARE="0.4",
        RTRL_LOOP__AB_TRAJECTORIES="60",
        RTRL_LOOP__SOLVE_TOLERANCE="1.0",
        RTRL_REWARDS__VERSIONS="v2,v1-discard-broken",
        RTRL_LOOP__SPECIALISED_ORGS="2",  # with per-org adapters for two orgs (issue 17)
        RTRL_ADAPTERS__ORGS="org-1,org-2",
        RTRL_ADAPTERS__MIN_SAMPLES="16",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "run"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, bootstrap, sent = [], None, False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if bootstrap is None and (m := re.match(r"broker (\S+) ·", line)):
                bootstrap = m[1]
            if not sent and bootstrap and line.startswith("v0 (warm start)"):  # topics exist, flows start now
                producer = Producer(producer_config(bootstrap))
                for kind, payload in JUNK.items():
                    producer.produce("rtrl.events", value=payload, key=kind.encode())
                assert producer.flush(30) == 0, "the junk events were not delivered"
                sent = True
        assert proc.wait(60) == 0, "".join(out)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert sent, "".join(out)[-4000:]
    return root


class Front:
    """`rtrl clickhouse serve --port P` as the documentation runs it (through bash, from the run's folder)."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, _free_port(), None
        self.lines: list[str] = []

    def start(self) -> Front:
        if self.proc is not None:
            return self
        serve = next(b for b in _blocks("bash") if "rtrl clickhouse serve" in b).strip()
        assert serve == f"rtrl clickhouse serve --port {DOC_PORT}"
        self.proc = subprocess.Popen(
            ["bash", "-c", "exec " + serve.replace(DOC_PORT, self.port)],
            cwd=self.root,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        self.lines = []
        for line in self.proc.stdout:  # the two lines come once it serves (or the error, then EOF)
            self.lines.append(line)
            if line.startswith("read-only analysts: "):
                break
        assert self.lines and self.lines[-1].startswith("read-only analysts: "), "".join(self.lines)
        return self

    @property
    def analyst_dsn(self) -> str:
        return self.lines[-1].split(": ", 1)[1].strip()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
            self.proc = None


@pytest.fixture(scope="module")
def front_handle(run_root):
    front = Front(run_root)
    yield front
    front.stop()


@pytest.fixture
def front(front_handle) -> Front:
    return front_handle.start()


def _python(code: str, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def test_every_documented_query_returns_rows_as_the_analyst(front):
    """Each ```sql block of ANALYST_QUERIES.md, as pasted, returns at least one row on the finished run when
    rtrl_analyst runs it through the front; the run holds what the blocks are about (arms, both reward
    versions, every junk kind dead-lettered), and the arms' Wilson intervals equal Python's."""
    from rtrl.clickhouse import connect

    client = connect(front.analyst_dsn)
    queries = analyst_queries()
    assert len(queries) >= 13
    empty, failed, results = [], [], {}
    for title, sql in queries.items():
        try:
            res = client.query(sql)
        except Exception as e:  # every block is tried; the failure names its heading
            failed.append(f"{title}: {str(e).splitlines()[0][:300]}")
            continue
        results[title] = [dict(zip(res.column_names, r)) for r in res.result_rows]
        if not res.result_rows:
            empty.append(title)
    assert not failed, "blocks that failed as the analyst: " + "; ".join(failed)
    assert not empty, f"blocks that returned no row on a finished run: {empty}"

    dead = {r["kind"] for r in results["Dead letters by kind"] if r["source"] == "rtrl.events"}
    assert set(JUNK) <= dead, dead
    arms = results["Behaviour of each arm with 95% intervals"]
    # the A/B mode's arms, and the final A/B's (v0 against the final version) the main job ends with
    assert {"control", "candidate"} <= {r["arm"] for r in arms} <= {"control", "candidate", "ab-v0", "ab-final"}
    z = 1.96
    for r in arms:
        n, p = r["trajectories"], r["hits"] / r["trajectories"]
        centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        assert (r["ci_low"], r["ci_high"]) == pytest.approx(
            ((centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)), rel=1e-9
        )
        assert r["ci_low"] <= r["rate"] <= r["ci_high"]
    gate = results["Gate decisions and eval results per checkpoint"]
    assert [r["version"] for r in gate] == [0, 1, 2] and all(r["solve_rate"] is not None for r in gate)
    assert results["Two reward versions side by side"][0]["trajectories_v1"] > 0


def test_connect_steps_work_as_written(front):
    """The front prints both DSNs with the token files the section names (owner-only); the curl line
    (basic auth), the same with X-ClickHouse-User/Key headers, and both Python snippets work from the run's
    folder with the documented port swapped for a free one."""
    auth = front.root / ".rtrl" / "clickhouse" / "rtrl-auth"
    writer, analyst = front.lines[-2:]
    assert writer.startswith("serving ") and f"http://rtrl_writer@127.0.0.1:{front.port}/?password_file=" in writer
    assert front.analyst_dsn == (
        f"http://rtrl_analyst@127.0.0.1:{front.port}/?password_file={(auth / 'rtrl_analyst.token').resolve()}"
    )
    token = auth / "rtrl_analyst.token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(auth.stat().st_mode) == 0o700

    curl = next(b for b in _blocks("bash") if b.lstrip().startswith("curl"))
    proc = subprocess.run(
        ["bash", "-c", curl.replace(DOC_PORT, front.port)],
        cwd=front.root,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "version" in proc.stdout and "promoted" in proc.stdout and "│" in proc.stdout  # PrettyCompact

    headers = subprocess.run(
        ["curl", "-sS", "--fail-with-body", "-H", "X-ClickHouse-User: rtrl_analyst"]
        + ["-H", f"X-ClickHouse-Key: {token.read_text().strip()}"]
        + [f"http://127.0.0.1:{front.port}/", "--data-binary", "SELECT count() FROM rtrl.checkpoints FINAL"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert headers.returncode == 0 and headers.stdout.strip() == "3", headers.stdout + headers.stderr

    snippets = [b for b in _blocks("python") if "8123" in b]
    assert len(snippets) == 2  # clickhouse-connect, rtrl's DSN
    for code in snippets:
        proc = _python(code.replace(DOC_PORT, front.port), front.root)
        assert proc.returncode == 0 and proc.stdout.strip(), code + proc.stdout + proc.stderr[-2000:]
    assert "promoted" in _python(snippets[0].replace(DOC_PORT, front.port), front.root).stdout


def _check_example_output(proc: subprocess.CompletedProcess, printed: str, png: Path) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for title in (
        "Checkpoints and gate decisions",
        "A/B arms: share of trajectories, 95% Wilson interval",
        "Candidate minus control arm",
        "Dead letters by kind",
    ):
        assert title in out, out
    assert re.search(r"│\s+v1 ← v0 │", out) and re.search(r"│\s+v\d │\s+candidate │", out)
    assert all(kind in out for kind in JUNK)
    assert max(len(line) for line in out.splitlines()) <= 100
    assert f"plot: {printed}" in out.replace("\n", "")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_example_script_through_the_front(front, tmp_path):
    """examples/analyst.py with the front's analyst DSN prints its four tables within 100 columns and writes
    the PNG where --out says."""
    png = tmp_path / "analyst.png"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--dsn", front.analyst_dsn, "--out", str(png)],
        cwd=front.root,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    _check_example_output(proc, str(png), png)


def test_chdb_steps_and_example_on_the_folder(front_handle):
    """While the front holds the folder, the chdb snippet fails with the lock message the section quotes;
    once it stopped, the snippet reads the run, and examples/analyst.py on its defaults (.rtrl/clickhouse
    with chdb) prints the tables and writes .rtrl/reports/analyst.png."""
    root = front_handle.root
    chdb_snippet = next(b for b in _blocks("python") if "chdb.session" in b)
    front_handle.start()
    held = _python(chdb_snippet, root)
    assert held.returncode != 0
    assert "Another server instance in same directory is already running" in held.stdout + held.stderr
    front_handle.stop()

    proc = _python(chdb_snippet, root)
    assert proc.returncode == 0 and "promoted" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=root, env=_env(), capture_output=True, text=True, timeout=300
    )
    _check_example_output(proc, ".rtrl/reports/analyst.png", root / ".rtrl" / "reports" / "analyst.png")


def test_ab_mode_serves_candidates_beside_control_and_decides_from_clickhouse(front_handle):
    """With loop.ab_share a candidate that passed the evals serves a share of the traffic (arm 'candidate')
    until ClickHouse holds enough of its trajectories; the monitors' comparison with the serving version then
    promotes it or rejects it with the alerts as the reason. (On this module's run: its A/B settings are the
    A/B test's own, beside both reward versions, per-org adapters and the junk events.)"""
    front_handle.stop()  # chdb reads the folder: one process at a time
    data = front_handle.root / ".rtrl"
    d = _dump(data)
    arms = {(v, a): n for v, a, n in d["arms"]}
    decided = [(v, s, r) for v, _, s, r, _ in d["checkpoints"][1:] if "A/B" in r]
    assert decided, d["checkpoints"]
    for version, status, reason in decided:
        assert arms.get((version, "candidate"), 0) >= 60  # it served beside the control arm
        assert (
            ("A/B on" in reason)
            if status == "promoted"
            else ("A/B alarm" in reason or "only" in reason or "too few users" in reason)
        )
    assert all(a in ("control", "candidate", "ab-v0", "ab-final") for _, a in arms), arms  # (the final A/B's)
    # randomised by user: while a candidate served, no user saw both arms (the analysis also drops any user it
    # finds in both, e.g. served before the policy server switched)
    proc = _python(USERS_IN_BOTH_ARMS, data, f"chdb://{data}/clickhouse")
    assert proc.returncode == 0, proc.stderr
    both, users = json.loads(proc.stdout.strip().splitlines()[-1])
    assert users > 0 and both == 0
