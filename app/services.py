"""The services every application job uses: the Kafka broker and ClickHouse, set up and migrated.

With ``kafka.bootstrap`` empty (the embedded defaults) the application starts the dev-only local
broker (:mod:`devservices.broker`), and the process mode serves the embedded ClickHouse folder through
:mod:`devservices.chserver`. This module is the one place outside tests and benchmarks that reaches
into ``devservices`` (tests/test_architecture.py holds it to that), and only when those embedded
defaults are in use: with a cluster and a server configured, ``devservices`` is never imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rtrl import clickhouse
from rtrl.kafka import ensure_topics_for
from rtrl.settings import Settings

if TYPE_CHECKING:
    import subprocess

    from devservices.broker import LocalBroker


def local_broker(data_dir: Path, port: int | None = None) -> LocalBroker:
    """The dev-only noida-db broker under ``data_dir`` (``rtrl broker``, the embedded defaults)."""
    from devservices.broker import LocalBroker

    return LocalBroker(data_dir, port=port)


def spawn_embedded_clickhouse(folder: str, log: Path) -> tuple[subprocess.Popen, str]:
    """The embedded ClickHouse folder behind its HTTP front in its own process: (process, http DSN)."""
    from devservices import chserver

    return chserver.spawn(folder, log=log)


def serve_embedded_clickhouse(argv: list[str]) -> Any:
    """``rtrl clickhouse serve``: the HTTP front in this process."""
    from devservices import chserver

    return chserver.main(argv)


def bootstrap_for(settings: Settings) -> str:
    """``kafka.bootstrap`` if set, else the local broker under ``data_dir/broker`` (started or reused)."""
    if settings.kafka.bootstrap:
        return settings.kafka.bootstrap
    return local_broker(settings.data_path / "broker").up(timeout_s=max(30.0, settings.kafka.timeout_s))


class Services:
    """The broker (local noida-db unless ``kafka.bootstrap`` is set) and ClickHouse, set up and migrated."""

    def __init__(self, settings: Settings):
        self.local_broker: LocalBroker | None = None
        if settings.kafka.bootstrap:
            self.bootstrap = settings.kafka.bootstrap
        else:
            self.local_broker = local_broker(settings.data_path / "broker")
            self.bootstrap = self.local_broker.up(timeout_s=max(30.0, settings.kafka.timeout_s))
        try:
            ensure_topics_for(settings, self.bootstrap)
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
