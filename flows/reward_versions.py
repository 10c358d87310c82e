"""ClickHouse's record of reward versions (table ``reward_versions``): what rewards.versions defines, registered.

:func:`register` writes each version with its checksum; a name that has scored anything (a row in ``rewards``)
is immutable, so registering other weights under it is refused with the fix. The reward flow's ClickHouse sink
registers the versions it scores before its first write, ``rtrl run`` before anything starts, and
``rtrl backfill`` the version it backfills.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from rewards.versions import Registry, RewardVersion, registry
from rtrl import clickhouse
from rtrl.errors import ConfigError
from rtrl.settings import Settings
from schemas.records import RewardVersionRecord


class RewardVersionImmutable(ConfigError):
    """A version that has scored trajectories was given other weights under the same name."""


def registered(client: Any, database: str) -> dict[str, RewardVersionRecord]:
    """The newest registration of every version in ClickHouse ``reward_versions``."""
    return {r.name: r for r in clickhouse.select(client, database, "reward_versions")}


def scored(client: Any, database: str, name: str) -> int:
    """Trajectories that version ``name`` has rewarded (rows of ``rewards``, revisions collapsed)."""
    return int(
        client.query(
            f"SELECT count() FROM {database}.rewards FINAL WHERE reward_version = {{v:String}}",
            parameters={"v": name},
        ).result_rows[0][0]
    )


def register(client: Any, database: str, versions: Iterable[RewardVersion], now_ms: int | None = None) -> list[str]:
    """Record each version in ``reward_versions`` (idempotent); return the names registered now.

    A name already registered with the same checksum is left alone. With another checksum it is
    registered again only while it has scored nothing; otherwise :class:`RewardVersionImmutable`."""
    have = registered(client, database)
    now_ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    new = []
    for v in versions:
        old = have.get(v.name)
        if old is not None and old.checksum == v.checksum:
            continue
        if old is not None:
            n = scored(client, database, v.name)
            if n:
                raise RewardVersionImmutable(
                    f"reward version {v.name!r} ({v.source}) has checksum {v.checksum[:12]}, but {database}."
                    f"reward_versions holds it with checksum {old.checksum[:12]} and it has scored {n:,} "
                    f"trajectories: a version that scored anything is immutable; fix: define these weights under "
                    f"a new name (parent = {v.name!r}) and use that name"
                )
        new.append(v.record(now_ms))
    clickhouse.insert(client, database, "reward_versions", new)
    return [r.name for r in new]


def register_settings(settings: Settings, names: Sequence[str] | None = None, client: Any = None) -> Registry:
    """Check ``rewards.versions`` (or ``names``) against the registry and register them in ClickHouse;
    with no ``client``, one is set up from the settings for the call."""
    reg = registry(settings)
    chosen = reg.select(list(settings.rewards.versions if names is None else names))
    own = client is None
    if own:
        client = clickhouse.setup_from(settings)
    try:
        register(client, settings.clickhouse.database, chosen)
    finally:
        if own and not settings.clickhouse_dsn.startswith("chdb://"):  # an embedded engine stays with the process
            client.close()
    return reg
