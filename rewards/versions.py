"""Reward versions as data: defined in TOML or the settings tree, registered in ClickHouse, immutable once used.

A version is a name, a full set of weights (a :class:`~rewards.functions.RewardConfig`), the version it was
derived from, why it exists and who defined it. Three places define versions, merged by :func:`registry`:

- the built-in ones in code (:data:`BUILTIN`: ``v2`` and the historical ``v1-discard-broken``);
- ``rewards.file``: a TOML file with one ``[versions.NAME]`` table per version (read once, when the settings
  load: :func:`rtrl.sections.rewards.read_reward_file`; this module reads no file, no clock, nothing);
- ``rewards.define``: ``[rewards.define.NAME]`` tables in the settings file (or ``RTRL_REWARDS__DEFINE`` as JSON).

Each table names a ``parent`` (built in or defined in either place), a ``reason``, an ``author`` and the
``weights`` that differ from the parent's, e.g.::

    [versions.v3-broken-harsher]
    parent = "v2"
    reason = "broken tool calls still pay off on hard tasks: make each one cost twice as much"
    author = "reward-team@example.com"
    weights = { w_broken = 0.5 }

The version's **checksum** is the sha256 of the canonical JSON of all of its weights (the parent's
included), so it changes exactly when what the version computes changes. :func:`register` writes each
version to ClickHouse ``reward_versions`` (flows.reward_versions); a name that has scored anything (a row in
``rewards``) is
immutable: registering other weights under it is refused with the fix (a new name). Built-in names can
never be redefined. Defining a version changes no code: add a table, list it in ``rewards.versions`` (the
reward flow shadow-scores every listed version) or backfill it (``rtrl backfill``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rewards.functions import V1_DISCARD_BROKEN, V2, RewardConfig
from rtrl.errors import ConfigError
from rtrl.sections.rewards import RewardDefinition
from rtrl.settings import Settings
from schemas.records import RewardVersionRecord

#: the weights of a version: every RewardConfig field but its name, in declaration order
WEIGHTS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RewardConfig) if f.name != "version")
_TYPES: dict[str, Any] = {f.name: f.type for f in dataclasses.fields(RewardConfig)}
#: weights added after versions were first registered, with the release that added them. Each enters the
#: canonical JSON (and so the checksum) only where a version sets it to something other than its default, so a
#: version registered before it keeps its checksum on upgrade. This is sound because each one only scores events
#: that did not exist before it (w_checkin and w_verdict: the task_checkin and task_verdict events of background
#: tasks, issue 16), so no trajectory a version scored before the upgrade scores differently after it.
#: Each value is the weight's default when it was added, frozen here: were a default changed later, versions
#: that use the old value would keep their checksum while scoring differently.
LATER_WEIGHTS: dict[str, float] = {"w_checkin": 0.3, "w_verdict": 1.0}  # added by issue 16
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class RewardVersion:
    """A named reward version: its weights and where it came from."""

    config: RewardConfig
    parent: str = ""
    reason: str = ""
    author: str = ""
    builtin: bool = False
    source: str = "built in"  # where it was defined, for messages ("rewards.define.v3", "versions.toml")

    @property
    def name(self) -> str:
        return self.config.version

    @property
    def weights(self) -> dict[str, Any]:
        return {k: getattr(self.config, k) for k in WEIGHTS}

    @property
    def weights_json(self) -> str:
        """All weights as canonical JSON: sorted keys, no spaces, floats as Python writes them (a weight of
        :data:`LATER_WEIGHTS` at its default is left out, so older versions keep their checksums)."""
        weights = {k: v for k, v in self.weights.items() if not (k in LATER_WEIGHTS and v == LATER_WEIGHTS[k])}
        return json.dumps(weights, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @property
    def checksum(self) -> str:
        """sha256 (hex) of :attr:`weights_json`: equal checksums score every trajectory alike."""
        return hashlib.sha256(self.weights_json.encode()).hexdigest()

    def record(self, now_ms: int) -> RewardVersionRecord:
        return RewardVersionRecord(
            name=self.name,
            checksum=self.checksum,
            weights=self.weights_json,
            parent=self.parent,
            reason=self.reason,
            author=self.author,
            builtin=self.builtin,
            registered_at=now_ms,
        )


BUILTIN: dict[str, RewardVersion] = {
    v.name: v
    for v in (
        RewardVersion(
            V2,
            parent="v1-discard-broken",
            reason="broken tool calls are negative, never discarded; asking instead of editing is capped at the "
            "neutral baseline and unneeded questions cost",
            author="rtrl",
            builtin=True,
        ),
        RewardVersion(
            V1_DISCARD_BROKEN,
            reason="the historical buggy version, kept to reproduce both reward hacks: it discards trajectories with "
            "a broken tool call and lets a clarifying question stand in for an edit",
            author="rtrl",
            builtin=True,
        ),
    )
}
"""The versions shipped in code; their names can never be redefined."""


def _coerce(name: str, value: Any, where: str) -> Any:
    kind = _TYPES[name]
    fix = f"fix: give {where}.weights.{name} a"
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}.weights.{name} = {value!r} is not true or false; {fix} boolean")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise ConfigError(f"{where}.weights.{name} = {value!r} is not a whole number; {fix} whole number")
        return int(value)
    if value is None and "None" in kind:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}.weights.{name} = {value!r} is not a number; {fix} number")
    return float(value)


def derive(name: str, parent: RewardConfig, weights: Mapping[str, Any], where: str) -> RewardConfig:
    """``parent``'s weights with ``weights`` changed, named ``name``; errors name ``where`` and the fix."""
    for key in weights:
        if key not in WEIGHTS:
            close = difflib.get_close_matches(key, WEIGHTS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"{where}.weights.{key} is not a reward weight; {hint}fix: use one of {', '.join(WEIGHTS)}"
            )
    changed = {k: _coerce(k, v, where) for k, v in weights.items()}
    try:
        return dataclasses.replace(parent, version=name, **changed)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}; fix: change that weight") from None


