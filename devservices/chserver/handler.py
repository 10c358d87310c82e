"""ClickHouse's HTTP interface of the embedded front: the request handler and the threaded server that bounds it.

What it speaks: ``GET``/``POST /?query=…`` (the query text from the URL and/or the body, as
ClickHouse concatenates them), ``database``, ``default_format``, ``param_*``, ``readonly`` and
``max_execution_time`` query parameters (other settings in the URL are accepted and ignored), request
bodies compressed with lz4/zstd/gzip/deflate, chunked bodies, ``INSERT … FORMAT F`` / ``VALUES`` with
the data in the body or inline (:mod:`devservices.chserver.engine`), ``/ping``, errors with
``X-ClickHouse-Exception-Code`` and ClickHouse's message (400 for the engine's syntax and query-parameter
errors, as a server sends them). A request line that is not ``METHOD PATH HTTP/1.x`` (HTTP/0.9, bytes that
are not HTTP) gets a 400 with a status line, or the connection closes.

Every request but ``/ping`` authenticates as ClickHouse's HTTP does (basic auth, ``X-ClickHouse-User``
/ ``X-ClickHouse-Key`` or ``user``/``password`` parameters), checked in constant time from the request
line and headers before any of the body is read; else 401 with code 516. The time to read the headers and
then the body is capped (a byte-a-second client is cut off), and so are concurrent connections (bounded
worker threads; the excess get 503 at once); an analyst asking for a ``max_execution_time`` above its cap
in the URL gets 452.
"""

from __future__ import annotations

import base64
import hmac
import json
import re
import secrets
import socket
import ssl
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from devservices.chserver.auth import ANALYST
from devservices.chserver.bodies import Body, decompress
from devservices.chserver.engine import _IDENT, Engine
from devservices.chserver.gates import ByteBudget
from devservices.chserver.limits import Limits, RequestError, _too_large

_CODE = re.compile(r"Code:\s*(\d+)")
#: the engine's errors a server answers with 400: SYNTAX_ERROR, UNKNOWN_QUERY_PARAMETER, BAD_QUERY_PARAMETER
_CLIENT_ERRORS = frozenset({62, 456, 457})


