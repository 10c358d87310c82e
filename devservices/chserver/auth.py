"""The embedded ClickHouse front's two users and their tokens: random per run, in owner-only files, never in a DSN.

Two users: :data:`WRITER` (the flows, trainer and tools) and :data:`ANALYST` (``readonly=1``:
read statements on :data:`rtrl.clickhouse.ANALYST_TABLES` only, the grants of the analyst role in
deploy/clickhouse/security.sql). Their tokens are random per run, in owner-only files (``0600`` in a
``0700`` folder, :func:`rtrl.files.write_private`) that clients read (``password_file``), never in a
DSN, environment or command line. The request handler (:mod:`devservices.chserver.handler`) checks them.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from urllib.parse import quote

from rtrl.files import private_dir, write_private

WRITER = "rtrl_writer"
ANALYST = "rtrl_analyst"
USERS = (WRITER, ANALYST)


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
