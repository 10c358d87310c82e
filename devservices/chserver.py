"""The embedded ClickHouse as a server: ClickHouse's HTTP interface in front of one chdb folder.

    rtrl clickhouse serve [--port P]       (python -m devservices.chserver DIR PORT)

chdb holds a data folder in one process only, so parts of the loop that run as separate processes
(reward flow, batch flow, trainer) cannot each open it. This process owns the folder and answers
ClickHouse's HTTP protocol on loopback, so every other process uses ``clickhouse.dsn =
http://rtrl_writer@127.0.0.1:P/?password_file=…`` through clickhouse-connect's ordinary HTTP client - the
same code path as a real ClickHouse server. Every statement runs on the real engine; only the transport
is ours. It is the single-machine stand-in for a ClickHouse server: production points ``clickhouse.dsn``
at a real server whose users, roles and grants are ``deploy/clickhouse/security.sql``.

What it speaks: ``GET``/``POST /?query=…`` (the query text from the URL and/or the body, as
ClickHouse concatenates them), ``database``, ``default_format``, ``param_*``, ``readonly`` and
``max_execution_time`` query parameters (other settings in the URL are accepted and ignored), request
bodies compressed with lz4/zstd/gzip/deflate, chunked bodies, ``INSERT … FORMAT F`` / ``VALUES`` with
the data in the body or inline (written to a private file and inserted ``FROM INFILE``; small ``VALUES``
data runs as ``INSERT … SELECT * FROM values(<data>)``, so its expressions are checked like any statement's,
and larger data is read as literals only), ``/ping``, errors with ``X-ClickHouse-Exception-Code`` and
ClickHouse's message (400 for the engine's syntax and query-parameter errors, as a server sends them).
Statements run one at a time; a request waits at most ``queue_timeout_s`` for the engine (then 503, code 202).
A waiting writer goes before every waiting analyst, so ingestion waits at most for the statement running now.
A request line that is not ``METHOD PATH HTTP/1.x`` (HTTP/0.9, bytes that are not HTTP) gets a 400 with a
status line, or the connection closes.

Safe by default (each point tested in tests/test_chserver_security.py):

- It binds to loopback only.
- Every request but ``/ping`` authenticates as ClickHouse's HTTP does (basic auth, ``X-ClickHouse-User``
  / ``X-ClickHouse-Key`` or ``user``/``password`` parameters), checked in constant time from the request
  line and headers before any of the body is read; else 401 with code 516. Two users: :data:`WRITER` (the flows, trainer and tools) and :data:`ANALYST` (``readonly=1``:
  read statements on :data:`rtrl.clickhouse.ANALYST_TABLES` only, the grants of the analyst role in
  deploy/clickhouse/security.sql). Their tokens are random per run, in owner-only files (``0600`` in a
  ``0700`` folder, :func:`rtrl.files.write_private`) that clients read (``password_file``), never in a
  DSN, environment or command line.
- The statement is classified by the engine's own parser (``formatQuerySingleLine`` refuses several
  statements; ``parseQueryToJSON`` / ``EXPLAIN AST`` give the tree) and what runs is the engine's
  canonical text of the one statement that was checked. Refused for everyone (code 497): table
  functions and table/database engines that touch files or the network (``file``, ``url``, ``s3``,
  ``remote``, ``mysql``, ``executable``, … - everything but :data:`TABLE_FUNCTIONS` and :data:`ENGINES`),
  ``INTO OUTFILE``, client-side ``FROM INFILE``, ``SYSTEM``, ``KILL``, ``BACKUP``/``RESTORE``,
  dictionaries, ``ATTACH``, access management. A read-only request (the analyst, or ``readonly=1`` in
  the URL) may only run read statements (else code 164) and the engine enforces ``readonly=1`` too.
- Each request runs in a fresh engine session with its own database and settings: one client's
  ``USE`` or ``SET`` ends with its request.
- A read-only request's tables are checked in the tree (or EXPLAIN AST's text for DESCRIBE, SHOW CREATE,
  EXISTS); a CTE named like a real table, or holding a dot, is refused. Its query parameters of type
  ``Identifier`` are refused (code 497): they could name a table or database around that check. No other
  type can stand where a name goes (the engine's parser refuses it), and the functions that take a table,
  database or dictionary name as a string (``merge``, ``remote``, ``cluster``, ``joinGet``, ``dict*``, …)
  are refused by name. A statement without a JSON tree is explained with its parameters substituted.
- Caps (:class:`Limits`): body size, decompressed size (inflated in steps, refused as soon as it
  passes the cap; at most ``max_inflating`` bodies at once), the inflated bodies held at once across all
  requests (``max_inflated_bytes``: a body reserves the most it may reach before inflating, keeps its size
  until its request ends, and waits at most ``queue_timeout_s`` for room, then 503), the time to read the
  headers and then the body (a byte-a-second client is cut off), concurrent connections (bounded worker
  threads; the excess get 503 at once), the wait for the engine and ``max_execution_time``: no ``SETTINGS``
  or ``SET`` may lift or change it (code 452), only lower it. The analyst's cap is lower
  (``analyst_max_execution_time_s``, 20 s, under the 30 s a writer waits for the engine); an analyst asking
  for more in the URL gets 452.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import io
import ipaddress
import json
import re
import secrets
import shutil
import socket
import ssl
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qsl, quote, urlsplit

from rtrl.clickhouse import ANALYST_TABLES, APPEND_ONLY_TABLES, on_engine_thread
from rtrl.files import private_dir, write_private

WRITER = "rtrl_writer"
ANALYST = "rtrl_analyst"
USERS = (WRITER, ANALYST)

#: table functions anyone may use (the rest touch files or the network, or read tables by pattern)
TABLE_FUNCTIONS = frozenset(
    {"numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateseries", "values", "null"}
    | {"view", "format", "generaterandom", "input"}
)
#: table and database engines a CREATE may use (the rest touch files or the network)
ENGINES = frozenset(
    {"mergetree", "replacingmergetree", "summingmergetree", "aggregatingmergetree", "collapsingmergetree"}
    | {"versionedcollapsingmergetree", "coalescingmergetree", "graphitemergetree", "memory", "log", "tinylog"}
    | {"stripelog", "null", "set", "join", "buffer", "view", "materializedview", "atomic", "ordinary"}
)
#: functions refused everywhere besides the engines' and table functions' names (they read files)
FUNCTIONS = frozenset({"file", "catboostevaluate"})
#: further functions a read-only request may not use (they read tables by name, around the table check;
#: so do all ``dict*`` functions, which read dictionaries by name)
ANALYST_FUNCTIONS = frozenset({"merge", "loop", "joinget", "joingetornull", "dictionary", "hascolumnintable"})
#: system tables a read-only request may read (what clients ask on connecting)
ANALYST_SYSTEM_TABLES = frozenset({"one", "numbers", "numbers_mt", "zeros", "settings", "functions", "formats"})
#: statements a read-only request may run (as the engine's parser names them)
READ_KINDS = frozenset(
    {"SelectWithUnionQuery", "SelectIntersectExceptQuery", "SelectQuery", "ShowTablesQuery", "ExplainQuery"}
    | {"DescribeQuery", "ShowCreateTableQuery", "ShowCreateViewQuery", "ShowCreateDatabaseQuery"}
    | {"ExistsTableQuery", "ExistsViewQuery", "ExistsDatabaseQuery", "ShowProcesslistQuery"}
)
#: statements the engine cannot give as JSON that may still run (their functions are checked)
INTROSPECTION_KINDS = READ_KINDS - {"SelectWithUnionQuery", "SelectIntersectExceptQuery", "SelectQuery"}
#: statements refused for everyone
REFUSED_KINDS = frozenset({"SystemQuery", "KillQueryQuery", "BackupQuery"})
#: the keys an INSERT whose data comes in the request may have in its tree
_DATA_INSERT_KEYS = frozenset({"type", "database", "table", "columns", "format"})
#: settings that bound a statement's time: a statement may only lower max_execution_time (within the cap)
TIME_SETTINGS = frozenset(
    {"max_execution_time", "max_execution_time_leaf", "timeout_overflow_mode", "timeout_overflow_mode_leaf"}
    | {"timeout_before_checking_execution_speed", "max_estimated_execution_time"}
)
#: what every session runs first: VALUES data is read as literals (never evaluated: ``file()`` in data)
SESSION_SETTINGS = ("input_format_values_interpret_expressions", "input_format_values_deduce_templates_of_expressions")
#: functions whose right argument, a bare identifier, names a table (``x IN t``)
_IN_FUNCTIONS = frozenset(
    {"in", "notin", "globalin", "globalnotin", "nullin", "notnullin", "globalnullin", "globalnotnullin"}
)
#: introspection statements whose first EXPLAIN AST line names a table: ``Kind db name``
_NAMED_TABLE_KINDS = frozenset({"ShowCreateTableQuery", "ShowCreateViewQuery", "ExistsTableQuery", "ExistsViewQuery"})

_CODE = re.compile(r"Code:\s*(\d+)")
#: the engine's errors a server answers with 400: SYNTAX_ERROR, UNKNOWN_QUERY_PARAMETER, BAD_QUERY_PARAMETER
_CLIENT_ERRORS = frozenset({62, 456, 457})
_DATA_START = re.compile(rb"\bVALUES\b|\bFORMAT\s+[A-Za-z0-9_]+", re.IGNORECASE)
_SEPARATOR = re.compile(rb"[ \t]*\r?\n?")  # always matches (maybe empty)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PARAMETER = re.compile(r"\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*([^{}]+)\}")
_CHUNK = 1 << 20
#: a request body: as read (bytes) or as inflated (bytearray)
Body = bytes | bytearray


@dataclass(frozen=True)
class Limits:
    """What one client can take from the server."""

    max_body_bytes: int = 256 << 20  #: request body as sent (compressed)
    max_decompressed_bytes: int = 512 << 20  #: request body after Content-Encoding
    max_query_bytes: int = 256 << 10  #: statement text (ClickHouse's max_query_size)
    read_timeout_s: float = 30.0  #: to read one request, headers and body (also a keep-alive's idle time)
    max_connections: int = 64  #: connections served at once (one thread each); the excess get 503
    max_execution_time_s: float = 300.0  #: default and ceiling of a statement's max_execution_time
    header_timeout_s: float = 10.0  #: to read a request's line and headers (at most read_timeout_s)
    queue_timeout_s: float = 30.0  #: to wait for the engine (statements run one at a time); then 503
    max_inflating: int = 2  #: compressed request bodies inflated at once (the others wait, then 503)
    #: inflated request bodies held at once, server-wide (while inflating and while waiting for the engine)
    max_inflated_bytes: int = 1 << 30
    #: the analyst's default and ceiling of max_execution_time (below queue_timeout_s: a writer outwaits it)
    analyst_max_execution_time_s: float = 20.0


class RequestError(Exception):
    """A refusal the client gets as ClickHouse sends it: HTTP status, code, name and message."""

    def __init__(self, status: int, code: int, name: str, message: str):
        super().__init__(f"Code: {code}. DB::Exception: {message}. ({name})")
        self.status, self.code = status, code


def _too_large(what: str, limit: int) -> RequestError:
    return RequestError(413, 307, "TOO_MANY_BYTES", f"{what} is larger than the server's limit of {limit} bytes")


def _denied(message: str) -> RequestError:
    return RequestError(403, 497, "ACCESS_DENIED", message)


def _readonly(user: str, what: str) -> RequestError:
    return RequestError(403, 164, "READONLY", f"{user}: Cannot execute query in readonly mode ({what})")


# ---------------------------------------------------------------- tokens


def auth_dir_for(path: str | Path) -> Path:
    """Where the front of the chdb folder ``path`` keeps its users' token files (owner-only)."""
    return Path(path).resolve() / "rtrl-auth"


