"""The embedded ClickHouse front as a process: one chdb folder served on loopback, in threads or as a child process.

    rtrl clickhouse serve [--port P]       (python -m devservices.chserver DIR PORT)

It binds to loopback only (:func:`check_loopback`): it is the single-machine stand-in for a ClickHouse
server. :class:`ClickHouseServer` serves the folder in background threads of this process; :func:`spawn`
starts ``python -m devservices.chserver`` as a child and returns the writer's DSN once it answers;
:func:`main` is that command line.
"""

from __future__ import annotations

import argparse
import ipaddress
import shutil
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import cast

from devservices.chserver.auth import ANALYST, WRITER, auth_dir_for, dsn_for, ensure_tokens
from devservices.chserver.engine import Engine
from devservices.chserver.handler import Handler, Server
from devservices.chserver.limits import Limits
from rtrl.files import private_dir, write_private


def check_loopback(host: str) -> str:
    """``host`` if it is an IPv4 loopback address (or ``localhost``); ValueError naming the fix otherwise.
    IPv6's ``::1`` is refused too: rtrl's clients build ``http://host:port`` URLs (no IPv6 brackets)."""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok or ":" in host:
        raise ValueError(
            f"the embedded ClickHouse front binds to loopback only, on IPv4 (127.0.0.1 or localhost; not ::1), "
            f"not {host!r}: it is the "
            "single-machine stand-in for a ClickHouse server; to share data across machines run a real "
            "ClickHouse server (users and grants: deploy/clickhouse/security.sql) and set clickhouse.dsn to it"
        )
    return "127.0.0.1" if host == "localhost" else host


class ClickHouseServer:
    """Serve ``path`` on loopback ``host:port`` (0 = a free port) in background threads of this process,
    its users' tokens in ``auth_dir`` (default :func:`auth_dir_for`; ``fresh_tokens=False`` keeps them)."""

    def __init__(
        self,
        path: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: Limits = Limits(),
        auth_dir: str | Path | None = None,
        fresh_tokens: bool = True,
        database: str = "rtrl",
        certfile: str | Path | None = None,
        keyfile: str | Path | None = None,
    ):
        host = check_loopback(host)
        tls = None
        if certfile:  # https: the certificate (and its key, unless in certfile) a client verifies with its CA
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.load_cert_chain(str(certfile), str(keyfile) if keyfile else None)
        elif keyfile:
            raise ValueError("--keyfile without --certfile; fix: give the certificate too")
        self.scheme = "https" if tls else "http"
        private_dir(path)
        self.auth_dir = Path(auth_dir) if auth_dir else auth_dir_for(path)
        tokens = ensure_tokens(self.auth_dir, fresh=fresh_tokens)
        self.engine = Engine(str(path), limits, database)
        attrs = {"engine": self.engine, "tokens": tokens, "limits": limits}
        handler = type("BoundHandler", (Handler,), attrs)
        self.httpd = Server((host, port), handler, limits, tls)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="chserver", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return cast("tuple[str, int]", self.httpd.server_address[:2])  # AF_INET: host is a str

    @property
    def dsn(self) -> str:
        """The writer's DSN (user and token file; no secret)."""
        return dsn_for(*self.address, self.auth_dir, WRITER, self.scheme)

    @property
    def analyst_dsn(self) -> str:
        return dsn_for(*self.address, self.auth_dir, ANALYST, self.scheme)

    def start(self) -> ClickHouseServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.close()


