"""Retention of checkpoints and the model registry (issue 38; `rtrl retention apply`).

A version's Megatron checkpoint and its registry export are deleted once it is none of these:

- one of the newest ``retention.checkpoints_keep`` versions;
- the serving version: the one most recently promoted;
- one of its ``retention.rollback_versions`` nearest promoted ancestors, which `rtrl rollback` may re-promote.

Only folders inside the data folder or the registry are deleted; a checkpoint elsewhere is left to its owner.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
