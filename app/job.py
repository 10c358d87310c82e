"""The main job's beginning and end, the same for each of its runners.

Before anything starts, :func:`preflight` refuses what would stop the run and :func:`fresh_start` clears a
previous run. At the end, :func:`final_ab` serves the final version beside v0 as a live A/B and
:func:`final_report` prints the tables and draws the plots.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
from confluent_kafka import Producer
from rich.console import Console

from app.deployments import announce_experiments
from app.loop_config import (
    loop_settings,
)
from app.serving import loop_model_config
from monitors.queries import ABRow, Side, live_ab
from rtrl.errors import ServiceUnavailable
from rtrl.files import RUN_PARTS, check_cleanable, data_folder
from rtrl.settings import Settings
from schemas.records import Experiment


def cycle_progress(console: Console, label: str = "cycles"):
    """The main job's progress bar: over cycles (``info`` says what serves), or ``label`` (the final A/B's
    trajectories per arm)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
    )


@dataclass
class FinalAB:
    """The main job's final live A/B (:meth:`app.loop.Loop.final_ab`): the final version against v0, users split by hash."""

    final: int
    since_ms: int
    trajectories: dict[str, int]
    """trajectories per arm ('ab-v0', 'ab-final') in ClickHouse when it ended"""
    rows: list[ABRow]
    """per metric the change and its interval; empty until :func:`final_report` reads them, after the drain"""
    seconds: float
    wanted: int


#: the final A/B's arms: v0 (the baseline) and the final version
FINAL_ARMS = {"baseline": "ab-v0", "treatment": "ab-final"}


