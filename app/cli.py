"""``rtrl`` command line: one entry point per job.

    rtrl run [--resume]      the main job: the closed loop (see app.loop); --resume continues a crashed run
    rtrl rollback V          mark version V rolled back and re-promote its parent (deployments + ClickHouse)
    rtrl ab                  two simulated policy profiles through the reward flow, compared (app.ab)
    rtrl broker up|down|status   the local Kafka-protocol broker under data_dir/broker
    rtrl topics              create the Kafka topics (idempotent)
    rtrl migrate             apply ClickHouse migrations and verify the tables
    rtrl clickhouse serve    the embedded ClickHouse folder behind ClickHouse's HTTP interface (for many processes)
    rtrl part NAME           one part of the loop as its own process: rewards, batches, serve, train
    rtrl simulate            send simulated users' events through the SDK
    rtrl flow rewards        the reward flow with Bytewax recovery (always-on)
    rtrl flow batches        the batch flow (rollouts + rewards -> micro-batches) with recovery
    rtrl train               the trainer on rtrl.batches (torchrun --nproc_per_node N -m trainer for DP/TP/PP)
    rtrl config              show the effective settings

Every command takes ``--config FILE`` (or ``RTRL_CONFIG``) and ``RTRL_*`` environment overrides.
Errors a user can fix are printed as one line naming the setting or address, with exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rich.console import Console

from rtrl.errors import RtrlError
from rtrl.settings import Settings, describe, load_settings


def _bootstrap(settings: Settings, clickhouse_too: bool = False) -> str:
    """The broker's address once it answers (and ClickHouse's, with ``clickhouse_too``): checked before any
    long work, so an unreachable service is one line naming its address, not a failure minutes later."""
    from app.services import preflight

    return preflight(settings, clickhouse_too=clickhouse_too)


def cmd_run(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.loop import run_loop

    run_loop(settings, console, resume=args.resume)
    return 0


def cmd_rollback(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.loop import rollback
    from app.services import Services

    services = Services(settings)
    try:
        back = rollback(settings, services.bootstrap, services.ch, args.version, args.reason)
    finally:
        services.close()
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

    client = clickhouse.connect(settings.clickhouse_dsn, settings.clickhouse.timeout_s)
    applied = clickhouse.migrate(client, settings.clickhouse.database)
    clickhouse.verify(client, settings.clickhouse.database)
    console.print(f"applied migrations: {applied or 'none pending'}; schema verified")
    return 0


def cmd_clickhouse(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.services import serve_embedded_clickhouse

    dsn = settings.clickhouse_dsn
    if not dsn.startswith("chdb://"):
        console.print(f"clickhouse.dsn is already a server ({dsn}); nothing to serve")
        return 2
    return serve_embedded_clickhouse([dsn[len("chdb://") :], "--port", str(args.port)])


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
    console.print({k: v for k, v in stats(emissions).items() if not isinstance(v, dict)})
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


def cmd_flow(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from app.parts import recovery_path, run_flow

    tail = settings.flow.tail if args.name == "rewards" else settings.batching.tail
    console.print(
        f"{args.name} flow: recovery in {recovery_path(settings, args.name)}, snapshot "
        f"every {settings.flow.snapshot_s:g}s ({'following the topics' if tail else 'until the end of the topics'})"
    )
    run_flow(settings, args.name, _bootstrap(settings, clickhouse_too=True), workers=args.workers)
    return 0


def cmd_train(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from trainer.run import run

    run(settings, _bootstrap(settings, clickhouse_too=True), console=console)
    return 0


def cmd_config(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    if args.example:
        from rtrl.settings import example_toml

        sys.stdout.write(example_toml())
        return 0
    for name, value, help_text in describe(settings):  # secrets redacted
        console.print(f"[bold]{name}[/] = {value!r}  [dim]# {help_text}[/]", highlight=False)
    return 0


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
    """argparse type of a policy version: a whole number >= 0."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a version number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is not a version: versions start at 0")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rtrl", description="real-time RL loop for LLM coding agents")
    p.add_argument("--config", help="TOML settings file (default: $RTRL_CONFIG)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug output")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the main job: the closed loop on the configured (default: embedded) services")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in data_dir (e.g. after a crash) instead of wiping it and starting afresh",
    )
    run.set_defaults(fn=cmd_run)
    rb = sub.add_parser("rollback", help="mark a promoted version rolled back and re-promote its parent")
    rb.add_argument("version", type=_version)
    rb.add_argument("--reason", default="manual rollback")
    rb.set_defaults(fn=cmd_rollback)
    sub.add_parser(
        "ab", help="two simulated policy profiles side by side through the reward flow, compared"
    ).set_defaults(fn=cmd_ab)
    b = sub.add_parser("broker", help="start/stop the local Kafka-protocol broker")
    b.add_argument("action", choices=["up", "down", "status"])
    b.add_argument("--port", type=_port, default=None, help="port to bind (default: a free one)")
    b.set_defaults(fn=cmd_broker)
    sub.add_parser("topics", help="create Kafka topics (idempotent)").set_defaults(fn=cmd_topics)
    sub.add_parser("migrate", help="apply ClickHouse migrations and verify").set_defaults(fn=cmd_migrate)
    chs = sub.add_parser("clickhouse", help="serve the embedded ClickHouse folder over ClickHouse's HTTP interface")
    chs.add_argument("action", choices=["serve"])
    chs.add_argument("--port", type=_port, default=8123)
    chs.set_defaults(fn=cmd_clickhouse)
    pt = sub.add_parser(
        "part",
        help="one part of the closed loop as its own process (what `rtrl run` supervises with loop.processes = true)",
    )
    pt.add_argument("name", choices=["rewards", "batches", "serve", "train"])
    pt.add_argument("--to-end", action="store_true", help="flows: stop at the end of the topics")
    pt.set_defaults(fn=cmd_part)
    s = sub.add_parser("simulate", help="send simulated users' events through the SDK")
    s.add_argument("--policy-version", type=_version, default=0)
    s.set_defaults(fn=cmd_simulate)
    f = sub.add_parser("flow", help="run a streaming flow with Bytewax recovery")
    f.add_argument("name", choices=["rewards", "batches"])
    f.add_argument("-w", "--workers", type=_count, default=1, help="worker threads in this process")
    f.set_defaults(fn=cmd_flow)
    sub.add_parser("train", help="train on rtrl.batches (torchrun -m trainer for DP/TP/PP)").set_defaults(fn=cmd_train)
    c = sub.add_parser("config", help="show the effective settings")
    c.add_argument("--example", action="store_true", help="print every setting at its default as TOML")
    c.set_defaults(fn=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
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

        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)  # "[loop]" is text
        return 2
    except KeyboardInterrupt:  # Ctrl-C of a foreground job: its finally blocks stopped what it started
        console.print("interrupted", highlight=False)
        return 130


if __name__ == "__main__":
    sys.exit(main())
