"""Analysts can start in five minutes: on a finished main job (A/B mode, both reward versions, a client that
sent a few malformed events), every SQL block of monitors/ANALYST_QUERIES.md returns rows when the read-only
analyst runs it through the embedded ClickHouse front; the steps of its "Connect" section work as written
(`rtrl clickhouse serve`, curl, clickhouse-connect, rtrl's DSN, chdb and its one-process rule); and
examples/analyst.py prints its tables and writes its PNG, through the front and with chdb.
(The same blocks on synthetic rows, with figures checked: tests/test_monitors.py.) The same run (with per-org
adapters), once every read-only test is done, holds the per-org adapters' main-job checks and an adapter rollback,
then one user's erasure (the last two tests, in this order: each changes the run's data)."""

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
from tests.test_per_org import ADAPTER_DUMP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # one small main job (~3-4 min on 2 cores)

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
    A/B mode, rewards v2 and v1-discard-broken, per-org adapters (``adapters.shared_traffic = "served"``, the
    default), an org of each data-use class (org-2 adapter_only, org-3 monitor_only, org-4 none; org-0 and org-1
    train), and the JUNK events produced once the job had started; its output in ``run.out``.

    Three cycles, not two: the shared policy trains through a serving adapter only on samples that adapter served
    (app.adapters.ServedThrough), and an adapter is first promoted in the adapter cycle that follows a cycle's base
    decision, while the policy server has already served most of the next cycle's quota (``samples_per_cycle`` per
    base decision, simulator.serve.PolicyServer.may_serve) with the base alone: the next cycle's trainer met an
    adapter's samples only if the one-task trickle after the quota reached it in time, which it did not under CPU
    load (the analyst query "The shared policy trained through the serving adapters" came back empty). An adapter
    promoted after cycle 1 on base B then serves, before cycle 3 trains, at full rate: in cycle 2's A/B phase
    (the control arm is B with the orgs' adapters, no quota while a candidate waits), or, cycle 2 refused before
    any A/B, in the quota after that refusal (B still serves, so its adapters do); cycle 3's trainer reads those
    batches (within train.max_delayed_lag of any new base, and every promoted adapter version within it is loaded).
    ``adapters.updates_per_step = 1`` keeps the third cycle's cost down (the adapter cycles after an A/B phase
    train tens of steps; 4 updates each took over a minute); the adapters' gate, routing and announcements are
    the same."""
    from confluent_kafka import Producer

    from rtrl.kafka import producer_config

    root = tmp_path_factory.mktemp("analyst")
    env = _env(
        **_small_loop(root / ".rtrl")
        | {"RTRL_LOOP__CYCLES": "3"},  # a cycle trains what the adapters promoted after cycle 1 served (see above)
        RTRL_LOOP__AB_SHARE="0.4",
        RTRL_LOOP__AB_TRAJECTORIES="60",
        RTRL_LOOP__SOLVE_TOLERANCE="1.0",
        RTRL_REWARDS__VERSIONS="v2,v1-discard-broken",
        RTRL_LOOP__SPECIALISED_ORGS="2",  # with per-org adapters for two orgs (issue 17)
        RTRL_ADAPTERS__ORGS="org-1,org-2",
        RTRL_ADAPTERS__MIN_SAMPLES="16",
        RTRL_ADAPTERS__UPDATES_PER_STEP="1",
        RTRL_LOOP__ORGS="5",  # and an org of each data-use class (issue 38): org-0 and org-1 train
        RTRL_GOVERNANCE__ORGS=json.dumps({"org-2": "adapter_only", "org-3": "monitor_only", "org-4": "none"}),
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
        (root / "run.out").write_text("".join(out))
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
    assert [r["version"] for r in gate] == [0, 1, 2, 3] and all(r["solve_rate"] is not None for r in gate)
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
    assert headers.returncode == 0 and headers.stdout.strip() == "4", headers.stdout + headers.stderr

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


#: ADAPTER_DUMP, then the shared policy's decisions (one process: each start of chdb costs seconds)
SHARED_DECISIONS = """
print(json.dumps(ch.query("SELECT version, parent, status, reason FROM rtrl.checkpoints FINAL ORDER BY version")
                 .result_rows))
