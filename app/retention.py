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

A reward flow prunes its own state folder's spill files as it starts. It never deletes a recovery folder: a
stopped flow's folder goes with `rtrl retention apply` on its volume. Spill files are pruned only where every
partition of the recovery store is reachable, since a snapshot may be filed on any of them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows import spill
from rtrl import clickhouse
from rtrl.settings import Settings
from schemas.records import Checkpoint
from trainer.registry import registry_dir

if TYPE_CHECKING:
    from app.flow_state import Flow


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
    """Hold a shared flock on the recovery folder ``folder`` (made if missing) while a flow uses it: retention
    keeps it. A folder deleted while this waited for the lock is made again and locked anew."""
    from rtrl.files import private_dir

    while True:
        fd = os.open(private_dir(folder), os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.stat(folder).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def recovery_folders(roots: Iterable[Path]) -> list[Path]:
    """The Bytewax recovery folders under ``roots``: those holding ``part-*.sqlite3`` files."""
    return sorted({f.parent for root in roots if root.is_dir() for f in root.rglob("part-*.sqlite3")})


def _written(folder: Path) -> float:
    return max((f.stat().st_mtime for f in folder.iterdir() if f.is_file()), default=0.0)


def prune_state(
    settings: Settings, now_s: float, flows: Sequence[Flow], dry_run: bool = False
) -> tuple[list[Path], list[Path]]:
    """Delete the ``flows``' recovery folders and spill files retention does not keep (the module docstring says
    which); return them. A cluster's ``process-*`` folders go together or not at all: each is locked while they
    go. The windowed flows' snapshots refer to the spill files."""
    from app.flow_state import recovery_path

    days = settings.retention.state_days
    if days <= 0:
        return [], []
    gone: list[Path] = []
    windowed = {recovery_path(settings, f) for f in flows if f.windowed}
    references = sorted(windowed)
    for root in (recovery_path(settings, f) for f in flows):
        folders = recovery_folders([root])
        if not folders or any(now_s - _written(f) < days * 86_400 for f in folders):
            continue
        locks: list[int] = []
        try:
            for f in folders:
                fd = spill.exclusive(f, os.O_RDONLY | os.O_DIRECTORY)
                if fd is None:
                    break
                locks.append(fd)
            else:
                gone += folders
                if root in windowed:
                    references.remove(root)  # its snapshots go: they refer to nothing any more
                if not dry_run:
                    for f in folders:
                        shutil.rmtree(f)
        finally:
            for fd in locks:
                os.close(fd)
    return gone, spill.prune(settings.state_root, references, days, now_s, dry_run)


def prune_at_start(settings: Settings, flow: Flow) -> list[Path]:
    """The windowed ``flow``'s unused spill files, pruned as it starts, before Bytewax opens its recovery store. A
    failure is logged, never raised: retention must not stop the flow."""
    import logging
    import time

    from app.flow_state import recovery_path

    try:
        r = [recovery_path(settings, flow)]
        return spill.prune(settings.state_root, r, settings.retention.state_days, time.time())
    except Exception as e:  # noqa: BLE001
        logging.getLogger(__name__).warning("retention of the %s flow's spill files skipped: %s", flow.name, e)
        return []
