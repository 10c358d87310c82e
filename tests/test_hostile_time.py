"""Hostile event times cannot make the reward flow lose honest events.

The attacks, as an attacker ran them against a fresh clone:

- one event stamped in the year 2299, sent first on a fresh partition;
- on a partition in use, three single-event trajectories at +23 h, +46 h and +69 h, each within a day
  of the clock the previous one advanced;
- then a real trajectory on the same partition, ten minutes after the traffic before the attacks.

The contract pinned here: each attack is dead-lettered as ``future`` with its reason, because event time
is bounded by the Kafka record's timestamp (the broker's append time on ``rtrl.events``), not only by
the clock the attack would advance. Every honest trajectory is rewarded exactly as without the attacks,
in the pure processor, in the backfill's replay, and in the real flow on the real broker across a
kill -9 and restart. The SDK refuses such stamps before they leave the process.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import msgspec
import pytest
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from client.sdk import InvalidEvent, RtrlClient
from devservices.broker import free_port
from flows.backfill import conform, to_events
from flows.processor import FlowOutput, Message, RewardProcessor
from flows.sinks import read_archive
from flows.windowing import PartitionWindows, WindowConfig
from rtrl.errors import SchemaMismatch
from rtrl.kafka import describe_topic, ensure_topics, producer_config, read_topic
from rtrl.sections.simulator import SimulatorSettings
from rtrl.settings import load_settings
from schemas.codec import event_codec
from simulator.generate import generate
from tests.test_reward_flow import _env, _flow_cmd, run_to_end

SALT = "flow-test-salt"
VERSIONS = "v2,v1-discard-broken"
HOUR = 3_600_000
YEAR_2299 = 10_413_705_600_000  # 2299-12-31: the schema allows event times up to the end of 2299
NOW = 1_796_000_000_000  # the pure tests' broker clock (2026-11-30)
CODEC = event_codec()
ENV = dict(org_id="acme", user_hash="0" * 32, policy_version=0, arm="control")


def _settings():
    return load_settings(env={"RTRL_SDK__SALT": SALT, "RTRL_REWARDS__VERSIONS": VERSIONS})


def _processor() -> RewardProcessor:
    return RewardProcessor("rtrl.events", WindowConfig(_settings().flow), VERSIONS.split(","))


def _event(kind: str, tid: str, ts: int, eid: str, **payload) -> bytes:
    return msgspec.json.encode({"type": kind, "event_id": eid, "trajectory_id": tid, "ts": ts, **ENV, **payload})


def _trajectory(tid: str, t0: int) -> list[bytes]:
    """A real trajectory of four events: started, a valid tool call, a satisfied follow-up, the end."""
    return [
        _event("trajectory_started", tid, t0, f"{tid}-0", task_kind="bugfix"),
        _event("tool_call", tid, t0 + 1_000, f"{tid}-1", tool="search", valid=True),
        _event("followup", tid, t0 + 5_000, f"{tid}-2", sentiment="satisfied"),
        _event("trajectory_ended", tid, t0 + 6_000, f"{tid}-3", status="completed"),
    ]


def _attacks(clock: int) -> list[bytes]:
    """The chained attack: single-event trajectories at +23 h, +46 h and +69 h of ``clock``."""
    return [
        _event("trajectory_started", f"evil-{h}h", clock + h * HOUR, f"evil-{h}h-0", task_kind="bugfix")
        for h in (23, 46, 69)
    ]


def _run(values: list[bytes], record_ts: list[int | None], state: bytes | None = None) -> tuple[FlowOutput, bytes]:
    """The values in order through one partition's processor (resumed from a pickled state when given), then
    the end of input; returns everything it produced and the state before the end."""
    proc = _processor()
    if state is not None:
        proc.windows = pickle.loads(state)
    out = proc.process([Message(None, v, 0, i, r) for i, (v, r) in enumerate(zip(values, record_ts))], now_ms=NOW)
    snapshot = pickle.dumps(proc.windows)
    out.extend(proc.finish(now_ms=NOW))
    return out, snapshot


def _rewards(out: FlowOutput, tids: set[str] | None = None) -> list[tuple]:
    return sorted(
        (r.trajectory_id, r.reward_version, r.revision, r.reward, r.close_reason, sorted(r.components.items()))
        for r in out.rewards
        if tids is None or r.trajectory_id in tids
    )


def _future(out: FlowOutput) -> list[str]:
    return sorted(msgspec.json.decode(d.payload)["event_id"] for d in out.dead_letters if d.kind == "future")


# ---------------------------------------------------------------- pure: one partition's processor


def test_an_event_from_2299_first_on_a_partition_costs_no_honest_event():
    """The 2299 event is dead-lettered as ``future`` against its record's timestamp; the real trajectory sent
    after it keeps all 4 events and the reward it gets without the attack."""
    honest = _trajectory("real", NOW - 60_000)
    clean, _ = _run(honest, [NOW] * 4)
    hostile = [_event("trajectory_started", "evil", YEAR_2299, "evil-0", task_kind="bugfix")]
    attacked, _ = _run(hostile + honest, [NOW] * 5)
    assert _future(attacked) == ["evil-0"]
    (letter,) = attacked.dead_letters
    assert "ahead of its Kafka record's timestamp" in letter.reason and letter.field == "$.ts"
    assert _rewards(attacked) == _rewards(clean) and len(_rewards(clean)) == 2  # v2 and v1, revision 0
    assert {r.n_events for r in attacked.rewards} == {4}


def _stamps(values: list[bytes]) -> list[int | None]:
    """The broker's append time of honest events: when they happened."""
    return [msgspec.json.decode(v)["ts"] for v in values]


