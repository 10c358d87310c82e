"""Where a flow process keeps its state: its Bytewax cluster identity, its recovery folder and partition keys.

A flow part is one process of a Bytewax cluster when the environment says so, as for ``python -m bytewax.run``:
``BYTEWAX_PROCESS_ID`` (or a StatefulSet pod's ``BYTEWAX_POD_NAME`` and ``BYTEWAX_STATEFULSET_NAME``) and
``BYTEWAX_ADDRESSES`` (``host:port;host:port``, or a ``BYTEWAX_HOSTFILE_PATH``): :func:`cluster_from`.
Every runner of a flow takes its recovery folder from here: the parts, the main job's threads and retention.
:class:`Flow` is what every runner needs to know about one flow part (:data:`app.parts.PART_LIST` holds them).
It is defined here, below :mod:`app.loop`, so the threads runner takes flows without importing the parts.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from flows.counts import FlowCounts
from rtrl.errors import ConfigError, ServiceUnavailable
from rtrl.files import private_dir
from rtrl.settings import Settings


@dataclass(frozen=True)
class Flow:
    """One flow part as every runner runs it: in a process of its own, on a thread, or drained to its end."""

    name: str
    """The part's name: its recovery folder's and its metrics' too."""
    build: Callable[[Settings, str, threading.Event, FlowCounts, Mapping[int, str] | None], Any]
    """Its dataflow: the settings, the broker's address, the stop event, the counts it keeps, the partition keys."""
    summary: Callable[[FlowCounts, Settings, float | None], str]
    """The line it prints at its end: what it read and wrote, in how many seconds if known."""
    tail: str
    """The setting that keeps it following its topics: false runs it to their end (a drain)."""
    recovery: str
    """The setting that names its Bytewax recovery folder: empty is ``<data_dir>/recovery/<name>``."""
    windowed: bool = False
    """It keeps windows: their state spills to ``flow.state_dir``, and a cluster spreads its keys over every worker."""

    def follows(self, settings: Settings) -> bool:
        """Whether it follows its topics under ``settings`` (its :attr:`tail` setting)."""
        return bool(settings.value(self.tail))


def recovery_path(settings: Settings, flow: Flow) -> Path:
    """Bytewax recovery folder of ``flow``: its :attr:`Flow.recovery` setting, else ``<data_dir>/recovery/<name>``."""
    return Path(settings.value(flow.recovery) or settings.data_path / "recovery" / flow.name)


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


def partitions_in(folder: Path) -> list[tuple[int, int]]:
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


def process_recovery_path(settings: Settings, flow: Flow, cluster: Cluster) -> Path:
    """The recovery folder of this process: the flow's folder for a lone process, else its ``process-<id>``
    subfolder, which holds this process's recovery partition only (a StatefulSet's pod has its own volume)."""
    base = recovery_path(settings, flow)
    return base if cluster.processes == 1 else base / f"process-{cluster.process_id}"


def recovery_config(settings: Settings, flow: Flow, cluster: Cluster | None = None) -> Any:
    """Bytewax's RecoveryConfig for ``flow``, its folder created (owner-only) and initialised once.

    A lone process keeps one partition in the flow's folder. In a cluster of N processes, process i keeps
    partition i of N in ``process-<i>`` under it: Bytewax finds the partitions across all processes, so each
    inits only its own, whether the processes share a volume or each has its own; a restart resumes from them.
    A folder made for another number of processes is refused (ConfigError with the fix): resuming it would lose
    or mix state."""
    from bytewax.recovery import RecoveryConfig, init_db_dir

    cluster = cluster or Cluster()
    name, setting = flow.name, flow.recovery
    base, n, i = recovery_path(settings, flow), cluster.processes, cluster.process_id
    recovery = process_recovery_path(settings, flow, cluster)
    fresh = f"or start the {name} flow afresh (delete {base} and replay the topics)"
    if n > 1 and base.is_dir() and partitions_in(base):
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
    held = partitions_in(recovery)
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


def check_state_volume(settings: Settings, flow: Flow) -> None:
    """With spilled window state (``flow.state_memory_mb`` > 0), ``flow.state_dir`` must be on the windowed
    ``flow``'s recovery folder's volume: the snapshots there refer to the files there, so they are backed up, restored and
    moved together (ConfigError naming both otherwise). Creates both folders (owner-only)."""
    if settings.flow.state_memory_mb <= 0:
        return
    state, recovery = private_dir(Path(settings.state_root)), private_dir(recovery_path(settings, flow))
    if state.stat().st_dev != recovery.stat().st_dev:
        raise ConfigError(
            f"flow.state_dir {state} is on another volume than the {flow.name} flow's recovery folder {recovery}; the "
            "recovery snapshots refer to the window state files, so both must be saved and restored together. "
            "Fix: set flow.state_dir to a folder on the recovery folder's volume (empty = <data_dir>/state/rewards)"
        )
