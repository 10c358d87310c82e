"""The reward flow on the real broker and the real ClickHouse engine.

In-process runs use the session's chdb folder (one database per test); the recovery and
scale-out tests run the flow as separate processes with ``python -m bytewax.run``, each with its
own chdb folder, and read results back through a subprocess (chdb allows one folder per process).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from bytewax.testing import run_main
from confluent_kafka import Producer

from devservices.broker import free_port
from flows.processor import Message, RewardProcessor
from flows.reward_flow import build_flow
from flows.sinks import read_archive
from flows.windowing import WindowConfig
from rewards import compute
from rtrl import clickhouse
from rtrl.kafka import ensure_topics, producer_config, read_topic
from rtrl.sections.simulator import SimulatorSettings
from rtrl.settings import load_settings
from schemas.codec import JsonCodec, event_codec
from schemas.records import EventBase, Reward
from simulator.generate import generate

SALT = "flow-test-salt"
VERSIONS = "v2,v1-discard-broken"


def _payloads(trajectories: int, seed: int, **kw) -> list[tuple[bytes, bytes]]:
    codec = event_codec()
    sim = SimulatorSettings(trajectories=trajectories, seed=seed, **kw)
    return [(e.event.trajectory_id.encode(), codec.encode(e.event)) for e in generate(sim, SALT)]


def _produce(bootstrap: str, topic: str, payloads) -> None:
    p = Producer(producer_config(bootstrap))
    for key, value in payloads:
        p.produce(topic, key=key, value=value)
    assert p.flush(30) == 0


def _settings(env: dict[str, str]):
    return load_settings(env={"RTRL_SDK__SALT": SALT, "RTRL_REWARDS__VERSIONS": VERSIONS} | env)


# ---------------------------------------------------------------- pure: the processor


def test_processor_rewards_every_started_trajectory_once_per_version():
    """Fed the simulator's stream (duplicates, reordering, late checks) in order, the processor rewards every
    trajectory under each version at revision 0 (v1 discards those with broken calls), re-emits a revision for
    each late persistence check, dead-letters exactly the duplicates, and each trajectory's final revision
    equals the reward of all its distinct events computed directly."""
    payloads = _payloads(300, seed=5, duplicate_rate=0.05, late_check_rate=0.2)
    proc = RewardProcessor("rtrl.events", WindowConfig(_settings({}).flow), VERSIONS.split(","))
    out = proc.process([Message(k, v, 0, i) for i, (k, v) in enumerate(payloads)])
    out.extend(proc.finish())

    events = [event_codec().decode(v) for _, v in payloads]
    by_traj = defaultdict(dict)
    for e in events:
        by_traj[e.trajectory_id][e.event_id] = e
    assert Counter(d.kind for d in out.dead_letters) == {"duplicate": len(events) - sum(map(len, by_traj.values()))}
    final: dict[tuple[str, str], Reward] = {}
    for r in out.rewards:
        key = (r.trajectory_id, r.reward_version)
        assert key not in final or final[key].revision == r.revision - 1  # revisions count up by one
        final[key] = r
    assert {t for t, v in final if v == "v2"} == set(by_traj)
    assert any(r.close_reason == "late" for r in out.rewards)
    for (tid, version), r in final.items():
        expected = compute(by_traj[tid].values(), version)
        assert (r.reward, r.components, r.flags) == (expected.reward, expected.components, expected.flags)
    broken = {t for t, evs in by_traj.items() if any(getattr(e, "valid", True) is False for e in evs.values())}
    assert {t for t, v in final if v == "v1-discard-broken"} == set(by_traj) - broken
    assert out.discarded >= len(broken)


def test_out_of_order_delivery_changes_no_final_reward():
    """Shuffling delivery heavily (each message moved up to 40 places) may add revisions, but every
    trajectory's final revision equals the reward of all its events, as with in-order delivery."""
    import random

    payloads = _payloads(200, seed=17, duplicate_rate=0.0, reorder_rate=0.0)
    rng = random.Random(3)
    shuffled = [p for _, p in sorted(((i + rng.uniform(0, 40), p) for i, p in enumerate(payloads)), key=lambda x: x[0])]
    finals = []
    for order in (payloads, shuffled):
        proc = RewardProcessor("rtrl.events", WindowConfig(_settings({}).flow), ["v2"])
        out = proc.process([Message(k, v, 0, i) for i, (k, v) in enumerate(order)])
        out.extend(proc.finish())
        assert not out.dead_letters
        final = {}
        for r in out.rewards:
            if r.revision >= final.get(r.trajectory_id, (-1,))[0]:
                final[r.trajectory_id] = (r.revision, r.reward, r.components, r.flags)
        finals.append({t: v[1:] for t, v in final.items()})
    assert finals[0] == finals[1]


