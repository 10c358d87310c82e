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

# the commands' bodies, by topic
from app.cli_loop import (
    cmd_ab,
    cmd_backfill,
    cmd_fleet,
    cmd_flow,
    cmd_model_init,
    cmd_part,
    cmd_rewards,
    cmd_rollback,
    cmd_run,
    cmd_simulate,
    cmd_train,
)
from app.cli_services import cmd_broker, cmd_clickhouse, cmd_config, cmd_erase, cmd_migrate, cmd_retention, cmd_topics
from app.parts import PART_LIST, PARTS
from rtrl.errors import RtrlError
from rtrl.quiet import quiet_known_warnings
from rtrl.section import redact_dsn
from rtrl.settings import load_settings


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
    pt.add_argument("name", choices=PARTS, help="which part to run")
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
    flows = [p for p in PART_LIST if p.flow]
    f.add_argument("name", choices=[p.name for p in flows], help="; ".join(f"{p.name}: the {p.title}" for p in flows))
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
