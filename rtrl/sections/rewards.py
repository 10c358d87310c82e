"""The rewards section, and reward versions defined as data (:mod:`rewards.versions`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import NoDecode

from rtrl.section import Section, setting


class RewardDefinition(Section):
    """A reward version defined as data: a parent version and the weights it changes (rewards.versions)."""

    parent: str = setting(
        "v2", "version whose weights this one starts from (built in, or defined before it)", min_length=1
    )
    reason: str = setting(..., "why this version exists, e.g. 'broken tool calls are negative'", min_length=1)
    author: str = setting(..., "who defined it (a name or an address)", min_length=1)
    weights: dict[str, float | bool | None] = setting(
        {}, "weights that differ from the parent's (names: rewards.RewardConfig's fields, e.g. w_broken = 0.5)"
    )


def read_reward_file(path: str) -> dict[str, RewardDefinition]:
    """The ``[versions.NAME]`` tables of ``rewards.file``, checked (ValueError naming the file, the table and the
    fix). Read once, when the settings load, so every part of a process sees the same definitions."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"setting rewards.file = {str(path)!r} cannot be read ({e}); fix: point it at a UTF-8 TOML file"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"rewards.file {p} is not valid TOML: {e}; fix: correct the file") from None
    extra = set(data) - {"versions"}
    if extra or not isinstance(data.get("versions", {}), dict):
        raise ValueError(
            f"rewards.file {p} may hold only [versions.NAME] tables, found {sorted(extra) or 'versions'}; "
            "fix: put each version in a [versions.NAME] table"
        )
    out = {}
    for name, table in data.get("versions", {}).items():
        try:
            out[name] = RewardDefinition.model_validate(table)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ValueError(f"{p} [versions.{name}]: {problems}; fix: correct that table") from None
    return out


class RewardSettings(Section):
    """Which reward versions exist in the stream, and which one trains: the built-in ones (v2, v1-discard-broken),
    those of ``rewards.file`` and those of ``rewards.define`` (rewards.versions)."""

    versions: Annotated[list[str], NoDecode] = setting(
        ["v2"], "reward versions the reward flow computes (comma-separated in the environment)", min_length=1
    )
    train_version: str = setting("v2", "reward version the batch flow trains on; the reward flow must compute it")
    file: str = setting(
        "",
        "TOML file of reward versions, one [versions.NAME] table each (parent, reason, author, weights); empty = none",
    )
    define: dict[str, RewardDefinition] = setting(
        {}, "reward versions defined in the settings tree: [rewards.define.NAME] with parent, reason, author, weights"
    )
    train_schedule: dict[int, str] = setting(
        {},
        "switch the trained reward version at cycle boundaries: {cycle = version}, e.g. {3 = 'v2'} trains cycles "
        "3 and later on v2 (before the first entry: train_version); `rtrl rewards train V` switches at the next "
        "cycle instead and overrides this schedule until another request",
    )
    batch_versions: Annotated[list[str], NoDecode] = setting(
        [],
        "reward versions the batch flow makes micro-batches for besides train_version and the train_schedule's "
        "(each batch names its version; a trainer trains only its cycle's): the versions `rtrl rewards train` "
        "may switch to (comma-separated in the environment)",
    )

    def trainable(self) -> list[str]:
        """The versions the batch flow makes micro-batches for: train_version, the schedule's, batch_versions."""
        out = [self.train_version]
        for v in [self.train_schedule[c] for c in sorted(self.train_schedule)] + list(self.batch_versions):
            if v not in out:
                out.append(v)
        return out

    def scheduled(self, cycle: int) -> str:
        """The reward version the schedule gives cycle ``cycle`` (1 = the first trained cycle)."""
        due = [c for c in sorted(self.train_schedule) if c <= cycle]
        return self.train_schedule[due[-1]] if due else self.train_version

    _file_versions: dict[str, RewardDefinition] = PrivateAttr(default_factory=dict)

    @property
    def file_versions(self) -> dict[str, RewardDefinition]:
        """The versions of ``rewards.file``, as read when the settings loaded."""
        return self._file_versions

    @model_validator(mode="after")
    def _read_file(self) -> RewardSettings:
        self._file_versions = read_reward_file(self.file) if self.file else {}
        return self

    @field_validator("versions", "batch_versions", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [x.strip() for x in v.split(",") if x.strip()]
        return v

    @model_validator(mode="after")
    def _trained_is_computed(self) -> RewardSettings:
        if self.train_version not in self.versions:
            raise ValueError(
                f"rewards.train_version = {self.train_version!r} is not among rewards.versions = "
                f"{self.versions}: the batch flow would wait for rewards nobody computes; fix: add it "
                "to rewards.versions"
            )
        for v in self.trainable():
            if v not in self.versions:
                where = "rewards.batch_versions" if v in self.batch_versions else "rewards.train_schedule"
                raise ValueError(
                    f"{where} names {v!r}, which is not among rewards.versions = {self.versions}: no reward "
                    "flow computes it, so no micro-batch would carry it; fix: add it to rewards.versions"
                )
        if any(c < 1 for c in self.train_schedule):
            raise ValueError("rewards.train_schedule: cycles count from 1; fix: use cycle numbers >= 1")
        return self
