"""What one trajectory's events say, independent of event order and duplicates (pure).

:func:`features` is the single place that interprets a trajectory's events; reward functions and
the behaviour monitors both read :class:`TrajectoryFeatures`, so they cannot disagree about what
happened. It deduplicates by ``event_id`` and sorts by ``(ts, event_id)`` first, so any
permutation or repetition of the same events gives the same features.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas.data_use import DataUse, stricter
from schemas.records import (
    EditAccepted,
    EditPersisted,
    EditProposed,
    EditRejected,
    EventBase,
    Followup,
    Latency,
    TaskCheckin,
    TaskVerdict,
    ToolCall,
    TrajectoryEnded,
    TrajectoryStarted,
    event_type,
)

_REACTION = {"satisfied": 1, "neutral": 0, "dissatisfied": -1}


@dataclass(frozen=True)
class TrajectoryFeatures:
    """Counts and outcomes of one trajectory (see field comments)."""

    trajectory_id: str
    policy_version: int
    org_id: str
    arm: str
    task_kind: str | None  # None when trajectory_started was never seen
    status: str | None  # trajectory_ended status, None while not ended
    n_events: int  # distinct events
    event_counts: dict[str, int]
    first_ts: int
    last_ts: int
    ended_ts: int | None
    tool_calls: int
    broken_tool_calls: int
    clarifying_questions: int
    answers_needed: int  # follow-ups answering a question that was needed
    answers_unneeded: int  # follow-ups showing the question was unneeded
    edits_proposed: int  # distinct edit ids proposed
    edits_accepted: int
    edits_rejected: int
    persisted: dict[str, float] = field(default_factory=dict)  # accepted edit id -> latest fraction
    followups: dict[str, int] = field(default_factory=dict)  # sentiment -> count (answers excluded)
    latency_ms: float | None = None  # worst total latency reported
    ttft_ms: float | None = None  # worst time to first token reported
    user_hash: str = ""  # the user's salted hash (the unit of an A/B's randomisation and analysis)
    checkins: int = 0  # interim check-ins of a background task
    checkin_score: float | None = None  # mean reaction to them: satisfied +1, neutral 0, dissatisfied -1
    progress: float | None = None  # largest progress a check-in reported
    verdict: str | None = None  # the user's verdict on the whole outcome (task_verdict), None until it arrives
    verdict_fraction: float | None = None  # fraction of the work the user kept, with the verdict
    verdict_ts: int | None = None  # event time of the verdict
    data_use: DataUse = "train"  # the data-use class its first trajectory_started gave (schemas.data_use)

    @property
    def started(self) -> bool:
        return self.task_kind is not None

    @property
    def pending_checks(self) -> int:
        """Accepted edits whose persistence check has not arrived."""
        return self.edits_accepted - len(self.persisted)

    @property
    def deferred(self) -> bool:
        """Asked a clarifying question and proposed no edit: the 'ask instead of edit' pattern. A background
        task the user gave a verdict on delivered work, so it is not a deferral."""
        return self.clarifying_questions > 0 and self.edits_proposed == 0 and self.verdict is None


def features(events: Iterable[EventBase]) -> TrajectoryFeatures:
    """Features of one trajectory's events (any order, duplicates allowed; at least one event)."""
    unique = {e.event_id: e for e in events}
    if not unique:
        raise ValueError("a trajectory needs at least one event")
    ordered = sorted(unique.values(), key=lambda e: (e.ts, e.event_id))
    ids = {e.trajectory_id for e in ordered}
    if len(ids) != 1:
        raise ValueError(f"events of several trajectories given: {sorted(ids)[:3]}")
    starts = [e for e in ordered if type(e) is TrajectoryStarted]  # records are final: identity, not isinstance
    head = starts[0] if starts else ordered[0]
    counts = Counter(event_type(e) for e in ordered)
    proposed, accepted, rejected = set(), set(), set()
    persisted: dict[str, float] = {}
    followups: Counter[str] = Counter()
    broken = answers_needed = answers_unneeded = 0
    status = ended_ts = latency = ttft = None
    reactions: list[int] = []
    progress: float | None = None
    verdict: TaskVerdict | None = None
    # ``t is X`` narrows ``e`` to X, which mypy does not follow through the alias ``t`` (kept: identity
    # checks on one type() call are the cheap path here), hence the attr-defined ignores below
    for e in ordered:
        t = type(e)
        if t is ToolCall:
            broken += not e.valid  # type: ignore[attr-defined]
        elif t is EditProposed:
            proposed.add(e.edit_id)  # type: ignore[attr-defined]
        elif t is EditAccepted:
            accepted.add(e.edit_id)  # type: ignore[attr-defined]
        elif t is EditRejected:
            rejected.add(e.edit_id)  # type: ignore[attr-defined]
        elif t is EditPersisted:
            persisted[e.edit_id] = e.fraction  # type: ignore[attr-defined]  # ordered by ts: the latest check wins
        elif t is Followup:
            if e.question_needed is True:  # type: ignore[attr-defined]
                answers_needed += 1
            elif e.question_needed is False:  # type: ignore[attr-defined]
                answers_unneeded += 1
            else:
                followups[e.sentiment] += 1  # type: ignore[attr-defined]
        elif t is Latency:
            latency = e.total_ms if latency is None else max(latency, e.total_ms)  # type: ignore[attr-defined]
            ttft = e.ttft_ms if ttft is None else max(ttft, e.ttft_ms)  # type: ignore[attr-defined]
        elif t is TrajectoryEnded:
            status, ended_ts = e.status, e.ts  # type: ignore[attr-defined]  # the latest end wins
        elif t is TaskCheckin:
            reactions.append(_REACTION[e.sentiment])  # type: ignore[attr-defined]
            progress = e.progress if progress is None else max(progress, e.progress)  # type: ignore[attr-defined]
        elif t is TaskVerdict:
            verdict = e  # type: ignore[assignment]  # the latest verdict wins (a user may change their mind)
    return TrajectoryFeatures(
        trajectory_id=head.trajectory_id,
        policy_version=head.policy_version,
        org_id=head.org_id,
        arm=head.arm,
        user_hash=head.user_hash,
        task_kind=starts[0].task_kind if starts else None,
        # a secret in its rollout (a secret_found event from the SDK) keeps the whole trajectory from training
        data_use=stricter(
            starts[0].data_use if starts else "train", "monitor_only" if counts["secret_found"] else "train"
        ),
        status=status,
        n_events=len(ordered),
        event_counts=dict(sorted(counts.items())),
        first_ts=ordered[0].ts,
        last_ts=ordered[-1].ts,
        ended_ts=ended_ts,
        tool_calls=counts["tool_call"],
        broken_tool_calls=broken,
        clarifying_questions=counts["clarifying_question"],
        answers_needed=answers_needed,
        answers_unneeded=answers_unneeded,
        edits_proposed=len(proposed),
        edits_accepted=len(accepted),
        edits_rejected=len(rejected - accepted),
        persisted={k: v for k, v in sorted(persisted.items()) if k in accepted},
        followups=dict(sorted(followups.items())),
        latency_ms=latency,
        ttft_ms=ttft,
        checkins=len(reactions),
        checkin_score=sum(reactions) / len(reactions) if reactions else None,
        progress=progress,
        verdict=None if verdict is None else verdict.verdict,
        verdict_fraction=None if verdict is None else verdict.fraction,
        verdict_ts=None if verdict is None else verdict.ts,
    )
