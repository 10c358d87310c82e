"""The closed loop as separate processes under a supervisor (``loop.processes = true``).

The supervisor starts the services (the local broker unless ``kafka.bootstrap`` is set; the
embedded ClickHouse behind :mod:`devservices.chserver` unless ``clickhouse.dsn`` is a server), then one
process per part (:mod:`app.parts`: reward flow, batch flow, policy server, trainer), and restarts
any part that dies - what systemd or Kubernetes does in production. Each part resumes by itself
(Bytewax recovery, the trainer's state file and step checkpoints, the server re-reading
``rtrl.deployments`` and ``rtrl.experiments``), so a kill -9 of any one of them costs time, not data. Logs go to
``<data_dir>/logs/<part>.log``.

Supervision:

* each part leads its own process group; before a dead part is restarted its whole group is ended
  (SIGTERM, a bounded wait, SIGKILL for stragglers), so helpers it forked (a checkpoint writer) never
  outlive it, and at the end of the run no process of the run is left;
* the embedded ClickHouse front is supervised like a part: restarted on the same port and with the
  same token file, so every client reconnects (the flows' sinks retry, the trainer's and the
  supervisor's clients wait out the outage);
* the restart budget is a rate, as systemd (``StartLimitBurst`` in ``StartLimitIntervalSec``) and
  Kubernetes count it: ``loop.max_restarts`` restarts of one part within a sliding window of
  ``loop.restart_window_s``; one more death in the window ends the run with one line naming the part
  and its log.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from app.deployments import end_running_experiments
from app.job import FinalAB, final_ab
from app.loop_config import loop_settings
from app.parts import DEFINED, PARTS, SUPERVISOR_PID, PatientClickHouse
from app.services import Services, spawn_embedded_clickhouse
from rtrl import clickhouse
from rtrl.errors import ServiceUnavailable
from rtrl.kafka import connection, producer_config
from rtrl.settings import Settings, as_env

#: the embedded ClickHouse front's name among the supervised processes (its log: logs/clickhouse.log)
CLICKHOUSE = "clickhouse"


def process_table() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc."""
    rows = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        state, ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]  # after "pid (comm) "
        rows.append((int(p.name), state, int(ppid), int(pgrp)))
    return rows


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    return [pid for pid, state, _, pgrp in process_table() if pgrp == pgid and state != "Z"]


