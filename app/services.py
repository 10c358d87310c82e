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

from flows.reward_versions import register_settings
from rtrl import clickhouse
from rtrl.files import data_folder
from rtrl.kafka import check_broker, connection, ensure_topics_for
from rtrl.settings import Settings

if TYPE_CHECKING:
    import subprocess

    from devservices.broker import LocalBroker


def local_broker(data_dir: Path, port: int | None = None) -> LocalBroker:
    """The dev-only noida-db broker under ``data_dir`` (``rtrl broker``, the embedded defaults)."""
    from devservices.broker import LocalBroker

    return LocalBroker(data_dir, port=port)


def spawn_embedded_clickhouse(
    folder: str, log: Path, *, port: int = 0, fresh_tokens: bool = True, database: str = "rtrl"
) -> tuple[subprocess.Popen, str]:
    """The embedded ClickHouse folder behind its HTTP front in its own process: (process, writer's DSN).

    The DSN (``http://rtrl_writer@127.0.0.1:P/?password_file=…``) names the owner-only file of the run's
    token, never the token: pass it on as ``clickhouse.dsn`` and :func:`rtrl.clickhouse.connect` reads the
    file. To restart a front that died without disturbing its clients, pass its ``port`` and
    ``fresh_tokens=False``: same DSN, same token. ``database`` is the one whose tables the analyst may read."""
    from devservices import chserver

    return chserver.spawn(folder, log=log, port=port, fresh_tokens=fresh_tokens, extra_args=["--database", database])


def serve_embedded_clickhouse(argv: list[str]) -> Any:
    """``rtrl clickhouse serve``: the HTTP front in this process."""
    from devservices import chserver

    return chserver.main(argv)


def bootstrap_for(settings: Settings) -> str:
    """``kafka.bootstrap`` if set, as a :class:`rtrl.kafka.KafkaConnection` carrying the cluster's security
    (checked: ServiceUnavailable naming it unless a broker answers within ``kafka.timeout_s``), else the local
    broker under ``data_dir/broker`` (started or reused; PLAINTEXT)."""
    if settings.kafka.bootstrap:
        cluster = connection(settings.kafka)
        check_broker(cluster, settings.kafka.timeout_s)
        return cluster
    return local_broker(settings.data_path / "broker").up(timeout_s=max(30.0, settings.kafka.timeout_s))


def preflight(settings: Settings, *, clickhouse_too: bool = True) -> str:
    """Before any long work (a warm start, a flow, a training run): the data folder made owner-only, the
    broker checked (its bootstrap returned) and, with ``clickhouse_too``, a ClickHouse server answering
    ``/ping`` within ``clickhouse.timeout_s``. Each failure is one ServiceUnavailable naming the address."""
    data_folder(settings.data_path)
    bootstrap = bootstrap_for(settings)
    dsn = settings.clickhouse_dsn
    if clickhouse_too and dsn.startswith(("http://", "https://")):
        clickhouse.ping(dsn, settings.clickhouse.timeout_s)
    return bootstrap


class Services:
    """The broker (local noida-db unless ``kafka.bootstrap`` is set) and ClickHouse, set up and migrated."""

    def __init__(self, settings: Settings):
        data_folder(settings.data_path)  # owner-only: the broker's control token and every reward live there
        self.local_broker: LocalBroker | None = None
        self.bootstrap: str
        if settings.kafka.bootstrap:
            self.bootstrap = connection(settings.kafka)  # the address with the cluster's security
        else:
            self.local_broker = local_broker(settings.data_path / "broker")
            self.bootstrap = self.local_broker.up(timeout_s=max(30.0, settings.kafka.timeout_s))
        try:
            ensure_topics_for(settings, self.bootstrap)
            self.ch = clickhouse.setup_from(settings)
            # the reward versions this run scores, registered before anything starts (refuses changed weights
            # under a name that has scored: a one-line error now, not a reward flow failing later)
            register_settings(settings, client=self.ch)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.local_broker is not None:
            self.local_broker.down()
            self.local_broker = None
