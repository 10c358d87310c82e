"""Kafka sources and sinks for Bytewax flows, guarded against unreachable brokers.

Bytewax's ``KafkaSource`` lists partitions with no deadline (about ten minutes of retries when the
broker is down), so every source is built only after :func:`rtrl.kafka.check_broker` answered
within ``kafka.timeout_s``.
"""

from __future__ import annotations

import logging

from bytewax.connectors.kafka import KafkaSource

from rtrl.kafka import check_broker

#: Bytewax sources need ~1000 messages per poll for throughput (the default of 1 is ~5x slower).
SOURCE_BATCH_SIZE = 1000


def kafka_source(bootstrap: str, topics: list[str], timeout_s: float = 10.0, tail: bool = True) -> KafkaSource:
    """A Bytewax KafkaSource over ``topics`` after checking, within ``timeout_s``, that they exist."""
    meta = check_broker(bootstrap, timeout_s)
    missing = [t for t in topics if t not in meta.topics]
    if missing:
        from rtrl.errors import ServiceUnavailable

        raise ServiceUnavailable(f"topics {missing} do not exist on {bootstrap}; fix: run `rtrl topics` first")
    return KafkaSource(
        [bootstrap], topics, tail=tail, batch_size=SOURCE_BATCH_SIZE,
        add_config={
            "socket.connection.setup.timeout.ms": str(int(timeout_s * 1000)),
            # Each partition has its own consumer. Bounded prefetch and few, large, long-polled
            # fetches keep four consumers from out-fetching the worker (bench/RESULTS.md: 7.8k ->
            # 35k events/s on 2 cores); a 16 MB prefetch with 8 MB fetches halved throughput again.
            "queued.max.messages.kbytes": "4096",
            "fetch.min.bytes": "1048576",
            "max.partition.fetch.bytes": "4194304",
            "fetch.wait.max.ms": "500",
            "logger": logging.getLogger("rtrl.kafka"),
        },
    )