class Registry(Mapping[str, RewardVersion]):
    """Every reward version known to one settings tree, by name (a read-only mapping)."""

    def __init__(self, versions: Iterable[RewardVersion]):
        self._by_name = {v.name: v for v in versions}

    def __getitem__(self, name: str) -> RewardVersion:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def check(self, names: Sequence[str], setting: str = "rewards.versions") -> None:
        """Raise :class:`ConfigError` naming ``setting`` when a name is not a version here."""
        unknown = [n for n in names if n not in self._by_name]
        if unknown:
            raise ConfigError(
                f"setting {setting} = {list(names)} names unknown reward versions {unknown}; fix: use "
                f"{', '.join(sorted(self._by_name))}, or define the version in rewards.file or rewards.define"
                + (f" (RTRL_{setting.upper().replace('.', '__')})" if re.fullmatch(r"rewards\.\w+", setting) else "")
            )

    def configs(self, names: Sequence[str], setting: str = "rewards.versions") -> list[RewardConfig]:
        self.check(names, setting)
        return [self._by_name[n].config for n in names]

    def select(self, names: Sequence[str], setting: str = "rewards.versions") -> list[RewardVersion]:
        self.check(names, setting)
        return [self._by_name[n] for n in names]


def registry(settings: Settings) -> Registry:
    """The built-in versions, then ``rewards.file``'s, then ``rewards.define``'s; parents may be defined in
    any order. Refused with the setting and the fix: a redefined built-in name, a name defined in both
    places, an unknown parent or a cycle, an unknown weight, a weight out of range."""
    rs = settings.rewards
    defs: dict[str, tuple[RewardDefinition, str]] = {}
    if rs.file:
        defs |= {n: (d, f"{rs.file} [versions.{n}]") for n, d in rs.file_versions.items()}
    for n, d in rs.define.items():
        if n in defs:
            raise ConfigError(
                f"reward version {n!r} is defined both in rewards.file ({rs.file}) and in rewards.define; fix: keep one"
            )
        defs[n] = (d, f"rewards.define.{n}")
    known: dict[str, RewardVersion] = dict(BUILTIN)
    for n, (_, where) in defs.items():
        if n in BUILTIN:
            raise ConfigError(
                f"{where} redefines the built-in reward version {n!r}, which is immutable; fix: choose a new name"
            )
        if not _NAME.match(n):
            raise ConfigError(
                f"{where}: {n!r} is not a valid version name; fix: use 1-64 letters, digits, '.', '_' or '-'"
            )
    pending = dict(defs)
    while pending:
        ready = [n for n, (d, _) in pending.items() if d.parent in known]
        if not ready:
            n, (d, where) = next(iter(pending.items()))
            why = "a cycle of parents" if d.parent in pending else "an unknown version"
            raise ConfigError(
                f"{where}.parent = {d.parent!r} is {why}; fix: use one of {', '.join(sorted(known))} "
                "or a version defined without a cycle"
            )
        for n in ready:
            d, where = pending.pop(n)
            config = derive(n, known[d.parent].config, d.weights, where)
            known[n] = RewardVersion(config, parent=d.parent, reason=d.reason, author=d.author, source=where)
    return Registry(known.values())