def test_chained_attacks_each_within_a_day_are_refused_and_the_next_real_trajectory_is_rewarded():
    """On a partition in use, the +23 h, +46 h and +69 h trajectories are each refused (each is a day ahead of the
    broker's clock, whatever it did to the partition's); a real trajectory ten minutes later is rewarded as
    without them, and so is the traffic before them."""
    before = _trajectory("early", NOW - 20 * 60_000)
    after = _trajectory("late", NOW - 10 * 60_000)
    clean, _ = _run(before + after, _stamps(before + after))
    attacks = _attacks(NOW - 14 * 60_000)
    attacked, _ = _run(before + attacks + after, _stamps(before) + [NOW - 14 * 60_000] * 3 + _stamps(after))
    assert _future(attacked) == ["evil-23h-0", "evil-46h-0", "evil-69h-0"]
    assert _rewards(attacked) == _rewards(clean)
    assert {r.close_reason for r in clean.rewards} == {"ended", "deadline"}  # early ends in the stream, late at flush


def test_an_event_within_the_clock_skew_cannot_move_the_partition_clock():
    """An event a few minutes ahead of its record (a fast client clock) is accepted, but the partition's clock moves
    only to the broker's: the real trajectory after it still waits for its events, as without it. Unbounded,
    the skewed stamp would have closed that trajectory as soon as it ended."""
    before = _trajectory("early", NOW - 20 * 60_000)
    after = _trajectory("late", NOW - 10 * 60_000)
    clean, _ = _run(before + after, _stamps(before + after))
    sent = NOW - 15 * 60_000
    skewed = _event("trajectory_started", "fast-clock", sent + 9 * 60_000, "fast-0", task_kind="bugfix")
    attacked, _ = _run(before + [skewed] + after, _stamps(before) + [sent] + _stamps(after))
    assert _future(attacked) == []
    assert _rewards(attacked, {"early", "late"}) == _rewards(clean)
    unbounded, _ = _run(before + [skewed] + after, [None] * 9)
    assert _rewards(unbounded, {"early", "late"}) != _rewards(clean)


