"""The reward flow's windows on disk: a SQLite :class:`flows.windowing.ColdStore`, one file per partition.

:class:`flows.windowing.PartitionWindows` keeps ``flow.state_memory_mb`` of windows in memory and moves the
least recently touched to this store (a row per window or tombstone: its pickled state and the due times
that drive it, each in an indexed column). The file lives in ``flow.state_dir`` (default
``<data_dir>/state/rewards``), beside the Bytewax recovery folder; keep both on one volume and move,
back up or delete them together.

**Consistency with Bytewax recovery.** Bytewax pickles the windows at every snapshot (epoch) and, after a
crash, resumes from the last snapshot it committed - possibly older than the file's newest writes. So the
file is versioned by *generation*: pickling the store (its ``__getstate__``) commits the open SQLite
transaction durably (WAL, ``synchronous=FULL``; the flow's ``snapshot()`` commits at every epoch end even
without recovery, when Bytewax pickles nothing, so no transaction grows for ever), saves only the file's name and the generation ``S`` just
closed, and starts generation ``S + 1``. Every row records the generation it was written in (``born``)
and the one it was taken out in (``died``; a live row has none). Resuming from a pickle of generation
``S`` first rolls the file back to it: rows born after ``S`` are deleted and rows that died after ``S``
live again - exactly the rows that snapshot's in-memory windows do not hold. A fresh start (no snapshot to
resume from) wipes the partition's file.

Dead rows are deleted for good only :data:`KEEP_GENERATIONS` generations after they died: Bytewax may resume
from an epoch before the newest snapshot this process pickled (a crash between our commit and Bytewax's,
or a cluster whose workers committed different epochs), and rolling back to it must find them. A resume
from further back than that is refused with an error rather than silently losing windows.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import re
import sqlite3
import uuid
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from flows.windowing import DUE_KEYS, Cold, DueKey
from rtrl.errors import RtrlError

#: generations a dead row is kept for rollback (see the module docstring)
KEEP_GENERATIONS = 16

_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS windows (tid TEXT NOT NULL, state TEXT NOT NULL, value BLOB, ready INTEGER, "
    "deadline INTEGER, retention INTEGER, expiry INTEGER, first INTEGER, born INTEGER NOT NULL, died INTEGER)",
    "CREATE UNIQUE INDEX IF NOT EXISTS live_tid ON windows (tid) WHERE died IS NULL",
    "CREATE INDEX IF NOT EXISTS dead ON windows (died) WHERE died IS NOT NULL",
] + [
    f"CREATE INDEX IF NOT EXISTS due_{k} ON windows ({k}, tid) WHERE died IS NULL AND {k} IS NOT NULL" for k in DUE_KEYS
]
_COLUMNS = "rowid, tid, state, value, ready, deadline, retention, expiry, first, born"


#: the state files this process holds open: :func:`prune` never opens one (closing any descriptor of a file
#: drops the process's SQLite locks on it)
_HELD: Counter[Path] = Counter()

#: the name of a state file: :func:`partition_file`'s
STATE_FILE = re.compile(r"^partition-\d+(-[0-9a-f]+)?\.sqlite$")


class StateError(RtrlError):
    """The reward flow's spilled window state cannot be used (missing, foreign, corrupt or too old)."""


def partition_file(state_dir: str | Path, partition: int, run: str = "") -> Path:
    """The state file of Kafka partition ``partition`` in ``state_dir`` (of one run of the flow, when ``run`` is
    given: a flow started afresh, e.g. a plain ``bytewax.run`` without recovery, then never overwrites the file a
    recovery snapshot of another run refers to; its own file stays behind, in the folder a fresh ``rtrl run``
    clears)."""
    return Path(state_dir) / (f"partition-{partition}-{run}.sqlite" if run else f"partition-{partition}.sqlite")