# ---------------------------------------------------------------- in-process flow


def _services_env(broker, topic_prefix: str, ch_dsn: str, ch_db: str, tmp_path) -> dict[str, str]:
    """The test's broker, topics and ClickHouse database, the flow stopping at the end of its topic."""
    return {
        "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        "RTRL_CLICKHOUSE__DSN": ch_dsn,
        "RTRL_CLICKHOUSE__DATABASE": ch_db,
        "RTRL_FLOW__TAIL": "false",
        "RTRL_DATA_DIR": str(tmp_path),
    }


#: dead letters by kind that _hostile()'s payloads give (duplicates counted apart)
HOSTILE_KINDS = {
    "malformed": 2,
    "unknown_type": 1,
    "invalid": 2,
    "oversize": 1,
    "never_started": 1,
    "too_late": 1,
    "future": 1,
}


def _hostile(sample: bytes) -> dict[str, bytes | None]:
    base = msgspec.json.decode(sample)
    return {
        "malformed": b"{oops",
        "unknown_type": msgspec.json.encode(base | {"type": "exfiltrate"}),
        "missing": msgspec.json.encode({k: v for k, v in base.items() if k != "org_id"}),
        "mistyped": msgspec.json.encode(base | {"ts": "noon"}),
        "oversize": msgspec.json.encode(base | {"error": "x" * 70_000}),
        "null": None,
        "never_started": msgspec.json.encode(
            {k: base[k] for k in EventBase.__struct_fields__}
            | {"type": "clarifying_question", "trajectory_id": "ghost", "event_id": "g1"}
        ),
        "too_late": msgspec.json.encode(base | {"trajectory_id": "ancient", "event_id": "old-1", "ts": 1_000}),
        # ten days ahead of the wall clock: ahead of the broker's record timestamp and of the partition's watermark
        "future": msgspec.json.encode(
            base | {"event_id": "future-1", "ts": time.time_ns() // 1_000_000 + 10 * 86_400_000}
        ),
    }


@pytest.mark.slow
def test_flow_end_to_end_with_bad_input(broker, topic_prefix, ch_dsn, ch_client, ch_db, tmp_path):
    """Events -> flow -> ClickHouse events/rewards/trajectories/dead_letters, Kafka rtrl.rewards and
    rtrl.dead_letters, and the Parquet archive. Every kind of bad input is dead-lettered with its kind and
    reason; none stops the flow; every valid trajectory is rewarded."""
    payloads = _payloads(150, seed=9, duplicate_rate=0.03)
    hostile = _hostile(payloads[0][1])
    # one partition so the clock-dependent cases (too_late, future, never_started) see the whole stream
    _produce(
        broker.bootstrap,
        topic_prefix + "events",
        [(b"k", v) for _, v in payloads] + [(b"k", v) for v in hostile.values()],
    )
    env = _services_env(broker, topic_prefix, ch_dsn, ch_db, tmp_path)
    run_main(build_flow(_settings(env)))

    distinct = {msgspec.json.decode(v)["event_id"] for _, v in payloads}
    trajectories = {msgspec.json.decode(v)["trajectory_id"] for _, v in payloads}
    q = lambda sql: ch_client.query(sql.format(db=ch_db)).result_rows  # noqa: E731
    kinds = dict(q("SELECT kind, count() FROM {db}.dead_letters FINAL GROUP BY kind"))
    assert kinds.pop("duplicate") == len(payloads) - len(distinct)
    assert kinds == HOSTILE_KINDS
    reasons = dict(q("SELECT kind, any(reason) FROM {db}.dead_letters FINAL GROUP BY kind"))
    assert "allowed lateness" in reasons["too_late"] and "never sent trajectory_started" in reasons["never_started"]
    assert q("SELECT uniqExact(trajectory_id) FROM {db}.rewards FINAL WHERE reward_version = 'v2'")[0][0] == len(
        trajectories
    )
    assert q("SELECT count() FROM {db}.trajectories FINAL")[0][0] == len(trajectories)
    assert {r[0] for r in q("SELECT event_id FROM {db}.events FINAL")} >= distinct

    kafka_rewards = [
        JsonCodec(Reward).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "rewards")
    ]
    stored = {(r.trajectory_id, r.reward_version): r for r in clickhouse.select(ch_client, ch_db, "rewards")}
    latest = {}
    for r in kafka_rewards:
        latest[(r.trajectory_id, r.reward_version)] = max(
            latest.get((r.trajectory_id, r.reward_version), r), r, key=lambda x: x.revision
        )
    assert latest == stored
    dl_topic = list(read_topic(broker.bootstrap, topic_prefix + "dead_letters"))
    assert len(dl_topic) == sum(n for (n,) in q("SELECT count() FROM {db}.dead_letters FINAL"))
    archived = read_archive(tmp_path / "archive" / "events")
    assert set(archived.column("event_id").to_pylist()) >= distinct


