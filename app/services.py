"""The services every application job uses: the Kafka broker and ClickHouse, set up and migrated.

With ``kafka.bootstrap`` empty (the embedded defaults) the application starts the dev-only local
broker (:mod:`devservices.broker`); this module is the one place outside tests and benchmarks that
reaches into ``devservices`` (tests/test_architecture.py holds it to that).
"""

from __future__ import annotations

from devservices import chserver
from devservices.broker import LocalBroker, free_port
from rtrl import clickhouse
from rtrl.kafka import ensure_topics
from rtrl.settings import Settings

__all__ = ["LocalBroker", "Services", "bootstrap_for", "chserver", "free_port"]


def bootstrap_for(settings: Settings) -> str:
    """``kafka.bootstrap`` if set, else the local broker under ``data_dir/broker`` (started or reused)."""
    if settings.kafka.bootstrap:
        return settings.kafka.bootstrap
    return LocalBroker(settings.data_path / "broker").up(timeout_s=max(30.0, settings.kafka.timeout_s))


class Services:
    """The broker (local noida-db unless ``kafka.bootstrap`` is set) and ClickHouse, set up and migrated."""

    def __init__(self, settings: Settings):
        self.local_broker: LocalBroker | None = None
        if settings.kafka.bootstrap:
            self.bootstrap = settings.kafka.bootstrap
        else:
            self.local_broker = LocalBroker(settings.data_path / "broker")
            self.bootstrap = self.local_broker.up(timeout_s=max(30.0, settings.kafka.timeout_s))
        try:
            ensure_topics(
                self.bootstrap,
                settings.kafka.topic_prefix,
                settings.kafka.partitions,
                timeout_s=settings.kafka.timeout_s,
                replication_factor=settings.kafka.replication_factor,
                min_insync_replicas=settings.kafka.min_insync_replicas,
            )
            self.ch = clickhouse.setup(
                settings.clickhouse_dsn, settings.clickhouse.database, settings.clickhouse.timeout_s
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.local_broker is not None:
            self.local_broker.down()
            self.local_broker = None
