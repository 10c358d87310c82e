"""``rtrl`` command line: one entry point per job.

    rtrl --version           print the installed version
    rtrl run [--resume]      the main job: the closed loop (see app.loop); --resume (alias --keep-data) continues
                             the run in data_dir without deleting anything
    rtrl rollback V          mark version V rolled back and re-promote its parent (deployments + ClickHouse);
                             --org ORG: ORG's adapter version V instead
    rtrl ab                  two simulated policy profiles through the reward flow, compared (app.ab)
    rtrl broker up|down|status   the local Kafka-protocol broker under data_dir/broker
    rtrl topics              create the Kafka topics (idempotent)
    rtrl migrate             apply ClickHouse migrations and verify the tables (--print: the DDL, no server)
    rtrl clickhouse serve    the embedded ClickHouse folder behind ClickHouse's HTTP interface (for many processes)
    rtrl part NAME           one part of the loop as its own process: rewards, batches, serve, train
    rtrl simulate            send simulated users' events through the SDK
    rtrl flow rewards        the reward flow with Bytewax recovery (always-on); -i/-a: one process of a cluster
    rtrl flow batches        the batch flow (rollouts + rewards -> micro-batches) with recovery
    rtrl train               the trainer on rtrl.batches (torchrun --nproc_per_node N -m trainer for DP/TP/PP)
    rtrl fleet follow        next to an inference server: load each promotion's hash-checked registry export into it
    rtrl config              show the effective settings

Every command takes ``--config FILE`` (or ``RTRL_CONFIG``), ``-v/--verbose`` - before or after the command
name - and ``RTRL_*`` environment overrides. Versions are written ``3`` or ``v3``.
Errors a user can fix are printed as one line naming the setting or address, with exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rtrl.errors import ConfigError, RtrlError
from rtrl.quiet import quiet_known_warnings
from rtrl.settings import Settings, describe, load_settings, redact_dsn


def _bootstrap(settings: Settings, clickhouse_too: bool = False) -> str:
    """The broker's address once it answers (and ClickHouse's, with ``clickhouse_too``): checked before any
    long work, so an unreachable service is one line naming its address, not a failure minutes later."""
    from app.services import preflight

    return preflight(settings, clickhouse_too=clickhouse_too)


def cmd_run(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.job import fresh_start_plan, preflight
    from app.run import run_loop

    # refuses (one line) settings, a model or a data folder the run cannot use, before anything is announced,
    # deleted or started
    if args.resume:
        preflight(settings)
        console.print(f"keeping {settings.data_path}: nothing is deleted (--resume/--keep-data)", highlight=False)
    else:
        doomed = fresh_start_plan(settings)
        console.print(
            f"fresh start: deleting {', '.join(str(d) for d in doomed)} (keep them: --keep-data)"
            if doomed
            else f"fresh start: nothing to delete in {settings.data_path}",
            highlight=False,
            soft_wrap=True,
        )
    run_loop(settings, console, resume=args.resume)
    return 0


def cmd_rollback(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.deployments import rollback
    from app.services import Services

    services = Services(settings)
    try:
        if args.org:
            from app.adapters import rollback_adapter

            rollback_adapter(settings, services.bootstrap, services.ch, args.org, args.version, args.reason)
        else:
            back = rollback(settings, services.bootstrap, services.ch, args.version, args.reason)
    finally:
        services.close()
    if args.org:
        console.print(
            f"{args.org}'s adapter a{args.version} rolled back on {settings.topic('deployments')}: the org is served "
            "its previous promoted adapter on the serving base, or the base alone",
            highlight=False,
        )
    else:
        console.print(f"v{args.version} rolled back; v{back.parent} re-promoted on {settings.topic('deployments')}")
    return 0


def cmd_ab(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.ab import run

    run(settings, console)
    return 0


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
    from rtrl.settings import RETAINED_TABLES

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
    from app.retention import prune_state  # last: a state it cannot read stops nothing else

    folders, files = prune_state(settings, time.time(), dry_run=dry)
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


def cmd_part(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.parts import main as part

    return part([args.name] + (["--to-end"] if args.to_end else []), settings)


def cmd_simulate(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from client.sdk import RtrlClient
    from simulator.drive import drive
    from simulator.generate import generate, stats

    bootstrap = _bootstrap(settings)
    emissions = generate(settings.simulator, settings.sdk.salt, policy_version=args.policy_version)
    with RtrlClient.from_settings(settings, bootstrap=bootstrap) as client:
        result = drive(client, emissions, rate=settings.simulator.rate, progress=True)
        final = client.close()
    for line in simulated(stats(emissions), args.policy_version):
        console.print(line, highlight=False)
    console.print(
        f"sent {result.accepted:,} in {result.seconds:.1f}s; delivered {final.delivered:,}, "
        f"failed {final.failed}, dropped {final.dropped}, undelivered {final.pending}"
    )
    lost = final.accepted + final.dropped - final.delivered  # failed, still pending at close, or dropped
    if lost:
        console.print(
            f"[red]error:[/] {lost:,} of {final.accepted + final.dropped:,} events were not delivered to {bootstrap} "
            f"(last error: {final.last_error or 'none reported'})",
            highlight=False,
        )
        return 1
    return 0


def simulated(s: dict, policy_version: int) -> list[str]:
    """The simulator's run in two lines: what it sent, and the behaviour it simulated."""
    return [
        f"simulated v{policy_version}: {s['trajectories']:,} trajectories, {s['events']:,} events, "
        f"{s['duplicates']:,} duplicates, {s['reordered']:,} reordered, {s['late_checks']:,} late checks",
        f"behaviour: broken tool calls {s['broken_tool_call_rate']:.1%}, clarifying {s['clarification_rate']:.1%}, "
        f"edits {s['edit_rate']:.1%} ({s['accept_rate']:.1%} accepted, {s['mean_persisted_fraction']:.1%} persisted)",
    ]


