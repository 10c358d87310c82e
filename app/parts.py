"""One part of the closed loop as its own process (``loop.processes``): what the supervisor starts.

    python -m app.parts rewards|batches|serve|train      (settings from RTRL_* / RTRL_CONFIG)
    python -m app.parts rewards|batches --to-end         (a flow until the end of its topics, then exit)

A flow part is one process of a Bytewax cluster when the environment says so, as for ``python -m bytewax.run``:
``BYTEWAX_PROCESS_ID`` (or a StatefulSet pod's ``BYTEWAX_POD_NAME`` and ``BYTEWAX_STATEFULSET_NAME``) and
``BYTEWAX_ADDRESSES`` (``host:port;host:port``, or a ``BYTEWAX_HOSTFILE_PATH``): :func:`cluster_from`.

``rewards``, ``batches``  the reward and batch flows under Bytewax with recovery (a restart after
                          kill -9 resumes from the last snapshot; sinks are at-least-once and
                          ClickHouse replaces replayed rows, the trainer skips replayed micro-batches)
``serve``                 the policy server: follows ``rtrl.deployments`` and ``rtrl.experiments``, serves
                          ``loop.rate`` tasks/s with backpressure per decision; a restart re-reads both
``train``                 the trainer and eval gate (:class:`app.loop.Loop` without the other parts):
                          resumes from ``loop/state.json`` and the cycle's newest step checkpoint,
                          exits 0 once ``loop.cycles`` decisions are made

Every part uses the loop's settings (:func:`app.loop.loop_settings`), ``kafka.bootstrap`` and
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
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from rtrl import metrics
from rtrl.errors import ConfigError, RtrlError, ServiceUnavailable
from rtrl.files import private_dir
from rtrl.quiet import quiet_known_warnings
from rtrl.settings import Settings, load_settings

PARTS = ("rewards", "batches", "serve", "train")


def recovery_path(settings: Settings, name: str) -> Path:
    """Bytewax recovery folder of flow ``name`` (its setting, else ``<data_dir>/recovery/<name>``)."""
    setting = settings.flow.recovery_dir if name == "rewards" else settings.batching.recovery_dir
    return Path(setting or settings.data_path / "recovery" / name)


@dataclass(frozen=True)
class Cluster:
    """Where this flow process stands in a Bytewax cluster: process ``process_id`` of ``addresses`` (every
    process's ``host:port``, this one's included, in process-id order), as ``python -m bytewax.run -i/-a`` takes
    them. A lone process is ``Cluster()``: process 0 of 1, no addresses."""

    process_id: int = 0
    addresses: tuple[str, ...] = ()

    @property
    def processes(self) -> int:
        return max(1, len(self.addresses))

    @property
    def local_index(self) -> int:
        """This process's place among the cluster's processes on its own host (by the host part of the addresses):
        what its metrics port is offset by. 0 for a lone process and for a pod alone on its host (a
        StatefulSet's pods each have their own address, so every pod serves metrics on ``metrics.port``, where
        its probes look); 0, 1, ... for processes that share a host, which would otherwise take the same port."""
        if not self.addresses:
            return 0
        host = self.addresses[self.process_id].rpartition(":")[0]
        return sum(1 for a in self.addresses[: self.process_id] if a.rpartition(":")[0] == host)

    def describe(self, workers: int) -> str:
        each = f"{workers} worker{'s' if workers != 1 else ''}"
        if not self.addresses:
            return f"one process, {each}"
        return f"process {self.process_id} of {self.processes} ({each} each; addresses {';'.join(self.addresses)})"


#: the environment ``bytewax.run`` reads its cluster from (and its Helm chart's StatefulSet sets)
CLUSTER_ENV = (
    "BYTEWAX_PROCESS_ID",
    "BYTEWAX_ADDRESSES",
    "BYTEWAX_POD_NAME",
    "BYTEWAX_STATEFULSET_NAME",
    "BYTEWAX_HOSTFILE_PATH",
)


def cluster_from(
    process_id: int | None = None, addresses: str | None = None, env: Mapping[str, str] | None = None
) -> Cluster:
    """The cluster as ``python -m bytewax.run`` resolves it: ``process_id`` (``-i``), else ``BYTEWAX_PROCESS_ID``,
    else the ordinal of ``BYTEWAX_POD_NAME`` after ``BYTEWAX_STATEFULSET_NAME-`` (a StatefulSet's pod); ``addresses``
    (``-a``, ``host:port;host:port``), else ``BYTEWAX_ADDRESSES``, else the lines of ``BYTEWAX_HOSTFILE_PATH``.
    Neither set: a lone process. Anything inconsistent is a ConfigError naming the option and the fix."""
    env = os.environ if env is None else env
    fix_a = "fix: pass -a/--addresses 'host0:port;host1:port' (or set BYTEWAX_ADDRESSES), one per process"
    if process_id is None and env.get("BYTEWAX_PROCESS_ID", "").strip():
        text = env["BYTEWAX_PROCESS_ID"].strip()
        if not text.isdigit():
            raise ConfigError(f"BYTEWAX_PROCESS_ID = {text!r} is not a process id; fix: set it to 0, 1, 2, ...")
        process_id = int(text)
    if process_id is None and env.get("BYTEWAX_POD_NAME") and env.get("BYTEWAX_STATEFULSET_NAME"):
        pod, sts = env["BYTEWAX_POD_NAME"], env["BYTEWAX_STATEFULSET_NAME"]
        ordinal = pod.removeprefix(sts + "-")
        if not pod.startswith(sts + "-") or not ordinal.isdigit():
            raise ConfigError(
                f"BYTEWAX_POD_NAME = {pod!r} is not a pod of StatefulSet BYTEWAX_STATEFULSET_NAME = {sts!r} "
                f"(<statefulset>-<ordinal>); fix: set BYTEWAX_POD_NAME from metadata.name and "
                "BYTEWAX_STATEFULSET_NAME to the StatefulSet's name"
            )
        process_id = int(ordinal)
    if addresses is None and env.get("BYTEWAX_ADDRESSES", "").strip():
        addresses = env["BYTEWAX_ADDRESSES"]
    if addresses is None and process_id is not None and env.get("BYTEWAX_HOSTFILE_PATH"):
        path = Path(env["BYTEWAX_HOSTFILE_PATH"])
        try:
            addresses = ";".join(line.strip() for line in path.read_text().splitlines() if line.strip())
        except OSError as e:
            raise ConfigError(
                f"BYTEWAX_HOSTFILE_PATH {path} cannot be read ({e.strerror or e}); fix: name a file with one "
                "host:port per line, or set BYTEWAX_ADDRESSES"
            ) from None
    if process_id is None and addresses is None:
        return Cluster()
    if process_id is None:
        raise ConfigError(
            "cluster addresses were given (-a/--addresses or BYTEWAX_ADDRESSES) without this process's id; fix: pass "
            "-i/--process-id N (or set BYTEWAX_PROCESS_ID, or BYTEWAX_POD_NAME and BYTEWAX_STATEFULSET_NAME)"
        )
    if process_id < 0:
        raise ConfigError(f"process id {process_id} is negative; fix: pass -i/--process-id 0, 1, 2, ...")
    if not addresses or not addresses.strip():
        raise ConfigError(f"process id {process_id} was given without the cluster's addresses; {fix_a}")
    found = tuple(a.strip() for a in addresses.split(";") if a.strip())
    for a in found:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"cluster address {a!r} is not host:port; {fix_a}")
    if len(set(found)) != len(found):
        raise ConfigError(f"cluster addresses {';'.join(found)} name a process twice; {fix_a}")
    if process_id >= len(found):
        raise ConfigError(
            f"process id {process_id} is out of range of the {len(found)} cluster address"
            f"{'es' if len(found) != 1 else ''} ({';'.join(found)}: ids 0..{len(found) - 1}); fix: give every "
            "process's address in -a/--addresses (BYTEWAX_ADDRESSES), or this process's right id"
        )
    return Cluster(process_id, found)


def _partitions_in(folder: Path) -> list[tuple[int, int]]:
    """(index, count) of the Bytewax recovery partitions in ``folder``."""
    import sqlite3

    found = []
    for f in sorted(folder.glob("part-*.sqlite3")):
        db = sqlite3.connect(f)  # read only; no flow runs on it yet
        try:
            found += [(int(i), int(n)) for i, n in db.execute("SELECT part_index, part_count FROM parts")]
        except sqlite3.Error:
            pass  # not a partition: Bytewax names it when it refuses the folder
        finally:
            db.close()
    return found


def process_recovery_path(settings: Settings, name: str, cluster: Cluster) -> Path:
    """The recovery folder of this process: the flow's folder for a lone process, else its ``process-<id>``
    subfolder, which holds this process's recovery partition only (a StatefulSet's pod has its own volume)."""
    base = recovery_path(settings, name)
    return base if cluster.processes == 1 else base / f"process-{cluster.process_id}"


def recovery_config(settings: Settings, name: str, cluster: Cluster | None = None) -> Any:
    """Bytewax's RecoveryConfig for flow ``name``, its folder created (owner-only) and initialised once.

    A lone process keeps one partition in the flow's folder. In a cluster of N processes, process i keeps
    partition i of N in ``process-<i>`` under it: Bytewax finds the partitions across all processes, so each
    inits only its own, whether the processes share a volume or each has its own; a restart resumes from them.
    A folder made for another number of processes is refused (ConfigError with the fix): resuming it would lose
    or mix state."""
    from bytewax.recovery import RecoveryConfig, init_db_dir

    cluster = cluster or Cluster()
    base, n, i = recovery_path(settings, name), cluster.processes, cluster.process_id
    recovery = process_recovery_path(settings, name, cluster)
    setting = "flow.recovery_dir" if name == "rewards" else "batching.recovery_dir"
    fresh = f"or start the {name} flow afresh (delete {base} and replay the topics)"
    if n > 1 and base.is_dir() and _partitions_in(base):
        raise ConfigError(
            f"the {name} flow's recovery folder {base} ({setting}) holds a lone process's state, and this is process "
            f"{i} of a cluster of {n}; fix: run it as one process again, {fresh}"
        )
    if n == 1 and base.is_dir() and any(base.glob("process-*")):
        raise ConfigError(
            f"the {name} flow's recovery folder {base} ({setting}) holds a cluster's state (process-* folders), and "
            f"this is a lone process; fix: run it with the cluster's -i/-a again, {fresh}"
        )
    if not recovery.exists() or not any(recovery.iterdir()):
        private_dir(recovery)
        if n == 1:
            init_db_dir(recovery, 1)
        else:  # partition i of n only: the other processes make theirs
            import tempfile

            with tempfile.TemporaryDirectory(dir=recovery) as tmp:
                init_db_dir(Path(tmp), n)
                os.replace(Path(tmp) / f"part-{i}.sqlite3", recovery / f"part-{i}.sqlite3")
    held = _partitions_in(recovery)
    if held and held != [(i, n)]:
        made = ", ".join(f"{j} of {m}" for j, m in held)
        raise ConfigError(
            f"the {name} flow's recovery folder {recovery} ({setting}) holds partition {made}, not {i} of {n} "
            f"(this process {i} of a cluster of {n}); fix: run the cluster with the number of processes the state "
            f"was made with, {fresh}"
        )
    return RecoveryConfig(str(recovery), backup_interval=timedelta(0))


#: the reward flow's partition keys a recovery folder's state was made under (flows.routing), beside its partitions
KEYS_FILE = "rtrl-partition-keys.json"


def partition_keys(settings: Settings, bootstrap: str, workers: int, recovery: Path, fresh: bool) -> dict[int, str]:
    """The reward flow's key for each partition of the events topic, spread over ``workers`` workers in all
    (:func:`flows.routing.balanced_keys`), and the same keys the state in ``recovery`` was made under: the first
    run records them (``rtrl-partition-keys.json``); a later run whose keys differ - another number of workers
    or of partitions - is refused with the fix, since its windows open under the old keys would never close.
    A folder with state from before the record (not ``fresh``) kept the plain keys: taken when they still are."""
    import json

    from flows.routing import balanced_keys
    from rtrl.kafka import check_broker

    topic = settings.topic("events")
    meta = check_broker(bootstrap, settings.kafka.timeout_s).topics.get(topic)
    if meta is None:
        raise ServiceUnavailable(f"topic {topic} does not exist on {bootstrap}; fix: run `rtrl topics` first")
    keys = balanced_keys(len(meta.partitions), workers)
    record = recovery / KEYS_FILE
    now = {str(p): k for p, k in keys.items()}
    if record.exists():
        then = json.loads(record.read_text())
    elif not fresh and any(k != str(p) for p, k in keys.items()):
        then = {str(p): str(p) for p in range(len(keys))}  # state from before the record: the plain keys
    else:
        then = now
    if then != now:
        raise ConfigError(
            f"the reward flow's recovery folder {recovery} holds windows keyed for {len(then)} partitions of {topic} "
            f"spread over the workers it ran with; with {workers} worker(s) in all and {len(keys)} partitions the "
            "keys differ, and the windows open under the old ones would never close. Fix: run with the workers "
            "(processes x -w) and partitions it ran with, or let it reach the end of its topics (flow.tail = false) "
            "and start it afresh (delete the recovery folders and replay the topics)"
        )
    record.write_text(json.dumps(now, sort_keys=True) + "\n")
    return keys


def check_state_volume(settings: Settings) -> None:
    """With spilled window state (``flow.state_memory_mb`` > 0), ``flow.state_dir`` must be on the reward flow's
    recovery folder's volume: the snapshots there refer to the files there, so they are backed up, restored and
    moved together (ConfigError naming both otherwise). Creates both folders (owner-only)."""
    if settings.flow.state_memory_mb <= 0:
        return
    state, recovery = private_dir(Path(settings.state_root)), private_dir(recovery_path(settings, "rewards"))
    if state.stat().st_dev != recovery.stat().st_dev:
        raise ConfigError(
            f"flow.state_dir {state} is on another volume than the reward flow's recovery folder {recovery}; the "
            "recovery snapshots refer to the window state files, so both must be saved and restored together. "
            "Fix: set flow.state_dir to a folder on the recovery folder's volume (empty = <data_dir>/state/rewards)"
        )


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

    from flows import batch_flow, reward_flow
    from flows.counts import FlowCounts
    from flows.kafka_io import stop_on_signals

    cluster = cluster or Cluster()
    counts, t0 = FlowCounts(), time.monotonic()
    if name == "rewards":
        check_state_volume(settings)
    folder = process_recovery_path(settings, name, cluster)
    from app.retention import hold, prune_at_start

    with hold(folder):  # from before its first look: `rtrl retention apply` keeps a folder a flow holds
        fresh = not _partitions_in(folder)
        recovery = recovery_config(settings, name, cluster)  # refused before anything starts when it does not fit
        if name == "rewards":  # spill files nothing uses go after retention.state_days, before Bytewax starts
            prune_at_start(settings)
        endpoint = metrics.serve_part(settings, f"flow-{name}", cluster.local_index)
        try:
            stop = stop if stop is not None else stop_on_signals()
            if name == "rewards":  # its partitions' keys spread over every worker of the cluster (flows.routing)
                keys = partition_keys(settings, bootstrap, workers * cluster.processes, folder, fresh)
                flow = reward_flow.build_flow(settings, bootstrap=bootstrap, stop=stop, counts=counts, keys=keys)
            else:
                flow = batch_flow.build_flow(settings, bootstrap=bootstrap, stop=stop, counts=counts)
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
    if name == "rewards":
        return where + reward_flow.summary(counts, settings.rewards.versions, seconds)
    return where + batch_flow.summary(counts, seconds)


def _stop_on_term() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


def serve(settings: Settings, bootstrap: str) -> None:
    """The policy server until SIGTERM or SIGINT (which flushes its rollouts and the SDK's events)."""
    stop = _stop_on_term()  # before the slow start: a signal during it is a clean stop too

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

    from app.adapters import describe
    from app.loop import Loop, Stopped

    torch.set_num_threads(1)
    endpoint = metrics.serve_part(settings, "train")
    loop = Loop(settings, bootstrap, clickhouse_for_part(settings), serve=False)
    loop.stop = stop  # ends the trainer's waits and its cycle before the next step
    endpoint.ready()
    try:
        if loop.resume():
            print(f"resumed: {loop.version} decisions made, serving v{loop.serving}", flush=True)
        elif not stop.is_set():
            loop.initial()
            print(f"v0 (warm start): held-out solve rate {loop.evals[0]['solve_rate']:.3f}", flush=True)
        while loop.version < settings.loop.cycles and not stop.is_set():
            r = loop.cycle()
            print(
                f"v{r.version} <- v{r.parent}: {r.status} after {len(r.steps)} steps "
                f"({r.seconds['train']:.0f}s): {r.reason}",
                flush=True,
            )
            for a in r.adapters:
                print(describe(a), flush=True)
    except Stopped as e:
        print(f"{e}: the step checkpoint holds what was trained; a restart resumes there", flush=True)
    finally:
        loop.close()
        endpoint.close()
    if stop.is_set():
        print("stopped cleanly", flush=True)


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
    if not argv or argv[0] not in PARTS or (len(argv) > 1 and not (to_end and argv[0] in ("rewards", "batches"))):
        print(f"usage: python -m app.parts {'|'.join(PARTS)}  (flows: --to-end)", file=sys.stderr)
        return 2
    from app.loop_config import loop_settings  # not app.loop: the flow parts never import torch
    from app.services import preflight

    name = argv[0]
    try:  # settings and services checked before the long work (a warm start, a flow's recovery)
        settings = loop_settings(settings or load_settings(), trains=name == "train")
        if to_end:
            settings = settings.updated({"flow.tail": False, "batching.tail": False})
        bootstrap = preflight(settings, clickhouse_too=name != "serve")
    except RtrlError as e:
        print(f"error: part {name}: {e}", file=sys.stderr)
        return 2
    _stop_with_supervisor()
    if name in ("rewards", "batches"):
        try:  # one of a Bytewax cluster when BYTEWAX_PROCESS_ID (or a StatefulSet's pod name) and addresses are set
            cluster = cluster_from()
            print(run_flow(settings, name, bootstrap, cluster=cluster), flush=True)
        except ConfigError as e:
            print(f"error: part {name}: {e}", file=sys.stderr)
            return 2
    elif name == "serve":
        try:  # serving.url unreachable, or not serving serving.model: one line naming it
            serve(settings, bootstrap)
        except RtrlError as e:
            print(f"error: part serve: {e}", file=sys.stderr)
            return 2
    else:
        train(settings, bootstrap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
