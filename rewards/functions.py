"""Pure, versioned reward functions (DESIGN.md, "Reward function").

``reward(features, config)`` turns one trajectory's :class:`~rewards.features.TrajectoryFeatures`
into a scalar reward made of named components that sum to it exactly, plus behaviour flags. It
reads nothing but its arguments (no I/O, no clock), so stream operators, the Beam backfill and
the simulator all get the same answer for the same events and version.

Two reward-hacking lessons are encoded in the current version (``v2``):

1. A broken tool call is a *negative* example (``broken_tool_calls`` component), never a
   discarded one.
2. Asking instead of editing is not a safe harbour: a deferred trajectory (clarifying question,
   no edit) is capped at the neutral baseline (``deferral_cap`` component) and penalised for each
   answer showing the question was unneeded (``deferral`` component).

``v1-discard-broken`` is the deliberately buggy historical version that taught both hacks; it is
kept on purpose (see :data:`V1_DISCARD_BROKEN`).

Every config produces the same component names for every trajectory (zeros included), in the
order of :data:`COMPONENTS`, so components can be compared row by row across trajectories and
versions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from rewards.features import TrajectoryFeatures, features
from rtrl.errors import ConfigError
from schemas.records import EventBase

COMPONENTS: tuple[str, ...] = (
    "edit",
    "broken_tool_calls",
    "followup",
    "latency",
    "status",
    "deferral",
    "checkin",
    "verdict",
    "deferral_cap",
)
"""Component names, in the order they are summed (the order of ``RewardResult.components``)."""


@dataclass(frozen=True)
class RewardConfig:
    """Weights of one reward version. Every penalty weight is a positive magnitude."""

    version: str
    """Name of the version; stored as ``reward_version`` with each reward."""

    # --- edit: w_edit * mean over edits of a per-edit outcome
    w_edit: float = 1.0
    """Scale of the ``edit`` component (the mean per-edit outcome lies in [rejected_value, 1])."""
    unverified_accept_credit: float = 0.5
    """Outcome of an accepted edit whose persistence check has not arrived (window closed by deadline)."""
    rejected_value: float = -0.2
    """Outcome of a rejected edit. Edits neither accepted nor rejected score 0."""

    # --- broken tool calls
    w_broken: float = 0.25
    """Penalty per broken tool call (``broken_tool_calls`` = -w_broken * min(n, broken_cap))."""
    broken_cap: int = 4
    """Broken calls counted at most; bounds the penalty at -w_broken * broken_cap."""
    discard_broken: bool = False
    """If true, trajectories with a broken tool call get no reward at all (None). The v1 bug."""

    # --- follow-ups (answers to clarifying questions are excluded by features())
    w_dissatisfied: float = 0.5
    """Penalty when any follow-up is dissatisfied."""
    w_satisfied: float = 0.2
    """Bonus when any follow-up is satisfied and none is dissatisfied."""

    # --- latency
    w_latency: float = 0.2
    """Largest latency penalty, reached at latency_target_ms + latency_scale_ms."""
    latency_target_ms: float = 10_000.0
    """Worst total latency that costs nothing."""
    latency_scale_ms: float = 50_000.0
    """Latency over the target at which the penalty saturates (> 0)."""

    # --- end status
    w_error: float = 0.5
    """Penalty when the trajectory ended with status ``error``."""
    w_abandoned: float = 0.3
    """Penalty when the user abandoned the trajectory."""

    # --- clarifying questions
    w_unneeded_question: float = 0.5
    """Penalty per answer showing a question was unneeded, when no edit was proposed."""
    w_unneeded_question_with_edit: float = 0.1
    """Smaller penalty per unneeded-question answer when edits were proposed after all."""
    unneeded_cap: int = 4
    """Unneeded-question answers counted at most."""
    deferral_ceiling: float | None = 0.0
    """Most a deferred trajectory (question, no edit) can earn: the neutral baseline. None: no cap (v1 bug)."""

    # --- background tasks: interim check-ins, then the user's verdict on the whole outcome
    w_checkin: float = 0.3
    """Scale of the ``checkin`` component: w_checkin * mean reaction to the check-ins (+1 satisfied, -1
    dissatisfied), only while no verdict has arrived (the provisional reward of a long task)."""
    w_verdict: float = 1.0
    """Scale of the ``verdict`` component: w_verdict * (2 * kept fraction - 1), so merged = +w_verdict and
    discarded = -w_verdict. A verdict judges the whole outcome, so it replaces the check-ins' component."""

    def __post_init__(self) -> None:
        if not self.version:
            raise ValueError("a reward config needs a version name")
        for name in (
            "w_edit", "w_broken", "w_dissatisfied", "w_satisfied", "w_latency", "w_error",
            "w_abandoned", "w_unneeded_question", "w_unneeded_question_with_edit", "latency_target_ms",
            "w_checkin", "w_verdict",
        ):  # fmt: skip
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite magnitude >= 0, got {value!r}")
        for name in ("unverified_accept_credit", "rejected_value"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite")
        if not (math.isfinite(self.latency_scale_ms) and self.latency_scale_ms > 0):
            raise ValueError(f"latency_scale_ms must be > 0, got {self.latency_scale_ms!r}")
        if self.broken_cap < 0 or self.unneeded_cap < 0:
            raise ValueError("broken_cap and unneeded_cap must be >= 0")
        if self.deferral_ceiling is not None and not math.isfinite(self.deferral_ceiling):
            raise ValueError("deferral_ceiling must be finite or None")


@dataclass(frozen=True)
class RewardResult:
    """A reward with its named components (summing to it) and sorted behaviour flags."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)


def _edit(f: TrajectoryFeatures, c: RewardConfig) -> float:
    # features() gives counts, not per-edit records: accepted and rejected-not-accepted edits are
    # disjoint, so max(proposed, accepted + rejected) is the number of edits seen (exact when every
    # accept/reject refers to a proposed edit, as well-formed clients send).
    n = max(f.edits_proposed, f.edits_accepted + f.edits_rejected)
    if n == 0:
        return 0.0
    outcomes = (
        sum(f.persisted.values())
        + c.unverified_accept_credit * max(f.pending_checks, 0)
        + c.rejected_value * f.edits_rejected
    )
    return c.w_edit * outcomes / n


def _followup(f: TrajectoryFeatures, c: RewardConfig) -> float:
    if f.followups.get("dissatisfied", 0) > 0:
        return -c.w_dissatisfied
    if f.followups.get("satisfied", 0) > 0:
        return c.w_satisfied
    return 0.0


def _latency(f: TrajectoryFeatures, c: RewardConfig) -> float:
    if f.latency_ms is None:
        return 0.0
    over = (f.latency_ms - c.latency_target_ms) / c.latency_scale_ms
    return -c.w_latency * min(max(over, 0.0), 1.0)


def _status(f: TrajectoryFeatures, c: RewardConfig) -> float:
    if f.status == "error":
        return -c.w_error
    if f.status == "abandoned":
        return -c.w_abandoned
    return 0.0  # completed, or not ended (closed by deadline)


def _unneeded(f: TrajectoryFeatures, c: RewardConfig) -> float:
    n = min(f.answers_unneeded, c.unneeded_cap)
    weight = c.w_unneeded_question if f.edits_proposed == 0 else c.w_unneeded_question_with_edit
    return -weight * n


def _checkin(f: TrajectoryFeatures, c: RewardConfig) -> float:
    if f.verdict is not None or f.checkin_score is None:
        return 0.0
    return c.w_checkin * f.checkin_score


def _verdict(f: TrajectoryFeatures, c: RewardConfig) -> float:
    if f.verdict_fraction is None:
        return 0.0
    return c.w_verdict * (2.0 * f.verdict_fraction - 1.0)


def _flags(f: TrajectoryFeatures) -> list[str]:
    flags = []
    if f.broken_tool_calls > 0:
        flags.append("invalid_tool_call")
    if f.deferred:
        flags.append("deferred_edit")
    if f.answers_unneeded > 0:
        flags.append("unneeded_question")
    if f.followups.get("dissatisfied", 0) > 0:
        flags.append("dissatisfied_followup")
    if f.pending_checks > 0:
        flags.append("unverified_edit")
    if f.status in ("error", "abandoned"):
        flags.append(f"status_{f.status}")
    if f.verdict is not None:
        flags.append(f"verdict_{f.verdict}")
    return sorted(flags)


def reward(f: TrajectoryFeatures, config: RewardConfig) -> RewardResult | None:
    """The reward of one trajectory under ``config``; None when the config discards it.

    Components are summed left to right in :data:`COMPONENTS` order; the deferral cap is the
    last one, so a capped trajectory's reward is exactly the ceiling.
    """
    if config.discard_broken and f.broken_tool_calls > 0:
        return None
    parts: dict[str, float] = {
        "edit": _edit(f, config),
        "broken_tool_calls": -config.w_broken * min(f.broken_tool_calls, config.broken_cap),
        "followup": _followup(f, config),
        "latency": _latency(f, config),
        "status": _status(f, config),
        "deferral": _unneeded(f, config),
        "checkin": _checkin(f, config),
        "verdict": _verdict(f, config),
    }
    total = 0.0
    for v in parts.values():
        total += v
    cap = 0.0
    if f.deferred and config.deferral_ceiling is not None and total > config.deferral_ceiling:
        cap = config.deferral_ceiling - total
    parts["deferral_cap"] = cap
    total += cap
    # Normalise -0.0 so serialised components look the same for every zero.
    components = {k: (v if v != 0 else 0.0) for k, v in parts.items()}
    return RewardResult(reward=total if total != 0 else 0.0, components=components, flags=_flags(f))


V2 = RewardConfig(version="v2")
"""Current version: broken calls penalised, deferrals capped at 0 and unneeded questions penalised."""

V1_DISCARD_BROKEN = RewardConfig(
    version="v1-discard-broken",
    discard_broken=True,
    w_unneeded_question=0.0,
    w_unneeded_question_with_edit=0.0,
    deferral_ceiling=None,
)
"""The deliberately buggy historical version, kept on purpose; never serve it.

Identical to v2 except that it DISCARDS (returns None for) every trajectory with a broken tool
call instead of penalising it, and has no deferral cap and no unneeded-question penalty (asking
a clarifying question was a safe harbour). Under it the policy learned to emit broken calls on
tasks it expected to fail and to ask instead of editing. It stays in the registry so the
simulator and the closed loop can reproduce both hacks, and so the behaviour monitors
(invalid-tool-call rate, edit rate, deferral rate) can be shown to catch them; replaying
archived events under both versions shows the difference.
"""

REWARD_VERSIONS: dict[str, RewardConfig] = {c.version: c for c in (V2, V1_DISCARD_BROKEN)}
"""Every known reward version by name."""

CURRENT_VERSION = "v2"
"""The version the live flow uses unless told otherwise."""


class UnknownRewardVersion(KeyError):
    """A reward version name that is not in :data:`REWARD_VERSIONS`."""

    def __str__(self) -> str:  # KeyError's default repr-quotes the message
        return str(self.args[0]) if self.args else "unknown reward version"


def get_config(version: str) -> RewardConfig:
    """The config of a reward version; raises :class:`UnknownRewardVersion` (a KeyError) listing known ones."""
    try:
        return REWARD_VERSIONS[version]
    except KeyError:
        raise UnknownRewardVersion(
            f"unknown reward version {version!r}; known versions: {', '.join(sorted(REWARD_VERSIONS))}"
        ) from None


def compute(events: Iterable[EventBase], version: str = CURRENT_VERSION) -> RewardResult | None:
    """Features of ``events`` (any order, duplicates allowed) scored under ``version``."""
    return reward(features(events), get_config(version))


def check_versions(names: list[str], setting: str = "rewards.versions") -> None:
    """Raise :class:`rtrl.errors.ConfigError` naming ``setting`` when a name is not a reward version."""
    unknown = [v for v in names if v not in REWARD_VERSIONS]
    if unknown:
        raise ConfigError(
            f"setting {setting} = {names} names unknown reward versions {unknown}; fix: use "
            f"{', '.join(sorted(REWARD_VERSIONS))} (RTRL_{setting.upper().replace('.', '__')})"
        )
