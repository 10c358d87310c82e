"""The reward flow's logic for one Kafka partition, free of Bytewax and I/O.

``RewardProcessor.process(messages)`` parses and validates raw messages (bad ones become dead
letters with their reason), feeds the valid events to the partition's windows
(:mod:`flows.windowing`), and turns every closed window into one :class:`Reward` per configured
reward version plus one :class:`TrajectorySummary`. A trajectory of a kind that ends with the user's verdict
(``verdict_kinds``, from ``flow.task_kinds``) gets provisional rewards until its ``task_verdict`` arrives; the
verdict, usually a late event, re-closes the window as a new revision whose rewards are final. The Bytewax flow only wraps it; tests drive it
directly. The wall clock is read only for ``emitted_at``/``at`` stamps, never for decisions.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from flows.windowing import Closed, PartitionWindows, Rejected, WindowConfig
from rewards import RewardConfig, check_versions, features, get_config, reward
from rewards.features import TrajectoryFeatures
from schemas.codec import Invalid, dead_letter, event_codec
from schemas.erasure import DenySource
from schemas.records import CloseReason, DeadLetter, DeadLetterKind, EventBase, Reward, TrajectorySummary


class Message(NamedTuple):
    """A raw Kafka message as the processor needs it."""

    key: bytes | None
    value: bytes | None
    partition: int
    offset: int
    timestamp: int | None = None  # the record's timestamp in ms (broker append time or producer time); None: unknown


@dataclass
class FlowOutput:
    """Everything one batch of input produced, grouped by destination."""

    events: list[EventBase] = field(default_factory=list)
    #: (Kafka partition, offset, record timestamp or -1) of each of ``events``
    coords: list[tuple[int, int, int]] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    summaries: list[TrajectorySummary] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    discarded: int = 0  # closes a reward version chose not to reward (the buggy v1 does this)
    erased: int = 0  # events of an erased user or organisation, skipped (`rtrl erase`)

    def extend(self, other: FlowOutput) -> None:
        self.events += other.events
        self.coords += other.coords
        self.rewards += other.rewards
        self.summaries += other.summaries
        self.dead_letters += other.dead_letters
        self.discarded += other.discarded
        self.erased += other.erased


_REJECTED_FIELD = {"duplicate": "$.event_id", "too_late": "$.ts", "future": "$.ts", "never_started": "$.trajectory_id"}


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def summary(f: TrajectoryFeatures, revision: int, close_reason: CloseReason) -> TrajectorySummary:
    """The monitors' view of a closed trajectory."""
    return TrajectorySummary(
        trajectory_id=f.trajectory_id,
        policy_version=f.policy_version,
        org_id=f.org_id,
        arm=f.arm,
        task_kind=f.task_kind or "unknown",
        revision=revision,
        close_reason=close_reason,
        status=f.status or "open",
        n_events=f.n_events,
        tool_calls=f.tool_calls,
        broken_tool_calls=f.broken_tool_calls,
        clarifying_questions=f.clarifying_questions,
        unneeded_questions=f.answers_unneeded,
        edits_proposed=f.edits_proposed,
        edits_accepted=f.edits_accepted,
        persistence_checks=len(f.persisted),
        persisted_fraction_sum=float(sum(f.persisted.values())),
        followups=sum(f.followups.values()),
        dissatisfied_followups=f.followups.get("dissatisfied", 0),
        latency_ms=f.latency_ms,
        ttft_ms=f.ttft_ms,
        first_event_ts=f.first_ts,
        last_event_ts=f.last_ts,
        user_hash=f.user_hash,
        data_use=f.data_use,
    )


