"""Kafka access: bounded reachability checks, idempotent topic creation, client configs.

Every call that talks to the broker has a deadline, so an unreachable broker is reported with its
address within ``kafka.timeout_s`` instead of hanging (Bytewax's KafkaSource lists partitions
with no deadline; flows call :func:`check_broker` before building one).
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from rtrl.errors import ServiceUnavailable
from schemas.topics import TOPICS, TopicSpec

log = logging.getLogger("rtrl.kafka")


def base_config(bootstrap: str) -> dict[str, Any]:
    """librdkafka settings every rtrl client shares (its logs go to Python logging, not stderr)."""
    return {"bootstrap.servers": bootstrap, "logger": log}


def producer_config(bootstrap: str, compression: str = "zstd", **overrides: Any) -> dict[str, Any]:
    """Idempotent producer: retries never duplicate or reorder within a partition.

    Batches are compressed (``kafka.compression``, zstd by default): the broker stores and serves
    compressed batches, so disk, network and the broker's own work shrink with the payload.
    """
    cfg = base_config(bootstrap) | {"enable.idempotence": True, "acks": "all", "linger.ms": 5,
                                    "compression.type": compression}
    return cfg | overrides


def check_broker(bootstrap: str, timeout_s: float = 10.0) -> Any:
    """Cluster metadata, or ServiceUnavailable naming the address after ``timeout_s``."""
    if not bootstrap:
        raise ServiceUnavailable("no Kafka broker configured; fix: set kafka.bootstrap (RTRL_KAFKA__BOOTSTRAP)")
    admin = AdminClient(base_config(bootstrap) | {"socket.connection.setup.timeout.ms": max(1000, int(timeout_s * 1000))})
    try:
        return admin.list_topics(timeout=timeout_s)
    except KafkaException as e:
        raise ServiceUnavailable(
            f"Kafka broker at {bootstrap} did not answer within {timeout_s:g}s ({e.args[0].str() if e.args else e}); "
            "fix: start it (`rtrl broker up`) or set kafka.bootstrap (RTRL_KAFKA__BOOTSTRAP)"
        ) from None


def ensure_topics(
    bootstrap: str, prefix: str, default_partitions: int, specs: tuple[TopicSpec, ...] = TOPICS, timeout_s: float = 10.0
) -> list[str]:
    """Create missing topics with their partitions and retention; return the names created now."""
    meta = check_broker(bootstrap, timeout_s)
    admin = AdminClient(base_config(bootstrap))
    wanted = [
        NewTopic(prefix + s.name, s.partitions or default_partitions, 1, config=s.configs())
        for s in specs
        if prefix + s.name not in meta.topics
    ]
    created = []
    if wanted:
        for name, fut in admin.create_topics(wanted, request_timeout=timeout_s).items():
            try:
                fut.result(timeout=timeout_s)
                created.append(name)
            except KafkaException as e:
                if e.args[0].name() != "TOPIC_ALREADY_EXISTS":  # lost a race with another creator: fine
                    raise ServiceUnavailable(f"could not create topic {name} on {bootstrap}: {e}") from None
    return created


def describe_topic(bootstrap: str, topic: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Partitions and retention settings of a topic, as the broker reports them."""
    meta = check_broker(bootstrap, timeout_s)
    if topic not in meta.topics:
        raise ServiceUnavailable(f"topic {topic} does not exist on {bootstrap}")
    admin = AdminClient(base_config(bootstrap))
    fut = admin.describe_configs([ConfigResource("topic", topic)])[ConfigResource("topic", topic)]
    cfg = fut.result(timeout=timeout_s)
    return {
        "partitions": len(meta.topics[topic].partitions),
        **{k: cfg[k].value for k in ("retention.ms", "cleanup.policy") if k in cfg},
    }


def read_topic(bootstrap: str, topic: str, timeout_s: float = 30.0, batch: int = 1000):
    """Yield every message currently in ``topic`` (all partitions, from the start to the high watermark).

    Uses partition assignment, not a consumer group, so nothing is committed; for audits, tests and
    tools. Raises ServiceUnavailable when the end is not reached within ``timeout_s``.
    """
    import time

    from confluent_kafka import Consumer, TopicPartition

    meta = check_broker(bootstrap, timeout_s)
    if topic not in meta.topics:
        raise ServiceUnavailable(f"topic {topic} does not exist on {bootstrap}")
    consumer = Consumer(
        base_config(bootstrap) | {"group.id": "rtrl-reader", "enable.auto.commit": False, "auto.offset.reset": "earliest"}
    )
    try:
        ends = {}
        for p in meta.topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"reading {topic} on {bootstrap} did not reach the end within {timeout_s:g}s")
            for msg in consumer.consume(batch, 0.2):
                if msg.error():
                    continue
                p = msg.partition()
                if p in ends and msg.offset() >= ends[p] - 1:
                    del ends[p]
                yield msg
    finally:
        consumer.close()
