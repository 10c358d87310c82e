"""The main job on the embedded defaults.

What exists today (issue 2, Foundation): simulated users -> client SDK -> Kafka ``rtrl.events``
-> loader -> ClickHouse ``events`` (+ dead letters), then a behaviour table and plots per policy
version read back from ClickHouse. The reward flow, trainer and closed loop (issues 3-5) will
extend this job; until then it says so.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from client.sdk import RtrlClient
from rtrl import clickhouse, report
from rtrl.broker import LocalBroker
from rtrl.config import Settings
from rtrl.kafka import ensure_topics
from rtrl.loader import load_events
from simulator.drive import drive
from simulator.generate import generate, stats

#: Policy versions the foundation run simulates (their behaviour comes from simulator profiles).
SIMULATED_VERSIONS = (0, 1)


class Services:
    """The broker (local noida-db unless ``kafka.bootstrap`` is set) and ClickHouse, set up and migrated."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.local_broker: LocalBroker | None = None
        if settings.kafka.bootstrap:
            self.bootstrap = settings.kafka.bootstrap
        else:
            self.local_broker = LocalBroker(settings.data_path / "broker")
            self.bootstrap = self.local_broker.up(timeout_s=max(30.0, settings.kafka.timeout_s))
        try:
            ensure_topics(self.bootstrap, settings.kafka.topic_prefix, settings.kafka.partitions,
                          timeout_s=settings.kafka.timeout_s)
            self.ch = clickhouse.setup(settings.clickhouse_dsn, settings.clickhouse.database, settings.clickhouse.timeout_s)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.local_broker is not None:
            self.local_broker.down()
            self.local_broker = None


def run(settings: Settings, console: Console | None = None) -> list[dict]:
    """Run the foundation pipeline once; returns the per-version behaviour rows it printed."""
    console = console or Console()
    console.rule("[bold]rtrl main job")
    console.print(
        "[yellow]The closed loop (reward flow, trainer, eval gate) is not built yet (issues 3-5).[/] "
        "This run: simulated users -> SDK -> Kafka -> ClickHouse, then behaviour per policy version."
    )
    t0 = time.monotonic()
    services = Services(settings)
    try:
        console.print(f"broker {services.bootstrap} · ClickHouse {clickhouse.redact(settings.clickhouse_dsn)}"
                      f" (database {settings.clickhouse.database}) · topics {settings.topic('*')}")
        sim = settings.simulator
        start_ms = sim.start_ms or time.time_ns() // 1_000_000
        with RtrlClient.from_settings(settings, bootstrap=services.bootstrap) as client:
            for v in SIMULATED_VERSIONS:
                emissions = generate(replace(sim, seed=sim.seed + v, start_ms=start_ms), settings.sdk.salt, policy_version=v)
                s = stats(emissions)
                result = drive(client, emissions, rate=sim.rate, progress=True)
                console.print(
                    f"policy v{v}: {s['trajectories']:,} trajectories, {result.accepted:,} events sent "
                    f"({s['duplicates']} duplicates, {s['reordered']} out of order, {s['late_checks']} late checks) "
                    f"in {result.seconds:.1f}s; dropped {result.dropped}"
                )
            final = client.close()
        console.print(f"SDK: {final.delivered:,} delivered, {final.failed} failed, {final.dropped} dropped")
        with Progress(console=console) as bar:
            task = bar.add_task("loading events into ClickHouse", total=final.delivered or None)
            loaded = load_events(
                services.bootstrap, settings.topic("events"), settings.topic("dead_letters"), services.ch,
                settings.clickhouse.database, max_event_bytes=settings.sdk.max_event_bytes,
                on_batch=lambda r: bar.update(task, completed=r.read),
            )
        console.print(f"loader: {loaded.read:,} read, {loaded.inserted:,} inserted, {loaded.dead_lettered} dead-lettered")
        rows = report.behaviour_by_version(services.ch, settings.clickhouse.database)
        title = "Behaviour per policy version (simulated profiles; from ClickHouse events FINAL)"
        console.print(report.table(rows, title))
        png = report.plot(rows, Path(settings.data_path) / "reports" / "behaviour.png", title)
        console.print(f"plots: {png}")
        console.print(f"done in {time.monotonic() - t0:.1f}s")
        return rows
    finally:
        services.close()