class RewardProcessor:
    """Parse -> window -> reward for the messages of one partition, in partition order."""

    def __init__(
        self,
        source: str,
        window: WindowConfig,
        reward_versions: Sequence[str | RewardConfig],
        max_event_bytes: int = 64 * 1024,
        state: PartitionWindows | None = None,
        verdict_kinds: Collection[str] = (),
        deny: DenySource | None = None,
    ):
        # a name is a built-in version; a config is any version (rewards.versions.registry resolves defined ones)
        check_versions([v for v in reward_versions if isinstance(v, str)])  # ConfigError naming rewards.versions
        configs = [get_config(v) if isinstance(v, str) else v for v in reward_versions]
        self.source = source
        self.versions = [(c.version, c) for c in configs]
        self.codec = event_codec(max_event_bytes)
        self.windows = state if state is not None else PartitionWindows(window)
        #: task kinds that end with the user's verdict: their rewards are provisional until it arrives
        self.verdict_kinds = frozenset(verdict_kinds)
        #: erased subjects (rtrl.clickhouse.DenyWatch, or a fixed schemas.erasure.DenyList): their events are skipped
        self.deny = deny

    def _denied(self, event: EventBase) -> bool:
        return self.deny is not None and self.deny.current().denies(event.trajectory_id, event.org_id, event.user_hash)

    def _dead(
        self,
        kind: DeadLetterKind,
        field_: str,
        reason: str,
        partition: int,
        offset: int,
        key: bytes | str | None,
        payload: bytes | None,
        now: int,
    ) -> DeadLetter:
        return dead_letter(kind, field_, reason, self.source, partition, offset, key, payload, now)

    def process(self, messages: Iterable[Message], now_ms: int | None = None) -> FlowOutput:
        now = _now_ms() if now_ms is None else now_ms
        out = FlowOutput()
        for m in messages:
            self.windows.partition = m.partition
            try:
                event = self.codec.decode(m.value)
            except Invalid as e:
                if self.deny is not None and self.deny.current().names(m.value, m.key):
                    out.erased += 1  # a malformed record of an erased subject: not dead-lettered again on a replay
                    continue
                out.dead_letters.append(
                    self._dead(e.kind, e.field, e.reason, m.partition, m.offset, m.key, m.value, now)
                )
                continue
            if self._denied(event):  # erased: neither stored, archived nor windowed
                out.erased += 1
                continue
            ts = -1 if m.timestamp is None else m.timestamp
            out.events.append(event)
            out.coords.append((m.partition, m.offset, ts))
            self._apply(self.windows.ingest(event, m.offset, ts), m.partition, out, now)
        return out

    def process_events(
        self, located: Iterable[tuple[EventBase, int, int, int]], now_ms: int | None = None
    ) -> FlowOutput:
        """Already-decoded ``(event, partition, offset, record timestamp or -1)`` in partition order (the backfill's
        input, read back from the archive): the same windows and rewards as :meth:`process` gives for their
        messages."""
        now = _now_ms() if now_ms is None else now_ms
        out = FlowOutput()
        for event, partition, offset, record_ts in located:
            self.windows.partition = partition
            if self._denied(event):
                out.erased += 1
                continue
            out.events.append(event)
            out.coords.append((partition, offset, record_ts))
            self._apply(self.windows.ingest(event, offset, record_ts), partition, out, now)
        return out

    def finish(self, now_ms: int | None = None) -> FlowOutput:
        """End of input: close every open window."""
        now = _now_ms() if now_ms is None else now_ms
        out = FlowOutput()
        self._apply(self.windows.flush(), self.windows.partition, out, now)
        return out

    def _apply(self, results: list[Closed | Rejected], partition: int, out: FlowOutput, now: int) -> None:
        for r in results:
            if isinstance(r, Rejected):
                out.dead_letters.append(
                    self._dead(
                        r.kind,
                        _REJECTED_FIELD.get(r.kind, "$"),
                        r.reason,
                        partition,
                        r.offset,
                        r.trajectory_id,
                        self.codec.encode(r.event),
                        now,
                    )
                )
                continue
            if r.events and self._denied(r.events[0]):  # erased while its window was open
                out.erased += len(r.events)
                continue
            f = features(r.events)
            out.summaries.append(summary(f, r.revision, r.close_reason))
            provisional = f.verdict is None and f.task_kind in self.verdict_kinds
            for name, cfg in self.versions:
                res = reward(f, cfg)
                if res is None:
                    out.discarded += 1
                    continue
                out.rewards.append(
                    Reward(
                        trajectory_id=f.trajectory_id,
                        policy_version=f.policy_version,
                        reward_version=name,
                        revision=r.revision,
                        reward=res.reward,
                        components=res.components,
                        flags=list(res.flags),
                        close_reason=r.close_reason,
                        org_id=f.org_id,
                        arm=f.arm,
                        task_kind=f.task_kind or "unknown",
                        n_events=f.n_events,
                        event_counts=f.event_counts,
                        first_event_ts=f.first_ts,
                        last_event_ts=f.last_ts,
                        emitted_at=now,
                        provisional=provisional,
                        data_use=f.data_use,
                    )
                )