def token_file(auth_dir: str | Path, user: str) -> Path:
    return Path(auth_dir) / f"{user}.token"


def ensure_tokens(auth_dir: str | Path, fresh: bool = True) -> dict[str, str]:
    """One random token per user in ``auth_dir`` (0700), each in its own 0600 file created with that mode;
    ``fresh`` replaces existing ones (a new run), else they are kept (a restarted front, same clients)."""
    folder = private_dir(auth_dir)
    tokens = {}
    for user in USERS:
        f = token_file(folder, user)
        if fresh or not f.exists():
            write_private(f, secrets.token_urlsafe(32).encode())
        tokens[user] = f.read_text().strip()
    return tokens


def dsn_for(host: str, port: int, auth_dir: str | Path, user: str = WRITER, scheme: str = "http") -> str:
    """The DSN a client connects with: no secret in it, only the path of the file holding the token."""
    return f"{scheme}://{user}@{host}:{port}/?password_file={quote(str(token_file(auth_dir, user)), safe='/')}"


# ---------------------------------------------------------------- request bodies


class _Inflate:
    """zlib/deflate as a reader that inflates at most ``n`` bytes per read, across concatenated members
    (as gzip allows); a stream that ends inside a member is an error, not silently shorter data."""

    def __init__(self, data: bytes):
        self.d, self.rest = zlib.decompressobj(zlib.MAX_WBITS | 32), data  # zlib or gzip header
        self.done = not data

    def read(self, n: int) -> bytes:
        for _ in range(len(self.rest) + 2):  # each turn consumes input or ends: bounded by the data
            if self.done:
                return b""
            if self.d.eof:  # the rest of the input is in unused_data (unconsumed_tail repeats it)
                self.rest = self.d.unused_data
                if not self.rest:
                    self.done = True
                    return b""
                self.d = zlib.decompressobj(zlib.MAX_WBITS | 32)  # the next member
            before = len(self.rest)
            try:
                out = self.d.decompress(self.rest, n)
            except zlib.error as e:
                raise RequestError(
                    400, 354, "CANNOT_DECOMPRESS", f"the compressed request body is malformed: {e}"
                ) from None
            self.rest = self.d.unconsumed_tail
            if out:
                return out
            if not self.d.eof and len(self.rest) == before:
                raise RequestError(400, 354, "CANNOT_DECOMPRESS", "the compressed request body ends early")
        raise RequestError(400, 354, "CANNOT_DECOMPRESS", "the compressed request body is malformed")


