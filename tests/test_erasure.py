"""Erasure of a user or an organisation (issue 38, point 3): `rtrl erase` on the real broker, engine and archive.

The world: the simulator's traffic of three organisations through the real reward flow, into ClickHouse (served
by the embedded front, as separate processes share it) and the Parquet archive. The training records that name
the trajectories' samples (micro-batches, optimizer steps, checkpoints and adapter versions) are added as the
trainer writes them. The tests run in order on that one world, each erasing another subject.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from bytewax.testing import run_main
from confluent_kafka import Producer

from app.erasure import STORES, Plan, erase, subject_from
from client.hashing import hash_user
from devservices.broker import free_port
from devservices.chserver import spawn
from flows.backfill import backfill
from flows.batch_flow import _parser
from flows.counts import FlowCounts
from flows.processor import Message, RewardProcessor
from flows.reward_flow import build_flow
from flows.sinks import read_archive
from flows.windowing import WindowConfig
from rtrl import clickhouse
from rtrl.errors import ConfigError, ServiceUnavailable
from rtrl.kafka import ensure_topics, producer_config, read_topic
from rtrl.settings import load_settings
from schemas.codec import JsonCodec, encode_batch
from schemas.erasure import DenyList, erasure_id
from schemas.records import DeadLetter, MicroBatch, Reward
from tests.test_reward_flow import SALT, _payloads, _produce, _services_env
from trainer.data import BatchStream

ROOT = Path(__file__).resolve().parent.parent
DB = "rtrl"


class World:
    def __init__(self, root: Path, env: dict[str, str], client, proc):
        self.root, self.env, self.client, self.proc = root, env, client, proc

    @property
    def settings(self):
        return load_settings(env=self.env)

    def q(self, sql: str) -> list:
        return self.client.query(sql.format(db=DB)).result_rows

    def trajectories(self, where: str) -> list[str]:
        return sorted(r[0] for r in self.q(f"SELECT DISTINCT trajectory_id FROM {{db}}.events WHERE {where}"))

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "app.cli", *args],
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _batch(batch_id: str, rows: list[list[tuple[str, list[int]]]], seq_len: int = 8) -> MicroBatch:
    """A micro-batch packing ``rows`` of (sample id, tokens) as the batch flow packs them."""
    ids = [sid for row in rows for sid, _ in row]
    tokens, segments = [], []
    for row in rows:
        t, g = [], []
        for sid, toks in row:
            t += toks
            g += [ids.index(sid)] * len(toks)
        tokens.append(t + [0] * (seq_len - len(t)))
        segments.append(g + [-1] * (seq_len - len(g)))
    mask = [[1 if s >= 0 else 0 for s in row] for row in segments]
    floats = [[0.5 if s >= 0 else 0.0 for s in row] for row in segments]
    return MicroBatch(
        batch_id=batch_id, created_at=int(time.time() * 1000), seq_len=seq_len, token_ids=tokens, loss_mask=mask,
        advantages=floats, behaviour_logprobs=floats, segment_ids=segments, sample_ids=ids,
        policy_versions=[1] * len(ids),
    )  # fmt: skip


@pytest.fixture(scope="module")
def world(broker, tmp_path_factory):
    root = tmp_path_factory.mktemp("erasure")
    proc, dsn = spawn(root / "clickhouse", log=root / "front.log")
    prefix = f"erase{uuid.uuid4().hex[:8]}."
    ensure_topics(broker.bootstrap, prefix, 2)
    env = _services_env(broker, prefix, dsn, DB, root / "data") | {
        "RTRL_SDK__SALT": SALT,
        "RTRL_REWARDS__VERSIONS": "v2",
        "RTRL_GOVERNANCE__DENY_REFRESH_S": "0.2",
    }
    _produce(broker.bootstrap, prefix + "events", _payloads(90, seed=37, orgs=3, users_per_org=3))
    try:
        w = World(root, env, clickhouse.connect(dsn, 10), proc)
        run_main(build_flow(w.settings))
        shutil.copytree(w.settings.archive_root, root / "archive-backup")  # a backup taken before any erasure
        _training_records(w)
        yield w
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _training_records(w: World) -> None:
    """What the batch flow and trainer write about the samples: two micro-batches, the optimizer steps of two
    cycles and of an adapter version, and the checkpoints they made (v1 and v2 from v0 and v1, v3 from v2; the
    org-00 adapter's a2 from a1)."""
    a = w.trajectories(f"user_hash = '{hash_user('user-00-000', SALT)}'")
    other = w.trajectories("org_id = 'org-01'")
    assert len(a) >= 2 and len(other) >= 3, (a, other)
    clickhouse.insert(
        w.client,
        DB,
        "batches",
        [
            _batch("b-mixed", [[(a[0], [5, 6, 7]), (other[0], [8, 9])], [(other[1], [3, 4, 4, 4])]]),
            _batch("b-clean", [[(other[2], [1, 2, 3])]]),
        ],
    )
    # dead letters that name a subject only in their payload: one whole, one cut at 4 KiB (no JSON left to parse)
    user = hash_user("user-00-000", SALT)
    clickhouse.insert(
        w.client,
        DB,
        "dead_letters",
        [
            DeadLetter(
                kind="malformed", source="events", partition=0, offset=10**6, key=None, field="$", reason="cut",
                payload=f'{{"user_hash":"{user}","ts":', at=1,
            ),
            DeadLetter(
                kind="malformed", source="events", partition=0, offset=10**6 + 1, key=None, field="$", reason="cut",
                payload='{"type":"tool_call","org_id":"org-02","tr', at=1,
            ),
        ],
    )  # fmt: skip
    now = int(time.time())
    at = lambda s: f"toDateTime64({now - s}, 3, 'UTC')"  # noqa: E731
    w.client.command(
        f"INSERT INTO {DB}.train_metrics (run_id, step, policy_version, sample_ids, at) SELECT * FROM values("
        f"('loop-0-v1', 1, 0, ['{other[0]}'], {at(9)}), ('loop-0-v2', 1, 1, ['{a[0]}', '{other[1]}'], {at(8)}), "
        f"('loop-0-org-00-a1', 1, 1, ['{a[1]}'], {at(7)}))"
    )
    w.client.command(
        f"INSERT INTO {DB}.checkpoints (version, parent, created_at, status, reason, path) SELECT * FROM values("
        f"(0, NULL, {at(10)}, 'promoted', 'warm start', ''), (1, 0, {at(8)}, 'promoted', '', ''), "
        f"(2, 1, {at(7)}, 'promoted', '', ''), (3, 2, {at(6)}, 'rejected', '', ''))"
    )
    w.client.command(
        f"INSERT INTO {DB}.adapter_checkpoints (org, version, parent, created_at, status, reason, path) SELECT * "
        f"FROM values(('org-00', 1, NULL, {at(6)}, 'promoted', '', ''), ('org-00', 2, 1, {at(5)}, 'promoted', '', ''))"
    )


#: per table, the rows that are not the subject's, as (count, checksum): what erasure must leave unchanged
def _others(w: World, trajectories: list[str], named: str) -> dict[str, tuple[int, str]]:
    out = {}
    ids = "[" + ",".join(f"'{t}'" for t in trajectories) + "]"
    for table in ("events", "trajectories", "rewards", "dead_letters", "checkpoints", "adapter_checkpoints"):
        key = "key" if table == "dead_letters" else "trajectory_id"
        where = f"WHERE NOT has({ids}, {key})" if table not in ("checkpoints", "adapter_checkpoints") else ""
        if table == "dead_letters":  # nor one whose payload names the subject
            where += f" AND position(payload, '{named}') = 0"
        rows = w.q(f"SELECT * FROM {{db}}.{table} FINAL {where} ORDER BY tuple(*)")
        out[table] = (len(rows), hashlib.sha256(repr(rows).encode()).hexdigest())
    archive = read_archive(w.settings.archive_root).to_pylist()
    kept = sorted((r for r in archive if r["trajectory_id"] not in trajectories), key=lambda r: r["event_id"])
    out["archive"] = (len(kept), hashlib.sha256(repr(kept).encode()).hexdigest())
    return out


def _left(w: World, plan: Plan) -> dict[str, int]:
    """What each store still holds of a subject."""
    counts = {s: int(w.q(plan.count(s))[0][0] or 0) for s in STORES if s != "archive"}
    column = "user_hash" if plan.s.kind == "user" else "org_id"
    files = Path(w.settings.archive_root).glob("date=*/part-*.parquet")  # every copy a replay wrote
    counts["archive"] = sum(pq.read_table(f).column(column).to_pylist().count(plan.s.value) for f in files)
    return counts


def test_a_dry_run_lists_what_would_go_and_removes_nothing(world):
    """`rtrl erase --user ID --dry-run` prints each store's rows of the user and the checkpoints that trained on
    them, and changes no store: no row, no archive file, no audit row."""
    subject = subject_from(world.settings, "user-00-000", None, None)
    plan = Plan(DB, subject)
    before = _left(world, plan)
    assert before["events"] and before["trajectories"] and before["rewards"] and before["archive"]
    assert before["batches"] == 1 and before["train_metrics"] == 2
    done = world.cli("erase", "--user", "user-00-000", "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"would erase: user {subject.value}" in done.stdout and "user-00-000" not in done.stdout
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in done.stdout.splitlines()
        if line.count("│") == 3
    }
    assert rows["events"] == f"{before['events']:,}" and rows["archive"] == f"{before['archive']:,} events", rows
    assert "v2, v3, org-00/a1, org-00/a2" in done.stdout
    assert _left(world, plan) == before
    assert world.q("SELECT count() FROM {db}.erasures")[0][0] == 0


def test_erasing_a_user_leaves_none_of_their_data_and_changes_nothing_else(world, broker):
    """After `erase` of one user: no table, archive file, Kafka replay or backfill returns any of the user's data;
    every other row and archived event is unchanged (count and checksum); the micro-batch that packed the user's
    sample beside others keeps the others' tokens; the audit row says what went and which checkpoints trained on
    it, under the salted hash and never the raw id."""
    settings = world.settings
    subject = subject_from(settings, "user-00-000", None, None)
    mine = world.trajectories(f"user_hash = '{subject.value}'")
    others = _others(world, mine, subject.value)
    mixed = world.q("SELECT token_ids, sample_ids FROM {db}.batches FINAL WHERE batch_id = 'b-mixed'")[0]

    result = erase(settings, subject, client=world.client)

    plan = Plan(DB, subject)
    assert result.counts["events"] > 0 and result.counts["archive"] > 0
    assert _left(world, plan) == dict.fromkeys(STORES, 0)
    assert world.q(f"SELECT count() FROM {{db}}.events WHERE user_hash = '{subject.value}'")[0][0] == 0
    assert world.q(f"SELECT count() FROM {{db}}.dead_letters WHERE position(payload, '{subject.value}') > 0")[0][0] == 0
    assert world.q(f"SELECT count() FROM {{db}}.rewards WHERE has({mine}, trajectory_id)")[0][0] == 0
    assert _others(world, mine, subject.value) == others
    tokens, ids = world.q("SELECT token_ids, sample_ids FROM {db}.batches FINAL WHERE batch_id = 'b-mixed'")[0]
    assert ids == ["erased", mixed[1][1], mixed[1][2]] and mixed[1][0] in mine
    assert tokens[0][:3] == [0, 0, 0] and tokens[0][3:5] == mixed[0][0][3:5] and tokens[1] == mixed[0][1]
    steps = dict(world.q("SELECT run_id, sample_ids FROM {db}.train_metrics FINAL"))
    assert not set(mine) & {s for ids in steps.values() for s in ids} and len(steps["loop-0-v2"]) == 1
    assert result.lineage == ["v2", "v3", "org-00/a1", "org-00/a2"]
    audit = world.q("SELECT erasure_id, subject_kind, subject, status, lineage FROM {db}.erasures ORDER BY at")
    assert [r[3] for r in audit] == ["started", "done"]
    assert {r[0] for r in audit} == {erasure_id("user", subject.value)} and {r[2] for r in audit} == {subject.value}
    assert "user-00-000" not in repr(world.q("SELECT * FROM {db}.erasures")) and audit[-1][4] == result.lineage

    # a replay of the whole events topic: the flow skips the user's events, stores and rewards none of them
    counts = FlowCounts()
    run_main(build_flow(settings, counts=counts))
    sent = [json.loads(v) for _, v in _payloads(90, seed=37, orgs=3, users_per_org=3)]
    assert counts.snapshot()["erased"] == sum(1 for e in sent if e["user_hash"] == subject.value)
    assert _left(world, plan) == dict.fromkeys(STORES, 0)
    assert {t: n for t, (n, _) in _others(world, mine, subject.value).items()} == {t: n for t, (n, _) in others.items()}

    # a backfill of an archive restored from a backup taken before the erasure: the user's events are skipped
    restored = load_settings(env=world.env | {"RTRL_FLOW__ARCHIVE_DIR": str(world.root / "archive-backup")})
    done = backfill(restored, "v2", client=world.client, workers=1, worker_log=False)
    assert done.counts["erased"] > 0 and done.counts["rewards"] > 0
    assert world.q(f"SELECT count() FROM {{db}}.rewards WHERE has({mine}, trajectory_id)")[0][0] == 0

    # the batch flow skips a reward of the user still in Kafka; the trainer refuses a micro-batch made before
    reward = next(
        m.value()
        for m in read_topic(broker.bootstrap, settings.topic("rewards"))
        if json.loads(m.value())["trajectory_id"] == mine[0]
    )
    deny = clickhouse.deny_watch(settings)
    assert _parser(JsonCodec(Reward), "reward", "rewards", deny)(Message(None, reward, 0, 0)) == []
    assert _parser(JsonCodec(Reward), "reward", "rewards")(Message(None, reward, 0, 0)) != []
    topic = settings.topic("batches")
    producer = Producer(producer_config(broker.bootstrap))
    for b in (_batch("old", [[(mine[0], [1, 2])]]), _batch("fine", [[("someone-else", [1, 2])]])):
        producer.produce(topic, key=b.batch_id.encode(), value=encode_batch(b), partition=0)
    assert producer.flush(30) == 0
    stream = BatchStream(broker.bootstrap, topic, settings.topic("dead_letters"), deny=deny)
    got = stream.get(30)
    assert got is not None and got.batch_id == "fine" and stream.dead_letters == 1
    dead = [
        JsonCodec(DeadLetter).decode(m.value()) for m in read_topic(broker.bootstrap, settings.topic("dead_letters"))
    ]
    refused = [d for d in dead if d.kind == "erased"]
    assert len(refused) == 1 and refused[0].payload == "" and "erased subject" in refused[0].reason
    stream.close()


_KILL_AFTER_ARCHIVE = """
import os, signal, sys
from app.erasure import erase, subject_from
from rtrl.settings import load_settings
s = load_settings()
def stop(store, n):
    if store == "archive":
        os.kill(os.getpid(), signal.SIGKILL)
erase(s, subject_from(s, sys.argv[1], None, None), on_store=stop)
"""


def test_an_erasure_killed_midway_resumes_and_completes(world):
    """kill -9 of an erasure after it cleaned the archive: the user is already on the deny list and part of the
    stores are clean; `rtrl erase` again finishes the rest, and the audit shows both runs."""
    settings = world.settings
    subject = subject_from(settings, "user-01-001", None, None)
    plan = Plan(DB, subject)
    before = _left(world, plan)
    assert before["events"] and before["archive"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | world.env
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_AFTER_ARCHIVE, "user-01-001"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    midway = _left(world, plan)
    assert midway["archive"] == 0 and midway["events"] == before["events"]  # events come after the archive
    audit = world.q(f"SELECT status FROM {{db}}.erasures WHERE erasure_id = '{subject.id}'")
    assert [r[0] for r in audit] == ["started"]
    assert subject.value in clickhouse.deny_list(world.client, DB).users
    done = world.cli("erase", "--user", "user-01-001")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _left(world, plan) == dict.fromkeys(STORES, 0)
    audit = world.q(f"SELECT status FROM {{db}}.erasures WHERE erasure_id = '{subject.id}' ORDER BY at")
    assert [r[0] for r in audit] == ["started", "started", "done"]
    again = world.cli("erase", "--user", "user-01-001")  # idempotent: nothing left, nothing breaks
    assert again.returncode == 0, again.stdout + again.stderr


def test_erasing_an_organisation_removes_all_its_users(world):
    """`rtrl erase --org` removes every user of the organisation from every store, and no one else's rows."""
    settings = world.settings
    mine = world.trajectories("org_id = 'org-02'")
    others = _others(world, mine, '"org_id":"org-02"')
    assert len({r[0] for r in world.q("SELECT user_hash FROM {db}.events WHERE org_id = 'org-02'")}) > 1
    assert world.q("SELECT count() FROM {db}.dead_letters WHERE position(payload, 'org-02') > 0")[0][0] > 0
    done = world.cli("erase", "--org", "org-02")
    assert done.returncode == 0, done.stdout + done.stderr
    plan = Plan(DB, subject_from(settings, None, None, "org-02"))
    assert _left(world, plan) == dict.fromkeys(STORES, 0)
    assert world.q("SELECT count() FROM {db}.dead_letters WHERE position(payload, 'org-02') > 0")[0][0] == 0
    assert _others(world, mine, '"org_id":"org-02"') == others
    assert not [
        p
        for p in Path(settings.archive_root).rglob("*.parquet")
        if "org-02" in pq.read_table(p).column("org_id").to_pylist()
    ]


def test_the_audit_is_append_only_and_the_analyst_reads_it_without_raw_ids(world):
    """The writer may insert into the audit, never alter, delete from, truncate or drop it; the analyst reads it."""
    erase(world.settings, subject_from(world.settings, "user-02-001", None, None), client=world.client)
    for stmt in (
        f"ALTER TABLE {DB}.erasures DELETE WHERE 1",
        f"DELETE FROM {DB}.erasures WHERE 1",
        f"TRUNCATE TABLE {DB}.erasures",
        f"DROP TABLE {DB}.erasures",
        f"RENAME TABLE {DB}.erasures TO {DB}.gone",
        f"CREATE OR REPLACE TABLE {DB}.erasures (a Int8) ENGINE = MergeTree ORDER BY a",
        f"EXCHANGE TABLES {DB}.trajectories AND {DB}.erasures",
        f"DROP DATABASE {DB}",
    ):
        with pytest.raises(Exception, match="append-only"):
            world.client.command(stmt)
    rows = world.q("SELECT count() FROM {db}.erasures")[0][0]
    assert rows >= 2
    front = (world.root / "front.log").read_text()
    analyst_dsn = next(
        line.split(": ", 1)[1].strip() for line in front.splitlines() if line.startswith("read-only analysts: ")
    )
    analyst = clickhouse.connect(analyst_dsn, 10)
    assert analyst.query(f"SELECT count() FROM {DB}.erasures").result_rows[0][0] == rows


def test_a_subject_is_named_once_and_checked():
    """One of --user, --user-hash or --org; a hash must be one; the raw id is hashed with the salt."""
    settings = load_settings(env={"RTRL_SDK__SALT": "a-test-salt"})
    assert subject_from(settings, "u", None, None).value == hash_user("u", "a-test-salt")
    assert subject_from(settings, None, "0" * 32, None).kind == "user"
    for bad in (
        (None, None, None),
        ("u", None, "o"),
        (None, "not-a-hash", None),
        (None, None, "o\n"),
        (None, None, ""),
    ):
        with pytest.raises(ConfigError):
            subject_from(settings, *bad)


@pytest.mark.slow
def test_a_consumer_holds_until_it_has_read_the_deny_list(tmp_path, caplog):
    """The deny list fails closed: a consumer whose first read of it fails retries with backoff and processes
    nothing meanwhile. With no ClickHouse to answer, it stops with an error naming clickhouse.dsn. With one that
    comes up while it waits, it goes on once its read succeeds."""
    folder, port = tmp_path / "clickhouse", free_port()
    dsn = f"http://rtrl_writer@127.0.0.1:{port}/?password_file={folder}/rtrl-auth/rtrl_writer.token"
    with pytest.raises(ServiceUnavailable, match=r"deny list of erased subjects.*clickhouse\.dsn.*Fix:"):
        clickhouse.DenyWatch(dsn, DB, 1.0, 10.0, patience_s=1.0).current()

    caplog.set_level(logging.WARNING, logger="rtrl.clickhouse")
    caplog.clear()
    watch = clickhouse.DenyWatch(dsn, DB, 1.0, 10.0, patience_s=120.0)
    started: list = []
    later = threading.Timer(2.0, lambda: started.append(spawn(folder, port=port)))
    later.start()
    try:
        assert watch.current() == DenyList()  # a fresh engine has erased nobody
        assert any("holding" in r.getMessage() for r in caplog.records)  # it waited for the engine
    finally:
        later.join()
        for proc, _ in started:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_a_malformed_record_of_an_erased_subject_is_not_dead_lettered_again():
    """A record the codec cannot decode has no fields to check, so its text is searched. On a replay, one that
    names an erased user's hash, an erased organisation or an erased trajectory is skipped, not dead-lettered
    with its payload again. Anyone else's malformed record is dead-lettered as before."""
    erased_user, other = hash_user("gone", SALT), hash_user("stays", SALT)
    deny = DenyList(users=frozenset({erased_user}), orgs=frozenset({"org-gone"}), trajectories=frozenset({"t-gone"}))
    processor = RewardProcessor("rtrl.events", WindowConfig(), ["v2"], deny=deny)
    skipped = [
        (b"t-1", b'{"type": "trajectory_started", "user_hash": "' + erased_user.encode() + b'", "ts": '),
        (b"t-2", b'{"type": "tool_call", "org_id": "org-gone", "oops"'),
        (b"t-gone", b"\xff\xfe not even text"),
        (None, b'{"type": "teleport", "trajectory_id": "t-gone"}'),
        (None, b'{"prompt": "say \\"hi\\"", "org_id": "org-gone", '),  # after escaped quotes
        (None, b'{"prompt": "a\\\\", "trajectory_id": "t-gone", '),
    ]
    kept = [
        (b"t-3", b'{"type": "trajectory_started", "user_hash": "' + other.encode() + b'", "ts": '),
        (b"t-4", b'{"type": "tool_call", "org_id": "org-stays", "oops"'),
    ]
    out = processor.process([Message(k, v, 0, i) for i, (k, v) in enumerate(skipped + kept)], now_ms=0)
    assert out.erased == len(skipped)
    assert sorted(d.key for d in out.dead_letters) == ["t-3", "t-4"]
    assert all(erased_user not in d.payload and "org-gone" not in d.payload for d in out.dead_letters)