@pytest.mark.slow
def test_clickhouse_outage_loses_nothing(broker, topic_prefix, ch_dsn, ch_client, ch_db, tmp_path, caplog):
    """With the ClickHouse tables detached (the engine rejects every insert) the sink retries with backoff and
    holds the flow; once they are attached again every row arrives, none twice."""
    payloads = _payloads(100, seed=13, duplicate_rate=0.0)
    _produce(broker.bootstrap, topic_prefix + "events", payloads)
    tables = ["events", "rewards", "trajectories"]
    for t in tables:
        ch_client.command(f"DETACH TABLE {ch_db}.{t}")
    env = _services_env(broker, topic_prefix, ch_dsn, ch_db, tmp_path)
    flow = build_flow(_settings(env))  # built before the outage check runs in the sink
    caplog.set_level(logging.WARNING, logger="rtrl.sinks")
    errors: list[BaseException] = []

    def run():
        try:
            run_main(flow)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    worker = threading.Thread(target=run)
    deadline = time.monotonic() + 120
    worker.start()
    while time.monotonic() < deadline and sum("failed" in r.getMessage() for r in caplog.records) < 3:
        time.sleep(0.05)
    assert sum("failed" in r.getMessage() for r in caplog.records) >= 3, "the sink never hit the outage"
    for t in tables:
        ch_client.command(f"ATTACH TABLE {ch_db}.{t}")
    worker.join(120)
    assert not worker.is_alive() and not errors
    distinct = {msgspec.json.decode(v)["event_id"] for _, v in payloads}
    trajectories = {msgspec.json.decode(v)["trajectory_id"] for _, v in payloads}
    assert ch_client.query(f"SELECT count() FROM {ch_db}.events FINAL").result_rows[0][0] == len(distinct)
    assert ch_client.query(f"SELECT count() FROM {ch_db}.trajectories FINAL").result_rows[0][0] == len(trajectories)
    assert ch_client.query(f"SELECT count() FROM {ch_db}.rewards FINAL WHERE reward_version='v2'").result_rows[0][
        0
    ] == len(trajectories)


# ---------------------------------------------------------------- separate processes: recovery and scale-out

DUMP = """
import json, sys
from rtrl import clickhouse
ch = clickhouse.connect(sys.argv[1])
out = {}
# wall-clock stamps and the (per-test) topic name are the only fields allowed to differ
for table, drop in [("rewards", {"emitted_at"}), ("trajectories", set()), ("dead_letters", {"at", "source"})]:
    rows = [r for r in ch.query(f"SELECT * FROM rtrl.{table} FINAL").named_results()]
    out[table] = sorted(json.dumps({k: v for k, v in r.items() if k not in drop}, default=str, sort_keys=True) for r in rows)
out["events"] = ch.query("SELECT count() FROM rtrl.events FINAL").result_rows[0][0]
print(json.dumps(out))
"""


