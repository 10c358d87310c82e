"""Decisions on Kafka: checkpoints on ``rtrl.deployments`` and experiments on ``rtrl.experiments``.

Every decision is recorded in ClickHouse first and then announced (:func:`announce`). :func:`rollback` undoes a
promotion. The experiments' announcements start and end a live A/B.
"""

from __future__ import annotations

import time

import msgspec
from confluent_kafka import Producer

from rtrl import clickhouse, metrics
from rtrl.errors import ConfigError, ServiceUnavailable
from rtrl.kafka import connection, producer_config, read_topic
from rtrl.settings import Settings
from schemas.codec import Invalid, JsonCodec
from schemas.records import Checkpoint, Experiment


def end_running_experiments(settings: Settings, bootstrap: str, producer: Producer) -> list[str]:
    """Announce ``ended`` for every experiment ``rtrl.experiments`` still has as running: a run stopped during its
    final A/B (kill -9, a lost broker) leaves one, which a policy server would serve again once its serving
    version serves. The main job calls it before it serves anything; returns the keys it ended."""
    codec: JsonCodec[Experiment] = JsonCodec(Experiment)
    newest: dict[str, Experiment] = {}
    for msg in read_topic(
        connection(settings.kafka, bootstrap), settings.topic("experiments"), timeout_s=settings.kafka.timeout_s
    ):
        try:
            exp = codec.decode(msg.value())
        except Invalid:
            continue
        newest[exp.key] = exp
    stale = [e for e in newest.values() if e.status == "running"]
    now = time.time_ns() // 1_000_000
    ended = [msgspec.structs.replace(e, status="ended", created_at=max(now, e.created_at)) for e in stale]
    announce_experiments(settings, producer, ended)
    return [e.key for e in stale]


def announce_experiments(settings: Settings, producer: Producer, experiments: list[Experiment]) -> None:
    """Publish ``experiments`` on ``rtrl.experiments`` (keyed by experiment) and wait for the broker's
    acknowledgement; ServiceUnavailable naming the topic when it does not come within 30 s."""
    if not experiments:
        return
    topic = settings.topic("experiments")
    codec: JsonCodec[Experiment] = JsonCodec(Experiment)
    for exp in experiments:
        producer.produce(topic, key=exp.key.encode(), value=codec.encode(exp))
    if producer.flush(30):
        raise ServiceUnavailable(f"announcing {len(experiments)} experiment(s) on {topic} did not finish within 30s")


def rollback(settings: Settings, bootstrap: str, ch, version: int, reason: str) -> Checkpoint:
    """Mark ``version`` rolled back and re-promote its parent (what ``rtrl rollback`` does)."""
    db = settings.clickhouse.database
    rows = {c.version: c for c in clickhouse.select(ch, db, "checkpoints")}
    if version not in rows:
        known = ", ".join(f"v{v}" for v in sorted(rows)) or "none (run `rtrl run` first)"
        raise ConfigError(f"no checkpoint v{version} in {db}.checkpoints; known versions: {known}")
    bad = rows[version]
    if bad.parent is None:
        raise ConfigError(f"v{version} has no parent to roll back to (it is the warm start)")
    parent = rows[bad.parent]
    producer = Producer(producer_config(connection(settings.kafka, bootstrap), settings.kafka.compression))
    now = time.time_ns() // 1_000_000
    back = msgspec.structs.replace(bad, status="rolled_back", reason=reason, created_at=now)
    announce(settings, ch, producer, back)
    announce(
        settings,
        ch,
        producer,
        msgspec.structs.replace(
            parent, status="promoted", reason=f"re-promoted: rollback of v{version}", created_at=now + 1
        ),
    )
    return back


def announce(settings: Settings, ch, producer: Producer, ck: Checkpoint) -> None:
    """Record a checkpoint decision in ClickHouse ``checkpoints`` (an org's adapter: ``adapter_checkpoints``) and
    publish it on ``rtrl.deployments``, keyed by version (an adapter: by org and version)."""
    clickhouse.insert(ch, settings.clickhouse.database, "adapter_checkpoints" if ck.org else "checkpoints", [ck])
    codec: JsonCodec[Checkpoint] = JsonCodec(Checkpoint)
    key = f"{ck.org}/{ck.version}" if ck.org else str(ck.version)
    producer.produce(settings.topic("deployments"), key=key.encode(), value=codec.encode(ck))
    if producer.flush(30):
        raise RuntimeError("deployment announcement not acknowledged")
    metrics.observe_decision(ck.status, ck.org, ck.version, "train")
