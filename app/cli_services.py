"""The ``rtrl`` commands that set up and look after the services and the data they keep, and show the settings.

    rtrl broker up|down|status, rtrl topics, rtrl migrate, rtrl clickhouse serve   the services
    rtrl retention apply, rtrl erase                                               the data they keep
    rtrl config                                                                    the effective settings

The parser that dispatches to them is :func:`app.cli.parser`; :func:`_bootstrap` is shared with the loop's
commands (:mod:`app.cli_loop`).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rtrl.errors import ConfigError
from rtrl.section import redact_dsn
from rtrl.settings import Settings, describe


def _bootstrap(settings: Settings, clickhouse_too: bool = False) -> str:
    """The broker's address once it answers (and ClickHouse's, with ``clickhouse_too``): checked before any
    long work, so an unreachable service is one line naming its address, not a failure minutes later."""
    from app.services import preflight

    return preflight(settings, clickhouse_too=clickhouse_too)


def cmd_broker(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.services import local_broker

    broker = local_broker(settings.data_path / "broker", port=args.port)
    if args.action == "up":
        console.print(broker.up())
    elif args.action == "down":
        broker.down()
        console.print("stopped")
    else:
        port = broker.running_port()
        console.print(f"{broker.host}:{port}" if port else "not running")
        return 0 if port else 1
    return 0


def cmd_topics(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from rtrl.kafka import ensure_topics_for

    created = ensure_topics_for(settings, _bootstrap(settings))
    console.print(f"created: {', '.join(created) or 'nothing (all exist)'}")
    return 0


def cmd_migrate(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from rtrl import clickhouse
    from rtrl.clickhouse_cluster import cluster_of

    cluster = cluster_of(settings.clickhouse)
    if args.print:  # no server: what migrate would run on an empty database, for review
        sys.stdout.write(clickhouse.ddl(settings.clickhouse.database, cluster))
        return 0
    client = clickhouse.connect(settings.clickhouse_dsn, settings.clickhouse.timeout_s)
    applied = clickhouse.migrate(client, settings.clickhouse.database, cluster=cluster)
    clickhouse.verify(client, settings.clickhouse.database, cluster)
    console.print(f"applied migrations: {applied or 'none pending'}; schema verified")
    return 0


def cmd_retention(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    """Each ClickHouse table's TTL made to follow ``retention.tables``; old archive days, checkpoints and flow state
    deleted."""
    import time

    from flows.sinks import prune_archive
    from rtrl import clickhouse
    from rtrl.clickhouse_cluster import cluster_of
    from rtrl.sections.app import RETAINED_TABLES

    r, dry = settings.retention, args.dry_run
    client = clickhouse.setup_from(settings)
    done = clickhouse.apply_retention(
        client, settings.clickhouse.database, r.tables, RETAINED_TABLES, cluster_of(settings.clickhouse), dry_run=dry
    )
    archive = settings.archive_root
    verb = "would " if dry else ""
    changed = {t: what for t, what in done.items() if what != "kept"}
    console.print(
        f"ClickHouse: {verb}set {', '.join(f'{t} {w}' for t, w in changed.items()) if changed else 'nothing (TTLs current)'}"
    )
    from app.retention import prune_checkpoints

    versions = prune_checkpoints(settings, client, dry_run=dry)
    console.print(
        f"checkpoints and registry: {verb}delete {len(versions)} version(s)"
        f"{': ' + ', '.join(f'v{v}' for v in versions) if versions else ''} (keeps the newest "
        f"{r.checkpoints_keep}, the serving version and {r.rollback_versions} rollback targets)",
        highlight=False,
    )
    if "://" in archive:  # shared storage: its own lifecycle rules delete old objects
        console.print(
            f"archive {archive}: not a local folder; give the bucket a lifecycle rule of {r.archive_days:g} days"
        )
    else:
        gone = prune_archive(archive, r.archive_days, time.time_ns() // 1_000_000, dry_run=dry)
        console.print(
            f"archive {archive}: {verb}delete {len(gone)} day(s){': ' + ', '.join(gone) if gone else ''}"
            f" (keeps {r.archive_days:g} days)"
        )
    from app.parts import FLOWS
    from app.retention import prune_state  # last: a state it cannot read stops nothing else

    folders, files = prune_state(settings, time.time(), FLOWS, dry_run=dry)
    console.print(
        f"flow state: {verb}delete {len(folders)} recovery folder(s) and {len(files)} spill file(s)"
        f"{': ' + ', '.join(str(p) for p in folders + files) if folders or files else ''} "
        f"(keeps what a running flow holds or was written in {r.state_days:g} days)",
        highlight=False,
    )
    return 0


def cmd_erase(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    """One user's or organisation's data out of every store, and onto the deny list (app/erasure.py)."""
    from app.erasure import erase, subject_from

    subject = subject_from(settings, args.user, args.user_hash, args.org)
    with console.status(f"erasing {subject}" if not args.dry_run else f"finding {subject}'s data"):
        result = erase(settings, subject, dry_run=args.dry_run)
    console.print(f"{'would erase' if args.dry_run else 'erased'}: {subject} (erasure {subject.id})", highlight=False)
    table = Table()
    table.add_column("store")
    table.add_column("rows", justify="right")
    for store, n in result.counts.items():
        unit = " samples" if store == "batches" else " events" if store == "archive" else ""
        table.add_row(store, f"{n:,}{unit}")
    console.print(table)
    for why in result.unreached:
        console.print(f"[yellow]not reached[/]: {why}", highlight=False)
    seen = ", ".join(result.lineage) or "none"
    console.print(f"checkpoints whose training saw the subject's samples: {seen}", highlight=False)
    if not args.dry_run:
        console.print(
            "Kafka keeps the subject's records until each topic's retention; every consumer now skips them "
            "(docs/governance.md)",
            highlight=False,
        )
    return 0


def cmd_clickhouse(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.services import serve_embedded_clickhouse

    dsn = settings.clickhouse_dsn
    if not dsn.startswith("chdb://"):
        raise ConfigError(
            f"clickhouse.dsn is already a server ({redact_dsn(dsn)}); nothing to serve: `rtrl clickhouse serve` "
            "serves the embedded folder (clickhouse.dsn empty or chdb:///folder)"
        )
    database = settings.clickhouse.database  # the analyst user reads that database's tables
    tls = [f"--{k}={getattr(args, k)}" for k in ("certfile", "keyfile") if getattr(args, k)]
    return serve_embedded_clickhouse([dsn[len("chdb://") :], "--port", str(args.port), "--database", database, *tls])


def cmd_config(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    if args.example:
        from rtrl.settings import example_toml

        sys.stdout.write(example_toml())
        return 0
    console.print(settings_grid(describe(settings)))  # secrets redacted
    return 0


def settings_grid(rows: list[tuple[str, object, str]]) -> Table:
    """``name = value`` and ``# help`` side by side: a long help wraps within its column (a value too long for
    the first, 40 characters, wraps within that), so every line fits the console."""
    grid = Table.grid(padding=(0, 2))  # not expanded: as wide as its rows, at most 40 + 2 + 58 = 100 columns
    grid.add_column(max_width=40, overflow="fold")
    grid.add_column(max_width=58, style="dim", overflow="fold")
    for name, value, help_text in rows:
        grid.add_row(Text.assemble((name, "bold"), f" = {value!r}"), f"# {help_text}")
    return grid
