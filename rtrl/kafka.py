"""Kafka access: bounded reachability checks, idempotent topic creation, client configs, produce with backpressure.

Every call that talks to the broker has a deadline, so an unreachable broker is reported with its
address within ``kafka.timeout_s`` instead of hanging (Bytewax's KafkaSource lists partitions
with no deadline; flows call :func:`check_broker` before building one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from rtrl.config import KafkaSettings
from rtrl.errors import ConfigError, SchemaMismatch, ServiceUnavailable
from rtrl.settings import Settings
from schemas.topics import TOPICS, TopicSpec

log = logging.getLogger("rtrl.kafka")


class KafkaConnection(str):
    """A broker address (``host:port,...``) carrying the librdkafka security settings of its cluster.

    It is a ``str`` on purpose: every rtrl function takes the broker as ``bootstrap: str``, prints it in its
    messages and hands it on, and all of them keep doing so unchanged, while :func:`base_config` - which
    every Producer, Consumer and AdminClient of rtrl is built from (tests/test_secure_connections.py holds
    the code to that) - adds :attr:`security` to the client's settings. A plain ``str`` is a PLAINTEXT broker
    (the local one, a test's). Build one from settings with :func:`connection`; anything derived from it
    by string operations (``split``, ``+``) is a plain ``str`` again, without the security. The secrets in
    :attr:`security` never show: ``str()`` is the address, ``repr()`` names the protocol only.
    """

    security: dict[str, str]

    def __new__(cls, bootstrap: str, security: Mapping[str, str] | None = None) -> KafkaConnection:
        self = super().__new__(cls, bootstrap)
        self.security = dict(security or {})
        return self

    def __repr__(self) -> str:
        return (
            f"KafkaConnection({str(self)!r}, security.protocol={self.security.get('security.protocol', 'PLAINTEXT')})"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its security (a flow's parts may be)
        return (KafkaConnection, (str(self), self.security))


def security_config(k: KafkaSettings) -> dict[str, str]:
    """The librdkafka security properties of the ``kafka`` settings (empty for PLAINTEXT): the one mapping from
    settings to ``security.protocol`` / ``sasl.*`` / ``ssl.*``. Files named by ``kafka.ssl_*`` must exist now
    (a ConfigError naming the setting otherwise): librdkafka would report them only when the client starts."""
    cfg: dict[str, str] = {}
    if k.security_protocol == "PLAINTEXT":
        return cfg
    cfg["security.protocol"] = k.security_protocol
    if k.security_protocol.startswith("SASL_"):
        cfg["sasl.mechanism"] = k.sasl_mechanism
        if k.sasl_mechanism == "OAUTHBEARER":
            cfg |= {
                "sasl.oauthbearer.method": "oidc",
                "sasl.oauthbearer.token.endpoint.url": k.oauth_token_endpoint_url,
                "sasl.oauthbearer.client.id": k.oauth_client_id,
                "sasl.oauthbearer.client.secret": k.oauth_client_secret,
            }
            if k.oauth_scope:
                cfg["sasl.oauthbearer.scope"] = k.oauth_scope
        else:
            cfg |= {"sasl.username": k.sasl_username, "sasl.password": k.sasl_password}
    if k.security_protocol.endswith("SSL"):
        files = {
            "ssl_ca_location": "ssl.ca.location",
            "ssl_certificate_location": "ssl.certificate.location",
            "ssl_key_location": "ssl.key.location",
        }
        for name, prop in files.items():
            path = getattr(k, name)
            if not path:
                continue
            if not Path(path).is_file():
                raise ConfigError(
                    f"kafka.{name} = {path!r} is not a readable file; fix: point kafka.{name} "
                    f"(RTRL_KAFKA__{name.upper()}) at the PEM file (e.g. a mounted Kubernetes Secret)"
                )
            cfg[prop] = path
        if k.ssl_key_password:
            cfg["ssl.key.password"] = k.ssl_key_password
        cfg["ssl.endpoint.identification.algorithm"] = k.ssl_endpoint_identification
    return cfg


def connection(k: KafkaSettings, bootstrap: str | None = None) -> KafkaConnection:
    """The cluster rtrl's clients connect to: ``bootstrap`` (default ``kafka.bootstrap``) with the ``kafka``
    section's security. A ``bootstrap`` that is a KafkaConnection already is returned as it is."""
    if isinstance(bootstrap, KafkaConnection):
        return bootstrap
    return KafkaConnection(bootstrap or k.bootstrap, security_config(k))


def base_config(bootstrap: str) -> dict[str, Any]:
    """librdkafka settings every rtrl client shares: the brokers, their security when ``bootstrap`` is a
    :class:`KafkaConnection`, and its logs to Python logging (not stderr). Every Producer, Consumer and
    AdminClient of rtrl is built from this (or :func:`producer_config`, which starts from it)."""
    return {"bootstrap.servers": str(bootstrap), "logger": log} | getattr(bootstrap, "security", {})


def producer_config(bootstrap: str, compression: str = "zstd", **overrides: Any) -> dict[str, Any]:
    """Idempotent producer: retries never duplicate or reorder within a partition.

    Batches are compressed (``kafka.compression``, zstd by default): the broker stores and serves
    compressed batches, so disk, network and the broker's own work shrink with the payload.
    """
    cfg = base_config(bootstrap) | {
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "compression.type": compression,
    }
    return cfg | overrides


def check_broker(bootstrap: str, timeout_s: float = 10.0) -> Any:
    """Cluster metadata, or ServiceUnavailable naming the address after ``timeout_s``."""
    if not bootstrap:
        raise ServiceUnavailable("no Kafka broker configured; fix: set kafka.bootstrap (RTRL_KAFKA__BOOTSTRAP)")
    admin = AdminClient(
        base_config(bootstrap) | {"socket.connection.setup.timeout.ms": max(1000, int(timeout_s * 1000))}
    )
    try:
        return admin.list_topics(timeout=timeout_s)
    except KafkaException as e:
        raise ServiceUnavailable(
            f"Kafka broker at {bootstrap} did not answer within {timeout_s:g}s ({e.args[0].str() if e.args else e}); "
            "fix: start it (`rtrl broker up`) or set kafka.bootstrap (RTRL_KAFKA__BOOTSTRAP)"
            + (
                f", and check kafka.security_protocol ({bootstrap.security.get('security.protocol', 'PLAINTEXT')}) "
                "and the kafka.sasl_* / kafka.ssl_* / kafka.oauth_* settings match the cluster's listener"
                if isinstance(bootstrap, KafkaConnection) and bootstrap.security
                else ""
            )
        ) from None


def ensure_topics(
    bootstrap: str,
    prefix: str,
    default_partitions: int,
    specs: tuple[TopicSpec, ...] = TOPICS,
    timeout_s: float = 10.0,
    replication_factor: int = 1,
    min_insync_replicas: int = 1,
) -> list[str]:
    """Create missing topics; check existing ones; return the names created now.

    New topics get their partitions (``spec.partitions`` or ``default_partitions``), retention,
    ``replication_factor`` replicas and, when ``min_insync_replicas`` > 1, the topic config
    ``min.insync.replicas`` (at 1 the cluster's own default is left in place: it can only be higher).
    Topics that exist already must have those partitions and that replication factor (and at least
    ``min_insync_replicas`` when it is > 1), else SchemaMismatch lists every difference and its fix:
    nothing is created then. A cluster with fewer brokers than ``replication_factor`` is a ConfigError.
    """
    if replication_factor < 1:
        raise ConfigError(
            f"kafka.replication_factor = {replication_factor} must be >= 1; "
            "fix: set kafka.replication_factor (RTRL_KAFKA__REPLICATION_FACTOR)"
        )
    if not 1 <= min_insync_replicas <= replication_factor:
        raise ConfigError(
            f"kafka.min_insync_replicas = {min_insync_replicas} must be between 1 and kafka.replication_factor "
            f"= {replication_factor} (with more, every acks=all write fails with NOT_ENOUGH_REPLICAS); fix: set "
            f"kafka.min_insync_replicas (RTRL_KAFKA__MIN_INSYNC_REPLICAS) to at most {replication_factor}, "
            "or raise kafka.replication_factor"
        )
    meta = check_broker(bootstrap, timeout_s)
    admin = AdminClient(base_config(bootstrap))
    partitions = {prefix + s.name: s.partitions or default_partitions for s in specs}
    existing = [name for name in partitions if name in meta.topics]
    problems = _topic_mismatches(
        admin,
        meta,
        existing,
        partitions,
        {s.name: s for s in specs},
        prefix,
        replication_factor,
        min_insync_replicas,
        timeout_s,
    )
    if problems:
        raise SchemaMismatch(
            f"Kafka topics on {bootstrap} differ from what rtrl wants:\n  - " + "\n  - ".join(problems)
        )
    missing = [s for s in specs if prefix + s.name not in meta.topics]
    if missing and replication_factor > len(meta.brokers):
        raise _too_few_brokers(bootstrap, replication_factor, len(meta.brokers))
    topic_config = {"min.insync.replicas": str(min_insync_replicas)} if min_insync_replicas > 1 else {}
    wanted = [
        NewTopic(prefix + s.name, partitions[prefix + s.name], replication_factor, config=s.configs() | topic_config)
        for s in missing
    ]
    created = []
    if wanted:
        for name, fut in admin.create_topics(wanted, request_timeout=timeout_s).items():
            try:
                fut.result(timeout=timeout_s)
                created.append(name)
            except KafkaException as e:
                if e.args[0].name() == "TOPIC_ALREADY_EXISTS":  # lost a race with another creator: fine
                    continue
                if e.args[0].name() == "INVALID_REPLICATION_FACTOR":  # brokers left since the metadata
                    raise _too_few_brokers(bootstrap, replication_factor, len(meta.brokers), e) from None
                raise ServiceUnavailable(f"could not create topic {name} on {bootstrap}: {e}") from None
    return created


def _too_few_brokers(bootstrap: str, replication_factor: int, brokers: int, err: Any = None) -> ConfigError:
    said = f" (broker: {err.args[0].str()})" if err is not None else ""
    return ConfigError(
        f"kafka.replication_factor = {replication_factor} but the cluster at {bootstrap} has {brokers} broker(s) "
        f"registered{said}; fix: set kafka.replication_factor (RTRL_KAFKA__REPLICATION_FACTOR) to at most "
        f"{brokers} (and kafka.min_insync_replicas no higher), or start the missing brokers"
    )


def _topic_mismatches(
    admin: AdminClient,
    meta: Any,
    names: list[str],
    partitions: dict[str, int],
    specs: dict[str, TopicSpec],
    prefix: str,
    replication_factor: int,
    min_insync_replicas: int,
    timeout_s: float,
) -> list[str]:
    """One line per difference between the existing topics ``names`` and what is wanted, with its fix."""
    problems = []
    for name in names:
        found = meta.topics[name].partitions
        want = partitions[name]
        setting = "kafka.partitions" if specs[name[len(prefix) :]].partitions is None else "schemas/topics.py"
        if len(found) != want:
            if len(found) < want:
                fix = (
                    f"add partitions (kafka-topics.sh --alter --topic {name} --partitions {want}; keys then map "
                    f"to other partitions), set {setting} to {len(found)}, or delete and recreate the topic"
                )
            else:
                fix = (
                    f"set {setting} to {len(found)}, or delete and recreate the topic "
                    "(Kafka can only add partitions, never remove them)"
                )
            problems.append(f"topic {name} has {len(found)} partitions, {setting} wants {want}; fix: {fix}")
        factors = sorted({len(p.replicas) for p in found.values()})
        if factors and factors != [replication_factor]:
            problems.append(
                f"topic {name} has replication factor {'/'.join(map(str, factors))}, kafka.replication_factor wants "
                f"{replication_factor}; fix: set kafka.replication_factor to {factors[0]}, change the topic's "
                "replicas with kafka-reassign-partitions.sh, or delete and recreate it"
            )
    # the topics whose spec wants the broker's clock, and every topic when min.insync.replicas is checked
    described = [n for n in names if min_insync_replicas > 1 or specs[n[len(prefix) :]].timestamp_type != "CreateTime"]
    if described:
        resources = [ConfigResource("topic", name) for name in described]
        for res, fut in admin.describe_configs(resources, request_timeout=timeout_s).items():
            cfg = fut.result(timeout=timeout_s)
            stamp = specs[res.name[len(prefix) :]].timestamp_type
            found = cfg["message.timestamp.type"].value if "message.timestamp.type" in cfg else stamp
            if stamp != "CreateTime" and found != stamp:
                problems.append(
                    f"topic {res.name} has message.timestamp.type {found}, rtrl wants {stamp} (the reward flow bounds "
                    f"event time by the broker's clock); fix: kafka-configs.sh --alter --entity-type topics "
                    f"--entity-name {res.name} --add-config message.timestamp.type={stamp}"
                )
            if min_insync_replicas <= 1:
                continue
            if "min.insync.replicas" in cfg and int(cfg["min.insync.replicas"].value) < min_insync_replicas:
                problems.append(
                    f"topic {res.name} has min.insync.replicas {cfg['min.insync.replicas'].value}, "
                    f"kafka.min_insync_replicas wants {min_insync_replicas}; fix: kafka-configs.sh --alter "
                    f"--entity-type topics --entity-name {res.name} --add-config "
                    f"min.insync.replicas={min_insync_replicas}, or lower kafka.min_insync_replicas"
                )
    return problems


def describe_topic(bootstrap: str, topic: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Partitions, replication factor, retention and ``min.insync.replicas``, as the broker reports them.

    ``replication_factor`` is the smallest replica count over the topic's partitions (they differ only
    during a reassignment).
    """
    meta = check_broker(bootstrap, timeout_s)
    if topic not in meta.topics:
        raise ServiceUnavailable(f"topic {topic} does not exist on {bootstrap}")
    admin = AdminClient(base_config(bootstrap))
    fut = admin.describe_configs([ConfigResource("topic", topic)])[ConfigResource("topic", topic)]
    cfg = fut.result(timeout=timeout_s)
    parts = meta.topics[topic].partitions
    return {
        "partitions": len(parts),
        "replication_factor": min((len(p.replicas) for p in parts.values()), default=0),
        **{
            k: cfg[k].value
            for k in ("retention.ms", "cleanup.policy", "min.insync.replicas", "message.timestamp.type")
            if k in cfg
        },
    }


def produce(
    producer: Any,
    topic: str,
    value: bytes | None,
    key: bytes | None = None,
    on_delivery: Callable[[Any, Any], None] | None = None,
    poll_s: float = 0.05,
    stop: Callable[[], bool] | Any | None = None,
    timestamp: int = 0,
) -> bool:
    """Hand one message to ``producer``, waiting while its local queue is full; never drops it.

    confluent-kafka raises BufferError when the producer's queue (``queue.buffering.max.messages`` /
    ``.kbytes``) is full, e.g. while the broker is down or slower than the caller. This serves delivery
    callbacks with ``producer.poll(poll_s)`` (which frees the queue as the broker acknowledges) and
    retries: the caller is held back (backpressure) for as long as it takes. ``stop``, a callable or a
    ``threading.Event``, is asked before each wait: when true this gives up and returns False, the
    message not produced. Returns True once the producer took the message (its delivery is reported to
    ``on_delivery`` later, from a ``poll``/``flush``); the fast path costs one ``produce`` call.
    ``timestamp`` is the record's CreateTime in ms (0: the producer's clock now); a topic with
    ``LogAppendTime`` replaces it with the broker's.
    """
    stopped = getattr(stop, "is_set", stop)
    while True:
        try:
            producer.produce(topic, value=value, key=key, on_delivery=on_delivery, timestamp=timestamp)
            return True
        except BufferError:
            if stopped is not None and stopped():
                return False
            producer.poll(poll_s)


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
        base_config(bootstrap)
        | {"group.id": "rtrl-reader", "enable.auto.commit": False, "auto.offset.reset": "earliest"}
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
                p, off = msg.partition(), msg.offset()
                if p in ends and off is not None and off >= ends[p] - 1:  # a consumed message has an offset
                    del ends[p]
                yield msg
    finally:
        consumer.close()


def ensure_topics_for(settings: Settings, bootstrap: str) -> list[str]:
    """:func:`ensure_topics` with the ``kafka`` section's prefix, partitions, replication, timeout and security."""
    k = settings.kafka
    return ensure_topics(
        connection(k, bootstrap),
        k.topic_prefix,
        k.partitions,
        timeout_s=k.timeout_s,
        replication_factor=k.replication_factor,
        min_insync_replicas=k.min_insync_replicas,
    )
