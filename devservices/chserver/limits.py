"""The caps on what one client can take from the embedded ClickHouse front, and its refusals as ClickHouse sends them.

Caps (:class:`Limits`): body size, decompressed size (inflated in steps, refused as soon as it
passes the cap; at most ``max_inflating`` bodies at once), the inflated bodies held at once across all
requests (``max_inflated_bytes``: a body reserves the most it may reach before inflating, keeps its size
until its request ends, and waits at most ``queue_timeout_s`` for room, then 503), the time to read the
headers and then the body (a byte-a-second client is cut off), concurrent connections (bounded worker
threads; the excess get 503 at once), the wait for the engine and ``max_execution_time``: no ``SETTINGS``
or ``SET`` may lift or change it (code 452), only lower it. The analyst's cap is lower
(``analyst_max_execution_time_s``, 20 s, under the 30 s a writer waits for the engine); an analyst asking
for more in the URL gets 452.

Every refusal is a :class:`RequestError`: the HTTP status, ClickHouse's code and name, and its message.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one client can take from the server."""

    max_body_bytes: int = 256 << 20  #: request body as sent (compressed)
    max_decompressed_bytes: int = 512 << 20  #: request body after Content-Encoding
    max_query_bytes: int = 256 << 10  #: statement text (ClickHouse's max_query_size)
    read_timeout_s: float = 30.0  #: to read one request, headers and body (also a keep-alive's idle time)
    max_connections: int = 64  #: connections served at once (one thread each); the excess get 503
    max_execution_time_s: float = 300.0  #: default and ceiling of a statement's max_execution_time
    header_timeout_s: float = 10.0  #: to read a request's line and headers from its first byte (at most read_timeout_s)
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