def decompress(data: bytes, encoding: str, limit: int = Limits.max_decompressed_bytes) -> Body:
    """``data`` decoded per Content-Encoding, inflated a MiB at a time and refused (413, code 307) as
    soon as it passes ``limit`` bytes: a small bomb never inflates further than the limit.
    The inflated bytes come back as they were built (no second copy of them)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return data
    reader: Any
    if encoding == "lz4":
        import lz4.frame

        reader = lz4.frame.LZ4FrameFile(io.BytesIO(data), "rb")
    elif encoding == "zstd":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    elif encoding in ("gzip", "deflate"):
        reader = _Inflate(data)  # every member, each inflated a step at a time
    else:
        raise ValueError(f"unsupported Content-Encoding {encoding!r} (lz4, zstd, gzip or deflate)")
    out = bytearray()
    for _ in range(limit // _CHUNK + 2):  # each read adds up to a MiB; one more than the limit is refused
        piece = reader.read(min(_CHUNK, limit + 1 - len(out)))
        if not piece:
            return out
        out += piece
        if len(out) > limit:
            break
    raise _too_large("the decompressed request body", limit)


# ---------------------------------------------------------------- statements


def _escape_param(text: str) -> str:
    """A string as a ``{q:String}`` query parameter (chdb reads parameters in the escaped TSV form)."""
    return (
        text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r").replace("\0", "\\0")
    )


def _quote_ident(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


@dataclass
class Statement:
    """One statement as the engine parsed it: what runs, and what the policy looks at."""

    kind: str  #: the root node's type, e.g. SelectWithUnionQuery, InsertQuery, CreateQuery
    sql: str  #: the engine's canonical text of it (what runs)
    ast: dict | None  #: parseQueryToJSON's tree (None for the few statements it cannot serialise)
    functions: set[str]  #: every function / table function / engine name in it, lower-case
    data: Body | None = None  #: an INSERT's data (from the body or inline)
    explain: list[str] | None = None  #: EXPLAIN AST's lines when ``ast`` is None
    parameters: dict[str, str] = field(default_factory=dict)  #: its query parameters: name -> type


def _explain_tree(lines: list[str]) -> dict:
    """EXPLAIN AST's indented text as nodes ``{"type", "text", "children"}`` (the root first)."""
    root: dict = {"type": "", "text": "", "children": []}
    stack: list[tuple[int, dict]] = [(-1, root)]
    for line in lines:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip(" "))
        body = re.sub(r"\s*\(children \d+\)$", "", line.strip())
        kind, _, text = body.partition(" ")
        node = {"type": kind, "text": text, "children": []}
        while stack[-1][0] >= depth:
            stack.pop()
        stack[-1][1]["children"].append(node)
        stack.append((depth, node))
    return root