def test_a_snapshot_whose_clock_an_attack_moved_is_pulled_back_to_the_broker_clock():
    """A recovery state from before this bound, its clock moved to 2299 by a hostile event, heals on the first
    record with a timestamp: the real trajectory after it is rewarded as on a clean partition."""
    honest = _trajectory("real", NOW - 60_000)
    clean, _ = _run(honest, _stamps(honest))
    poisoned = PartitionWindows(WindowConfig(_settings().flow))
    poisoned.ingest(CODEC.decode(_event("trajectory_started", "evil", YEAR_2299, "evil-0", task_kind="x")), 0)
    assert poisoned.watermark == YEAR_2299 and poisoned.record_clock is None
    del poisoned.__dict__["record_clock"]  # as unpickled from a state written before the field existed
    healed, _ = _run(honest, _stamps(honest), state=pickle.dumps(poisoned))
    assert _rewards(healed, {"real"}) == _rewards(clean)


def test_a_quiet_day_on_a_partition_rejects_no_honest_event():
    """The watermark bound alone refused honest events after a partition was quiet for more than
    ``flow.max_future_s``; against the record's timestamp they are accepted."""
    first, second = _trajectory("monday", NOW - 30 * HOUR), _trajectory("tuesday", NOW - 60_000)
    out, _ = _run(first + second, _stamps(first + second))
    assert _future(out) == [] and {r.trajectory_id for r in out.rewards} == {"monday", "tuesday"}
    without, _ = _run(first + second, [None] * 8)  # input without record timestamps keeps the old bound
    assert _future(without) == ["tuesday-0", "tuesday-1", "tuesday-2", "tuesday-3"]


def test_the_backfill_replay_bounds_time_by_the_archived_record_timestamps():
    """The backfill replays the archive's (event, partition, offset, record timestamp) rows: the attack is refused
    and the rewards are the stream's, so stream = batch holds with hostile input too."""
    values = _trajectory("early", NOW - 20 * 60_000) + _attacks(NOW - 14 * 60_000) + _trajectory("late", NOW - 600_000)
    stream, _ = _run(values, [NOW] * len(values))
    replay = _processor()
    batch = replay.process_events([(e, p, o, r) for e, (p, o, r) in zip(stream.events, stream.coords)], now_ms=NOW)
    batch.extend(replay.finish(now_ms=NOW))
    assert [c[2] for c in stream.coords] == [NOW] * len(values)
    assert _rewards(batch) == _rewards(stream) and _future(batch) == _future(stream) != []


# ---------------------------------------------------------------- the SDK


def test_the_sdk_refuses_event_times_outside_its_window(broker, topic_prefix):
    """``ts`` beyond ``sdk.max_future_s`` ahead or ``sdk.max_past_s`` behind its clock raises InvalidEvent naming
    ``$.ts`` and the settings; a stamp within them is sent; a replay passes its own clock. The events topic is
    stamped by the broker (LogAppendTime), so a forged producer time never reaches the flow."""
    settings = load_settings(
        env={
            "RTRL_SDK__SALT": SALT,
            "RTRL_KAFKA__BOOTSTRAP": broker.bootstrap,
            "RTRL_KAFKA__TOPIC_PREFIX": topic_prefix,
        }
    )
    now = time.time_ns() // 1_000_000
    client = RtrlClient.from_settings(settings)
    for ts in (YEAR_2299, now + 11 * 60_000, now - 8 * 24 * HOUR):
        with pytest.raises(InvalidEvent) as err:
            client.start_trajectory(org_id="acme", user_id="u", task_kind="bugfix", policy_version=0, ts=ts)
        assert err.value.field == "$.ts" and "sdk.max_future_s" in err.value.reason
    kept = client.start_trajectory(org_id="acme", user_id="u", task_kind="bugfix", policy_version=0, ts=now + 60_000)
    replayed = CODEC.decode(_event("trajectory_started", "replayed", now - 30 * 24 * HOUR, "r-0", task_kind="x"))
    assert client.record(replayed, now_ms=replayed.ts + 5)
    stats = client.close()
    assert (stats.invalid, stats.delivered) == (3, 2)
    assert describe_topic(broker.bootstrap, topic_prefix + "events")["message.timestamp.type"] == "LogAppendTime"
    records = list(read_topic(broker.bootstrap, topic_prefix + "events"))
    assert {msgspec.json.decode(m.value())["trajectory_id"] for m in records} == {kept.trajectory_id, "replayed"}
    for m in records:
        kind, stamp = m.timestamp()
        assert kind == TIMESTAMP_LOG_APPEND_TIME and abs(stamp - now) < 10 * 60_000