class SqliteStore:
    """A :class:`flows.windowing.ColdStore` in one SQLite file (see the module docstring).

    Make one with :meth:`fresh` (a new file, any old one wiped) or get one back from a pickle and call
    :meth:`resume` (rolls the file back to the pickle's generation) before use."""

    def __init__(self, path: Path, run: str, snapshot: int):
        self.path = Path(path)
        self.run = run  # names the lineage of snapshots this file belongs to
        self.snapshot = snapshot  # the generation the last pickle closed (-1: none yet)
        self.generation = snapshot + 1  # the generation being written
        self._db: sqlite3.Connection | None = None
        self._lock: weakref.finalize | None = None  # releases the shared flock that makes retention keep the file
        self._live = 0
        self._min: dict[str, int | None] = {}  # cached min_due per key (absent: ask the file)
        self._dirty = False  # written since the last checkpoint

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def fresh(cls, path: str | Path) -> SqliteStore:
        """A new, empty store at ``path`` (an old file there and its WAL are deleted: a fresh start)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        for f in _companions(p):
            f.unlink(missing_ok=True)
        store = cls(p, uuid.uuid4().hex, -1)
        db = store._connect()
        db.executemany("INSERT INTO meta VALUES (?, ?)", [("run", store.run), ("snapshot", "-1"), ("purged", "-1")])
        db.execute("COMMIT")
        db.execute("BEGIN")
        return store

    def resume(self, path: str | Path | None = None) -> SqliteStore:
        """Open the file (at ``path`` when given: the state folder may have moved) and roll it back to this
        store's snapshot generation. Raises :class:`StateError` naming the file, ``flow.state_dir`` and the likely
        cause when it is missing, not a state file, of another run, or older than the snapshot."""
        if path is not None:
            self.path = Path(path)
        p = self.path
        if not p.exists():
            raise StateError(
                f"the reward flow's window state file {p} is missing, but the recovery snapshot being resumed "
                f"refers to it; likely cause: flow.state_dir was changed or its folder deleted, or the recovery "
                f"folder was copied without it. Fix: point flow.state_dir at the folder holding it (keep it beside "
                f"the recovery folder, on the same volume), or delete the recovery folder to start afresh"
            )
        try:
            db = self._connect()
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as e:
            raise StateError(
                f"the reward flow's window state file {p} (in flow.state_dir) cannot be read: {e}; likely cause: "
                f"it was overwritten or corrupted. Fix: restore it with its recovery folder, or delete both to start "
                f"afresh"
            ) from None
        if meta.get("run") != self.run:
            raise StateError(
                f"the reward flow's window state file {p} (in flow.state_dir) belongs to another run than the "
                f"recovery snapshot being resumed; likely cause: the flow was started afresh (or with another "
                f"recovery folder) over the same flow.state_dir. Fix: use the recovery folder and state folder of "
                f"one run together, or delete both to start afresh"
            )
        committed, purged = int(meta["snapshot"]), int(meta["purged"])
        if committed < self.snapshot or purged > self.snapshot:
            raise StateError(
                f"the reward flow's window state file {p} (in flow.state_dir) holds generations {purged + 1}.."
                f"{committed}, not the recovery snapshot's {self.snapshot}; likely cause: an older copy of the "
                f"file, or a recovery folder restored from a backup older than it. Fix: restore both from the "
                f"same backup, or delete both to start afresh"
            )
        s = self.snapshot
        db.execute("DELETE FROM windows WHERE born > ?", (s,))
        db.execute("UPDATE windows SET died = NULL WHERE died IS NOT NULL AND died > ?", (s,))
        db.execute("UPDATE meta SET value = ? WHERE key = 'snapshot'", (str(s),))
        db.execute("COMMIT")
        db.execute("BEGIN")
        self.generation = s + 1
        self._min.clear()
        self._live = db.execute("SELECT count(*) FROM windows WHERE died IS NULL").fetchone()[0]
        return self

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        if self._lock is None:  # a flock is apart from SQLite's own fcntl locks on a local file system
            fd, held = os.open(self.path, os.O_RDONLY), self.path.resolve()
            fcntl.flock(fd, fcntl.LOCK_SH)
            _HELD[held] += 1
            self._lock = weakref.finalize(self, _release, fd, held)  # at close(), or when the store is collected
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a commit (at each snapshot) is on disk when it returns
        for stmt in _SCHEMA:
            db.execute(stmt)
        db.execute("BEGIN")
        self._db = db
        return db

    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise StateError(f"window state {self.path} was restored from a snapshot but not resumed (call resume())")
        return self._db

    def checkpoint(self) -> int:
        """Commit generation ``generation`` durably and start the next; returns the generation committed. With
        nothing written since the last one, nothing changes (no write, no fsync): that one is returned."""
        if not self._dirty:
            return self.snapshot
        db, s = self.db(), self.generation
        purge = s - KEEP_GENERATIONS
        if purge >= 0:
            db.execute("DELETE FROM windows WHERE died IS NOT NULL AND died <= ?", (purge,))
            db.execute("UPDATE meta SET value = ? WHERE key = 'purged'", (str(purge),))
        db.execute("UPDATE meta SET value = ? WHERE key = 'snapshot'", (str(s),))
        db.execute("COMMIT")
        db.execute("BEGIN")
        self.snapshot, self.generation, self._dirty = s, s + 1, False
        return s

    def close(self) -> None:
        try:
            if self._db is not None:
                db, self._db = self._db, None
                try:
                    db.execute("ROLLBACK")  # what the last snapshot did not commit is not state
                finally:
                    db.close()
        finally:
            if self._lock is not None:
                self._lock()
                self._lock = None

    def __getstate__(self) -> dict[str, Any]:
        # pickling is Bytewax's snapshot: commit what the pickle's windows rely on, and name its generation
        # (the flow's snapshot() has just checkpointed: then nothing is new and the generation is that one)
        snapshot = self.checkpoint() if self._db is not None else self.snapshot
        return {"path": str(self.path), "run": self.run, "snapshot": snapshot}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(Path(state["path"]), state["run"], state["snapshot"])  # type: ignore[misc]

    # ------------------------------------------------------------ ColdStore

    def __len__(self) -> int:
        return self._live

    def put(self, rows: Sequence[Cold]) -> None:
        g = self.generation
        self.db().executemany(
            "INSERT INTO windows (tid, state, value, ready, deadline, retention, expiry, first, born) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    r.tid,
                    r.state,
                    None if r.value is None else pickle.dumps(r.value, pickle.HIGHEST_PROTOCOL),
                    r.ready,
                    r.deadline,
                    r.retention,
                    r.expiry,
                    r.first,
                    g,
                )
                for r in rows
            ],
        )
        self._live += len(rows)
        self._dirty = True
        for k, cached in list(self._min.items()):
            values = [v for r in rows if (v := getattr(r, k)) is not None]
            if values and (cached is None or min(values) < cached):
                self._min[k] = min(values)

    def _kill(self, found: list[tuple]) -> list[Cold]:
        """Take rows out: delete those written in this generation (no snapshot holds them), mark the rest."""
        db, g = self.db(), self.generation
        db.executemany("DELETE FROM windows WHERE rowid = ?", [(f[0],) for f in found if f[9] == g])
        db.executemany("UPDATE windows SET died = ? WHERE rowid = ?", [(g, f[0]) for f in found if f[9] != g])
        self._live -= len(found)
        self._dirty = True
        rows = [Cold(f[1], f[2], None if f[3] is None else pickle.loads(f[3]), *f[4:9]) for f in found]
        for k, cached in list(self._min.items()):
            if cached is not None and any(getattr(r, k) == cached for r in rows):
                del self._min[k]  # the smallest may be gone: ask again
        return rows

    def min_due(self, key: DueKey) -> int | None:
        if key not in self._min:
            self._min[key] = (
                self.db()
                .execute(f"SELECT min({key}) FROM windows WHERE died IS NULL AND {key} IS NOT NULL")
                .fetchone()[0]
            )
        return self._min[key]

    def take(self, tid: str) -> Cold | None:
        found = self.db().execute(f"SELECT {_COLUMNS} FROM windows WHERE tid = ? AND died IS NULL", (tid,)).fetchall()
        return self._kill(found)[0] if found else None

    def take_due(self, key: DueKey, until: int, limit: int) -> list[Cold]:
        assert key in DUE_KEYS
        found = (
            self.db()
            .execute(
                f"SELECT {_COLUMNS} FROM windows WHERE died IS NULL AND {key} IS NOT NULL AND {key} <= ? "
                f"ORDER BY {key}, tid LIMIT ?",
                (until, limit),
            )
            .fetchall()
        )
        return self._kill(found) if found else []


# ---------------------------------------------------------------- retention


def _release(fd: int, held: Path) -> None:
    _HELD[held] -= 1
    if _HELD[held] <= 0:
        del _HELD[held]
    os.close(fd)  # releases the flock


#: a state file's name as a snapshot holds it: each :class:`SqliteStore` pickles its path as text
_REFERENCE = re.compile(rb"partition-\d+(?:-[0-9a-f]+)?\.sqlite")


def referenced(recovery_dirs: Iterable[str | Path]) -> set[str]:
    """The names of the state files that the snapshots in these Bytewax recovery folders refer to (their
    ``process-*`` subfolders included). The snapshots' raw bytes are searched for state file names: nothing in
    them is built or run, and a name found by chance only keeps a file longer.

    Bytewax files a snapshot on any partition of the cluster's recovery store, not on the process that owns it.
    So every partition must be in these folders. Raises :class:`StateError` when one is missing or a snapshot
    cannot be read: then no file can be known unused."""
    names: set[str] = set()
    for folder in recovery_dirs:
        parts: dict[int, int] = {}  # partition index -> partition count
        for db in sorted(Path(folder).rglob("part-*.sqlite3")):
            try:
                with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as c:
                    parts.update((int(i), int(n)) for i, n in c.execute("SELECT part_index, part_count FROM parts"))
                    for (blob,) in c.execute("SELECT ser_change FROM snaps WHERE ser_change IS NOT NULL"):
                        names.update(m.decode() for m in _REFERENCE.findall(blob))
            except sqlite3.Error as e:
                raise StateError(
                    f"the recovery snapshots in {db} cannot be read ({e}), so no window state file can be known "
                    "unused; nothing is deleted. Fix: restore or delete that recovery folder"
                ) from None
        counts = set(parts.values())
        if parts and (len(counts) != 1 or set(parts) != set(range(max(counts)))):
            raise StateError(
                f"the recovery folder {folder} holds partitions {sorted(parts)} of a store of {max(counts)}; the "
                "others are on other volumes and may refer to files here, so none can be known unused; nothing is "
                "deleted. Fix: none needed, a cluster with a volume per process leaves no unused files behind"
            )
    return names


def exclusive(path: Path, flags: int = os.O_RDONLY) -> int | None:
    """An exclusive flock on ``path`` when no one holds a flock on it: its descriptor, to close when done."""
    fd = os.open(path, flags)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def in_use(path: Path) -> bool:
    """Whether a running flow holds the state file ``path`` open (its shared flock)."""
    if path.resolve() in _HELD:
        return True
    try:
        fd = exclusive(path)
    except FileNotFoundError:
        return False
    if fd is None:
        return True
    os.close(fd)
    return False


def _companions(path: Path) -> list[Path]:
    return [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]


def prune(
    state_dir: str | Path, recovery_dirs: Iterable[str | Path], days: float, now_s: float, dry_run: bool = False
) -> list[Path]:
    """Delete the state files in ``state_dir`` that no running flow holds, no snapshot in ``recovery_dirs``
    refers to and nothing wrote for ``days`` days (0: keep all), with their WAL and shared-memory files;
    return them. Another file in the folder is never touched."""
    folder = Path(state_dir)
    if days <= 0 or not folder.is_dir():
        return []
    live = referenced(recovery_dirs)
    gone = []
    for path in sorted(folder.iterdir()):
        if not STATE_FILE.match(path.name) or path.name in live:
            continue
        written = max((f.stat().st_mtime for f in _companions(path) if f.exists()), default=now_s)
        if now_s - written < days * 86_400 or in_use(path):
            continue
        gone.append(path)
        if not dry_run:
            for f in _companions(path):
                f.unlink(missing_ok=True)
    return gone
