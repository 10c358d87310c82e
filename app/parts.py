"""One part of the closed loop as its own process (``loop.processes``): what the supervisor starts.

    python -m app.parts rewards|batches|serve|train      (settings from RTRL_* / RTRL_CONFIG)
    python -m app.parts rewards|batches --to-end         (a flow until the end of its topics, then exit)

A flow part is one process of a Bytewax cluster when the environment says so, as for ``python -m bytewax.run``:
``BYTEWAX_PROCESS_ID`` (or a StatefulSet pod's ``BYTEWAX_POD_NAME`` and ``BYTEWAX_STATEFULSET_NAME``) and
``BYTEWAX_ADDRESSES`` (``host:port;host:port``, or a ``BYTEWAX_HOSTFILE_PATH``): :func:`app.flow_state.cluster_from`.

Each part is defined once in :data:`PART_LIST`, and every runner takes it from there.
The part entry point and the supervisor run its body. The main job's threads runner runs its :class:`Flow` on a thread.
The local cluster starts its :class:`Local` processes. The Kubernetes manifests make its :class:`Workload`.

``rewards``, ``batches``  the reward and batch flows under Bytewax with recovery (a restart after
                          kill -9 resumes from the last snapshot; sinks are at-least-once and
                          ClickHouse replaces replayed rows, the trainer skips replayed micro-batches)
``serve``                 the policy server: follows ``rtrl.deployments`` and ``rtrl.experiments``, serves
                          ``loop.rate`` tasks/s with backpressure per decision; a restart re-reads both
``train``                 the trainer and eval gate (:class:`app.loop.Loop` without the other parts):
                          resumes from ``loop/state.json`` and the cycle's newest step checkpoint,
                          exits 0 once ``loop.cycles`` decisions are made

Every part uses the loop's settings (:func:`app.loop_config.loop_settings`), ``kafka.bootstrap`` and
``clickhouse.dsn`` (a server: chdb holds a folder in one process only).

SIGTERM and SIGINT stop every part cleanly with exit code 0: the flows end their input, take a final
snapshot and keep what is open in it (:class:`flows.kafka_io.Pause`), the policy server flushes its
rollouts and events, and the trainer stops before its next step and checkpoints what it trained (it
makes no decision on a half cycle). A restart continues from there, losing and repeating nothing.
A short ClickHouse outage (the supervisor restarting the embedded front) is waited out: the flows'
sinks retry, and the trainer's calls are retried (:class:`PatientClickHouse`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from app.flow_state import (
    Cluster,
    Flow,
    check_state_volume,
    cluster_from,
    partition_keys,
    partitions_in,
    process_recovery_path,
    recovery_config,
)
from flows.counts import FlowCounts
from rtrl import metrics
from rtrl.errors import RtrlError, ServiceUnavailable
from rtrl.quiet import quiet_known_warnings
from rtrl.settings import Settings, load_settings


def run_flow(
    settings: Settings,
    name: str,
    bootstrap: str,
    workers: int = 1,
    stop: threading.Event | None = None,
    cluster: Cluster | None = None,
) -> str:
    """A flow under ``bytewax.run``'s driver with recovery in ``<data_dir>/recovery/<name>`` (or the setting).
    It runs until the end of its topics (``tail`` off), or until ``stop`` - by default SIGTERM or SIGINT
    (:func:`flows.kafka_io.stop_on_signals`): a clean stop with a final snapshot, then a normal return.
    With ``cluster`` this process is one of a Bytewax cluster (``-i/-a``): the Kafka partitions are split over
    every process's workers, state is exchanged between them, each process serves its metrics on
    ``metrics.port`` + its place among the processes on its host (:attr:`Cluster.local_index`), and a clean stop
    needs every process stopped.
    Returns the one-line summary of what this process read and wrote (:mod:`flows.counts`)."""
    from bytewax.run import cli_main

    from flows.kafka_io import stop_on_signals

    spec = DEFINED[name].flow
    if spec is None:
        raise ValueError(f"part {name} is not a flow")
    cluster = cluster or Cluster()
    counts, t0 = FlowCounts(), time.monotonic()
    if spec.windowed:
        check_state_volume(settings, spec)
    folder = process_recovery_path(settings, spec, cluster)
    from app.retention import hold, prune_at_start

    with hold(folder):  # from before its first look: `rtrl retention apply` keeps a folder a flow holds
        fresh = not partitions_in(folder)
        recovery = recovery_config(settings, spec, cluster)  # refused before anything starts when it does not fit
        if spec.windowed:  # spill files nothing uses go after retention.state_days, before Bytewax starts
            prune_at_start(settings, spec)
        endpoint = metrics.serve_part(settings, f"flow-{name}", cluster.local_index)
        try:
            stop = stop if stop is not None else stop_on_signals()
            # a windowed flow's partitions' keys spread over every worker of the cluster (flows.routing)
            keys = (
                partition_keys(settings, bootstrap, workers * cluster.processes, folder, fresh)
                if spec.windowed
                else None
            )
            flow = spec.build(settings, bootstrap, stop, counts, keys)
            endpoint.ready()  # its broker and topics checked, its sinks configured: it reads from here on
            cli_main(
                flow,
                workers_per_process=workers,
                process_id=cluster.process_id if cluster.addresses else None,
                addresses=list(cluster.addresses) if cluster.addresses else None,
                epoch_interval=timedelta(seconds=settings.flow.snapshot_s),
                recovery_config=recovery,
            )
        finally:
            endpoint.close()
    seconds = time.monotonic() - t0
    where = f"process {cluster.process_id} of {cluster.processes}: " if cluster.addresses else ""
    return where + spec.summary(counts, settings, seconds)


def _reward_flow(
    settings: Settings, bootstrap: str, stop: threading.Event, counts: FlowCounts, keys: Mapping[int, str] | None
) -> Any:
    from flows import reward_flow  # here, not at the top: `rtrl --help` and the serve part never load Bytewax

    return reward_flow.build_flow(settings, bootstrap=bootstrap, stop=stop, counts=counts, keys=keys)


def _reward_summary(counts: FlowCounts, settings: Settings, seconds: float | None) -> str:
    from flows import reward_flow

    return reward_flow.summary(counts, settings.rewards.versions, seconds)


def _batch_flow(
    settings: Settings, bootstrap: str, stop: threading.Event, counts: FlowCounts, keys: Mapping[int, str] | None
) -> Any:
    from flows import batch_flow

    return batch_flow.build_flow(settings, bootstrap=bootstrap, stop=stop, counts=counts)


def _batch_summary(counts: FlowCounts, settings: Settings, seconds: float | None) -> str:
    from flows import batch_flow

    return batch_flow.summary(counts, seconds)


def _stop_on_term() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


def serve(settings: Settings, bootstrap: str) -> None:
    """The policy server until SIGTERM or SIGINT (which flushes its rollouts and the SDK's events)."""
    stop = _stop_on_term()  # before the slow start: a signal during it is a clean stop too

    import torch

    from app.serving import loop_model_config, policy_server, serve_until
    from client.sdk import RtrlClient
    from trainer.model import init_parallel

    torch.set_num_threads(1)
    cfg, _ = loop_model_config(settings)
    init_parallel(cfg)
    client = RtrlClient.from_settings(settings, bootstrap=bootstrap)
    # a restarted server must not replay its predecessor's tasks: seed from the seed and the process
    seed = settings.loop.seed * 1_000_003 + os.getpid() + time.time_ns() % 1_000_000
    endpoint = metrics.serve_part(settings, "serve")
    server = policy_server(settings, bootstrap, client, seed)
    endpoint.ready()
    try:
        serve_until(server, settings.loop, stop)
    finally:
        server.close()
        client.close()
        endpoint.close()


class PatientClickHouse:
    """A ClickHouse client that waits out a short outage of its server: a call that fails for want of a
    connection is retried (with a new client) until ``patience_s`` have passed, then reported as one
    ServiceUnavailable naming the address. Only for idempotent use: the tables replace replayed rows."""

    def __init__(self, dsn: str, timeout_s: float, patience_s: float):
        from rtrl import clickhouse

        self._connect = lambda: clickhouse.connect(dsn, timeout_s)
        self._where, self._patience_s = clickhouse.redact(dsn), patience_s
        self._client: Any = None
        self._call(lambda: None, "connect")

    def _call(self, fn: Any, name: str) -> Any:
        from clickhouse_connect.driver.exceptions import OperationalError

        deadline = time.monotonic() + self._patience_s
        while True:
            try:
                if self._client is None:
                    self._client = self._connect()
                return fn()
            except (OperationalError, ServiceUnavailable, ConnectionError) as e:
                self._client = None  # a new client (and connection) for the next try
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(
                        f"ClickHouse at {self._where} did not come back within {self._patience_s:g}s "
                        f"({name}: {type(e).__name__})"
                    ) from None
                time.sleep(0.5)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **kw: self._call(lambda: getattr(self._client, name)(*a, **kw), name)


def clickhouse_for_part(settings: Settings) -> Any:
    """The part's ClickHouse client: patient with a server (the supervisor may be restarting it), plain with chdb."""
    from rtrl import clickhouse

    dsn, timeout_s = settings.clickhouse_dsn, settings.clickhouse.timeout_s
    if dsn.startswith("chdb://"):
        return clickhouse.connect(dsn, timeout_s)
    return PatientClickHouse(dsn, timeout_s, patience_s=max(60.0, 3 * timeout_s))


def train(settings: Settings, bootstrap: str) -> None:
    """The trainer and eval gate until ``loop.cycles`` decisions exist (resuming whatever was done),
    or until SIGTERM/SIGINT (then it checkpoints what it trained and returns)."""
    stop = _stop_on_term()  # before the slow imports and the warm start: a signal then is a clean stop too
    import torch

    from app.loop import Loop, Stopped

    torch.set_num_threads(1)
    endpoint = metrics.serve_part(settings, "train")
    loop = Loop(settings, bootstrap, clickhouse_for_part(settings), serve=False)
    loop.stop = stop  # ends the trainer's waits and its cycle before the next step
    endpoint.ready()
    try:
        if not stop.is_set():
            print(loop.begin(), flush=True)
        loop.run_cycles(lambda r: print("\n".join(r.lines()), flush=True), stop)
    except Stopped as e:
        print(f"{e}: the step checkpoint holds what was trained; a restart resumes there", flush=True)
    finally:
        signalled = stop.is_set()  # read before close(), which sets the stop event at every end, a normal one too
        loop.close()
        endpoint.close()
    if signalled:
        print("stopped cleanly", flush=True)
    else:
        print(f"done: {loop.version} decisions made", flush=True)


def _flow(name: str) -> Callable[[Settings, str], None]:
    def run(settings: Settings, bootstrap: str) -> None:
        # one of a Bytewax cluster when BYTEWAX_PROCESS_ID (or a StatefulSet's pod name) and addresses are set
        print(run_flow(settings, name, bootstrap, cluster=cluster_from()), flush=True)

    return run


@dataclass(frozen=True)
class Workload:
    """How the Kubernetes manifests run a part (:func:`app.manifests.kubernetes`)."""

    file: str
    """Its file under ``deploy/k8s``: the number orders the files as they are applied."""
    kind: str
    """``StatefulSet``: a Bytewax cluster. ``PyTorchJob``: ``torchrun`` on every node."""
    name: str
    """The workload's name. A StatefulSet's pods are ``<name>-0``, ``<name>-1`` and so on."""
    replicas: str
    """The field of :class:`app.manifests.Shape` that says how many pods or nodes it has."""
    recovery_volume: bool = False
    """Each pod gets a volume of its own for its recovery state."""


@dataclass(frozen=True)
class Local:
    """How the cluster's shape on one machine starts a part (:mod:`app.local_cluster`)."""

    process: str
    """Its process's name, and its log's. Several processes are ``<process>-0``, ``<process>-1`` and so on."""
    args: tuple[str, ...]
    """What follows the interpreter: the module and its arguments. ``--config`` comes after them."""
    processes: int = 1
    """Bytewax processes of one cluster. Each takes its identity from the workload's pod names."""
    ranks: int = 0
    """``torchrun``'s ranks on this machine. With 0 the part is one plain process."""

    def names(self) -> list[str]:
        """Its processes' names, in process-id order."""
        return [f"{self.process}-{i}" for i in range(self.processes)] if self.processes > 1 else [self.process]


@dataclass(frozen=True)
class Part:
    """One part of the closed loop, defined once: every runner starts, waits for and stops it from here."""

    name: str
    title: str
    """What a runner's lines call it, e.g. ``reward flow``."""
    run: Callable[[Settings, str], None]
    """Its body in a process of its own: the settings and the broker's address. It returns at its end or on
    SIGTERM or SIGINT, stopping cleanly."""
    needs_clickhouse: bool
    """Whether it writes to ClickHouse: it starts only once the ClickHouse front is ready."""
    flow: Flow | None
    """A Bytewax flow: how to build it, summarise it and drain it. ``--to-end`` runs it to the end of its
    topics and closes every window still open. The main job's threads runner runs it on a thread."""
    stops_first: bool
    """Stopped before the other parts: the policy server sends the events and rollouts it still holds, which
    the flows then read."""
    local: Local
    """How the local cluster starts it."""
    workload: Workload | None = None
    """How Kubernetes runs it. None: it is not deployed, as the policy server (the inference fleet serves)."""
    finishes: bool = False
    """Its clean exit ends the run: the trainer's, once its steps or decisions are done. The others run until
    they are stopped. It is the part that trains, so the loop's training settings are its own to refuse."""

    def __post_init__(self) -> None:
        if self.flow is not None and self.flow.name != self.name:
            raise ValueError(f"part {self.name}: its flow is named {self.flow.name}")
        if self.local.processes > 1 and (self.flow is None or self.workload is None):
            raise ValueError(f"part {self.name}: only a deployed flow runs as several Bytewax processes")


#: the closed loop's parts in start order: the flows first, so they read what the server writes from its start
PART_LIST = (
    Part(
        "rewards",
        "reward flow",
        _flow("rewards"),
        needs_clickhouse=True,
        flow=Flow(
            "rewards", _reward_flow, _reward_summary, tail="flow.tail", recovery="flow.recovery_dir", windowed=True
        ),
        stops_first=False,
        local=Local("rewards", ("-m", "app.cli", "flow", "rewards", "-w", "1"), processes=2),
        workload=Workload("20-reward-flow.yaml", "StatefulSet", "rtrl-reward-flow", "reward_processes", True),
    ),
    Part(
        "batches",
        "batch flow",
        _flow("batches"),
        needs_clickhouse=True,
        flow=Flow("batches", _batch_flow, _batch_summary, tail="batching.tail", recovery="batching.recovery_dir"),
        stops_first=False,
        local=Local("batches", ("-m", "app.cli", "flow", "batches")),
        workload=Workload("30-batch-flow.yaml", "StatefulSet", "rtrl-batch-flow", "batch_processes", True),
    ),
    Part(
        "serve",
        "policy server",
        serve,
        needs_clickhouse=False,
        flow=None,
        stops_first=True,
        local=Local("serve", ("-m", "app.cli", "part", "serve")),
    ),
    Part(
        "train",
        "trainer",
        train,
        needs_clickhouse=True,
        flow=None,
        stops_first=False,
        local=Local("trainer", ("-m", "trainer"), ranks=2),
        workload=Workload("40-trainer.yaml", "PyTorchJob", "rtrl-trainer", "trainer_nodes"),
        finishes=True,
    ),
)
DEFINED = {p.name: p for p in PART_LIST}
PARTS = tuple(DEFINED)
#: each flow part's flow by its name, in start order
FLOW = {p.name: p.flow for p in PART_LIST if p.flow is not None}
FLOWS = tuple(FLOW.values())


#: set by the supervisor for its parts: the part stops (cleanly, as on SIGTERM) when that process is gone
SUPERVISOR_PID = "_RTRL_SUPERVISOR_PID"


def _stop_with_supervisor(poll_s: float = 1.0) -> None:
    """A part started by a supervisor that then dies (kill -9, OOM) would otherwise run on, orphaned, for
    ever: it signals itself SIGTERM - the clean stop - once its parent is no longer that supervisor."""
    pid = os.environ.get(SUPERVISOR_PID)
    if not pid or not pid.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(pid):
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="rtrl-supervisor-watch", daemon=True).start()


def main(argv: list[str] | None = None, settings: Settings | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_known_warnings()
    to_end = argv[1:] == ["--to-end"]
    part = DEFINED.get(argv[0]) if argv else None
    if part is None or (len(argv) > 1 and not (to_end and part.flow is not None)):
        print(f"usage: python -m app.parts {'|'.join(PARTS)}  (flows: --to-end)", file=sys.stderr)
        return 2
    from app.loop_config import loop_settings  # not app.loop: the flow parts never import torch
    from app.services import preflight

    try:  # settings and services checked before the long work (a warm start, a flow's recovery)
        settings = loop_settings(settings or load_settings(), trains=part.finishes)
        if to_end and part.flow is not None:
            settings = settings.updated({part.flow.tail: False})
        bootstrap = preflight(settings, clickhouse_too=part.needs_clickhouse)
    except RtrlError as e:
        print(f"error: part {part.name}: {e}", file=sys.stderr)
        return 2
    _stop_with_supervisor()
    try:  # a flow's recovery that does not fit, serving.url unreachable ...: one line naming it
        part.run(settings, bootstrap)
    except RtrlError as e:
        print(f"error: part {part.name}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
