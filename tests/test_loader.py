"""Kafka rtrl.events -> ClickHouse events on the real broker and engine: hostile input is dead-lettered
with its reason and never stops the load; a kill -9 and restart neither loses nor double-counts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import msgspec
from confluent_kafka import Producer

from rtrl import clickhouse
from rtrl.config import SimulatorSettings
from rtrl.kafka import producer_config, read_topic
from rtrl.loader import load_events
from schemas.codec import JsonCodec, event_codec
from schemas.records import DeadLetter
from simulator.generate import generate

SALT = "loader-test-salt"


def _produce(bootstrap: str, topic: str, payloads: list[tuple[bytes, bytes | None]]) -> None:
    p = Producer(producer_config(bootstrap))
    for key, value in payloads:
        p.produce(topic, key=key, value=value)
    assert p.flush(10) == 0


def test_hostile_input_is_dead_lettered_with_reasons(broker, topic_prefix, ch_client, ch_db):
    """Valid events land once (a duplicate collapses); each bad message lands in the dead_letters table
    and topic with the field and reason; a second load reads nothing new."""
    emissions = generate(SimulatorSettings(trajectories=20, seed=3, duplicate_rate=0.1), SALT)
    codec = event_codec()
    good = [(e.event.trajectory_id.encode(), codec.encode(e.event)) for e in emissions]
    sample = msgspec.json.decode(good[0][1])
    hostile = {
        "malformed": b'{"type": "tool_call", ',
        "unknown_type": msgspec.json.encode(sample | {"type": "mind_control"}),
        "missing_field": msgspec.json.encode({k: v for k, v in sample.items() if k != "ts"}),
        "mistyped": msgspec.json.encode(sample | {"policy_version": "latest"}),
        "oversize": msgspec.json.encode(sample | {"arm": "a" * 100, "pad": "x" * 70_000}),
        "null": None,
        "raw_user_id": msgspec.json.encode(sample | {"user_hash": "bob@example.com"}),
    }
    _produce(broker.bootstrap, topic_prefix + "events", good + [(b"t", v) for v in hostile.values()])

    result = load_events(broker.bootstrap, topic_prefix + "events", topic_prefix + "dead_letters", ch_client, ch_db)
    assert (result.read, result.dead_lettered) == (len(good) + len(hostile), len(hostile))

    distinct = {e.event.event_id for e in emissions}
    assert len(distinct) < len(emissions)  # the simulator did send duplicates
    rows = clickhouse.select(ch_client, ch_db, "events")
    assert sorted(r.event_id for r in rows) == sorted(distinct)

    dead = clickhouse.select(ch_client, ch_db, "dead_letters")
    reasons = {d.reason.split(":")[0] for d in dead}
    assert len(dead) == len(hostile)
    assert {d.kind for d in dead} == {"malformed", "unknown_type", "invalid", "oversize"}
    assert {d.field for d in dead} >= {"$", "$.type", "$.ts", "$.policy_version", "$.user_hash"}
    assert "unknown event type" in reasons and "malformed payload" in reasons
    assert any("exceeds the limit" in d.reason for d in dead)
    assert any("empty message" in d.reason for d in dead)
    dlq = [JsonCodec(DeadLetter).decode(m.value()) for m in read_topic(broker.bootstrap, topic_prefix + "dead_letters")]
    assert sorted(d.offset for d in dlq) == sorted(d.offset for d in dead)

    again = load_events(broker.bootstrap, topic_prefix + "events", topic_prefix + "dead_letters", ch_client, ch_db)
    assert (again.read, again.inserted) == (0, 0)


LOADER = textwrap.dedent(
    """
    import sys
    from rtrl import clickhouse
    from rtrl.loader import load_events
    bootstrap, prefix, dsn = sys.argv[1:4]
    ch = clickhouse.setup(dsn, "rtrl")
    r = load_events(bootstrap, prefix + "events", prefix + "dead_letters", ch, "rtrl", batch_size=500,
                    on_batch=lambda r: print(r.read, flush=True))
    final = ch.query("SELECT count() FROM rtrl.events FINAL").result_rows[0][0]
    raw = ch.query("SELECT count() FROM rtrl.events").result_rows[0][0]
    print("DONE", r.read, final, raw, flush=True)
    """
)


def test_kill_9_and_restart_loses_and_double_counts_nothing(broker, topic_prefix, tmp_path):
    """kill -9 the loader mid-load, restart it: every event is in ClickHouse exactly once under FINAL
    (replayed rows replace themselves) and the restart resumed from committed offsets, not the start."""
    emissions = generate(SimulatorSettings(trajectories=800, seed=11, duplicate_rate=0.0), SALT)
    codec = event_codec()
    _produce(broker.bootstrap, topic_prefix + "events",
             [(e.event.trajectory_id.encode(), codec.encode(e.event)) for e in emissions])
    dsn = f"chdb://{tmp_path / 'ch'}"
    args = [sys.executable, "-c", LOADER, broker.bootstrap, topic_prefix, dsn]

    first = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    progress = int(first.stdout.readline())
    os.kill(first.pid, signal.SIGKILL)
    first.wait(30)
    assert 0 < progress < len(emissions)

    second = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    done = second.stdout.strip().splitlines()[-1].split()
    read_again, final_rows, raw_rows = map(int, done[1:])
    assert final_rows == len(emissions)
    assert read_again <= len(emissions) - progress + 500 * 2  # resumed near the committed offset
    assert raw_rows >= final_rows