"""


def _adapter_dump(data: Path) -> dict:
    """ADAPTER_DUMP's figures, and the shared policy's decisions under "shared"."""
    proc = _python(ADAPTER_DUMP + SHARED_DECISIONS, data, f"chdb://{data}/clickhouse")
    assert proc.returncode == 0, proc.stderr[-3000:]
    *_, adapters, shared = proc.stdout.strip().splitlines()
    return json.loads(adapters) | {"shared": json.loads(shared)}


def _rtrl(data: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=data.parent,
        env=_env(RTRL_DATA_DIR=str(data)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_no_trained_sample_is_one_its_data_use_class_forbids(front):
    """Issue 38, end to end on this module's run, as the analyst: joining every trained sample id to its
    trajectory shows none the governance forbids (the shared policy trained train samples only, org-2's adapter
    its adapter_only ones). org-3's trajectories are monitored (summaries, rewards) and kept from training, each
    counted by reason; org-4's (none) left nothing at all."""
    from rtrl.clickhouse import connect

    queries = analyst_queries()
    client = connect(front.analyst_dsn)

    def rows(title: str) -> list[dict]:
        res = client.query(queries[title])
        return [dict(zip(res.column_names, r)) for r in res.result_rows]

    trained = rows("Trained samples by data-use class")
    assert trained and all(r["allowed"] for r in trained), trained
    shared = {(r["org_id"], r["data_use"]) for r in trained if r["trained_into"] == "shared policy"}
    assert shared <= {("org-0", "train"), ("org-1", "train")} and shared, trained
    assert not {r["org_id"] for r in trained} & {"org-3", "org-4"}
    assert any(r["trained_into"] == "adapter of org-2" and r["data_use"] == "adapter_only" for r in trained), trained
    kept = rows("Samples kept from training by data use")
    assert {r["reason"] for r in kept} == {"data_use:monitor_only"} and {r["cohort"][:6] for r in kept} == {"org-3/"}
    by_org = dict(
        client.query("SELECT org_id, groupUniqArray(data_use) FROM rtrl.trajectories FINAL GROUP BY org_id").result_rows
    )
    assert by_org["org-3"] == ["monitor_only"] and by_org["org-2"] == ["adapter_only"] and "org-4" not in by_org
    monitored = client.query(
        "SELECT uniqExact(trajectory_id) FROM rtrl.rewards WHERE org_id = 'org-3' AND reward_version = 'v2'"
    ).result_rows[0][0]
    # each monitored trajectory the batch flow read is counted once (the last rewards may come after it stopped)
    assert 0 < sum(r["trajectories"] for r in kept) <= monitored


def test_the_main_job_trains_gates_and_serves_each_orgs_adapter_and_rolls_one_back(front_handle):
    """On this module's run (two specialised orgs given adapters, the shared policy trained on all traffic through
    the adapter that served each sample: ``adapters.shared_traffic = "served"``, the default): each org's adapter
    trains on that org's stream only (every sample id in its train_metrics rows is a trajectory of that org), is
    gated on the org's held-out tasks plus the global guard and announced with (org, adapter version, base version)
    and its checkpoint in adapter_checkpoints, never in the shared policy's checkpoints; after a base promotion each
    serving adapter is re-validated on the new base (a new version whose parent is the old one); the shared
    policy's runs train no adapter. The report has the per-org table and PNG. `rtrl rollback N --org` then rolls
    back one org's serving adapter and leaves the other org's and the shared policy's decisions as they were;
    rolling it back again is refused (not promoted). Next to last in this module: the rollback changes the run's
    data.

    (Moved here from tests/test_per_org.py, which ran a main job of its own under ``shared_traffic = "all"``; that
    mode's routing - every adapted org's batches to its adapter and a copy to the shared stream, an org's samples
    only ever in its own adapter's batches - stays covered by tests/test_per_org.py::
    test_an_orgs_samples_only_ever_reach_its_own_adapter.)"""
    front_handle.stop()  # chdb and the rollback's writes: one process at a time
    root = front_handle.root
    data = root / ".rtrl"
    out = (root / "run.out").read_text()
    assert "Per-org adapters" in out and (data / "reports" / "adapters.png").read_bytes()[:4] == b"\x89PNG"

    d = _adapter_dump(data)
    cks = d["checkpoints"]
    assert d["shared_with_org"] == 0  # adapter decisions never land in the shared policy's table
    for org in ("org-1", "org-2"):
        mine = [c for c in cks if c[0] == org]
        assert mine and all(c[4] in ("promoted", "rejected", "rolled_back") for c in mine), mine
        assert all(c[3] is not None and c[6] for c in mine)  # a base version and an adapter checkpoint each
        assert {"solve_rate", "base_solve_rate", "guard_solve_rate", "eval_samples"} <= set(mine[0][7])
    revalidated = [c for c in cks if "re-validated on base" in c[5] or "refused on base" in c[5]]
    assert revalidated and all(c[2] is not None for c in revalidated), cks  # each has the version it re-judges
    trained = [s for s in d["steps"] if s[0]]
    assert {s[0] for s in trained} <= {"org-1", "org-2"} and trained
    for adapter, _run_id, ids in trained:
        assert ids and {d["orgs"][i] for i in ids} == {adapter}  # an org's adapter trains its org's samples only
    assert all(not s[0] for s in d["steps"] if s[1].startswith("loop-0-v"))  # the shared runs: no adapter

    # one org's newest promoted adapter rolled back (org-1's when it has one); the other org's are untouched
    promoted = {org: [c for c in cks if c[0] == org and c[4] == "promoted"] for org in ("org-1", "org-2")}
    org = "org-1" if promoted["org-1"] else "org-2"
    other = "org-2" if org == "org-1" else "org-1"
    assert promoted[org], cks
    version = promoted[org][-1][1]
    back = _rtrl(data, "rollback", str(version), "--org", org, "--reason", "test")
    assert back.returncode == 0, back.stdout + back.stderr
    d_after = _adapter_dump(data)
    after = {(c[0], c[1]): c for c in d_after["checkpoints"]}
    assert after[(org, version)][4] == "rolled_back" and after[(org, version)][5] == "test"
    assert all(after[(c[0], c[1])][4] == c[4] for c in cks if c[0] == other)  # the other org is untouched
    assert d_after["shared"] == d["shared"] and len(d["shared"]) == 4  # and so are the shared policy's decisions
    again = _rtrl(data, "rollback", str(version), "--org", org)
    assert again.returncode != 0 and "not promoted" in again.stdout + again.stderr