def end_group(pgid: int, timeout_s: float = 5.0) -> None:
    """End process group ``pgid``: SIGTERM, wait up to ``timeout_s`` for it to empty, SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not group_members(pgid):
            return


class RestartBudget:
    """At most ``limit`` restarts per name within a sliding window of ``window_s`` seconds."""

    def __init__(self, limit: int, window_s: float, clock=time.monotonic):
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.times: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self.total: collections.Counter[str] = collections.Counter()

    def allow(self, name: str) -> bool:
        """Record a restart of ``name`` if the window has room for it; False when it has none."""
        now, times = self.clock(), self.times[name]
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) >= self.limit:
            return False
        times.append(now)
        self.total[name] += 1
        return True


class Supervisor:
    def __init__(self, settings: Settings, max_restarts: int | None = None, restart_window_s: float | None = None):
        # the parts run with the loop's settings; a user value the loop cannot honour is refused here, once
        self.settings = loop_settings(settings)
        ls = self.settings.loop
        self.budget = RestartBudget(
            ls.max_restarts if max_restarts is None else max_restarts,
            ls.restart_window_s if restart_window_s is None else restart_window_s,
        )
        self.log_dir = settings.data_path / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.services: Services | None = None
        self.ch_proc: subprocess.Popen | None = None
        self.ch_folder: str | None = None
        self.ch_port: int | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.exits: list[tuple[str, int | None]] = []  # (name, exit code) of every process that ended
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.failed = threading.Event()  # the run cannot go on (failure says why); set with done
        self.failure: str | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.clickhouse_ready = threading.Event()  # clear while the embedded front restarts
        self.clickhouse_ready.set()
        self._ch_restart: threading.Thread | None = None

    @property
    def restarts(self) -> collections.Counter[str]:
        """Restarts per part (and ``clickhouse``) over the whole run."""
        return self.budget.total

    # ------------------------------------------------------------ services

    def _spawn_clickhouse(self) -> str:
        """The embedded front on its folder; after the first start on the same port (and token file)."""
        assert self.ch_folder is not None
        kwargs: dict[str, Any] = {
            "log": self.log_dir / f"{CLICKHOUSE}.log",
            "database": self.settings.clickhouse.database,
        }
        if self.ch_port is not None:  # a restart: the same port and token files, so every client's DSN stays valid
            kwargs |= {"port": self.ch_port, "fresh_tokens": False}
        proc, dsn = spawn_embedded_clickhouse(self.ch_folder, **kwargs)
        with self.lock:
            self.ch_proc = proc
        from urllib.parse import urlsplit

        self.ch_port = urlsplit(dsn).port
        return dsn

    def start_services(self) -> None:
        """The embedded ClickHouse behind its server (unless a server is configured), then the broker,
        topics and migrations as every job gets them (:class:`app.services.Services`)."""
        s = self.settings
        if s.clickhouse_dsn.startswith("chdb://"):
            self.ch_folder = s.clickhouse_dsn[len("chdb://") :]
            self.dsn = self._spawn_clickhouse()
        else:
            self.dsn = s.clickhouse_dsn
        try:
            self.services = Services(s.updated({"clickhouse.dsn": self.dsn}))
        except BaseException:
            self.close()
            raise
        self.bootstrap = self.services.bootstrap
        # the supervisor's own queries wait out a restart of the front, then fail as one line naming it
        self.ch: Any = PatientClickHouse(
            self.dsn, s.clickhouse.timeout_s, patience_s=max(60.0, 3 * s.clickhouse.timeout_s)
        )
        child = s.updated({"kafka.bootstrap": self.bootstrap, "clickhouse.dsn": self.dsn})
        # no BYTEWAX_* cluster variable of this shell: each flow part here is a lone process (app.flow_state.cluster_from)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RTRL_", "BYTEWAX_"))} | as_env(child)
        self.env[SUPERVISOR_PID] = str(os.getpid())  # parts stop by themselves should this process die

    # ------------------------------------------------------------ parts

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        # each part in its own process group: a signal reaches the helpers it forks too (a checkpoint
        # writer killed with its trainer would otherwise be left behind, orphaned)
        env = self.env
        if self.settings.metrics.port:  # every part its own endpoint: metrics.port + the part's place in PARTS
            env = env | {"RTRL_METRICS__PORT": str(self.settings.metrics.port + PARTS.index(name))}
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.parts", name, *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
            start_new_session=True,
        )
        log.close()
        with self.lock:
            self.procs[name] = proc
        return proc

    def start_all(self) -> None:
        for name in PARTS:
            self.start(name)
        self._watcher = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._watcher.start()

    def pid(self, name: str) -> int:
        """The process id of a part or of the ClickHouse front (``clickhouse``) as it runs now."""
        with self.lock:
            proc = self.ch_proc if name == CLICKHOUSE else self.procs[name]
        if proc is None:
            raise KeyError(name)
        return proc.pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to a part's process group (kill -9 by default); the supervisor restarts it. Returns its pid."""
        with self.lock:
            proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        return proc.pid

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _give_up(self, name: str, rc: int | None) -> None:
        b = self.budget
        self.failure = (
            f"{'the ClickHouse front' if name == CLICKHOUSE else 'part ' + name} died {b.limit + 1} times within "
            f"{b.window_s:g}s (loop.max_restarts = {b.limit}, loop.restart_window_s = {b.window_s:g}; "
            f"last exit code {rc}); log {self.log_dir / (name + '.log')}:\n{self.log_tail(name)}"
        )
        self.failed.set()
        self.done.set()

    def _restart_clickhouse(self) -> None:
        """The front again, on its port and token files; its readiness lets the parts that wait for it start."""
        try:
            self._spawn_clickhouse()
        except ServiceUnavailable as e:
            self.failure = f"the ClickHouse front could not be restarted: {e}"
            self.failed.set()
            self.done.set()
            return
        self.clickhouse_ready.set()

    def _watch(self) -> None:
        """Restart what died. The front restarts on a thread of its own, so the parts' restarts do not queue
        behind it; a part that writes to ClickHouse waits for the front's readiness before it is restarted,
        instead of failing its start and spending its restart budget."""
        waiting: dict[str, int | None] = {}  # dead parts to restart, with their exit codes
        while not self._stop.wait(0.2):
            # before the front is read: a restart that ends in between has already put the new front in place
            busy = self._ch_restart is not None and self._ch_restart.is_alive()
            with self.lock:
                items = list(self.procs.items())
                ch = self.ch_proc
            if self.failed.is_set():
                return
            if ch is not None and not busy and ch.poll() is not None and not self._stop.is_set():
                self.exits.append((CLICKHOUSE, ch.returncode))
                if not self.budget.allow(CLICKHOUSE):
                    return self._give_up(CLICKHOUSE, ch.returncode)
                self.clickhouse_ready.clear()
                self._ch_restart = threading.Thread(
                    target=self._restart_clickhouse, name="clickhouse-restart", daemon=True
                )
                self._ch_restart.start()
            for name, proc in items:
                rc = proc.poll()
                if rc is None or name in waiting or self._stop.is_set():
                    continue
                end_group(proc.pid)  # whatever the dead part forked goes with it
                self.exits.append((name, rc))
                if DEFINED[name].finishes and rc == 0 and self.decided_all():
                    # every decision made: the other parts run on (the final A/B) and are still supervised
                    with self.lock:
                        self.procs.pop(name, None)
                    self.done.set()
                    continue
                waiting[name] = rc
            for name, rc in list(waiting.items()):
                if self._stop.is_set() or (DEFINED[name].needs_clickhouse and not self.clickhouse_ready.is_set()):
                    continue
                del waiting[name]
                if not self.budget.allow(name):
                    return self._give_up(name, rc)
                self.start(name)

    def decided_all(self) -> bool:
        """Whether the trainer's state file records every decision (``loop.cycles``); a trainer that exits 0
        before that was stopped, and is restarted like any part that ended."""
        try:
            return self._state()["version"] >= self.settings.loop.cycles
        except (OSError, ValueError, KeyError):
            return False

    def _state(self) -> dict:
        """The trainer's state file (``loop/state.json``); OSError or ValueError when it cannot be read."""
        return json.loads((self.settings.data_path / "loop" / "state.json").read_text())

    def wait(self, timeout_s: float, tick=None) -> None:
        """Until the trainer has made every decision (``tick()`` is called about once a second)."""
        deadline = time.monotonic() + timeout_s
        while not self.done.wait(1.0):
            if tick is not None:
                tick()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the loop did not finish within {timeout_s:g}s; trainer log:\n{self.log_tail('train')}"
                )
        if self.failure:
            raise ServiceUnavailable(self.failure)

    def final_ab(self, console) -> FinalAB | str:
        """The main job's final live A/B (:func:`app.job.final_ab`) while the parts still run: the final version
        comes from the trainer's state file, the experiment goes to the serve part over ``rtrl.experiments``."""
        try:
            final = int(self._state()["serving"])
        except (OSError, ValueError, KeyError) as e:
            return f"no final A/B: the trainer's state file cannot be read ({e})"
        producer = Producer(
            producer_config(connection(self.settings.kafka, self.bootstrap), self.settings.kafka.compression)
        )
        try:  # a part that gives up meanwhile ends it at once
            ab = final_ab(self.settings, self.ch, producer, console, final, stop=self.failed)
        finally:
            producer.flush(10)
        if self.failure:  # a part gave up meanwhile: its table would not be worth printing
            raise ServiceUnavailable(self.failure)
        return ab

    def stop_parts(self) -> None:
        """The policy server first (SIGTERM: it flushes its rollouts and events), then the rest, each
        stopping cleanly (the flows snapshot, the trainer checkpoints); SIGKILL for any that does not
        within its time, and every part's process group is ended."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(30)
        if self._ch_restart is not None:  # a front it is starting must be there for close() to stop (spawn is bounded)
            self._ch_restart.join()
        with self.lock:
            procs = dict(self.procs)
        first = [(name, procs.pop(name)) for name in list(procs) if DEFINED[name].stops_first]
        for group in (first, list(procs.items())):
            running = [(name, proc) for name, proc in group if proc.poll() is None]
            for _, proc in running:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            for name, proc in running:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
                self.exits.append((name, proc.returncode))
            for _, proc in group:
                end_group(proc.pid, timeout_s=2.0)  # whatever a part forked and left behind

    def drain_flows(self, timeout_s: float = 300.0) -> None:
        """After :meth:`stop_parts`: run the reward flow, then the batch flow, from its recovery state to the end of
        its topics, closing every window still open (no traffic is coming any more). Afterwards every event has
        its reward in ClickHouse and every reward its place in a micro-batch."""
        for name in (p.name for p in DEFINED.values() if p.flow):
            proc = self.start(name, "--to-end")
            try:
                rc = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            end_group(proc.pid)
            if rc != 0:
                raise ServiceUnavailable(f"draining the {name} flow failed (exit code {rc}):\n{self.log_tail(name)}")

    def close(self) -> None:
        self.stop_parts()
        with self.lock:
            ch, self.ch_proc = self.ch_proc, None
        if ch is not None:
            ch.terminate()
            try:
                ch.wait(30)
            except subprocess.TimeoutExpired:
                ch.kill()
                ch.wait(10)
        if self.services is not None:
            self.services.close()  # the local broker, if it started one
            self.services = None


def run_processes(settings: Settings, console, resume: bool = False) -> list[dict]:
    """The main job with every part in its own process: progress from ClickHouse, then the same table and
    plots. With ``resume`` the data folder of a crashed run is kept and every part continues from it."""
    from app.job import cycle_progress, final_report, fresh_start, preflight

    console.rule("[bold]rtrl main job: the closed loop, one process per part")
    if resume:
        preflight(settings)
    else:
        fresh_start(settings)
    t0 = time.monotonic()
    sup = Supervisor(settings)
    try:
        sup.start_services()
        db, ls = settings.clickhouse.database, settings.loop
        console.print(
            f"broker {sup.bootstrap} · ClickHouse {clickhouse.redact(sup.dsn)}"
            f"{' (the embedded folder behind devservices.chserver)' if sup.ch_proc is not None else ''} · "
            f"parts: {', '.join(PARTS)} · "
            f"logs in {sup.log_dir}{' · resuming the run in ' + str(settings.data_path) if resume else ''}"
        )
        producer = Producer(producer_config(connection(settings.kafka, sup.bootstrap), settings.kafka.compression))
        for key in end_running_experiments(sup.settings, sup.bootstrap, producer):
            console.print(f"ended experiment {key}, left running by an earlier run", highlight=False)
        sup.start_all()
        shown: set[int] = set()
        with cycle_progress(console) as bar:
            task = bar.add_task("loop", total=ls.cycles, info="")

            def tick() -> None:
                try:
                    rows = sup.ch.query(
                        f"SELECT version, parent, status, reason FROM {db}.checkpoints FINAL "
                        "WHERE version > 0 AND status IN ('promoted', 'rejected') ORDER BY version"
                    ).result_rows
                except ServiceUnavailable:
                    return  # ClickHouse is gone for now: the watcher restarts it or ends the run
                for version, parent, status, reason in rows:
                    if version not in shown:
                        shown.add(version)
                        colour = "green" if status == "promoted" else "red"
                        bar.console.print(f"v{version} <- v{parent}: [{colour}]{status}[/]: {reason}")
                restarts = ", ".join(f"{k} x{v}" for k, v in sup.restarts.items())
                bar.update(task, completed=len(shown), info=f"restarts: {restarts}" if restarts else "")

            sup.wait(ls.cycles * ls.cycle_max_s * 2 + 600, tick)
            tick()
        ab = sup.final_ab(console)  # the seed's table: the serve part serves the experiment it announces
        sup.stop_parts()
        try:  # every event served has its reward before anything reads the rewards
            sup.drain_flows()
        except ServiceUnavailable as e:  # the cycles are done: their report still comes, with this said first
            console.print(f"warning: {e}; the rewards in ClickHouse may miss the last trajectories", markup=False)
        return final_report(settings, sup.ch, console, t0, ab)
    finally:
        sup.close()
