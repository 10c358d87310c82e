"""The embedded ClickHouse as a server: ClickHouse's HTTP interface in front of one chdb folder.

    rtrl clickhouse serve [--port P]       (python -m devservices.chserver DIR PORT)

chdb holds a data folder in one process only, so parts of the loop that run as separate processes
(reward flow, batch flow, trainer) cannot each open it. This process owns the folder and answers
ClickHouse's HTTP protocol on loopback, so every other process uses ``clickhouse.dsn =
http://127.0.0.1:P`` through clickhouse-connect's ordinary HTTP client - the same code path as a
real ClickHouse server. Every statement runs on the real engine; only the transport is ours.

What it speaks: ``GET``/``POST /?query=…`` (the query text from the URL and/or the body, as
ClickHouse concatenates them), ``database``, ``default_format``, ``param_*`` query parameters,
the statement at the head of the body before the data, request bodies compressed with lz4/zstd/gzip/deflate, chunked bodies, ``INSERT … FORMAT F`` with the
data in the body (written to a private file and inserted ``FROM INFILE``), ``/ping``, errors as
HTTP 500 with ``X-ClickHouse-Exception-Code`` and ClickHouse's message. Other settings in the URL
are accepted and ignored (the engine's defaults apply). Statements run one at a time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import tempfile
import threading
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import cast
from urllib.parse import parse_qsl, urlsplit

from rtrl.clickhouse import on_engine_thread

_INSERT = re.compile(r"^\s*INSERT\s+INTO\s+(?P<target>.+?)\s+FORMAT\s+(?P<fmt>\w+)\s*$", re.IGNORECASE | re.DOTALL)
_INSERT_HEAD = re.compile(rb"^\s*INSERT\s+INTO\s+[^\n]+?\s+FORMAT\s+\w+[ \t]*(\r?\n|$)", re.IGNORECASE)
_CODE = re.compile(r"Code:\s*(\d+)")


def decompress(data: bytes, encoding: str) -> bytes:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return data
    if encoding == "lz4":
        import lz4.frame

        return lz4.frame.decompress(data)
    if encoding == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if encoding == "gzip":
        return gzip.decompress(data)
    if encoding == "deflate":
        return zlib.decompress(data)
    raise ValueError(f"unsupported Content-Encoding {encoding!r} (lz4, zstd, gzip or deflate)")


class Engine:
    """One chdb connection; every call runs on the process's one chdb thread
    (:func:`rtrl.clickhouse.on_engine_thread`: chdb wants Python-created threads, one at a time)."""

    def __init__(self, path: str):
        import chdb

        self.conn = on_engine_thread(chdb.connect, str(Path(path).resolve()))
        self.database: str | None = None
        self.spool = Path(tempfile.mkdtemp(prefix="rtrl-chserver-"))

    def run(self, sql: str, fmt: str, params: dict[str, str], database: str | None, data: bytes | None):
        return on_engine_thread(self._run, sql, fmt, params, database, data)

    def _run(self, sql: str, fmt: str, params: dict[str, str], database: str | None, data: bytes | None):
        if database and database != self.database:
            self.conn.query(f"USE `{database.replace('`', '')}`", "TabSeparated")
            self.database = database
        if data is None:
            return self.conn.query(sql, fmt, params=params)
        m = _INSERT.match(sql)
        if m is None:
            raise ValueError(
                "Code: 62. DB::Exception: a request body with data needs INSERT INTO … FORMAT … in the query"
            )
        spool = self.spool / f"{uuid.uuid4().hex}.{m['fmt']}"
        spool.write_bytes(data)
        try:
            return self.conn.query(
                f"INSERT INTO {m['target']} FROM INFILE '{spool}' FORMAT {m['fmt']}", fmt, params=params
            )
        finally:
            spool.unlink(missing_ok=True)

    def close(self) -> None:
        on_engine_thread(self.conn.close)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine: Engine  # set on the subclass the server is built with

    def log_message(self, *args) -> None:  # no access log on stderr
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            data = b"".join(parts)
        else:
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return decompress(data, self.headers.get("Content-Encoding", ""))

    def _reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._guarded(lambda: b"")

    def do_POST(self) -> None:
        self._guarded(self._body)

    def _guarded(self, body) -> None:
        try:
            self._handle(body())
        except Exception as e:  # noqa: BLE001 - a request we cannot read: say why instead of dropping the connection
            self._reply(
                400,
                f"Code: 1000. DB::Exception: bad request: {type(e).__name__}: {e}".encode(),
                {"X-ClickHouse-Exception-Code": "1000", "Content-Type": "text/plain; charset=UTF-8"},
            )

    def _handle(self, body: bytes) -> None:
        url = urlsplit(self.path)
        if url.path.rstrip("/") == "/ping":
            return self._reply(200, b"Ok.\n", {"Content-Type": "text/plain"})
        args = dict(parse_qsl(url.query, keep_blank_values=True))
        query_id = args.get("query_id") or uuid.uuid4().hex
        base = {
            "X-ClickHouse-Query-Id": query_id,
            "X-ClickHouse-Timezone": "UTC",
            "X-ClickHouse-Server-Display-Name": "rtrl-chserver",
        }
        query, data = args.get("query", ""), None
        if query and body and _INSERT.match(query):
            data = body  # the statement in the URL, the data in the body
        elif body and not query and (head := _INSERT_HEAD.match(body)):
            query, data = head.group(0).decode().strip(), body[head.end() :]  # statement, newline, data
        elif body:
            query = f"{query} {body.decode()}" if query else body.decode()
        if not query.strip():
            return self._reply(200, b"Ok.\n", base | {"Content-Type": "text/plain"})
        fmt = args.get("default_format") or "TabSeparated"
        params = {k[6:]: v for k, v in args.items() if k.startswith("param_")}
        try:
            res = self.engine.run(query, fmt, params, args.get("database"), data)
        except Exception as e:  # noqa: BLE001 - the engine's own message, as a server sends it
            text = str(e)
            code = _CODE.search(text)
            return self._reply(
                500,
                (text if text.startswith("Code:") else f"Code: 1000. DB::Exception: {text}").encode(),
                base
                | {
                    "X-ClickHouse-Exception-Code": code.group(1) if code else "1000",
                    "Content-Type": "text/plain; charset=UTF-8",
                },
            )
        summary = {
            "read_rows": str(res.rows_read()),
            "read_bytes": str(res.bytes_read()),
            "written_rows": str(getattr(res, "rows_written", lambda: 0)()),
            "written_bytes": str(getattr(res, "bytes_written", lambda: 0)()),
            "result_rows": "0",
        }
        self._reply(
            200,
            res.bytes(),
            base
            | {
                "X-ClickHouse-Format": fmt,
                "X-ClickHouse-Summary": json.dumps(summary),
                "Content-Type": "application/octet-stream",
            },
        )


class ClickHouseServer:
    """Serve ``path`` on ``host:port`` (0 = a free port) in background threads of this process."""

    def __init__(self, path: str | Path, host: str = "127.0.0.1", port: int = 0):
        Path(path).mkdir(parents=True, exist_ok=True)
        self.engine = Engine(str(path))
        handler = type("BoundHandler", (Handler,), {"engine": self.engine})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="chserver", daemon=True)

    @property
    def dsn(self) -> str:
        host, port = cast("tuple[str, int]", self.httpd.server_address[:2])  # AF_INET: host is a str
        return f"http://{host}:{port}"

    def start(self) -> ClickHouseServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.close()


def spawn(path: str | Path, ready_timeout_s: float = 60.0, log: Path | None = None):
    """Start ``python -m devservices.chserver path`` as a child process; returns (Popen, dsn) once it answers."""
    import subprocess
    import time

    ready = Path(tempfile.mkdtemp(prefix="rtrl-chserver-ready-")) / "dsn"
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(
        [sys.executable, "-m", "devservices.chserver", str(path), "--ready-file", str(ready)],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + ready_timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            from rtrl.errors import ServiceUnavailable

            raise ServiceUnavailable(
                f"embedded ClickHouse server for {path} did not start within {ready_timeout_s:g}s "
                f"(exit code {proc.poll()}); is another process holding that folder?"
            )
        time.sleep(0.05)
    return proc, ready.read_text()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devservices.chserver", description=__doc__.splitlines()[0])
    p.add_argument("path", help="chdb data folder this server owns")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = a free port")
    p.add_argument("--ready-file", help="write the DSN here once serving (atomically)")
    a = p.parse_args(argv)
    server = ClickHouseServer(a.path, a.host, a.port).start()
    if a.ready_file:
        tmp = Path(a.ready_file + ".tmp")
        tmp.write_text(server.dsn)
        os.replace(tmp, a.ready_file)
    print(f"serving {a.path} at {server.dsn}", flush=True)
    import signal

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
