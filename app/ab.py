"""``rtrl ab``: two simulated behaviour profiles side by side through the reward flow.

Simulated users of two policy profiles -> client SDK -> Kafka ``rtrl.events`` -> the reward flow
(Bytewax: windows, versioned rewards) -> ClickHouse ``events``/``rewards``/``trajectories``, then
behaviour and reward per policy version from the monitors' views, as a table with 95% intervals and
PNG plots. (The main job, the closed loop, is :mod:`app.loop`.)
"""

from __future__ import annotations

import time
from pathlib import Path

from bytewax.testing import run_main
from rich.console import Console

from app import report
from app.services import Services
from client.sdk import RtrlClient
from flows.reward_flow import build_flow
from rtrl import clickhouse
from rtrl.settings import Settings
from simulator.drive import drive
from simulator.generate import generate, stats

#: Policy versions the run simulates side by side (their behaviour comes from simulator profiles).
SIMULATED_VERSIONS = (0, 1)


def run(settings: Settings, console: Console | None = None) -> list[dict]:
    """Run the pipeline once; returns the per-version rows it printed."""
    console = console or Console()
    console.rule("[bold]rtrl ab: two behaviour profiles")
    console.print(
        "Two simulated behaviour profiles: users -> SDK -> Kafka -> reward flow -> ClickHouse, then "
        "behaviour and reward per policy version."
    )
    t0 = time.monotonic()
    services = Services(settings)
    try:
        db = settings.clickhouse.database
        console.print(
            f"broker {services.bootstrap} · ClickHouse {clickhouse.redact(settings.clickhouse_dsn)}"
            f" (database {db}) · topics {settings.topic('*')} · reward versions {settings.rewards.versions}"
        )
        sim = settings.simulator

        def traffic(v: int, start_ms: int) -> list:
            return generate(
                sim.model_copy(update={"seed": sim.seed + v, "start_ms": start_ms}),
                settings.sdk.salt,
                policy_version=v,
                arm="control" if v == SIMULATED_VERSIONS[0] else "candidate",
            )

        start_ms = sim.start_ms
        if not start_ms:  # the traffic ends now: no event is stamped ahead of the broker's clock
            probe = 1_000_000_000_000
            span = max(e.at_ms for v in SIMULATED_VERSIONS for e in traffic(v, probe)) - probe
            start_ms = time.time_ns() // 1_000_000 - span
        emissions = []
        for v in SIMULATED_VERSIONS:  # versions served side by side, as in an A/B test
            part = traffic(v, start_ms)
            s = stats(part)
            console.print(
                f"policy v{v}: {s['trajectories']:,} trajectories, {s['emissions']:,} events "
                f"({s['duplicates']} duplicates, {s['reordered']} out of order, {s['late_checks']} late checks)"
            )
            emissions += part
        emissions.sort(key=lambda e: e.at_ms)
        with RtrlClient.from_settings(settings, bootstrap=services.bootstrap) as client:
            result = drive(client, emissions, rate=sim.rate, progress=True)
            final = client.close()
        console.print(
            f"SDK: {result.accepted:,} sent in {result.seconds:.1f}s; {final.delivered:,} delivered, "
            f"{final.failed} failed, {final.dropped} dropped"
        )
        with console.status("reward flow: windows -> rewards -> ClickHouse ..."):
            t = time.monotonic()
            run_main(build_flow(settings.updated({"flow.tail": False}), bootstrap=services.bootstrap))
        counts = {
            t_: services.ch.query(f"SELECT count() FROM {db}.{t_} FINAL").result_rows[0][0]
            for t_ in ("events", "rewards", "trajectories", "dead_letters")
        }
        console.print(
            f"reward flow: {time.monotonic() - t:.1f}s; " + ", ".join(f"{k} {v:,}" for k, v in counts.items())
        )
        rows = report.version_rows(services.ch, db, settings.rewards.versions[0])
        ab = report.comparison(services.ch, db, rows)
        title = (
            f"Behaviour and reward ({settings.rewards.versions[0]}) per policy version: simulated profiles, "
            "from ClickHouse"
        )
        console.print(report.table(rows, title, ab))
        png = report.plot(rows, Path(settings.data_path) / "reports" / "behaviour.png", "Behaviour per policy version")
        console.print(f"plots: {png}")
        console.print(f"done in {time.monotonic() - t0:.1f}s")
        return rows
    finally:
        services.close()
