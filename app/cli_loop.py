"""The ``rtrl`` commands that run the closed loop, its parts and the jobs around it.

    rtrl run, rollback, ab, part          the closed loop, a rollback, the A/B run, one part as its own process
    rtrl simulate, flow, train            simulated users, a streaming flow, the trainer
    rtrl backfill, rewards                reward versions: score the archive, list, compare, switch
    rtrl fleet follow, model init         an inference server beside the loop, a Hugging Face model folder

The parser that dispatches to them is :func:`app.cli.parser`.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from app.cli_services import _bootstrap
from rtrl.errors import ConfigError
from rtrl.section import redact_dsn
from rtrl.settings import Settings


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
    from app.parts import DEFINED, run_flow

    # one process of a Bytewax cluster with -i/-a (or bytewax.run's environment: a StatefulSet's pod name)
    cluster = cluster_from(args.process_id, args.addresses)
    flow = DEFINED[args.name].flow
    assert flow is not None  # the command's choices are the flow parts
    tail = flow.follows(settings)
    console.print(
        f"{args.name} flow, {cluster.describe(args.workers)}: recovery in "
        f"{process_recovery_path(settings, flow, cluster)}, snapshot every {settings.flow.snapshot_s:g}s "
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
    chosen = settings.model.model_fields_set
    unwritten = sorted({"rope_scaling", "rope_scaling_factor"} & chosen)
    if "qk_layernorm" in chosen and settings.model.qk_layernorm != (args.family == "qwen3"):
        unwritten.append("qk_layernorm")  # the family says it: Qwen3 normalises queries and keys, the others do not
    if unwritten:
        raise ConfigError(
            f"rtrl model init writes a plain {args.family} config.json, without model.{', model.'.join(unwritten)}; "
            "fix: unset them for the init (a checkpoint's own config.json may set them)"
        )
    hf = new_hf_config(
        args.family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.ffn_width,
        max_position_embeddings=cfg.seq_length,
        rope_theta=cfg.rope_base,
        tie_word_embeddings=args.tie,
        **({"rms_norm_eps": cfg.norm_eps} if "norm_eps" in chosen else {}),
        head_dim=cfg.head_dim,
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
