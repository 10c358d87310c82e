"""The embedded ClickHouse as a server: ClickHouse's HTTP interface in front of one chdb folder.

    rtrl clickhouse serve [--port P]       (python -m devservices.chserver DIR PORT)

chdb holds a data folder in one process only, so parts of the loop that run as separate processes
(reward flow, batch flow, trainer) cannot each open it. This process owns the folder and answers
ClickHouse's HTTP protocol on loopback, so every other process uses ``clickhouse.dsn =
http://rtrl_writer@127.0.0.1:P/?password_file=…`` through clickhouse-connect's ordinary HTTP client - the
same code path as a real ClickHouse server. Every statement runs on the real engine; only the transport
is ours. It is the single-machine stand-in for a ClickHouse server: production points ``clickhouse.dsn``
at a real server whose users, roles and grants are ``deploy/clickhouse/security.sql``.

It is safe by default (each point tested in tests/test_chserver_security.py): loopback only, every request
authenticated, every statement checked on the engine's own parse tree before it runs, each request in a
fresh engine session, and every resource a client can take capped. The package re-exports every public name
of its modules, one concern each; each module's docstring says what its part speaks, refuses or caps:

- :mod:`devservices.chserver.limits`: the caps on what one client can take (:class:`Limits`) and the
  refusals it gets as ClickHouse sends them (:class:`RequestError`).
- :mod:`devservices.chserver.auth`: the two users (:data:`WRITER`, :data:`ANALYST`), their token files and
  the DSNs that name them (:func:`ensure_tokens`, :func:`dsn_for`).
- :mod:`devservices.chserver.bodies`: request bodies decoded per Content-Encoding under a cap
  (:func:`decompress`).
- :mod:`devservices.chserver.policy`: what each request may run, decided on the engine's parse tree
  (:class:`Statement`, :class:`Policy`).
- :mod:`devservices.chserver.gates`: bounded waits: the engine, one request at a time and writers first
  (:class:`Gate`), and the inflated bodies held at once (:class:`ByteBudget`).
- :mod:`devservices.chserver.engine`: the chdb folder: each request's one statement parsed, checked and run
  in a fresh session (:class:`Engine`).
- :mod:`devservices.chserver.handler`: ClickHouse's HTTP interface: the request handler (:class:`Handler`)
  and the threaded server with bounded connections and read deadlines (:class:`Server`).
- :mod:`devservices.chserver.process`: the front in this process (:class:`ClickHouseServer`, loopback only:
  :func:`check_loopback`), as a child process (:func:`spawn`) and its command line (:func:`main`;
  ``python -m devservices.chserver`` runs it).
"""

from __future__ import annotations

from devservices.chserver.auth import ANALYST, USERS, WRITER, auth_dir_for, dsn_for, ensure_tokens, token_file
from devservices.chserver.bodies import Body, decompress
from devservices.chserver.engine import SESSION_SETTINGS, Engine
from devservices.chserver.gates import ByteBudget, Gate
from devservices.chserver.handler import Handler, Server
from devservices.chserver.limits import Limits, RequestError
from devservices.chserver.policy import (
    ANALYST_FUNCTIONS,
    ANALYST_SYSTEM_TABLES,
    ENGINES,
    FUNCTIONS,
    INTROSPECTION_KINDS,
    READ_KINDS,
    REFUSED_KINDS,
    TABLE_FUNCTIONS,
    TIME_SETTINGS,
    Policy,
    Statement,
)
from devservices.chserver.process import ClickHouseServer, check_loopback, main, spawn

__all__ = [
    # limits
    "Limits",
    "RequestError",
    # users and tokens
    "ANALYST",
    "USERS",
    "WRITER",
    "auth_dir_for",
    "dsn_for",
    "ensure_tokens",
    "token_file",
    # request bodies
    "Body",
    "decompress",
    # statements
    "ANALYST_FUNCTIONS",
    "ANALYST_SYSTEM_TABLES",
    "ENGINES",
    "FUNCTIONS",
    "INTROSPECTION_KINDS",
    "READ_KINDS",
    "REFUSED_KINDS",
    "TABLE_FUNCTIONS",
    "TIME_SETTINGS",
    "Policy",
    "Statement",
    # bounded waits
    "ByteBudget",
    "Gate",
    # the engine
    "SESSION_SETTINGS",
    "Engine",
    # HTTP
    "Handler",
    "Server",
    # the process
    "ClickHouseServer",
    "check_loopback",
    "main",
    "spawn",
]