def cmd_flow(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.flow_state import cluster_from, process_recovery_path
    from app.parts import run_flow

    # one process of a Bytewax cluster with -i/-a (or bytewax.run's environment: a StatefulSet's pod name)
    cluster = cluster_from(args.process_id, args.addresses)
    tail = settings.flow.tail if args.name == "rewards" else settings.batching.tail
    console.print(
        f"{args.name} flow, {cluster.describe(args.workers)}: recovery in "
        f"{process_recovery_path(settings, args.name, cluster)}, snapshot every {settings.flow.snapshot_s:g}s "
        f"({'following the topics' if tail else 'until the end of the topics'})",
        highlight=False,
        soft_wrap=True,
    )
    bootstrap = _bootstrap(settings, clickhouse_too=True)
    line = run_flow(settings, args.name, bootstrap, workers=args.workers, cluster=cluster)
    console.print(line, highlight=False, soft_wrap=True)
    return 0


def cmd_backfill(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from flows.backfill import backfill, describe_plan

    since, until = args.since, args.until
    console.print(
        describe_plan(settings, args.reward_version, since, until, args.workers), highlight=False, soft_wrap=True
    )
    with console.status("backfilling (Apache Beam)"):
        result = backfill(
            settings, args.reward_version, since, until, workers=args.workers, worker_log=not args.verbose
        )
    console.print(result.summary(), highlight=False, soft_wrap=True)
    return 0


def cmd_rewards(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from rewards.versions import registry

    reg = registry(settings)
    if args.action == "list":
        from flows.reward_versions import registered, scored
        from rtrl import clickhouse

        client = clickhouse.connect(settings.clickhouse_dsn, settings.clickhouse.timeout_s)  # read only (analysts)
        db = settings.clickhouse.database
        try:
            have = registered(client, db)
        except Exception as e:  # noqa: BLE001 - a database without the table: say which and what to do
            raise ConfigError(
                f"cannot read {db}.reward_versions ({str(e).splitlines()[0][:300]}); fix: run `rtrl migrate` as the "
                "writer, or check clickhouse.dsn and clickhouse.database"
            ) from None
        table = Table(title="reward versions", title_justify="left")
        for col in ("version", "parent", "checksum", "registered", "scored", "use", "defined in", "author", "reason"):
            # names and checksums stay whole (what a user copies); the prose folds
            table.add_column(col, overflow="fold", no_wrap=col not in ("author", "reason"))
        for name, v in reg.items():
            use = ("trains, " if name == settings.rewards.train_version else "") + (
                "live" if name in settings.rewards.versions else "-"
            )
            old = have.get(name)
            state = "no" if old is None else ("yes" if old.checksum == v.checksum else f"as {old.checksum[:12]}")
            table.add_row(
                name, v.parent or "-", v.checksum[:12], state, f"{scored(client, db, name):,}", use, v.source,
                v.author, v.reason,
            )  # fmt: skip
        console.print(table)
        return 0
    if args.action == "train":
        from app.loop import request_reward_switch

        if not args.a:
            raise ConfigError("rtrl rewards train needs the version to train on, e.g. `rtrl rewards train v2`")
        path = request_reward_switch(settings, args.a)
        console.print(f"the loop trains on reward {args.a} from its next cycle on (request: {path})")
        return 0
    from app.report import reward_comparison

    if not args.a or not args.b:
        raise ConfigError("rtrl rewards compare needs two versions, e.g. `rtrl rewards compare v1-discard-broken v2`")
    reg.check([args.a, args.b], "rtrl rewards compare")
    return reward_comparison(settings, args.a, args.b, args.since, args.until, console)


def cmd_train(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from trainer.run import run

    run(settings, _bootstrap(settings, clickhouse_too=True), console=console)
    return 0


def cmd_fleet(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    import signal
    import threading
    from pathlib import Path

    from client.fleet import FleetFollower, ReloadClient

    sv = settings.serving
    url = args.url or sv.reload_url or sv.url
    if not url:
        raise ConfigError(
            "no inference server to reload: set serving.reload_url (or serving.url) to its address, or give --url"
        )
    api_key = None
    if sv.api_key_file:
        try:
            api_key = Path(sv.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"serving.api_key_file {sv.api_key_file} cannot be read ({e.strerror or e})") from None
    engine = ReloadClient(
        url, args.api or sv.reload_api, timeout_s=sv.reload_timeout_s, retries=sv.retries, api_key=api_key
    )
    bootstrap, topic = _bootstrap(settings), settings.topic("deployments")
    follower = FleetFollower(bootstrap, topic, engine, model_name=sv.model)
    console.print(
        f"following {topic} on {bootstrap}: each promotion's export, hash-checked, loaded through {redact_dsn(engine.endpoint)}",
        highlight=False,
        soft_wrap=True,
    )
    stop = threading.Event()
    before = (
        {} if args.once else {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    )
    try:
        if args.once:
            follower.poll(timeout_s=settings.kafka.timeout_s)
        else:
            follower.run(stop)  # until SIGTERM or Ctrl-C: a clean stop, exit code 0
        served, target = follower.served, follower.target()
    finally:
        follower.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)
    console.print(
        f"serving v{served.version} from {served.path}" if served else "nothing loaded",
        highlight=False,
        soft_wrap=True,
    )
    for line in follower.refused.values():
        console.print(line, highlight=False, soft_wrap=True)
    return 1 if args.once and target is not None and (served is None or served.version != target.version) else 0


def cmd_model_init(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from app.serving import loop_model_config
    from trainer.hf.config import new_hf_config
    from trainer.hf.export import init_hf
    from trainer.model import init_parallel

    out = Path(args.dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder; give a new folder")
    shape = settings.model_copy(update={"model": settings.model.model_copy(update={"hf_path": ""})})
    cfg, _ = loop_model_config(shape)  # the loop's vocabulary and positions, the model section's widths
    hf = new_hf_config(
        args.family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        intermediate_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        max_position_embeddings=cfg.seq_length,
        rope_theta=cfg.rope_base,
        tie_word_embeddings=args.tie,
    )
    init_parallel(cfg)
    init_hf(out, hf, seed=cfg.seed)
    console.print(
        f"wrote a random {args.family} checkpoint ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocabulary "
        f"{cfg.vocab_size}, {cfg.seq_length} positions) to {out}; train it: RTRL_MODEL__HF_PATH={out} rtrl run",
        highlight=False,
        soft_wrap=True,
    )
    return 0


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


def _count(text: str) -> int:
    """argparse type of a count of workers: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a count: give 1 or more")
    return n


def _port(text: str) -> int:
    """argparse type of a TCP port: 1..65535."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < n < 65536:
        raise argparse.ArgumentTypeError(f"{n} is not a port: give 1..65535")
    return n


def _version(text: str) -> int:
    """argparse type of a policy version: a whole number >= 0, written ``3`` or ``v3``."""
    digits = text[1:] if text[:1] in ("v", "V") else text
    try:
        n = int(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a version number (write 3 or v3)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is not a version: versions start at 0")
    return n


def _when(text: str) -> int:
    """argparse type of a point in time: milliseconds since the epoch, or an ISO 8601 date or time (UTC unless it
    says otherwise), e.g. 2026-11-30 or 2026-11-30T12:00+01:00."""
    from datetime import UTC, datetime

    if text.isdigit():
        if int(text) > 253_402_300_799_999:  # 9999-12-31T23:59:59.999Z, the last instant a date can name
            raise argparse.ArgumentTypeError(f"{text} ms is after the year 9999: give milliseconds since the epoch")
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time: give milliseconds since the epoch or an ISO date, e.g. 2026-11-30T12:00"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def distribution_version() -> str:
    """The installed ``rtrl`` distribution's version (pyproject.toml's name), else ``rtrl.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rtrl")
    except PackageNotFoundError:
        import rtrl

        return str(getattr(rtrl, "__version__", "unknown"))


def _global_options(p: argparse.ArgumentParser, default: object) -> None:
    """``--config`` and ``-v``: on the main parser with real defaults, on each subcommand with
    ``argparse.SUPPRESS`` so that a value given after the command name overrides one given before it."""
    p.add_argument("--config", metavar="FILE", default=default, help="TOML settings file (default: $RTRL_CONFIG)")
    p.add_argument(
        "-v", "--verbose", action="store_true", default=False if default is None else default, help="log debug output"
    )


class OneLineParser(argparse.ArgumentParser):
    """argparse with its mistakes in one line: ``rtrl run: error: ... (see rtrl run --help)``, exit 2 (argparse
    prints the whole usage block first; the subcommands inherit this class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="rtrl",
        description="real-time RL loop for LLM coding agents",
        epilog="`rtrl COMMAND --help` describes a command; --config and -v go before or after it.",
    )
    p.add_argument("--version", action="version", version=f"rtrl {distribution_version()}")
    _global_options(p, None)
    common = OneLineParser(add_help=False)
    _global_options(common, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    def command(name: str, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=description or help_text, parents=[common])

    run = command(
        "run",
        "the main job: the closed loop on the configured (default: embedded) services",
        "The main job: the closed loop on the configured (default: embedded) services. It starts afresh, "
        "deleting the previous run's folders in data_dir (it prints which), unless --resume/--keep-data.",
    )
    run.add_argument(
        "--resume",
        "--keep-data",
        dest="resume",
        action="store_true",
        help="delete nothing: continue the run in data_dir (e.g. after a crash), or start one on the data "
        "there if it holds no run yet; without it the loop starts afresh",
    )
    run.set_defaults(fn=cmd_run)
    rb = command(
        "rollback",
        "mark a promoted version rolled back and re-promote its parent",
        "Mark a promoted version rolled back and re-promote its parent (ClickHouse checkpoints and the "
        "deployments topic).",
    )
    rb.add_argument("version", type=_version, help="the version to roll back, e.g. 3 or v3")
    rb.add_argument("--reason", default="manual rollback", help="why, recorded with the decision (%(default)r)")
    rb.add_argument(
        "--org",
        default="",
        help="roll back this org's adapter version N instead (ClickHouse adapter_checkpoints); the other orgs and "
        "the shared policy are untouched",
    )
    rb.set_defaults(fn=cmd_rollback)
    command("ab", "two simulated policy profiles side by side through the reward flow, compared").set_defaults(
        fn=cmd_ab
    )
    b = command("broker", "start/stop the local Kafka-protocol broker", "The local broker under data_dir/broker.")
    b.add_argument("action", choices=["up", "down", "status"], help="up: start; down: stop; status: its address")
    b.add_argument("--port", type=_port, default=None, help="port to bind (default: a free one)")
    b.set_defaults(fn=cmd_broker)
    command("topics", "create Kafka topics (idempotent)").set_defaults(fn=cmd_topics)
    mg = command("migrate", "apply ClickHouse migrations and verify")
    mg.add_argument(
        "--print",
        action="store_true",
        help="print the DDL it would run on an empty database (for clickhouse.cluster when set) and touch no server",
    )
    mg.set_defaults(fn=cmd_migrate)
    ret = command(
        "retention",
        "apply retention: ClickHouse TTLs from retention.tables, the archive's days older than retention.archive_days",
    )
    ret.add_argument("action", choices=["apply"], help="apply: make every store keep what its retention says")
    ret.add_argument("--dry-run", action="store_true", help="say what would change and change nothing")
    ret.set_defaults(fn=cmd_retention)
    er = command("erase", "erase one user's or organisation's data from every store, and keep it out (deny list)")
    who = er.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", help="the user's raw id, hashed with sdk.salt as the SDK hashes it (never stored)")
    who.add_argument("--user-hash", help="the user's salted hash, as the user_hash column holds it")
    who.add_argument("--org", help="an organisation's id (org_id)")
    er.add_argument("--dry-run", action="store_true", help="list what would be erased and erase nothing")
    er.set_defaults(fn=cmd_erase)
    chs = command("clickhouse", "serve the embedded ClickHouse folder over ClickHouse's HTTP interface")
    chs.add_argument("action", choices=["serve"], help="serve: the folder of clickhouse.dsn = chdb://FOLDER")
    chs.add_argument("--port", type=_port, default=8123, help="HTTP port to listen on (default: %(default)s)")
    chs.add_argument("--certfile", help="serve https with this PEM certificate (chain); clients set clickhouse.ca_cert")
    chs.add_argument("--keyfile", help="the certificate's PEM private key, unless it is in --certfile")
    chs.set_defaults(fn=cmd_clickhouse)
    pt = command(
        "part",
        "one part of the closed loop as its own process (what `rtrl run` supervises with loop.processes = true)",
    )
    pt.add_argument("name", choices=["rewards", "batches", "serve", "train"], help="which part to run")
    pt.add_argument("--to-end", action="store_true", help="flows: stop at the end of the topics")
    pt.set_defaults(fn=cmd_part)
    s = command("simulate", "send simulated users' events through the SDK")
    s.add_argument(
        "--policy-version",
        type=_version,
        default=0,
        help="the policy version the simulated events claim, e.g. 3 or v3 (default: %(default)s)",
    )
    s.set_defaults(fn=cmd_simulate)
    f = command("flow", "run a streaming flow with Bytewax recovery")
    f.add_argument("name", choices=["rewards", "batches"], help="rewards: the reward flow; batches: micro-batches")
    f.add_argument("-w", "--workers", type=_count, default=1, help="worker threads in this process")
    f.add_argument(
        "-i",
        "--process-id",
        type=int,
        default=None,
        help="this process's place in a Bytewax cluster, from 0 (default: $BYTEWAX_PROCESS_ID, else the ordinal of "
        "$BYTEWAX_POD_NAME after $BYTEWAX_STATEFULSET_NAME-); needs --addresses",
    )
    f.add_argument(
        "-a",
        "--addresses",
        default=None,
        help="every cluster process's host:port, in process-id order, separated by ';' (default: $BYTEWAX_ADDRESSES, "
        "else the lines of $BYTEWAX_HOSTFILE_PATH)",
    )
    f.set_defaults(fn=cmd_flow)
    command("train", "train on rtrl.batches (torchrun -m trainer for DP/TP/PP)").set_defaults(fn=cmd_train)
    bf = command(
        "backfill",
        "score the Parquet archive under a reward version with Apache Beam (Parquet + ClickHouse, idempotent)",
        "Score the archived events under one reward version with Apache Beam: the reward flow's own windows, "
        "dead-letter rules and reward code, partition by partition in offset order. Rewards of trajectories whose "
        "first event lies in [--from, --to) go to Parquet (backfill.out_dir) and to ClickHouse rewards; rows already "
        "there with the same content are not written again, so a rerun changes nothing. Bad files and rows become "
        "dead letters naming the file and the row. Locally it runs on Beam's FnApiRunner with backfill.workers "
        "processes; backfill.pipeline_options names another runner (deploy/beam/).",
    )
    bf.add_argument(
        "--reward-version", required=True, help="the version to score: built in, rewards.file or rewards.define"
    )
    bf.add_argument(
        "--from",
        dest="since",
        type=_when,
        default=None,
        help="first trajectory start (ms or ISO time; default: the archive's start)",
    )
    bf.add_argument(
        "--to", dest="until", type=_when, default=None, help="end of the range, exclusive (default: the archive's end)"
    )
    bf.add_argument(
        "-w", "--workers", type=_count, default=None, help="FnApiRunner worker processes (default: backfill.workers)"
    )
    bf.set_defaults(fn=cmd_backfill)
    rw = command(
        "rewards",
        "reward versions: list them, compare two over the same trajectories, or switch what the loop trains on",
        "Reward versions. `rtrl rewards list`: every version (built in, rewards.file, rewards.define) with its "
        "checksum, whether ClickHouse has it registered and how many trajectories it scored. `rtrl rewards compare A "
        "B`: how B differs from A over the trajectories both scored or one discarded, per policy version and org "
        "(means, shift with its 95% interval, rank correlation, sign flips, discards), behaviour flags under each, "
        "the cohorts that move most, and a PNG. `rtrl rewards train V`: the loop's trainer trains on V from its next "
        "cycle on (the cycle in progress keeps its version; each checkpoint records the version it trained on).",
    )
    rw.add_argument(
        "action",
        choices=["list", "compare", "train"],
        help="list: the versions; compare: A against B; train: switch to A",
    )
    rw.add_argument(
        "a", nargs="?", default=None, help="compare: the version compared against (e.g. v1-discard-broken); train: V"
    )
    rw.add_argument("b", nargs="?", default=None, help="compare: the version compared (e.g. v2)")
    rw.add_argument(
        "--from", dest="since", type=_when, default=None, help="compare: trajectories starting from (ms or ISO)"
    )
    rw.add_argument(
        "--to", dest="until", type=_when, default=None, help="compare: trajectories starting before (ms or ISO)"
    )
    rw.set_defaults(fn=cmd_rewards)
    fl = command(
        "fleet",
        "next to an inference server: load each promoted version's registry export into it",
        "Next to an inference server (SGLang, vLLM, or rtrl's own): follow the deployments topic and have the "
        "server load the export of each promoted version (a rollback re-promotes the parent: its export is loaded) "
        "after checking the export's content hash against the announcement. A mismatch is refused and nothing is "
        "loaded. Runs until SIGTERM or Ctrl-C.",
    )
    fl.add_argument("action", choices=["follow"], help="follow: keep the server on the newest promotion")
    fl.add_argument(
        "--url",
        default=None,
        help="the server's base URL, e.g. http://127.0.0.1:30000 (default: serving.reload_url, else serving.url)",
    )
    fl.add_argument(
        "--api",
        choices=["sglang", "vllm"],
        default=None,
        help="its reload API: sglang (POST /update_weights_from_disk) or vllm (POST /collective_rpc reload_weights, "
        "VLLM_SERVER_DEV_MODE=1) (default: serving.reload_api)",
    )
    fl.add_argument(
        "--once",
        action="store_true",
        help="read the topic to its end, load the newest promotion, and exit (1 when it could not be loaded)",
    )
    fl.set_defaults(fn=cmd_fleet)
    mo = command(
        "model",
        "Hugging Face model folders for model.hf_path",
        "Hugging Face model folders for model.hf_path. `rtrl model init DIR` writes a new, randomly initialised "
        "checkpoint (config.json + model.safetensors) of the closed loop's shape, to run the loop on a Hugging "
        "Face model without downloading one.",
    )
    mo.add_argument(
        "action",
        choices=["init"],
        help="init: write a new random Hugging Face checkpoint of the loop's shape (the simulator's vocabulary, "
        "model.seq_length positions, the model section's widths) into DIR; then RTRL_MODEL__HF_PATH=DIR rtrl run",
    )
    mo.add_argument("dir", metavar="DIR", help="the folder to create (absent or empty)")
    mo.add_argument(
        "--family", choices=("llama", "qwen2", "qwen3"), default="qwen2", help="the architecture (default qwen2)"
    )
    mo.add_argument("--tie", action="store_true", help="tie the input embedding and the output layer")
    mo.set_defaults(fn=cmd_model_init)
    c = command("config", "show the effective settings")
    c.add_argument("--example", action="store_true", help="print every setting at its default as TOML")
    c.set_defaults(fn=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    quiet_known_warnings()  # megatron's TE/Apex fallbacks and the like, one by one (rtrl/quiet.py)
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:
        logging.getLogger("rtrl.kafka").setLevel(
            logging.CRITICAL
        )  # librdkafka connection chatter; errors surface as ServiceUnavailable
    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        settings = load_settings(args.config)
        return args.fn(settings, args, console)
    except RtrlError as e:
        from rich.markup import escape

        # "[loop]" is text; a DSN's password or ?token= that reached a message from anywhere is ***
        console.print(f"[red]error:[/] {escape(redact_dsn(str(e)))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C of a foreground job: its finally blocks stopped what it started
        console.print("interrupted", highlight=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())
