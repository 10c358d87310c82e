"""Owner-only folders and files for local state (the data folder, recovery, checkpoints, tokens).

The data folder holds the local broker's control token, the embedded ClickHouse (every reward) and
checkpoints: another local user must not read or change them. Folders rtrl creates are ``0700`` and
secret files ``0600`` from the moment they exist (the mode is given to ``mkdir``/``open``, never set
after the fact, so there is no window in which they are readable). A folder that already exists and
belongs to this user is tightened to ``0700``; one that belongs to someone else is left alone (a
shared mount is the operator's choice) but is never loosened.
"""

from __future__ import annotations

import os
from pathlib import Path

from rtrl.errors import ConfigError

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` and any missing parents created owner-only (0700); an existing folder of ours tightened."""
    p = Path(path)
    missing = []
    q = p
    while not q.exists() and q != q.parent:
        missing.append(q)
        q = q.parent
    try:
        for folder in reversed(missing):
            folder.mkdir(mode=PRIVATE_DIR, exist_ok=True)
            os.chmod(folder, PRIVATE_DIR)  # mkdir's mode is masked by the umask: only ever tighter
        st = p.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(p, st.st_mode & 0o700 | PRIVATE_DIR)
    except NotADirectoryError:
        raise ConfigError(
            f"{p} is not a folder (a file is in the way); fix: remove it or choose another folder"
        ) from None
    except OSError as e:
        raise ConfigError(
            f"cannot create the private folder {p} ({e.strerror or e}); fix: choose a writable folder"
        ) from None
    if not p.is_dir():
        raise ConfigError(f"{p} is not a folder; fix: remove it or choose another folder")
    return p


def write_private(path: str | os.PathLike, data: bytes) -> Path:
    """``data`` written to ``path`` as an owner-only file (0600 from creation), replacing it atomically."""
    p = Path(path)
    private_dir(p.parent)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a process that died mid-write
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, PRIVATE_FILE)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, p)
    return p


#: written into a data folder rtrl created: only such a folder is ever cleaned by ``rtrl run``
MARKER = ".rtrl-data"
#: what ``rtrl run`` on the embedded defaults deletes for a fresh start
RUN_PARTS = ("broker", "clickhouse", "archive", "loop", "recovery", "state", "logs", "registry")
#: files only rtrl writes: the marker, or (folders of runs before the marker existed) its broker's address
#: file and the loop's state
_SIGNS = (MARKER, "broker/rtrl-broker.json", "loop/state.json")


def data_folder(path: str | os.PathLike) -> Path:
    """The data folder, owner-only, and marked as rtrl's unless it already holds one of :data:`RUN_PARTS`
    without the marker (someone else's folder: :func:`check_cleanable` then refuses to clean it)."""
    p = private_dir(path)
    ours = not any((p / name).exists() for name in RUN_PARTS) or any((p / sign).exists() for sign in _SIGNS)
    if not (p / MARKER).exists() and ours:
        (p / MARKER).write_text("a data folder of rtrl: `rtrl run` may delete its contents\n")
    return p


def check_cleanable(path: str | os.PathLike) -> None:
    """Refuse (ConfigError) a data folder that is a file, or to clean :data:`RUN_PARTS` of a folder rtrl did not
    mark as its own."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"data_dir {p} is a file, not a folder; fix: set data_dir (RTRL_DATA_DIR) to a folder")
    present = [name for name in RUN_PARTS if (p / name).exists()]
    if present and not any((p / sign).exists() for sign in _SIGNS):
        raise ConfigError(
            f"data_dir {p} holds {', '.join(present)} but was not created by rtrl (no {MARKER} in it), so "
            "`rtrl run` will not delete them; fix: set data_dir to a folder of its own, or if that folder is "
            f"rtrl's, create {p / MARKER}"
        )