# ---------------------------------------------------------------- the real flow, the real broker, kill -9

DUMP = """
import json, sys
from rtrl import clickhouse
ch = clickhouse.connect(sys.argv[1])
rewards = ch.query("SELECT trajectory_id, reward_version, revision, reward, close_reason, n_events FROM rtrl.rewards FINAL")
dead = ch.query("SELECT kind, payload, reason FROM rtrl.dead_letters FINAL")
print(json.dumps({"rewards": [list(r) for r in rewards.result_rows], "dead": [list(r) for r in dead.result_rows]}))
"""


def _live_traffic(end_ms: int, seed: int) -> list[bytes]:
    """Simulated users' events whose last send is at ``end_ms``: real-time traffic, every stamp behind the broker's
    clock (duplicates, reordering and late persistence checks included)."""
    sim = SimulatorSettings(trajectories=120, seed=seed, duplicate_rate=0.02, late_check_rate=0.1)
    probe = 1_000_000_000_000
    span = max(e.at_ms for e in generate(sim.model_copy(update={"start_ms": probe}), SALT)) - probe
    emissions = generate(sim.model_copy(update={"start_ms": end_ms - span}), SALT)
    return [CODEC.encode(e.event) for e in emissions]


def _send(bootstrap: str, topic: str, partition: int, values: list[bytes]) -> None:
    """A raw producer that bypasses the SDK and forges each record's CreateTime as its event time."""
    p = Producer(producer_config(bootstrap))
    for v in values:
        ts = msgspec.json.decode(v)["ts"]
        p.produce(
            topic, value=v, key=msgspec.json.decode(v)["trajectory_id"].encode(), partition=partition, timestamp=ts
        )
    assert p.flush(30) == 0


def _expected(partitions: list[list[bytes]]) -> list[list]:
    """Each partition's honest messages through the processor alone: the final revision of each reward."""
    final: dict[tuple[str, str], list] = {}
    for values in partitions:
        out, _ = _run(values, [None] * len(values))
        for r in out.rewards:
            key = (r.trajectory_id, r.reward_version)
            if key not in final or final[key][2] < r.revision:
                final[key] = [r.trajectory_id, r.reward_version, r.revision, r.reward, r.close_reason, r.n_events]
    return sorted(final.values())


def _replayed(archive) -> list[list]:
    """The archive read as the backfill reads it, each partition replayed in offset order with its record
    timestamps: the final revision of each v2 and v1 reward."""
    table, drift = conform(read_archive(archive))
    assert table is not None and drift == []
    events, bad = to_events(table)
    assert bad == [] and -1 not in table.column("kafka_timestamp").to_pylist()
    coords = list(zip(*(table.column(c).to_pylist() for c in ("kafka_partition", "kafka_offset", "kafka_timestamp"))))
    final: dict[tuple[str, str], list] = {}
    for partition in sorted({p for p, _, _ in coords}):
        rows = sorted((coords[i][1], i) for i, _ in events if coords[i][0] == partition)
        proc = _processor()
        out = proc.process_events([(events[i][1], partition, o, coords[i][2]) for o, i in rows], now_ms=NOW)
        out.extend(proc.finish(now_ms=NOW))
        for r in out.rewards:
            final[(r.trajectory_id, r.reward_version)] = [
                r.trajectory_id, r.reward_version, r.revision, r.reward, r.close_reason, r.n_events
            ]  # fmt: skip
    return sorted(final.values())


