"""One part of the closed loop as its own process (``loop.processes``): what the supervisor starts.

    python -m app.parts rewards|batches|serve|train      (settings from RTRL_* / RTRL_CONFIG)
    python -m app.parts rewards|batches --to-end         (a flow until the end of its topics, then exit)

``rewards``, ``batches``  the reward and batch flows under Bytewax with recovery (a restart after
                          kill -9 resumes from the last snapshot; sinks are at-least-once and
                          ClickHouse replaces replayed rows, the trainer skips replayed micro-batches)
``serve``                 the policy server: follows ``rtrl.deployments``, serves ``loop.rate`` tasks/s
                          with backpressure per decision; a restart re-reads the deployments
``train``                 the trainer and eval gate (:class:`app.loop.Loop` without the other parts):
                          resumes from ``loop/state.json`` and the cycle's newest step checkpoint,
                          exits 0 once ``loop.cycles`` decisions are made

Every part uses the loop's settings (:func:`app.loop.loop_settings`), ``kafka.bootstrap`` and
``clickhouse.dsn`` (a server: chdb holds a folder in one process only).
"""

from __future__ import annotations

import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path

from rtrl.settings import Settings, load_settings

PARTS = ("rewards", "batches", "serve", "train")


def recovery_path(settings: Settings, name: str) -> Path:
    """Bytewax recovery folder of flow ``name`` (its setting, else ``<data_dir>/recovery/<name>``)."""
    setting = settings.flow.recovery_dir if name == "rewards" else settings.batching.recovery_dir
    return Path(setting or settings.data_path / "recovery" / name)


def run_flow(settings: Settings, name: str, bootstrap: str, workers: int = 1) -> None:
    """A flow under ``bytewax.run``'s driver with recovery in ``<data_dir>/recovery/<name>`` (or the setting)."""
    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.run import cli_main

    if name == "rewards":
        from flows.reward_flow import build_flow
    else:
        from flows.batch_flow import build_flow
    recovery = recovery_path(settings, name)
    if not recovery.exists() or not any(recovery.iterdir()):
        recovery.mkdir(parents=True, exist_ok=True)
        init_db_dir(recovery, 1)
    cli_main(
        build_flow(settings, bootstrap=bootstrap),
        workers_per_process=workers,
        epoch_interval=timedelta(seconds=settings.flow.snapshot_s),
        recovery_config=RecoveryConfig(str(recovery), backup_interval=timedelta(0)),
    )


def _stop_on_term() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


def serve(settings: Settings, bootstrap: str) -> None:
    """The policy server until SIGTERM (which flushes its rollouts and the SDK's events)."""
    import os
    import time

    import torch

    from app.loop import loop_model_config, policy_server, serve_until
    from client.sdk import RtrlClient
    from trainer.model import init_parallel

    torch.set_num_threads(1)
    cfg, _ = loop_model_config(settings)
    init_parallel(cfg)
    client = RtrlClient.from_settings(settings, bootstrap=bootstrap)
    # a restarted server must not replay its predecessor's tasks: seed from the seed and the process
    seed = settings.loop.seed * 1_000_003 + os.getpid() + time.time_ns() % 1_000_000
    server = policy_server(settings, bootstrap, client, seed)
    try:
        serve_until(server, settings.loop, _stop_on_term())
    finally:
        server.close()
        client.close()


def train(settings: Settings, bootstrap: str) -> None:
    """The trainer and eval gate until ``loop.cycles`` decisions exist (resuming whatever was done)."""
    import torch

    from app.loop import Loop
    from rtrl import clickhouse

    torch.set_num_threads(1)
    ch = clickhouse.connect(settings.clickhouse_dsn, settings.clickhouse.timeout_s)
    loop = Loop(settings, bootstrap, ch, serve=False)
    try:
        if loop.resume():
            print(f"resumed: {loop.version} decisions made, serving v{loop.serving}", flush=True)
        else:
            loop.initial()
            print(f"v0 (warm start): held-out solve rate {loop.evals[0]['solve_rate']:.3f}", flush=True)
        while loop.version < settings.loop.cycles:
            r = loop.cycle()
            print(
                f"v{r.version} <- v{r.parent}: {r.status} after {len(r.steps)} steps "
                f"({r.seconds['train']:.0f}s): {r.reason}",
                flush=True,
            )
    finally:
        loop.close()


def main(argv: list[str] | None = None, settings: Settings | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    to_end = argv[1:] == ["--to-end"]
    if not argv or argv[0] not in PARTS or (len(argv) > 1 and not (to_end and argv[0] in ("rewards", "batches"))):
        print(f"usage: python -m app.parts {'|'.join(PARTS)}  (flows: --to-end)", file=sys.stderr)
        return 2
    from app.loop import loop_settings
    from app.services import bootstrap_for

    settings = loop_settings(settings or load_settings())
    if to_end:
        settings = settings.updated({"flow.tail": False, "batching.tail": False})
    bootstrap = bootstrap_for(settings)
    name = argv[0]
    if name in ("rewards", "batches"):
        run_flow(settings, name, bootstrap)
    elif name == "serve":
        serve(settings, bootstrap)
    else:
        train(settings, bootstrap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