#: one user's data in every store of the run, the other rows' checksums, and the lineage from the run's own records
#: (argv: the chdb DSN; the user's hash, or '' to pick the user whose samples the most training runs saw; the archive;
#: the user's trajectory ids as JSON, or [] to find them)
ERASURE_DUMP = """
import json, re, sys
from collections import defaultdict
from flows.sinks import read_archive
from rtrl import clickhouse

ch = clickhouse.connect(sys.argv[1])
q = lambda sql: ch.query(sql).result_rows
h = sys.argv[2] or q(
    "SELECT t.user_hash FROM (SELECT arrayJoin(sample_ids) AS tid, run_id FROM rtrl.train_metrics FINAL) AS s "
    "INNER JOIN (SELECT trajectory_id, any(user_hash) AS user_hash FROM rtrl.trajectories FINAL GROUP BY trajectory_id)"
    " AS t ON s.tid = t.trajectory_id GROUP BY t.user_hash ORDER BY uniqExact(s.run_id) DESC, t.user_hash LIMIT 1"
)[0][0]
ids = json.loads(sys.argv[4]) or sorted(r[0] for r in q(
    f"SELECT trajectory_id FROM rtrl.events WHERE user_hash = '{h}' "
    f"UNION DISTINCT SELECT trajectory_id FROM rtrl.trajectories WHERE user_hash = '{h}'"
))
arr = "[" + ",".join("'" + i + "'" for i in ids) + "]"
columns = defaultdict(set)
for table, column in q("SELECT table, name FROM system.columns WHERE database = 'rtrl'"):
    columns[table].add(column)
stats = {}
for table, engine in q("SELECT name, engine FROM system.tables WHERE database = 'rtrl' AND engine LIKE '%MergeTree'"):
    c = columns[table]
    if table in ("erasures", "erased_trajectories"):
        continue
    mine = ([f"user_hash = '{h}'"] if "user_hash" in c else []) + (
        [f"trajectory_id IN {arr}"] if "trajectory_id" in c else []) + (
        [f"hasAny(sample_ids, {arr})"] if "sample_ids" in c else []) + (
        [f"key IN {arr}", f"position(payload, '{h}') > 0"] if table == "dead_letters" else [])
    if not mine:
        continue
    cond, final = " OR ".join(f"({m})" for m in mine), "" if engine == "MergeTree" else " FINAL"
    if "sample_ids" in c:  # rows stay: other users' samples in them
        row = q(f"SELECT count(), countIf({cond}), sum(arrayCount(x -> has({arr}, x), sample_ids)), "
                f"sum(arrayCount(x -> NOT has({arr}, x) AND x != 'erased', sample_ids)), "
                f"sum(arrayCount(x -> x = 'erased', sample_ids)) FROM rtrl.{table}{final}")[0]
        stats[table] = {"rows": row[0], "mine": row[1], "my_samples": row[2], "others": row[3], "erased": row[4]}
    else:
        row = q(f"SELECT count(), countIf({cond}), toString(sumIf(cityHash64(*), NOT ({cond}))) "
                f"FROM rtrl.{table}{final}")[0]
        stats[table] = {"rows": row[0], "mine": row[1], "others": row[2]}
archive = read_archive(sys.argv[3]).column("user_hash").to_pylist()
runs = sorted(r[0] for r in q(f"SELECT DISTINCT run_id FROM rtrl.train_metrics FINAL WHERE hasAny(sample_ids, {arr})"))
shared = {int(v): p for v, p in q("SELECT version, any(parent) FROM rtrl.checkpoints GROUP BY version")}
adapters = {(o, int(v)): (p, b) for o, v, p, b in
            q("SELECT org, version, any(parent), any(base_version) FROM rtrl.adapter_checkpoints GROUP BY org, version")}
seen = {int(m[1]) for r in runs if (m := re.fullmatch(r"loop-\\d+-v(\\d+)", r))}
seen_adapters = {(m[1], int(m[2])) for r in runs if (m := re.fullmatch(r"loop-\\d+-(.+)-a(\\d+)", r))}
while grown := {v for v, p in shared.items() if p in seen} - seen:  # and every version trained from one of those
    seen |= grown
seen_adapters |= {k for k, (_, base) in adapters.items() if base in seen}
while grown := {(o, v) for (o, v), (p, _) in adapters.items() if (o, p) in seen_adapters} - seen_adapters:
    seen_adapters |= grown
lineage = [f"v{v}" for v in sorted(seen)] + [f"{o}/a{v}" for o, v in sorted(seen_adapters)]
audit = sorted(r[0] for r in q(f"SELECT status FROM rtrl.erasures WHERE subject = '{h}'"))
denied = q(f"SELECT uniqExact(trajectory_id) FROM rtrl.erased_trajectories WHERE trajectory_id IN {arr}")[0][0]
print(json.dumps({"hash": h, "ids": ids, "stats": stats, "archive": [len(archive), archive.count(h)],
                  "runs": runs, "lineage": lineage, "audit": audit, "denied": denied}))
"""