def _basic(header: str) -> tuple[str, str] | None:
    if not header.lower().startswith("basic "):
        return None
    try:
        user, _, key = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
    except Exception:  # noqa: BLE001 - a malformed header is a failed login
        return None
    return user, key


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine: Engine  # set on the subclass the server is built with
    tokens: dict[str, str]
    limits: Limits
    server: Server

    default_request_version = "HTTP/1.1"  # a request line refused before its version is read: a status line
    held = 0  #: bytes of the inflated-body budget this request holds

    def log_message(self, *args) -> None:  # no access log on stderr
        pass

    def parse_request(self) -> bool:
        """The request line and headers. Anything but ``METHOD PATH HTTP/x.y`` gets a 400 with a status
        line: HTTP/0.9 (``GET /``) and bytes that are not HTTP at all are refused, never served."""
        raw: bytes = getattr(self, "raw_requestline", b"")
        words = raw.split()
        if len(words) in (1, 2):
            self.command, self.request_version, self.close_connection = "", "HTTP/1.1", True
            self.requestline = str(raw, "iso-8859-1").rstrip("\r\n")
            self.send_error(400, "Bad request: not an HTTP/1.x request line")
            return False
        return super().parse_request()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """An error of the HTTP layer (bad request line, headers, method) as ClickHouse's, with a status line
        (Python's HTTP/0.9 replies have none); the connection closes."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.1"
        self.close_connection = True
        self._error(RequestError(code, 1000, "BAD_REQUEST", message or HTTPStatus(code).phrase))

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.limits.read_timeout_s)
        self.served = 0  # requests answered on this connection

    def handle_one_request(self) -> None:
        if self.served:
            # a kept-alive connection may idle up to read_timeout_s before its next request, as a client's pool
            # keeps it: cut at the header deadline, a pooled connection could close under a request being sent
            self.server.arm(self.connection, self.limits.read_timeout_s)
            try:
                first = self.rfile.peek(1)  # type: ignore[attr-defined]  # a BufferedReader: a byte, or EOF
            except (OSError, ValueError):
                first = b""
            if not first:
                self.server.disarm(self.connection)
                self.close_connection = True
                return
        # from its first byte, the request line and headers within the (short) header deadline: a slow client is
        # cut off
        self.server.arm(self.connection, min(self.limits.header_timeout_s, self.limits.read_timeout_s))
        try:
            super().handle_one_request()
        finally:
            self.server.disarm(self.connection)
            self.served += 1

    def _chunk_size(self) -> int:
        """The size on a chunk-size line (``hex[;extensions]``); 400 for anything else."""
        line = self.rfile.readline(1024)
        if not line:
            raise ConnectionError("the request body ended early")
        size = line.split(b";", 1)[0].strip()
        if not line.endswith(b"\n") or not re.fullmatch(rb"[0-9A-Fa-f]{1,15}", size):
            self.close_connection = True
            raise RequestError(400, 1000, "BAD_REQUEST", f"bad chunk size line {line[:40]!r}")
        return int(size, 16)

    def _raw_body(self) -> bytes:
        limit = self.limits.max_body_bytes
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts, total = [], 0
            for _ in range(limit + 1):  # every chunk but the last holds a byte at least
                size = self._chunk_size()
                if size == 0:
                    for _ in range(100):  # trailers
                        if self.rfile.readline(65537) in (b"\r\n", b"\n", b""):
                            break
                    break
                total += size
                if total > limit:
                    self.close_connection = True
                    raise _too_large("the request body", limit)
                part = self.rfile.read(size)
                if len(part) < size:
                    raise ConnectionError("the request body ended early")
                parts.append(part)
                if self.rfile.readline(3) not in (b"\r\n", b"\n"):
                    self.close_connection = True
                    raise RequestError(400, 1000, "BAD_REQUEST", "a chunk does not end with CRLF")
            return b"".join(parts)
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise RequestError(400, 1000, "BAD_REQUEST", "bad Content-Length")
        if n > limit:
            self.close_connection = True
            raise _too_large("the request body", limit)
        data = self.rfile.read(n)
        if len(data) < n:
            raise ConnectionError("the request body ended early")
        return data

    def _body(self) -> Body:
        """The request body, read within ``limits.read_timeout_s`` and inflated per Content-Encoding.
        At most ``limits.max_inflating`` bodies inflate at once, server-wide.
        An inflated body holds its bytes of the server's budget (``limits.max_inflated_bytes``) until its
        request ends: while inflating it holds the most it may reach, then its size."""
        self.server.arm(self.connection, self.limits.read_timeout_s)
        try:
            data = self._raw_body()
        finally:
            self.server.disarm(self.connection)  # read in time: the statement has its own limit
        encoding = self.headers.get("Content-Encoding", "")
        if encoding.strip().lower() in ("", "identity"):
            return data
        budget, wait = self.server.inflated, self.limits.queue_timeout_s
        cap = min(self.limits.max_decompressed_bytes, budget.total)
        deadline = time.monotonic() + wait
        if not budget.reserve(cap, wait):
            raise RequestError(
                503,
                202,
                "TOO_MANY_SIMULTANEOUS_QUERIES",
                f"the server holds too many inflated request bodies (at most {budget.total} bytes at once): "
                f"waited {wait:g} s (try again later)",
            )
        self.held = cap
        if not self.server.inflating.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RequestError(
                503, 202, "TOO_MANY_SIMULTANEOUS_QUERIES", "too many compressed request bodies at once (try again)"
            )
        try:
            out = decompress(data, encoding, cap)
        finally:
            self.server.inflating.release()
        budget.release(cap - len(out))  # what it did not need, at once
        self.held = len(out)
        return out

    def _release_body(self) -> None:
        """Give back the request's share of the inflated-body budget (its request has ended)."""
        held, self.held = self.held, 0
        if held:
            self.server.inflated.release(held)

    def _has_body(self) -> bool:
        return bool(self.headers.get("Transfer-Encoding")) or self.headers.get("Content-Length", "0").strip() != "0"

    def _reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        try:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client went away (or was cut off): nothing to tell it
            self.close_connection = True

    def _error(self, e: RequestError, base: dict[str, str] | None = None) -> None:
        headers = (base or {}) | {
            "X-ClickHouse-Exception-Code": str(e.code),
            "Content-Type": "text/plain; charset=UTF-8",
        }
        if e.code == 516:
            headers["WWW-Authenticate"] = 'Basic realm="rtrl-chserver", charset="UTF-8"'
        self._reply(e.status, (str(e) + "\n").encode(), headers)

    def do_GET(self) -> None:
        self._guarded(read_body=False)

    def do_POST(self) -> None:
        self._guarded(read_body=True)

    def _guarded(self, read_body: bool) -> None:
        """Authenticate from the request line and headers (where ClickHouse's HTTP credentials are), then
        read the body: an unauthenticated client never gets a byte of its body read or inflated."""
        self.server.disarm(self.connection)  # the headers are in
        self.held = 0
        try:
            self._serve(read_body)
        finally:
            self._release_body()  # always, whatever became of the request

    def _serve(self, read_body: bool) -> None:
        url = urlsplit(self.path)
        args = dict(parse_qsl(url.query, keep_blank_values=True))
        if not read_body and self._has_body():
            self.close_connection = True  # a GET's body is never read: the connection cannot go on
        if url.path.rstrip("/") == "/ping":
            if read_body and self._has_body():
                self.close_connection = True
            return self._reply(200, b"Ok.\n", {"Content-Type": "text/plain"})
        try:
            user = self._user(args)
        except RequestError as e:
            if self._has_body():
                self.close_connection = True  # its body stays unread
            return self._error(e)
        try:
            data = self._body() if read_body else b""
        except RequestError as e:
            return self._error(e)
        except Exception as e:  # noqa: BLE001 - a request we cannot read: say why instead of dropping the connection
            self.close_connection = True
            return self._error(RequestError(400, 1000, "BAD_REQUEST", f"bad request: {type(e).__name__}: {e}"))
        try:
            self._handle(data, args, user)
        except RequestError as e:
            self._error(e)

    def _user(self, args: dict[str, str]) -> str:
        """The authenticated user; 401 / code 516 otherwise (compared in constant time)."""
        user = self.headers.get("X-ClickHouse-User") or args.get("user")
        key = self.headers.get("X-ClickHouse-Key") or args.get("password")
        basic = _basic(self.headers.get("Authorization", ""))
        if basic is not None:
            user, key = basic
        user = user or "default"
        expected = self.tokens.get(user)
        ok = hmac.compare_digest((key or "").encode(), (expected or secrets.token_urlsafe(32)).encode())
        if not ok or expected is None:
            raise RequestError(
                401,
                516,
                "AUTHENTICATION_FAILED",
                f"{user}: Authentication failed: password is incorrect, or there is no user with such name",
            )
        return user

    def _handle(self, body: Body, args: dict[str, str], user: str) -> None:
        query_id = args.get("query_id") or uuid.uuid4().hex
        base = {
            "X-ClickHouse-Query-Id": query_id,
            "X-ClickHouse-Timezone": "UTC",
            "X-ClickHouse-Server-Display-Name": "rtrl-chserver",
        }
        query = args.get("query", "")
        if not query.strip() and (not body or body.isspace()):  # isspace: no copy of a large body
            return self._reply(200, b"Ok.\n", base | {"Content-Type": "text/plain"})
        fmt = args.get("default_format") or "TabSeparated"
        params = {k[6:]: v for k, v in args.items() if k.startswith("param_")}
        database = args.get("database") or "default"
        try:
            readonly = user == ANALYST or int(args.get("readonly") or 0) > 0
            wanted = float(args.get("max_execution_time") or 0)
        except ValueError as e:
            return self._error(RequestError(400, 72, "CANNOT_PARSE_NUMBER", f"bad setting in the URL: {e}"), base)
        cap = self.engine.time_cap(user)
        if user == ANALYST and wanted > cap:
            return self._error(
                RequestError(
                    400,
                    452,
                    "SETTING_CONSTRAINT_VIOLATION",
                    f"{user}: max_execution_time = {wanted:g} is above the analyst's cap of {cap:g} s on the "
                    "embedded ClickHouse front (analysts may not hold the engine the writers share)",
                ),
                base,
            )
        max_time = min(wanted, cap) if wanted > 0 else cap
        if not _IDENT.match(database):
            return self._error(RequestError(400, 81, "UNKNOWN_DATABASE", f"Database {database!r} does not exist"), base)
        try:
            run_args = {"fmt": fmt, "params": params, "max_time": max_time}
            res = self.engine.execute(query, body, user, readonly, database, run_args)
        except RequestError as e:
            return self._error(e, base)
        except Exception as e:  # noqa: BLE001 - the engine's own message, as a server sends it
            text = str(e)
            code = _CODE.search(text)
            return self._reply(
                400 if code and int(code.group(1)) in _CLIENT_ERRORS else 500,
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


class Server(ThreadingHTTPServer):
    """At most ``limits.max_connections`` connections at once, one thread each (more are answered 503,
    code 202, at once); a reaper shuts the socket of any request not read within ``limits.read_timeout_s``."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[Handler], limits: Limits, tls: ssl.SSLContext | None = None
    ):
        self.limits, self.tls = limits, tls
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        self.deadlines: dict[socket.socket, float] = {}
        self.deadlines_lock = threading.Lock()
        self.stopping = threading.Event()
        self.inflating = threading.BoundedSemaphore(max(1, limits.max_inflating))
        self.inflated = ByteBudget(limits.max_inflated_bytes)  # inflated bodies held at once, server-wide
        super().__init__(address, handler)
        self.reaper = threading.Thread(target=self._reap, name="chserver-reaper", daemon=True)
        self.reaper.start()

    def get_request(self) -> tuple[socket.socket, Any]:
        """The accepted connection, wrapped in TLS when serving https: its handshake runs on the handler's
        thread at its first read (under the header deadline), never on the accepting thread."""
        sock, addr = super().get_request()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError)):  # a client's failed handshake or exit
            return
        super().handle_error(request, client_address)

    def arm(self, sock: socket.socket, seconds: float) -> None:
        """Shut ``sock`` unless :meth:`disarm` comes within ``seconds``."""
        with self.deadlines_lock:
            self.deadlines[sock] = time.monotonic() + seconds

    def disarm(self, sock: socket.socket) -> None:
        with self.deadlines_lock:
            self.deadlines.pop(sock, None)

    def _reap(self) -> None:
        while not self.stopping.wait(0.1):
            now = time.monotonic()
            with self.deadlines_lock:
                late = [s for s, d in self.deadlines.items() if d < now]
                for s in late:
                    del self.deadlines[s]
            for s in late:
                try:
                    s.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns; it closes
                except OSError:
                    pass

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            body = b"Code: 202. DB::Exception: Too many simultaneous connections. (TOO_MANY_SIMULTANEOUS_QUERIES)\n"
            try:
                request.settimeout(1.0)
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nX-ClickHouse-Exception-Code: 202\r\n"
                    b"Content-Type: text/plain; charset=UTF-8\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def server_close(self) -> None:
        self.stopping.set()
        super().server_close()