def _walk(node: Any):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


class Policy:
    """What each request may run, decided on the engine's parse tree (pure: no I/O)."""

    def __init__(self, table_functions: set[str], engines: set[str], database: str):
        names = {n.lower() for n in table_functions | engines}
        self.forbidden = (names - TABLE_FUNCTIONS - ENGINES) | FUNCTIONS
        self.table_functions = {n.lower() for n in table_functions}
        self.database = database
        self.analyst_tables = {f"{database}.{t}" for t in ANALYST_TABLES} | {
            f"system.{t}" for t in ANALYST_SYSTEM_TABLES
        }

    def check(
        self,
        st: Statement,
        user: str,
        readonly: bool,
        database: str,
        max_time_s: float = Limits.max_execution_time_s,
        existing: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        """Raise RequestError (497, 164 or 452) unless ``user`` may run ``st``. ``max_time_s`` is the server's
        ceiling of max_execution_time; ``existing`` the (database, table) pairs there are (for read-only
        requests: a CTE may not take a real table's name)."""
        for name in sorted(st.functions):
            if name in self.forbidden or name.startswith(("iceberg", "deltalake", "hudi", "paimon")):
                raise _denied(
                    f"{user}: {name} is refused by the embedded ClickHouse front (it reaches files or the network)"
                )
        if st.kind in REFUSED_KINDS:
            raise _denied(f"{user}: {st.kind} is refused by the embedded ClickHouse front")
        if st.ast is None and st.kind not in INTROSPECTION_KINDS:
            raise _denied(
                f"{user}: {st.kind} is not available on the embedded ClickHouse front (access control and "
                "administration belong to a real server: deploy/clickhouse/security.sql)"
            )
        self._check_settings(st, user, max_time_s)
        for node in _walk(st.ast):
            if "out_file" in node:
                raise _denied(f"{user}: INTO OUTFILE is refused (it writes a file on the server)")
            if "infile" in node:
                raise _denied(f"{user}: FROM INFILE is refused (it reads a file on the server)")
            if "attach_from_path" in node or node.get("attach") is True:
                raise _denied(f"{user}: ATTACH is refused by the embedded ClickHouse front")
            if node.get("is_dictionary") is True and node.get("type") == "CreateQuery":
                raise _denied(f"{user}: dictionaries are refused (their sources read files or the network)")
        if not readonly:
            self._check_append_only(st, user, database)
            return
        if st.kind not in READ_KINDS or (
            st.kind == "ExplainQuery" and (st.ast or {}).get("query", {}).get("type") not in READ_KINDS
        ):
            raise _readonly(user, f"{st.kind} is not a read")
        bad = sorted(n for n in st.functions if n in ANALYST_FUNCTIONS or n.startswith("dict"))
        if bad:
            raise _readonly(user, f"{bad[0]} is not available to read-only users")
        names = sorted(n for n, t in st.parameters.items() if t.strip().lower() == "identifier")
        if names:
            raise _denied(
                f"{user}: the query parameter {{{names[0]}:Identifier}} is refused for read-only users (it could "
                "name a table or database, around the table check); write the name in the statement"
            )
        if st.ast is not None:
            tables = self._tables(st.ast, database, user, existing)
        else:
            tables = self._explained_tables(st.explain or [], database, existing)
        for table in sorted(tables):
            if table not in self.analyst_tables:
                raise _denied(
                    f"{user}: Not enough privileges. To execute this query, it's necessary to have the grant "
                    f"SELECT ON {table} (read-only users read {', '.join(sorted(ANALYST_TABLES))})"
                )

    def _check_append_only(self, st: Statement, user: str, database: str) -> None:
        """No one alters, deletes from, truncates, drops, replaces or renames an append-only table (the erasure
        audit), nor drops the database that holds it: the engine's equivalent of the writer role's REVOKE in
        deploy/clickhouse/security.sql."""
        ast = st.ast or {}
        replaces = st.kind == "CreateQuery" and (ast.get("replace_table") or ast.get("create_or_replace"))
        if st.kind not in ("AlterQuery", "DropQuery", "DeleteQuery", "RenameQuery") and not replaces:
            return
        name = lambda x: x.get("name") if isinstance(x, dict) else x  # noqa: E731
        db = name(ast.get("database")) or database
        if st.kind == "DropQuery" and not name(ast.get("table")) and db == self.database:
            raise _denied(f"{user}: dropping {db} would drop its append-only erasure audit; refused")
        pairs = [(db, name(ast.get("table")))]
        for e in ast.get("elements") or []:
            pairs += [(e.get("from_database") or database, e.get("from_table"))]
            pairs += [(e.get("to_database") or database, e.get("to_table"))]
        for db, table in pairs:
            if db == self.database and table in APPEND_ONLY_TABLES:
                raise _denied(
                    f"{user}: {db}.{table} is append-only (the erasure audit): it may be read and inserted into, "
                    "never altered, deleted from, truncated, dropped, replaced or renamed"
                )

    def _check_settings(self, st: Statement, user: str, max_time_s: float) -> None:
        """A statement may lower max_execution_time (SETTINGS or SET), never raise or lift it, nor change how
        the time limit acts: the server's ceiling holds for every user."""

        def refuse(what: str) -> RequestError:
            return RequestError(
                400,
                452,
                "SETTING_CONSTRAINT_VIOLATION",
                f"{user}: {what} (the embedded ClickHouse front caps max_execution_time at {max_time_s:g} s; "
                "a statement may only lower it)",
            )

        if st.ast is None:
            if any(ln.strip() == "Set" for ln in st.explain or []):
                raise refuse(f"SETTINGS on {st.kind} is not available")
            return
        for node in _walk(st.ast):
            if node.get("type") != "SetQuery":
                continue
            for change in node.get("changes", []):
                name = str(change.get("name", "")).lower()
                if name not in TIME_SETTINGS:
                    continue
                value = (change.get("value") or {}).get("value")
                try:
                    seconds = float(value)  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    seconds = -1.0
                if name != "max_execution_time" or not 0 < seconds <= max_time_s:
                    raise refuse(f"setting {name} to {value!r} is not allowed")

    @staticmethod
    def _qualified(node: dict, database: str) -> str:
        """``db.name`` of a table identifier node: qualified only when the engine parsed two parts
        (a backquoted name holding a dot is a name in ``database``)."""
        parts = node.get("name_parts")
        if isinstance(parts, list) and len(parts) == 2:
            return f"{parts[0]}.{parts[1]}"
        return f"{database}.{node.get('name')}"

    def _tables(self, ast: dict, database: str, user: str, existing: frozenset[tuple[str, str]]) -> set[str]:
        """Every table, view or parameterised view ``ast`` reads, as ``db.name``. A bare name that a CTE of
        the query defines is left out; a CTE name holding a dot or equal to a real table's name is refused
        (a CTE is visible in its own scope only: a table of that name elsewhere would pass unchecked)."""
        ctes = {str(n["name"]) for n in _walk(ast) if n.get("type") == "WithElement" and "name" in n}
        real = {name.lower() for _, name in existing} | {t.lower() for t in ANALYST_TABLES}
        for cte in sorted(ctes):
            if "." in cte or cte.lower() in real:
                raise _denied(
                    f"{user}: a CTE named {cte!r} is refused for read-only users (it names or shadows a table)"
                )
        found = set()
        for node in _walk(ast):
            ref = None
            if node.get("type") == "TableIdentifier":
                ref = node
            elif node.get("type") == "TableExpression" and "table_function" in node:
                fn = node["table_function"].get("name", "")
                if fn.lower() not in self.table_functions:
                    ref = {"name": fn, "name_parts": fn.split(".") if "." in fn else None}  # parameterised view
            elif node.get("type") == "Function" and str(node.get("name", "")).lower() in _IN_FUNCTIONS:
                args = node.get("arguments", {}).get("children", [])
                if len(args) == 2 and args[1].get("type") == "Identifier":
                    ref = args[1]  # x IN t reads table t
            if ref is None:
                continue
            if not ref.get("name"):  # a name the tree does not carry (a query parameter's): refused
                found.add(f"{database}.?")
                continue
            bare = not (isinstance(ref.get("name_parts"), list) and len(ref["name_parts"]) == 2)
            if bare and ref["name"] in ctes:
                continue
            found.add(self._qualified(ref, database))
        return found

    def _explained_tables(self, lines: list[str], database: str, existing: frozenset[tuple[str, str]]) -> set[str]:
        """The tables a statement without a JSON tree (DESCRIBE, SHOW CREATE, EXISTS) names, from EXPLAIN
        AST's text. That text cannot tell ``db.t`` from a backquoted dotted name: a dotted name is read as
        both when a table of that dotted name exists in ``database``. CTEs are not exempt here."""

        def names(text: str) -> set[str]:
            if "." not in text:
                return {f"{database}.{text}"}
            bare = f"{database}.{text}"
            return {text, bare} if (database, text) in existing else {text}

        found: set[str] = set()
        head = lines[0] if lines else ""
        kind = head.split(" ")[0]
        if kind in _NAMED_TABLE_KINDS:
            parts = re.sub(r"\s*\(children \d+\)$", "", head).split(" ")
            if len(parts) != 3 or not parts[2]:
                found.add(f"{database}.?")  # a name the text cannot carry: refused
            else:
                found.add(f"{parts[1] or database}.{parts[2]}")
        for node in _walk(_explain_tree(lines)):
            kind = node.get("type")
            if kind == "TableIdentifier":
                found |= names(node["text"])
            elif kind == "TableExpression":
                for child in node["children"]:
                    fn = child["text"] if child["type"] == "Function" else ""
                    if fn and fn.lower() not in self.table_functions:
                        found |= names(fn)
            elif kind == "Function" and node["text"].lower() in _IN_FUNCTIONS:
                args = node["children"][0]["children"] if node["children"] else []
                if len(args) == 2 and args[1]["type"] == "Identifier":
                    found |= names(args[1]["text"])
        return found


# ---------------------------------------------------------------- the engine


class Gate:
    """The engine, one request at a time. A waiting writer goes before every waiting analyst.
    Each kind waits in arrival order. A wait is bounded: past its timeout the request gives up its place."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._queues: tuple[deque[object], deque[object]] = (deque(), deque())  # writers, analysts

    def _head(self) -> object | None:
        return next((q[0] for q in self._queues if q), None)

    def acquire(self, writer: bool, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the engine; True once it is this caller's."""
        ticket, queue = object(), self._queues[0 if writer else 1]
        deadline = time.monotonic() + timeout
        with self._cond:
            queue.append(ticket)
            try:
                while self._busy or self._head() is not ticket:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                self._busy = True
                return True
            finally:
                queue.remove(ticket)
                self._cond.notify_all()  # a new head of the queue (or the one after a caller that gave up)

    def release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


class ByteBudget:
    """Bytes held at once, server-wide: a reservation waits (bounded) until it fits in ``total``.
    No holder waits for more budget, so holders always release (no deadlock)."""

    def __init__(self, total: int):
        self.total, self.held, self.peak = max(1, total), 0, 0
        self._cond = threading.Condition()

    def reserve(self, n: int, timeout: float) -> bool:
        """Hold ``n`` bytes (at most ``total``) once they fit, waiting at most ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.held + n <= self.total, timeout):
                return False
            self.held += n
            self.peak = max(self.peak, self.held)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()


class Engine:
    """The chdb folder; every call runs on the process's one chdb thread
    (:func:`rtrl.clickhouse.on_engine_thread`: chdb wants Python-created threads, one at a time)."""

    def __init__(self, path: str, limits: Limits = Limits(), database: str = "rtrl"):
        import chdb

        self.path, self.limits = str(Path(path).resolve()), limits
        self.conn = on_engine_thread(chdb.connect, self.path)  # holds the folder; parses statements
        # INSERT data on its way in: inside the folder (owner-only), emptied at each start, so a front
        # killed with SIGKILL leaves nothing behind that the next start does not clear
        self.spool = Path(self.path) / "rtrl-spool"
        shutil.rmtree(self.spool, ignore_errors=True)
        private_dir(self.spool)
        self.gate = Gate()  # one request on the engine at a time (writers first); the others wait, bounded
        names = on_engine_thread(self._names)
        self.policy = Policy(names["table_functions"], names["table_engines"] | names["database_engines"], database)

    def _names(self) -> dict[str, set[str]]:
        out = {}
        for table in ("table_functions", "table_engines", "database_engines"):
            text = self.conn.query(f"SELECT name FROM system.{table}", "TabSeparatedRaw").bytes().decode()
            out[table] = set(text.split())
        return out

    def _call(self, fn: str, text: str) -> str:
        res = self.conn.query(f"SELECT {fn}({{q:String}})", "TabSeparatedRaw", params={"q": _escape_param(text)})
        return res.bytes().decode().removesuffix("\n")

    def _parse(self, text: str, params: dict[str, str] | None = None) -> Statement:
        """The one statement in ``text`` (SYNTAX_ERROR if there are several), parsed by the engine.
        Its query parameters are listed with their types. A statement without a JSON tree is explained
        with ``params`` substituted (as it runs), so the policy sees the names they fill in."""
        canonical = self._call("formatQuerySingleLine", text)  # refuses multi-statements
        try:
            ast = json.loads(self._call("parseQueryToJSON", canonical))
        except Exception as e:  # noqa: BLE001 - a statement the JSON form does not cover: EXPLAIN AST's tree
            if "does not support JSON" not in str(e) and "not supported by parseQueryToJSON" not in str(e):
                raise
            explained = self.conn.query(f"EXPLAIN AST {canonical}", "TabSeparatedRaw", params=params or {})
            lines = explained.bytes().decode().splitlines()
            kind = lines[0].split()[0] if lines else "?"
            functions = {
                ln.split()[1].lower() for ln in lines if ln.strip().startswith("Function ") and len(ln.split()) > 1
            }
            # the text's {name:Type} (one inside a string literal too: only ever a stricter check)
            parameters = {m[0]: m[1].strip() for m in _PARAMETER.findall(canonical)}
            return Statement(kind, canonical, None, functions, explain=lines, parameters=parameters)
        functions = {str(n["name"]).lower() for n in _walk(ast) if n.get("type") == "Function" and "name" in n}
        parameters = {
            str(n.get("name")): str(n.get("param_type")) for n in _walk(ast) if n.get("type") == "QueryParameter"
        }
        return Statement(str(ast.get("type")), canonical, ast, functions, parameters=parameters)

    def _data_insert(self, text: Body) -> tuple[Statement, int] | None:
        """An ``INSERT … FORMAT F`` / ``VALUES`` at the head of ``text`` whose data follows it: the statement
        and where the data starts. The engine decides: the first candidate prefix it parses as a complete
        INSERT with a format and no SELECT is the head (a keyword inside a comment or string never is)."""
        head = text[: self.limits.max_query_bytes]
        for m in list(_DATA_START.finditer(head))[:32]:
            try:
                prefix = head[: m.end()].decode()
                ast = json.loads(self._call("parseQueryToJSON", prefix))
            except Exception:  # noqa: BLE001,S112 - not a complete statement there: the next candidate
                continue
            if ast.get("type") != "InsertQuery" or "format" not in ast or "select" in ast:
                continue
            st = Statement("InsertQuery", self._call("formatQuerySingleLine", prefix), ast, set())
            st.functions = {str(n["name"]).lower() for n in _walk(ast) if n.get("type") == "Function" and "name" in n}
            return st, m.end()
        return None

    def time_cap(self, user: str) -> float:
        """The ceiling (and default) of ``user``'s max_execution_time: the analyst's is the lower one."""
        cap = self.limits.max_execution_time_s
        return min(cap, self.limits.analyst_max_execution_time_s) if user == ANALYST else cap

    def execute(self, query: str, body: Body, user: str, readonly: bool, database: str, run_args: dict) -> Any:
        """Parse, check and run one request's statement, waiting at most ``limits.queue_timeout_s`` for the
        engine (it runs one statement at a time); 503 / code 202 once that wait is over. A writer waits
        for the statement running now, never for queued analysts' (their statements are capped too)."""
        wait = self.limits.queue_timeout_s
        if not self.gate.acquire(user != ANALYST, wait):
            raise RequestError(
                503,
                202,
                "TOO_MANY_SIMULTANEOUS_QUERIES",
                f"Too many simultaneous queries: waited {wait:g} s for the engine, which runs one statement at "
                "a time (try again later)",
            )
        try:
            st = self.prepare(query, body, run_args["params"])
            existing = self.tables() if readonly else frozenset()
            self.policy.check(st, user, readonly, database, self.time_cap(user), existing)
            return self.run(st, database=database, readonly=readonly, **run_args)
        finally:
            self.gate.release()

    def tables(self) -> frozenset[tuple[str, str]]:
        """Every (database, table) there is now."""
        text = on_engine_thread(
            lambda: self.conn.query("SELECT database, name FROM system.tables", "JSONCompactEachRow").bytes()
        )
        return frozenset(tuple(json.loads(ln)) for ln in text.decode().splitlines() if ln.strip())  # type: ignore[misc]

    def _values_as_sql(self, st: Statement) -> Statement:
        """An ``INSERT … VALUES`` whose data is small enough to parse as the statement
        ``INSERT INTO t SELECT * FROM values(<data>)``: expressions in its data (``now()``, ``file(…)``) are
        then parsed, checked by the policy and run as any statement's are. Larger data, or data that does
        not parse so, stays data and is read as literals only (the session never evaluates VALUES data)."""
        ast = st.ast or {}
        if str(ast.get("format", "")).lower() != "values" or set(ast) - _DATA_INSERT_KEYS:
            return st
        data = (st.data or b"").strip().removesuffix(b";").strip()
        if not data:
            return st
        if len(data) > self.limits.max_query_bytes or not data.startswith(b"("):
            return st
        try:
            text = f"INSERT INTO {self._target(ast)} SELECT * FROM values({data.decode()})"
            return self._parse(text)
        except Exception:  # noqa: BLE001 - not one expression list: the literal-only data path
            return st

    @staticmethod
    def _target(ast: dict) -> str:
        target = _quote_ident(ast["table"]["name"])
        if "database" in ast:
            target = f"{_quote_ident(ast['database']['name'])}.{target}"
        cols = ast.get("columns", {}).get("children", [])
        if cols:
            target += " (" + ", ".join(_quote_ident(c["name"]) for c in cols) + ")"
        return target

    def prepare(self, url_query: str, body: Body, params: dict[str, str] | None = None) -> Statement:
        return cast(Statement, on_engine_thread(self._prepare, url_query, body, params))

    def _prepare(self, url_query: str, body: Body, params: dict[str, str] | None = None) -> Statement:
        if url_query and body:
            found = self._data_insert(url_query.encode())
            if found and not url_query.encode()[found[1] :].strip():
                found[0].data = body  # the statement in the URL, the data in the body
                return self._values_as_sql(found[0])
            text: Body = url_query.encode() + b"\n" + body  # ClickHouse concatenates them
        else:
            text = url_query.encode() or body
        found = self._data_insert(text)
        if found is not None:
            st, start = found
            if st.ast and st.ast.get("format", "").lower() != "values":
                start = _SEPARATOR.match(text, start).end()  # type: ignore[union-attr]  # the one after FORMAT F
            st.data = text[start:]  # one copy of the data
            return self._values_as_sql(st)
        if len(text) > self.limits.max_query_bytes:
            raise RequestError(
                400, 62, "SYNTAX_ERROR", f"Max query size exceeded ({len(text)} > {self.limits.max_query_bytes} bytes)"
            )
        try:
            sql = text.decode()
        except UnicodeDecodeError:
            raise RequestError(400, 62, "SYNTAX_ERROR", "the statement is not valid UTF-8") from None
        return self._parse(sql, params)

    def run(self, st: Statement, fmt: str, params: dict[str, str], database: str, readonly: bool, max_time: float):
        return on_engine_thread(self._run, st, fmt, params, database, readonly, max_time)

    def _run(self, st: Statement, fmt: str, params: dict[str, str], database: str, readonly: bool, max_time: float):
        import chdb

        session = chdb.connect(self.path)  # a fresh session: no USE or SET outlives its request
        try:
            session.query(f"SET max_execution_time = {max_time:g}")
            for name in SESSION_SETTINGS:
                session.query(f"SET {name} = 0")
            if database:
                session.query(f"USE {_quote_ident(database)}")
            if readonly:
                session.query("SET readonly = 1")  # the engine enforces it as well
            if st.data is None:
                return session.query(st.sql, fmt, params=params)
            return self._insert(session, st, fmt, params)
        finally:
            session.close()

    def _insert(self, session: Any, st: Statement, fmt: str, params: dict[str, str]):
        ast = st.ast or {}
        extra = set(ast) - _DATA_INSERT_KEYS
        if extra:
            raise RequestError(
                400, 48, "NOT_IMPLEMENTED", f"INSERT with {', '.join(sorted(extra))} and data is not supported here"
            )
        target = self._target(ast)
        form = str(ast["format"])
        if not _IDENT.match(form):
            raise RequestError(400, 73, "UNKNOWN_FORMAT", f"unknown format {form!r}")
        spool = self.spool / f"{uuid.uuid4().hex}.{form}"
        spool.write_bytes(st.data or b"")
        try:  # the one FROM INFILE that runs: ours, of a file we wrote
            return session.query(f"INSERT INTO {target} FROM INFILE '{spool}' FORMAT {form}", fmt, params=params)
        finally:
            spool.unlink(missing_ok=True)

    def close(self) -> None:
        try:
            on_engine_thread(self.conn.close)
        finally:
            shutil.rmtree(self.spool, ignore_errors=True)


# ---------------------------------------------------------------- HTTP


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

    def handle_one_request(self) -> None:
        # the request line and headers within the (short) header deadline: a slow or idle client is cut off
        self.server.arm(self.connection, min(self.limits.header_timeout_s, self.limits.read_timeout_s))
        try:
            super().handle_one_request()
        finally:
            self.server.disarm(self.connection)

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


if __name__ == "__main__":
    sys.exit(main())
