"""``rtrl ab``: two simulated behaviour profiles side by side, and the local services every job uses.

Simulated users of two policy profiles -> client SDK -> Kafka ``rtrl.events`` -> the reward flow
(Bytewax: windows, versioned rewards) -> ClickHouse ``events``/``rewards``/``trajectories``, then
behaviour and reward per policy version from the monitors' views, as a table with 95% intervals and
PNG plots. (The main job, the closed loop, is :mod:`rtrl.loop`.)
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from bytewax.testing import run_main
from rich.console import Console

from client.sdk import RtrlClient
from flows.rewards import build_flow
from rtrl import clickhouse, report
from rtrl.broker import LocalBroker
from rtrl.config import Settings
from rtrl.kafka import ensure_topics
from simulator.drive import drive
from simulator.generate import generate, stats

#: Policy versions the run simulates side by side (their behaviour comes from simulator profiles).
SIMULATED_VERSIONS = (0, 1)


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
    """Run the pipeline once; returns the per-version rows it printed."""
    console = console or Console()
    console.rule("[bold]rtrl ab: two behaviour profiles")
    console.print("Two simulated behaviour profiles: users -> SDK -> Kafka -> reward flow -> ClickHouse, then "
                  "behaviour and reward per policy version.")
    t0 = time.monotonic()
    services = Services(settings)
    try:
        db = settings.clickhouse.database
        console.print(f"broker {services.bootstrap} · ClickHouse {clickhouse.redact(settings.clickhouse_dsn)}"
                      f" (database {db}) · topics {settings.topic('*')} · reward versions {settings.flow.reward_versions}")
        sim = settings.simulator
        start_ms = sim.start_ms or time.time_ns() // 1_000_000
        emissions = []
        for v in SIMULATED_VERSIONS:  # versions served side by side, as in an A/B test
            part = generate(replace(sim, seed=sim.seed + v, start_ms=start_ms), settings.sdk.salt, policy_version=v,
                            arm="control" if v == SIMULATED_VERSIONS[0] else "candidate")
            s = stats(part)
            console.print(f"policy v{v}: {s['trajectories']:,} trajectories, {s['emissions']:,} events "
                          f"({s['duplicates']} duplicates, {s['reordered']} out of order, {s['late_checks']} late checks)")
            emissions += part
        emissions.sort(key=lambda e: e.at_ms)
        with RtrlClient.from_settings(settings, bootstrap=services.bootstrap) as client:
            result = drive(client, emissions, rate=sim.rate, progress=True)
            final = client.close()
        console.print(f"SDK: {result.accepted:,} sent in {result.seconds:.1f}s; {final.delivered:,} delivered, "
                      f"{final.failed} failed, {final.dropped} dropped")
        with console.status("reward flow: windows -> rewards -> ClickHouse ..."):
            t = time.monotonic()
            run_main(build_flow(replace(settings, flow=replace(settings.flow, tail=False)), bootstrap=services.bootstrap))
        counts = {t_: services.ch.query(f"SELECT count() FROM {db}.{t_} FINAL").result_rows[0][0]
                  for t_ in ("events", "rewards", "trajectories", "dead_letters")}
        console.print(f"reward flow: {time.monotonic() - t:.1f}s; " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
        rows = report.version_rows(services.ch, db, settings.flow.versions[0])
        ab = report.comparison(services.ch, db, rows)
        title = (f"Behaviour and reward ({settings.flow.versions[0]}) per policy version — simulated profiles, "
                 "from ClickHouse; change vs the first version [95% CI]")
        console.print(report.table(rows, title, ab))
        png = report.plot(rows, Path(settings.data_path) / "reports" / "behaviour.png", "Behaviour per policy version")
        console.print(f"plots: {png}")
        console.print(f"done in {time.monotonic() - t0:.1f}s")
        return rows
    finally:
        services.close()