def final_ab(
    settings: Settings,
    ch,
    producer: Producer,
    console: Console,
    final: int,
    stop: threading.Event | None = None,
) -> FinalAB | str:
    """The main job's ending: the final version (what serves) and v0 serve side by side as a live A/B, each user in
    one arm by the hash of the user id and the experiment's key (:func:`simulator.serve.ab_bucket`, 50/50), until
    each arm has ``loop.final_ab_trajectories`` trajectories in ClickHouse (or ``loop.final_ab_max_s`` passed).
    :func:`final_report` then reads per metric the relative change, its 95% interval and p-value over users from
    the analyst views (:func:`monitors.queries.live_ab`), once the runner has drained the flows. The experiment is announced on ``rtrl.experiments`` (running, then ended),
    so a policy server in its own process (``loop.processes``) serves it as one in this process does. A line
    saying why when it cannot run."""
    ls, db = settings.loop, settings.clickhouse.database
    if not ls.final_ab_trajectories:
        return "no final A/B (loop.final_ab_trajectories = 0)"
    if final == 0:
        return "no final A/B: no candidate was promoted, v0 still serves"
    if settings.serving.url:
        return "no final A/B: serving.url names an external server, which serves one version (run it yourself)"
    since = time.time_ns() // 1_000_000
    running = Experiment(
        key=f"final-ab-{ls.seed}-v{final}-v0",
        status="running",
        created_at=since,
        share=0.5,
        serving_version=final,
        serving_arm=FINAL_ARMS["treatment"],
        candidate_version=0,
        candidate_path=str(settings.data_path / "loop" / "checkpoints" / "v0"),
        candidate_arm=FINAL_ARMS["baseline"],
    )

    t0, wanted = time.monotonic(), ls.final_ab_trajectories
    counts = dict.fromkeys(FINAL_ARMS.values(), 0)
    try:
        announce_experiments(settings, producer, [running])
        with cycle_progress(console, f"final A/B v{final} vs v0") as bar:
            task = bar.add_task("ab", total=wanted, info="trajectories in the smaller arm")
            while time.monotonic() < t0 + ls.final_ab_max_s and not (stop is not None and stop.is_set()):
                got = ch.query(
                    f"SELECT arm, count() FROM {db}.trajectories FINAL WHERE arm IN {{arms:Array(String)}} "
                    "AND first_event_ts >= fromUnixTimestamp64Milli({since:Int64}) GROUP BY arm",
                    parameters={"arms": list(FINAL_ARMS.values()), "since": since},
                ).result_rows
                counts |= {str(a): int(n) for a, n in got}
                bar.update(task, completed=min(wanted, min(counts.values())))
                if min(counts.values()) >= wanted:
                    break
                time.sleep(1.0)
    finally:  # whatever ended it; a failure to say so must not hide why (the next run ends it)
        try:
            ended = msgspec.structs.replace(running, status="ended", created_at=time.time_ns() // 10**6)
            announce_experiments(settings, producer, [ended])
        except ServiceUnavailable as e:
            console.print(f"warning: {e}; the next `rtrl run` ends it", markup=False, highlight=False)
    return FinalAB(final, since, counts, [], time.monotonic() - t0, wanted)


def preflight(settings: Settings, trains: bool = True) -> None:
    """Refuse (ConfigError, one line) what would stop the main job, before anything is deleted or started.

    It checks the settings (:func:`loop_settings`; ``trains`` as there) and the model. With ``model.hf_path`` the
    checkpoint's family, vocabulary, shape settings and parallel layout are checked, and its tensors' shapes from
    the files' headers. It checks the data folder too: rtrl's own, and a folder."""
    cfg, _ = loop_model_config(loop_settings(settings, trains=trains))
    if cfg.hf_path:
        from trainer.hf.load import check_hf

        check_hf(cfg)
    check_cleanable(settings.data_path)


def fresh_start_plan(settings: Settings, trains: bool = True) -> list[Path]:
    """The folders :func:`fresh_start` deletes (those that exist): a previous run's loop state, flow recovery
    and logs; on the embedded defaults its broker, ClickHouse and event archive too (with a cluster and a server
    configured, those are theirs; the archive's Kafka offsets belong to the broker's history, which a backfill
    replays, so it goes with the broker). First :func:`preflight`: a run that cannot start deletes nothing."""
    preflight(settings, trains)
    embedded = not settings.kafka.bootstrap and not settings.clickhouse.dsn
    parts = [p for p in RUN_PARTS if embedded or p not in ("broker", "clickhouse", "archive")]
    return [settings.data_path / p for p in parts if (settings.data_path / p).exists()]


def fresh_start(settings: Settings, trains: bool = True) -> list[Path]:
    """The main job starts afresh: deletes :func:`fresh_start_plan`'s folders, returned."""
    doomed = fresh_start_plan(settings, trains)
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    data_folder(settings.data_path)
    return doomed


def final_report(settings: Settings, ch, console: Console, t0: float, ab: FinalAB | str | None = None) -> list[dict]:
    """How the main job ends: three summary lines (v0 -> the final version, promotions and refusals), the seed's
    table (the final live A/B, :meth:`app.loop.Loop.final_ab`), the table per checkpoint from ClickHouse and the PNG plots."""
    from app import report

    rv, db = settings.rewards.train_version, settings.clickhouse.database
    rows = report.checkpoint_rows(ch, db, rv)
    final_ab = None
    if isinstance(ab, FinalAB):  # read now: the runner drained the flows, so every trajectory served has its reward
        arms = Side(0, FINAL_ARMS["baseline"]), Side(ab.final, FINAL_ARMS["treatment"])
        final_ab = replace(ab, rows=live_ab(ch, db, *arms, rv, since_ms=ab.since_ms))
    for line in report.summary_lines(ch, settings.clickhouse.database, rows, rv, ab=final_ab):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if final_ab is not None:
        console.print(report.final_ab_table(final_ab, rv))
        png = report.final_ab_plot(final_ab, settings.data_path / "reports" / "final_ab.png", rv)
        console.print(f"final A/B plot: {png}")
    elif isinstance(ab, str):
        console.print(ab, markup=False, highlight=False)
    console.print(
        report.checkpoint_table(
            rows, f"Checkpoints (reward {rv}): eval gate, live behaviour from ClickHouse, change vs v0"
        )
    )
    png = report.checkpoint_plot(rows, settings.data_path / "reports" / "loop.png", f"The closed loop (reward {rv})")
    console.print(f"plots: {png}")
    adapters = report.adapter_rows(ch, settings.clickhouse.database)
    if adapters:  # per-org adapters (adapters.orgs): what serves each org, against the base alone
        console.print(report.adapter_table(adapters))
        png = report.adapter_plot(adapters, settings.data_path / "reports" / "adapters.png")
        console.print(f"per-org plot: {png}")
    console.print(f"done in {time.monotonic() - t0:.0f}s")
    return rows