def _env(bootstrap: str, prefix: str, data_dir, tail: bool) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    return keep | {
        "RTRL_KAFKA__BOOTSTRAP": bootstrap,
        "RTRL_KAFKA__TOPIC_PREFIX": prefix,
        "RTRL_DATA_DIR": str(data_dir),
        "RTRL_FLOW__TAIL": "true" if tail else "false",
        "RTRL_SDK__SALT": SALT,
        "RTRL_REWARDS__VERSIONS": VERSIONS,
    }


def _flow_cmd(recovery=None, extra=()) -> list[str]:
    cmd = [sys.executable, "-m", "bytewax.run", "flows.reward_flow:flow", "-s", "1", "-b", "0"]
    if recovery is not None:
        cmd += ["-r", str(recovery)]
    return cmd + list(extra)


def _dump(data_dir) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", DUMP, f"chdb://{data_dir}/clickhouse"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(broker, tmp_path_factory):
    """An uninterrupted single-worker run over the whole input: (payload phases, its dump)."""
    phase1 = _payloads(400, seed=21, duplicate_rate=0.02, late_check_rate=0.1)
    phase2 = _payloads(300, seed=22, duplicate_rate=0.02, late_check_rate=0.1, start_ms=1_767_226_400_000)
    prefix, data = f"ref{free_port()}.", tmp_path_factory.mktemp("reference")
    ensure_topics(broker.bootstrap, prefix, 4)
    _produce(broker.bootstrap, prefix + "events", phase1 + phase2)
    proc = subprocess.run(
        _flow_cmd(), env=_env(broker.bootstrap, prefix, data, tail=False), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return phase1, phase2, _dump(data)


def _run_then_kill(
    recovery: Path,
    env: dict[str, str],
    bootstrap: str,
    rewards_topic: str,
    after: int = 100,
    ready: Callable[[], bool] = lambda: True,
) -> None:
    """Start the flow on its recovery folder, wait until it has written `after` rewards and `ready()` holds, then
    SIGKILL it."""
    first = subprocess.Popen(_flow_cmd(recovery), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if sum(1 for _ in read_topic(bootstrap, rewards_topic)) >= after and ready():
            break
        time.sleep(0.2)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(30)


def run_to_end(recovery: Path, bootstrap: str, prefix: str, data_dir: Path) -> None:
    """Restart the flow from its recovery folder and run it to the end of the input: it must exit 0."""
    done = subprocess.run(
        _flow_cmd(recovery),
        env=_env(bootstrap, prefix, data_dir, tail=False),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_kill_9_and_restart_equals_uninterrupted(broker, tmp_path, reference):
    """kill -9 the flow mid-stream, restart it from its recovery folder: rewards, trajectories and dead letters
    (FINAL) equal an uninterrupted run of the same input exactly."""
    phase1, phase2, expected = reference
    prefix = f"kill{free_port()}."
    ensure_topics(broker.bootstrap, prefix, 4)
    recovery = tmp_path / "recovery"
    recovery.mkdir()
    subprocess.run([sys.executable, "-m", "bytewax.recovery", str(recovery), "1"], check=True, timeout=60)
    _produce(broker.bootstrap, prefix + "events", phase1)
    _run_then_kill(recovery, _env(broker.bootstrap, prefix, tmp_path, tail=True), broker.bootstrap, prefix + "rewards")
    _produce(broker.bootstrap, prefix + "events", phase2)
    run_to_end(recovery, broker.bootstrap, prefix, tmp_path)
    assert _dump(tmp_path) == expected


@pytest.mark.slow
def test_two_worker_processes_equal_one(broker, tmp_path, reference):
    """The same input through a two-process Bytewax cluster gives exactly the single-worker results."""
    phase1, phase2, expected = reference
    prefix = f"two{free_port()}."
    ensure_topics(broker.bootstrap, prefix, 4)
    _produce(broker.bootstrap, prefix + "events", phase1 + phase2)
    addresses = f"127.0.0.1:{free_port()};127.0.0.1:{free_port()}"
    env = _env(broker.bootstrap, prefix, tmp_path, tail=False)
    procs = [
        subprocess.Popen(
            _flow_cmd(extra=["-i", str(i), "-a", addresses]), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        for i in (0, 1)
    ]
    for p in procs:
        assert p.wait(300) == 0, p.stderr.read()[-3000:]
    assert _dump(tmp_path) == expected