def test_an_events_topic_stamped_by_producers_is_refused_with_the_fix(broker):
    """An existing ``rtrl.events`` made with CreateTime (producers' clocks, which an attacker forges) is a schema
    mismatch naming the topic config and the command that fixes it; nothing else is created."""
    prefix = f"ct{free_port()}."
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for fut in admin.create_topics([NewTopic(prefix + "events", 2, 1)]).values():
        fut.result(10)
    with pytest.raises(SchemaMismatch, match=r"message.timestamp.type CreateTime, rtrl wants LogAppendTime") as err:
        ensure_topics(broker.bootstrap, prefix, 2)
    assert "--add-config message.timestamp.type=LogAppendTime" in str(err.value)


@pytest.mark.slow
def test_the_attacks_on_the_real_flow_lose_no_honest_event_across_kill_9(broker, tmp_path):
    """The reward flow on the real broker: partition 1 gets the 2299 event first, then a real trajectory; partition 0
    gets live traffic, the chained attacks, and (after a kill -9 of the flow and a restart from its recovery
    folder) a real trajectory ten minutes later. Every attack is a ``future`` dead letter in ClickHouse, and every
    honest trajectory has exactly the rewards it gets without the attacks."""
    prefix = f"hostile{free_port()}."
    ensure_topics(broker.bootstrap, prefix, 2)
    topic = prefix + "events"
    now = time.time_ns() // 1_000_000
    traffic = _live_traffic(now - 15 * 60_000, seed=40)
    first = _trajectory("first-real", now - 60_000)
    later = _trajectory("ten-minutes-later", now - 5 * 60_000)
    evil_2299 = _event("trajectory_started", "evil-2299", YEAR_2299, "evil-2299-0", task_kind="bugfix")
    _send(broker.bootstrap, topic, 1, [evil_2299, *first])
    _send(broker.bootstrap, topic, 0, traffic + _attacks(now - 15 * 60_000))

    recovery = tmp_path / "recovery"
    recovery.mkdir()
    subprocess.run([sys.executable, "-m", "bytewax.recovery", str(recovery), "1"], check=True, timeout=60)
    flow = subprocess.Popen(
        _flow_cmd(recovery),
        env=_env(broker.bootstrap, prefix, tmp_path, tail=True),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # every attack refused: the flow has read past them
        if sum(b'"future"' in m.value() for m in read_topic(broker.bootstrap, prefix + "dead_letters")) >= 4:
            break
        time.sleep(0.2)
    os.kill(flow.pid, signal.SIGKILL)
    flow.wait(30)
    _send(broker.bootstrap, topic, 0, later)
    run_to_end(recovery, broker.bootstrap, prefix, tmp_path)
    dump = subprocess.run(
        [sys.executable, "-c", DUMP, f"chdb://{tmp_path}/clickhouse"], capture_output=True, text=True, timeout=120
    )
    assert dump.returncode == 0, dump.stderr
    got = json.loads(dump.stdout.strip().splitlines()[-1])

    future = {json.loads(p)["event_id"]: why for kind, p, why in got["dead"] if kind == "future"}
    assert set(future) == {"evil-2299-0", "evil-23h-0", "evil-46h-0", "evil-69h-0"}
    assert all("ahead of its Kafka record's timestamp" in why for why in future.values())
    expected = _expected([traffic + later, first])
    assert sorted(got["rewards"]) == expected
    assert _replayed(tmp_path / "archive" / "events") == expected  # the backfill's input gives the same
    rewarded = {r[0] for r in expected}
    assert {"first-real", "ten-minutes-later"} <= rewarded and len(rewarded) > 100
    assert not rewarded & {"evil-2299", "evil-23h", "evil-46h", "evil-69h"}
