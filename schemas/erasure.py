"""The deny list of erased subjects (issue 38): pure logic, read from ClickHouse by rtrl.clickhouse.deny_list.

``rtrl erase`` (app/erasure.py) deletes a user's or an organisation's data from every store, then keeps it out:
each consumer skips a record whose user, organisation or trajectory is on this list. So a replay of Kafka or a
backfill brings none of it back. The list holds the users' salted hashes, never a raw id.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Protocol

_HEX32 = re.compile(rb"[0-9a-f]{32}")  # a salted user hash, as the SDK writes it
_QUOTED = re.compile(rb'"((?:[^"\\]|\\.){1,256})"')  # a JSON string, its escapes skipped whole


@dataclass(frozen=True)
class DenyList:
    """Erased users (salted hashes), organisations and their trajectories."""

    users: frozenset[str] = frozenset()
    orgs: frozenset[str] = frozenset()
    trajectories: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.users or self.orgs or self.trajectories)

    def denies(self, trajectory_id: str, org_id: str = "", user_hash: str = "") -> bool:
        """Whether a record of this trajectory, organisation or user belongs to an erased subject."""
        return (
            trajectory_id in self.trajectories
            or (bool(org_id) and org_id in self.orgs)
            or (bool(user_hash) and user_hash in self.users)
        )

    def names(self, payload: bytes | None, key: bytes | str | None = None) -> bool:
        """Whether a record that could not be decoded names an erased subject. It has no fields to read, so its
        text is searched: a denied user's hash anywhere, or a denied trajectory or organisation as a quoted
        string. Its Kafka key, a trajectory id, is checked too. It errs on the side of skipping."""
        if not self:
            return False
        k = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        if k and k in self.trajectories:
            return True
        if not payload:
            return False
        if self.users and any(h.decode() in self.users for h in _HEX32.findall(payload)):
            return True
        named = self.trajectories | self.orgs
        return bool(named) and any(q.decode("utf-8", "replace") in named for q in _QUOTED.findall(payload))

    def current(self) -> DenyList:
        """This list (a fixed list is its own source: see rtrl.clickhouse.DenyWatch)."""
        return self


def erasure_id(kind: str, subject: str) -> str:
    """The stable id of one subject's erasure: a rerun, or a resume after a crash, writes under the same id."""
    return hashlib.sha256(f"{kind}:{subject}".encode()).hexdigest()[:16]


class DenySource(Protocol):
    """Where a consumer reads the deny list: a fixed :class:`DenyList`, or rtrl.clickhouse.DenyWatch."""

    def current(self) -> DenyList: ...