def _erasure_dump(data: Path, user_hash: str = "", ids: list[str] | None = None) -> dict:
    archive = str(data / "archive" / "events")
    proc = _python(ERASURE_DUMP, data, f"chdb://{data}/clickhouse", user_hash, archive, json.dumps(ids or []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_erasing_a_trained_user_reaches_every_store_and_names_the_checkpoints_that_saw_them(front_handle):
    """Issue 38, point 3, on this module's finished main job: `rtrl erase --user-hash H` for the user whose samples
    the most training runs saw. The dry run changes nothing. The erasure leaves none of the user's rows in any
    table and none of their events in the archive, and every other row as it was: counts and checksums, and every
    other sample in the micro-batches and training steps. It names exactly the checkpoints and adapter versions
    that the run's own training records and parent links say saw the user. The audit holds a started and a done
    row, and the deny list holds the user's trajectories. Last in this module: the erasure changes the run's data."""
    front_handle.stop()  # chdb: one process at a time
    data = front_handle.root / ".rtrl"
    before = _erasure_dump(data)
    h, stats = before["hash"], before["stats"]
    assert before["ids"] and before["runs"] and before["lineage"], before  # a trained run saw the user's samples
    assert stats["events"]["mine"] > 0 and stats["train_metrics"]["my_samples"] > 0 and before["archive"][1] > 0
    erase = [sys.executable, "-m", "app.cli", "erase", "--user-hash", h]
    env = _env(RTRL_DATA_DIR=str(data), RTRL_GOVERNANCE__DENY_REFRESH_S="1")

    def rtrl(*extra: str) -> str:
        proc = subprocess.run(
            erase + list(extra), cwd=data.parent, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return " ".join(proc.stdout.split()) + " "  # as one line: the console wraps long ones

    named = f"checkpoints whose training saw the subject's samples: {', '.join(before['lineage'])} "
    dry = rtrl("--dry-run")
    assert named in dry and f"would erase: user {h}" in dry
    assert _erasure_dump(data, h, before["ids"]) == before  # the dry run changed nothing
    done = rtrl()
    assert named in done and f"erased: user {h}" in done
    after = _erasure_dump(data, h, before["ids"])  # the user's trajectories, as they were before
    for table, s in stats.items():
        a = after["stats"][table]
        assert a["mine"] == 0, (table, a)
        if "my_samples" in s:  # the rows stay, with every other user's samples
            assert a["rows"] == s["rows"] and a["my_samples"] == 0 and a["others"] == s["others"], (table, s, a)
            if table == "batches":  # the user's samples are marked, their tokens zeroed
                assert a["erased"] == s["erased"] + s["my_samples"], (s, a)
        else:
            assert a["rows"] == s["rows"] - s["mine"] and a["others"] == s["others"], (table, s, a)
    assert after["archive"] == [before["archive"][0] - before["archive"][1], 0]
    assert after["audit"] == ["done", "started"] and after["denied"] == len(before["ids"])
    assert not after["runs"] and after["lineage"] == []  # no training record names the user's samples any more