def spawn(
    path: str | Path,
    ready_timeout_s: float = 60.0,
    log: Path | None = None,
    *,
    port: int = 0,
    fresh_tokens: bool = True,
    extra_args: list[str] | None = None,
):
    """Start ``python -m devservices.chserver path`` as a child process; returns (Popen, dsn) once it answers.

    The DSN is the writer's, ``http://rtrl_writer@127.0.0.1:P/?password_file=<path>/rtrl-auth/rtrl_writer.token``:
    it carries no secret, :func:`rtrl.clickhouse.connect` reads the token from that owner-only file. A
    restart of the same front (a supervisor's) passes the previous ``port`` and ``fresh_tokens=False``,
    so its clients' DSN and token stay valid. ``extra_args`` go to the command line (limits, see ``--help``).
    """
    import subprocess

    ready = Path(tempfile.mkdtemp(prefix="rtrl-chserver-ready-")) / "dsn"
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
    cmd = [sys.executable, "-m", "devservices.chserver", str(path), "--ready-file", str(ready), "--port", str(port)]
    proc = subprocess.Popen(
        cmd + ([] if fresh_tokens else ["--keep-tokens"]) + list(extra_args or []),
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + ready_timeout_s
    try:
        for _ in range(int(ready_timeout_s / 0.05) + 2):
            if ready.exists():
                return proc, ready.read_text()
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        proc.kill()
        proc.wait(30)
    finally:
        shutil.rmtree(ready.parent, ignore_errors=True)  # the DSN is read (or the child is gone)
    from rtrl.errors import ServiceUnavailable

    raise ServiceUnavailable(
        f"embedded ClickHouse server for {path} did not start within {ready_timeout_s:g}s "
        f"(exit code {proc.poll()}); is another process holding that folder?"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devservices.chserver", description=__doc__.splitlines()[0])
    p.add_argument("path", help="chdb data folder this server owns")
    p.add_argument("--host", default="127.0.0.1", help="a loopback address (anything else is refused)")
    p.add_argument("--port", type=int, default=0, help="0 = a free port")
    p.add_argument("--ready-file", help="write the writer's DSN here once serving (atomically)")
    p.add_argument("--auth-dir", help="owner-only folder of the users' token files (default PATH/rtrl-auth)")
    p.add_argument("--keep-tokens", action="store_true", help="reuse the token files there (a restart)")
    p.add_argument("--database", default="rtrl", help="database of the analyst tables")
    p.add_argument("--certfile", help="serve https with this PEM certificate (chain) instead of http")
    p.add_argument("--keyfile", help="the certificate's PEM private key, unless it is in --certfile")
    d = Limits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--max-decompressed-bytes", type=int, default=d.max_decompressed_bytes)
    p.add_argument("--read-timeout-s", type=float, default=d.read_timeout_s)
    p.add_argument("--max-connections", type=int, default=d.max_connections)
    p.add_argument("--max-execution-time-s", type=float, default=d.max_execution_time_s)
    p.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s)
    p.add_argument("--queue-timeout-s", type=float, default=d.queue_timeout_s, help="wait for the engine; then 503")
    p.add_argument("--max-inflating", type=int, default=d.max_inflating)
    p.add_argument("--max-inflated-bytes", type=int, default=d.max_inflated_bytes, help="all inflated bodies at once")
    p.add_argument("--analyst-max-execution-time-s", type=float, default=d.analyst_max_execution_time_s)
    a = p.parse_args(argv)
    limits = Limits(
        max_body_bytes=a.max_body_bytes,
        max_decompressed_bytes=a.max_decompressed_bytes,
        read_timeout_s=a.read_timeout_s,
        max_connections=a.max_connections,
        max_execution_time_s=a.max_execution_time_s,
        header_timeout_s=a.header_timeout_s,
        queue_timeout_s=a.queue_timeout_s,
        max_inflating=a.max_inflating,
        max_inflated_bytes=a.max_inflated_bytes,
        analyst_max_execution_time_s=a.analyst_max_execution_time_s,
    )
    try:
        server = ClickHouseServer(
            a.path,
            a.host,
            a.port,
            limits=limits,
            auth_dir=a.auth_dir,
            fresh_tokens=not a.keep_tokens,
            database=a.database,
            certfile=a.certfile,
            keyfile=a.keyfile,
        ).start()
    except (ValueError, OSError) as e:  # OSError: a certificate or key that cannot be read or does not match
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.ready_file:
        write_private(a.ready_file, server.dsn.encode())
    print(f"serving {a.path} at {server.dsn}", flush=True)
    print(f"read-only analysts: {server.analyst_dsn}", flush=True)
    import signal

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.close()
    budget = server.httpd.inflated
    print(f"stopped; inflated request bodies held at most {budget.peak} bytes at once (of {budget.total})", flush=True)
    return 0
