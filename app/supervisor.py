"""The closed loop as separate processes under a supervisor (``loop.processes = true``).

The supervisor starts the services (the local broker unless ``kafka.bootstrap`` is set; the
embedded ClickHouse behind :mod:`devservices.chserver` unless ``clickhouse.dsn`` is a server), then one
process per part (:mod:`app.parts`: reward flow, batch flow, policy server, trainer), and restarts
any part that dies - what systemd or Kubernetes does in production. Each part resumes by itself
(Bytewax recovery, the trainer's state file and step checkpoints, the server re-reading
``rtrl.deployments``), so a kill -9 of any one of them costs time, not data. Logs go to
``<data_dir>/logs/<part>.log``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from app.loop import loop_settings
from app.parts import PARTS
from app.services import Services, spawn_embedded_clickhouse
from rtrl import clickhouse
from rtrl.errors import ServiceUnavailable
from rtrl.settings import Settings, as_env


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal a part's whole process group (it leads its own session)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class Supervisor:
    def __init__(self, settings: Settings, max_restarts: int = 5):
        # the parts run with the loop's settings; a user value the loop cannot honour is refused here, once
        self.settings, self.max_restarts = loop_settings(settings), max_restarts
        self.log_dir = settings.data_path / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.services: Services | None = None
        self.ch_proc: subprocess.Popen | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.failure: str | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # ------------------------------------------------------------ services

    def start_services(self) -> None:
        """The embedded ClickHouse behind its server (unless a server is configured), then the broker,
        topics and migrations as every job gets them (:class:`app.services.Services`)."""
        s = self.settings
        if s.clickhouse_dsn.startswith("chdb://"):
            self.ch_proc, self.dsn = spawn_embedded_clickhouse(
                s.clickhouse_dsn[len("chdb://") :], log=self.log_dir / "clickhouse.log"
            )
        else:
            self.dsn = s.clickhouse_dsn
        self.services = Services(s.updated({"clickhouse.dsn": self.dsn}))
        self.bootstrap, self.ch = self.services.bootstrap, self.services.ch
        child = s.updated({"kafka.bootstrap": self.bootstrap, "clickhouse.dsn": self.dsn})
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")} | as_env(child)

    # ------------------------------------------------------------ parts

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        # each part in its own process group: a signal reaches the helpers it forks too (a checkpoint
        # writer killed with its trainer would otherwise be left behind, orphaned)
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.parts", name, *args],
            env=self.env,
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

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to a part (kill -9 by default); the supervisor restarts it. Returns its pid."""
        with self.lock:
            proc = self.procs[name]
        _signal_group(proc, sig)
        return proc.pid

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            with self.lock:
                items = list(self.procs.items())
            for name, proc in items:
                rc = proc.poll()
                if rc is None or self._stop.is_set():
                    continue
                if name == "train" and rc == 0:
                    self.done.set()  # every cycle decided
                    return
                self.restarts[name] += 1
                if self.restarts[name] > self.max_restarts:
                    self.failure = (
                        f"part {name} died {self.restarts[name]} times (last exit code {rc}); "
                        f"log {self.log_dir / (name + '.log')}:\n{self.log_tail(name)}"
                    )
                    self.done.set()
                    return
                self.start(name)

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

    def stop_parts(self) -> None:
        """The policy server first (SIGTERM: it flushes its rollouts and events), then the rest."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5)
        with self.lock:
            procs = dict(self.procs)
        order = ["serve"] + [n for n in procs if n != "serve"]
        for name in order:
            proc = procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(30 if name == "serve" else 5)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        for proc in procs.values():  # whatever a part forked and left behind
            _signal_group(proc, signal.SIGKILL)

    def drain_rewards(self, timeout_s: float = 300.0) -> None:
        """Run the reward flow from its recovery state to the end of ``rtrl.events`` and close every
        window still open (no traffic is coming any more): afterwards every event has its reward."""
        proc = self.start("rewards", "--to-end")
        if proc.wait(timeout_s) != 0:
            raise ServiceUnavailable(f"draining the reward flow failed:\n{self.log_tail('rewards')}")

    def close(self) -> None:
        self.stop_parts()
        if self.ch_proc is not None:
            self.ch_proc.terminate()
            try:
                self.ch_proc.wait(30)
            except subprocess.TimeoutExpired:
                self.ch_proc.kill()
            self.ch_proc = None
        if self.services is not None:
            self.services.close()  # the local broker, if it started one
            self.services = None


def run_processes(settings: Settings, console) -> list[dict]:
    """The main job with every part in its own process: progress from ClickHouse, then the same table and plots."""
    from app.loop import cycle_progress, final_report, fresh_start

    console.rule("[bold]rtrl main job: the closed loop, one process per part")
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
            f"logs in {sup.log_dir}"
        )
        sup.start_all()
        shown: set[int] = set()
        with cycle_progress(console) as bar:
            task = bar.add_task("loop", total=ls.cycles, info="")

            def tick() -> None:
                rows = sup.ch.query(
                    f"SELECT version, parent, status, reason FROM {db}.checkpoints FINAL "
                    "WHERE version > 0 AND status IN ('promoted', 'rejected') ORDER BY version"
                ).result_rows
                for version, parent, status, reason in rows:
                    if version not in shown:
                        shown.add(version)
                        colour = "green" if status == "promoted" else "red"
                        bar.console.print(f"v{version} <- v{parent}: [{colour}]{status}[/]: {reason}")
                restarts = ", ".join(f"{k} x{v}" for k, v in sup.restarts.items())
                bar.update(task, completed=len(shown), info=f"restarts: {restarts}" if restarts else "")

            sup.wait(ls.cycles * ls.cycle_max_s * 2 + 600, tick)
            tick()
        sup.stop_parts()
        return final_report(settings, sup.ch, console, t0)
    finally:
        sup.close()
