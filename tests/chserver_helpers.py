"""Raw HTTP to the embedded ClickHouse front, for its tests: one request's status, exception code and body.

The writer's credentials unless told, the analyst's DSN and token from the writer's; a process's thread count.
Used by tests/test_chserver_security.py and tests/test_chserver_resources.py (not collected: no ``test_`` prefix).
"""

from __future__ import annotations

import base64
import http.client
import re
import urllib.parse
from pathlib import Path

from devservices import chserver
from rtrl import clickhouse


def address(dsn: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(dsn)
    return u.hostname or "", u.port or 0


def token(dsn: str) -> str:
    return clickhouse.split_password_file(dsn)[1] or ""


def analyst(dsn: str) -> str:
    return dsn.replace(chserver.WRITER, chserver.ANALYST)


def basic(dsn: str, user: str = chserver.WRITER) -> bytes:
    """The Authorization header line of ``user`` (the writer unless told), for raw sockets."""
    key = token(dsn if user == chserver.WRITER else analyst(dsn))
    return b"Authorization: Basic " + base64.b64encode(f"{user}:{key}".encode()) + b"\r\n"


def request(dsn, sql="", *, user=None, key=None, body=b"", params=None, headers=None, timeout=20.0):
    """(status, exception code, body) of one raw HTTP request; the writer's credentials unless told."""
    host, port = address(dsn)
    user = chserver.WRITER if user is None else user
    key = token(dsn) if key is None else key
    q = {"query": sql} if sql else {}
    path = "/?" + urllib.parse.urlencode(q | (params or {}))
    h = dict(headers or {})
    if user:
        h["Authorization"] = "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("POST" if body else "GET", path, body=body or None, headers=h)
        r = c.getresponse()
        return r.status, r.getheader("X-ClickHouse-Exception-Code"), r.read()
    finally:
        c.close()


def rows(dsn, sql, **kw) -> bytes:
    status, code, out = request(dsn, sql, **kw)
    assert status == 200, (code, out)
    return out


def _threads(pid: int) -> int:
    m = re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert m
    return int(m.group(1))
