"""A local Kafka-protocol broker (noida-db) for development, tests and the main job.

``LocalBroker(data_dir).up()`` starts noida-db's Kafka service on a free loopback port with its
own data folder and waits until it answers Kafka metadata requests; ``down()`` stops it with
``noida-db down`` (a signal to the wrapper would leave the real binary running). Production points
``kafka.bootstrap`` at a real cluster instead.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from rtrl.errors import ServiceUnavailable
from rtrl.files import private_dir
from rtrl.kafka import check_broker


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports that were free a moment ago on ``host``.

    The run lies below Linux's ephemeral range (32768 and up). Outgoing connections and ``free_port`` draw from that
    range, so none of them can take a port of the run between this check and its use."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32768 - count)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind((host, port))
            return base
        except OSError:
            continue
    raise ServiceUnavailable(f"no {count} consecutive free ports on {host} below 32768")


def _noida() -> str:
    exe = Path(sys.executable).parent / "noida-db"
    if exe.exists():
        return str(exe)
    found = shutil.which("noida-db")
    if not found:
        raise ServiceUnavailable("noida-db is not installed; fix: pip install noida-db==0.2.3 (the Makefile does)")
    return found


class LocalBroker:
    """noida-db's Kafka service bound to 127.0.0.1, its state in ``data_dir``."""

    def __init__(self, data_dir: str | Path, port: int | None = None, host: str = "127.0.0.1"):
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.port = port

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def _run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_noida(), *args, "--data-dir", str(self.data_dir)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def running_port(self) -> int | None:
        """Port of a noida-db Kafka service already running on this data folder, if any."""
        control = self.data_dir / "noida.control.json"
        if not control.exists():
            return None
        out = self._run("status", timeout=10).stdout
        for line in out.splitlines():
            if "kafka" in line and f"{self.host}:" in line:
                try:
                    return int(line.rsplit(":", 1)[1].split()[0])
                except ValueError:
                    return None
        return None

    def up(self, timeout_s: float = 30.0) -> str:
        """Start (or reuse) the broker and wait until it answers; return its bootstrap address."""
        private_dir(self.data_dir)  # owner-only: noida-db keeps its control token here
        existing = self.running_port()
        if existing:
            self.port = existing
        else:
            if self.port is None:
                self.port = free_port(self.host)
            proc = self._run(
                "up", "--only", "kafka", "--host", self.host, "--kafka-port", str(self.port), timeout=timeout_s
            )
            if proc.returncode != 0:
                raise ServiceUnavailable(
                    f"noida-db failed to start on {self.bootstrap} (exit {proc.returncode}): "
                    f"{_tail(proc.stderr or proc.stdout)}; log: {self.data_dir / 'noida.log'}"
                )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                check_broker(self.bootstrap, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
                break
            except ServiceUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
        (self.data_dir / "rtrl-broker.json").write_text(json.dumps({"bootstrap": self.bootstrap}))
        return self.bootstrap

    def down(self, timeout_s: float = 60.0) -> None:
        """Save state and stop the broker (idempotent)."""
        if not (self.data_dir / "noida.control.json").exists():
            return
        self._run("down", timeout=timeout_s)

    def __enter__(self) -> LocalBroker:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def _tail(text: str, n: int = 5) -> str:
    lines = [line for line in text.strip().splitlines() if "GLIBC" not in line]
    return " | ".join(lines[-n:])
