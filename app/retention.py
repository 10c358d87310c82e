"""Retention of checkpoints, the model registry and the flows' state (issue 38; `rtrl retention apply`).

A version's Megatron checkpoint and its registry export are deleted once it is none of these:

- one of the newest ``retention.checkpoints_keep`` versions;
- the serving version: the one most recently promoted;
- one of its ``retention.rollback_versions`` nearest promoted ancestors, which `rtrl rollback` may re-promote.

Only folders inside the data folder or the registry are deleted; a checkpoint elsewhere is left to its owner.

The flows' state is deleted once nothing wrote it for ``retention.state_days``:

- a recovery folder that no running flow holds (a flow holds a shared ``flock`` on its folder: :func:`hold`);
- a spill file of the reward flow that no running flow holds and no kept snapshot refers to
  (:func:`flows.spill.prune`).

A running flow prunes its own state folder's spill files at its start and every hour. It never deletes a
recovery folder: a stopped flow's folder goes with `rtrl retention apply` on its volume.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flows import spill
from rtrl import clickhouse
from rtrl.settings import Settings
from schemas.records import Checkpoint
from trainer.registry import registry_dir


def serving(latest: dict[int, Checkpoint]) -> int | None:
    """The serving version: the one whose latest decision is the most recent promotion."""
    promoted = [c for c in latest.values() if c.status == "promoted"]
    return max(promoted, key=lambda c: (c.created_at, c.version)).version if promoted else None


def kept(latest: dict[int, Checkpoint], keep_last: int, rollback_versions: int) -> set[int]:
    """The versions retention keeps, from each version's latest decision (pure)."""
    if keep_last <= 0:
        return set(latest)
    keep = set(sorted(latest)[-keep_last:])
    current = serving(latest)
    if current is not None:
        keep.add(current)
        parent, found = latest[current].parent, 0
        while parent is not None and parent in latest and found < rollback_versions:
            if latest[parent].status == "promoted":
                keep.add(parent)
                found += 1
            parent = latest[parent].parent
    return keep


def _inside(path: Path, roots: Iterable[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved != r and resolved.is_relative_to(r) for r in roots)


def prune_checkpoints(settings: Settings, client: Any, dry_run: bool = False) -> list[int]:
    """Delete the checkpoint folders and registry exports of the versions retention does not keep; return them."""
    latest = {c.version: c for c in clickhouse.select(client, settings.clickhouse.database, "checkpoints")}
    r = settings.retention
    keep = kept(latest, r.checkpoints_keep, r.rollback_versions)
    registry = registry_dir(settings)
    roots = [settings.data_path.resolve(), registry.resolve()]
    gone = []
    for version in sorted(set(latest) - keep):
        folders = [Path(p) for p in (latest[version].path, latest[version].export_path) if p and "://" not in p]
        folders.append(registry / f"v{version}")
        here = [f for f in folders if f.exists() and _inside(f, roots)]
        if not here:
            continue
        gone.append(version)
        if not dry_run:
            for f in here:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    return gone


@contextmanager
def hold(folder: Path) -> Iterator[None]:
    """Hold a shared flock on the recovery folder ``folder`` while a flow runs on it: retention keeps it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _held(folder: Path) -> bool:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def recovery_roots(settings: Settings) -> list[Path]:
    """Both flows' recovery folders (each may hold a cluster's ``process-*`` subfolders)."""
    from app.parts import recovery_path

    return [recovery_path(settings, name) for name in ("rewards", "batches")]


def recovery_folders(roots: Iterable[Path]) -> list[Path]:
    """The Bytewax recovery folders under ``roots``: those holding ``part-*.sqlite3`` files."""
    return sorted({f.parent for root in roots if root.is_dir() for f in root.rglob("part-*.sqlite3")})


def _written(folder: Path) -> float:
    return max((f.stat().st_mtime for f in folder.iterdir() if f.is_file()), default=0.0)


def prune_state(settings: Settings, now_s: float, dry_run: bool = False) -> tuple[list[Path], list[Path]]:
    """Delete the recovery folders and spill files retention does not keep (the module docstring says which);
    return them."""
    days = settings.retention.state_days
    if days <= 0:
        return [], []
    folders = recovery_folders(recovery_roots(settings))
    old = [f for f in folders if now_s - _written(f) >= days * 86_400 and not _held(f)]
    if not dry_run:
        for f in old:
            shutil.rmtree(f)
    kept_folders = [f for f in folders if f not in old]
    return old, spill.prune(settings.state_root, kept_folders, days, now_s, dry_run)


class StatePruner:
    """Prunes the reward flow's unused spill files now and every ``every_s`` seconds, in a daemon thread."""

    def __init__(self, settings: Settings, every_s: float = 3600.0):
        self.settings, self.every_s, self.stop = settings, every_s, threading.Event()
        self.prune()
        self.thread = threading.Thread(target=self._run, name="rtrl-state-retention", daemon=True)
        self.thread.start()

    def prune(self) -> list[Path]:
        """One pass; a failure is logged, never raised: retention must not stop the flow (it retries next time)."""
        import logging
        import time

        s = self.settings
        try:
            return spill.prune(s.state_root, recovery_roots(s), s.retention.state_days, time.time())
        except Exception as e:  # noqa: BLE001
            logging.getLogger(__name__).warning("retention of the reward flow's spill files skipped: %s", e)
            return []

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.prune()

    def close(self) -> None:
        self.stop.set()
