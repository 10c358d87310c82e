"""Seeded generation of agent trajectories as a delivery-ordered list of events.

:func:`generate` is pure: it does no I/O and draws every random number from generators seeded
by ``settings.seed``, so the same arguments always give the same list. Each trajectory gets its
own content and delivery generators drawn from the master one; a trajectory's events therefore
do not depend on how many trajectories follow it.

Event time (``Event.ts``) is when something happened at the client; ``Emission.at_ms`` is when
the client sends it. Delivery is deliberately imperfect: network jitter, events overtaken by
their successor (``reorder_rate``), client retries that send an event twice with the same
``event_id`` (``duplicate_rate``), and persistence checks that happen hours late
(``late_check_rate``).

**Background tasks** (``long_task_share`` of the trajectories, kind ``background``) run for hours of
event time (median ``long_task_hours``): the agent works with tool calls and sends a check-in about
every 45 minutes, to which the user reacts (a noisy view of how the task is going); after the end, the
user's verdict on the whole outcome (merged, partly kept, discarded) arrives ``verdict_min_h`` to
``verdict_max_h`` hours later, for ``verdict_rate`` of the tasks. The verdict is a sharper signal than
the check-ins: it follows the task's latent outcome closely, while each check-in reaction is that
outcome plus wide noise. Event time is simulated, so days of it take seconds to generate.
"""

from __future__ import annotations

import math
import random
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rtrl.sections.simulator import SimulatorSettings
from schemas.records import (
    ClarifyingQuestion,
    EditAccepted,
    EditPersisted,
    EditProposed,
    EditRejected,
    Event,
    Followup,
    Latency,
    TaskCheckin,
    TaskVerdict,
    ToolCall,
    TrajectoryEnded,
    TrajectoryStarted,
    Verdict,
    event_type,
)
from simulator.population import (
    EDIT_PROPENSITY,
    TASK_KINDS,
    Org,
    PolicyProfile,
    User,
    build_population,
    pick_task_kind,
    profile_for,
)

DEFAULT_START_MS = 1_767_225_600_000
"""Event time of the first trajectory when ``settings.start_ms`` is 0 (2026-01-01T00:00:00Z)."""
ARRIVAL_MEAN_MS = 2_000.0
"""Mean gap between trajectory starts (Poisson arrivals)."""
CHECK_AFTER_MS = (60_000, 1_800_000)
"""Range of the normal delay between accepting an edit and checking its persistence (1-30 min)."""
LATE_CHECK_AFTER_MS = (7_200_000, 43_200_000)
"""Range of the delay for a late persistence check (2-12 h)."""

TOOLS = ("read_file", "grep", "list_dir", "run_tests", "shell", "apply_patch")
TOOL_ERRORS = (
    "invalid JSON arguments: expected ',' or '}}' at char {n}",
    "missing required argument 'path'",
    "unknown tool '{tool}x'",
    "file not found: src/module_{n}.py",
    "command timed out after {n}s",
    "patch does not apply: hunk #{n} failed",
)


@dataclass(frozen=True, slots=True)
class Emission:
    """One send by the client: the event and when it is sent (ms since epoch)."""

    at_ms: int
    event: Event


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def _poisson(rng: random.Random, mean: float) -> int:
    """Knuth's method; fine for the small means used here."""
    if mean <= 0:
        return 0
    limit, k, p = math.exp(-min(mean, 50.0)), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _sentiment(rng: random.Random, score: float, strictness: float) -> str:
    """Follow-up sentiment for an outcome ``score`` in 0..1; strict users are harder to please."""
    p_dis = min(0.9, 0.05 + 0.7 * (1.0 - score) * (0.6 + 0.8 * strictness))
    p_sat = min(1.0 - p_dis, 0.1 + 0.6 * score * (1.0 - 0.5 * strictness))
    u = rng.random()
    return "dissatisfied" if u < p_dis else "satisfied" if u < p_dis + p_sat else "neutral"


class _Trajectory:
    """Builds one trajectory's events in event-time order, plus its later persistence checks."""

    def __init__(self, rng: random.Random, start_ms: int, user: User, policy_version: int, arm: str):
        self.rng = rng
        self.t = start_ms
        self.env: dict[str, Any] = dict(
            trajectory_id=_uuid(rng),
            org_id=user.org_id,
            user_hash=user.user_hash,
            policy_version=policy_version,
            arm=arm,
        )
        self.events: list[Event] = []
        self.checks: list[Event] = []

    def emit(self, cls: type, gap_ms: float, **payload: Any) -> Any:
        """Append an event ``gap_ms`` (at least 1 ms) after the previous one."""
        if self.events:
            self.t += max(1, int(gap_ms))
        ev = cls(event_id=_uuid(self.rng), ts=self.t, **self.env, **payload)
        self.events.append(ev)
        return ev

    def check(self, ts: int, **payload: Any) -> None:
        """Record a persistence check at event time ``ts`` (usually after the trajectory ended)."""
        self.checks.append(EditPersisted(event_id=_uuid(self.rng), ts=ts, **self.env, **payload))

    def tool_calls(self, n: int, p_broken: float) -> bool:
        """Emit ``n`` tool calls; True when the last one was broken."""
        broken = False
        for _ in range(n):
            tool = self.rng.choice(TOOLS)
            broken = self.rng.random() < p_broken
            error = None
            if broken:
                error = self.rng.choice(TOOL_ERRORS).format(tool=tool, n=self.rng.randint(1, 99))
            self.emit(ToolCall, _lognormal(self.rng, 1500.0, 0.6), tool=tool, valid=not broken, error=error)
        return broken


def _edits(
    tr: _Trajectory, profile: PolicyProfile, user: User, quality: float, p_broken: float, late_rate: float
) -> list[float]:
    """Propose one or more edits; returns per-edit outcome (persisted fraction, 0 if rejected)."""
    rng = tr.rng
    outcomes: list[float] = []
    while True:
        if outcomes:
            tr.tool_calls(_poisson(rng, profile.mean_tool_calls / 2), p_broken)
        lines = min(5000, max(1, round(_lognormal(rng, 12.0, 1.0))))
        edit_id = f"edit-{rng.getrandbits(64):016x}"
        tr.emit(EditProposed, _lognormal(rng, 4000.0, 0.6), edit_id=edit_id, lines=lines)
        # The edit's latent goodness, centred on the policy's quality: Beta(1+6q, 1+6(1-q)).
        good = rng.betavariate(1 + 6 * quality, 1 + 6 * (1 - quality))
        p_accept = min(1.0, good * (1.0 - 0.5 * user.strictness) + 0.15)
        review_ms = _lognormal(rng, 15_000.0 * (1 + lines / 50), 0.6)
        if rng.random() < p_accept:
            acc = tr.emit(EditAccepted, review_ms, edit_id=edit_id)
            # Accepted edits are mostly kept; strict users rewrite more of them.
            fraction = rng.betavariate(1 + 8 * good, 1 + 3 * (1 - good) + 2 * user.strictness)
            late = rng.random() < late_rate
            normal_ms, late_ms = rng.randint(*CHECK_AFTER_MS), rng.randint(*LATE_CHECK_AFTER_MS)
            after_ms = late_ms if late else normal_ms
            tr.check(acc.ts + after_ms, edit_id=edit_id, fraction=fraction, checked_after_s=after_ms / 1000)
            outcomes.append(fraction)
        else:
            tr.emit(EditRejected, review_ms, edit_id=edit_id)
            outcomes.append(0.0)
        if len(outcomes) >= profile.max_edits or rng.random() >= profile.p_extra_edit:
            return outcomes


def _simulate(tr: _Trajectory, user: User, org: Org, profile: PolicyProfile, late_rate: float) -> None:
    """Fill ``tr`` with one trajectory: start, tools, question or edits, latency, follow-up, end."""
    rng = tr.rng
    kind = pick_task_kind(rng)
    tr.emit(TrajectoryStarted, 0, task_kind=kind)
    p_broken = min(1.0, profile.p_broken_tool_call * org.difficulty)
    quality = profile.edit_quality**org.difficulty
    ambiguous = rng.random() < TASK_KINDS[kind]
    wants_edit = rng.random() < profile.p_edit * EDIT_PROPENSITY[kind]

    last_broken = tr.tool_calls(_poisson(rng, profile.mean_tool_calls), p_broken)
    status: str | None = "error" if (last_broken and rng.random() < 0.5) or rng.random() < 0.02 else None
    outcomes: list[float] = []
    if status is None:
        asks = rng.random() < (profile.p_clarify if ambiguous else profile.p_clarify_unneeded)
        if asks:
            tr.emit(ClarifyingQuestion, _lognormal(rng, 3000.0, 0.5))
            sentiment = _sentiment(rng, 0.85 if ambiguous else 0.15, user.strictness)
            tr.emit(Followup, _lognormal(rng, 40_000.0, 0.8), sentiment=sentiment, question_needed=ambiguous)
            if not ambiguous and sentiment == "dissatisfied" and rng.random() < 0.25:
                status = "abandoned"
        elif ambiguous:
            quality *= 0.6  # the agent guessed what an ambiguous task meant
        if status is None and wants_edit:
            outcomes = _edits(tr, profile, user, quality, p_broken, late_rate)
            if not any(outcomes) and rng.random() < 0.3:
                status = "abandoned"

    ttft = _lognormal(rng, profile.ttft_median_ms, profile.ttft_sigma)
    total = ttft + _lognormal(rng, profile.gen_median_ms, profile.gen_sigma)
    tr.emit(Latency, _lognormal(rng, 200.0, 0.5), ttft_ms=round(ttft, 1), total_ms=round(total, 1))

    if status != "error" and rng.random() < 0.6:
        score = sum(outcomes) / len(outcomes) if outcomes else (0.1 if status else 0.7)
        sentiment = _sentiment(rng, score, user.strictness)
        tr.emit(Followup, _lognormal(rng, 30_000.0, 0.8), sentiment=sentiment)
        if status is None and sentiment == "dissatisfied" and rng.random() < 0.3:
            status = "abandoned"
    tr.emit(TrajectoryEnded, _lognormal(rng, 5000.0, 0.6), status=status or "completed")


BACKGROUND = "background"
"""Task kind of the hours-long background tasks (``flow.task_kinds.background`` awaits their verdict)."""
CHECKIN_EVERY_MS = 2_700_000.0
"""Median event time between two check-ins of a background task (45 min)."""


def _background(tr: _Trajectory, user: User, org: Org, profile: PolicyProfile, settings: SimulatorSettings) -> None:
    """Fill ``tr`` with one background task: tool calls and check-ins over hours, the end, and (in
    ``tr.checks``, delivered at its own time) the user's verdict."""
    rng = tr.rng
    tr.emit(TrajectoryStarted, 0, task_kind=BACKGROUND)
    p_broken = min(1.0, profile.p_broken_tool_call * org.difficulty)
    quality = profile.edit_quality**org.difficulty
    outcome = rng.betavariate(1 + 8 * quality, 1 + 8 * (1 - quality))  # the task's latent outcome, 0..1
    length_ms = min(12 * 3_600_000.0, max(1_800_000.0, _lognormal(rng, settings.long_task_hours * 3_600_000, 0.5)))
    start = tr.t
    checkins = max(1, round(length_ms / CHECKIN_EVERY_MS))
    broken = False
    for k in range(1, checkins + 1):
        broken = tr.tool_calls(_poisson(rng, profile.mean_tool_calls), p_broken) or broken
        due = start + length_ms * k / (checkins + 1)
        # the user sees the work so far: the outcome plus wide noise, so one reaction says little
        seen = min(1.0, max(0.0, outcome + rng.gauss(0.0, 0.35)))
        tr.emit(
            TaskCheckin,
            due - tr.t,
            progress=round(k / (checkins + 1), 3),
            sentiment=_sentiment(rng, seen, user.strictness),
        )
    ttft = _lognormal(rng, profile.ttft_median_ms, profile.ttft_sigma)
    total = ttft + _lognormal(rng, profile.gen_median_ms, profile.gen_sigma)
    tr.emit(Latency, max(1.0, start + length_ms - tr.t), ttft_ms=round(ttft, 1), total_ms=round(total, 1))
    status = "error" if broken and rng.random() < 0.1 else "completed"
    tr.emit(TrajectoryEnded, _lognormal(rng, 5000.0, 0.6), status=status)
    if status == "completed" and rng.random() < settings.verdict_rate:
        # the verdict follows the outcome closely: merged, partly kept (about the outcome's share) or discarded
        kept = min(1.0, max(0.0, outcome + rng.gauss(0.0, 0.05)))
        verdict: Verdict = "merged" if kept >= 0.75 else "discarded" if kept < 0.3 else "partly_kept"
        fraction = {"merged": 1.0, "discarded": 0.0}.get(verdict, kept)
        after_ms = rng.uniform(settings.verdict_min_h, settings.verdict_max_h) * 3_600_000
        tr.checks.append(
            TaskVerdict(
                event_id=_uuid(rng),
                ts=tr.t + max(1, int(after_ms)),
                **tr.env,
                verdict=verdict,
                fraction=round(fraction, 4),
                verdict_after_s=round(max(1, int(after_ms)) / 1000, 3),
            )
        )


def _deliver(
    rng: random.Random, events: list[Event], checks: list[Event], settings: SimulatorSettings
) -> list[Emission]:
    """Send times: jitter, overtaking (reorder), client retries (duplicates)."""

    def delay() -> int:
        return max(1, round(_lognormal(rng, 40.0, 0.7)))

    at = [ev.ts + delay() for ev in events]
    # Walk backwards so a successor's send time is final before an event is moved after it.
    for i in range(len(events) - 2, -1, -1):
        if rng.random() < settings.reorder_rate:
            at[i] = at[i + 1] + delay()
    sends = [Emission(a, ev) for a, ev in zip(at, events)] + [Emission(c.ts + delay(), c) for c in checks]
    # A retry resends the identical event (same event_id) after a client timeout.
    dups = [
        Emission(s.at_ms + max(1, round(_lognormal(rng, 2000.0, 1.0))), s.event)
        for s in sends
        if rng.random() < settings.duplicate_rate
    ]
    return sends + dups


def generate(
    settings: SimulatorSettings,
    salt: str,
    profiles: Mapping[int, PolicyProfile] | None = None,
    policy_version: int = 0,
    arm: str = "control",
    *,
    arrival_mean_ms: float = ARRIVAL_MEAN_MS,
) -> list[Emission]:
    """All sends of ``settings.trajectories`` simulated trajectories, sorted (stably) by ``at_ms``.

    Trajectories start as a Poisson process from ``settings.start_ms`` (or
    :data:`DEFAULT_START_MS`), and are served by ``policy_version`` under ``arm`` with the
    behaviour ``profiles[policy_version]`` (default: :func:`simulator.population.default_profile`).
    """
    if policy_version < 0 or not arm:
        raise ValueError("policy_version must be >= 0 and arm non-empty")
    master = random.Random(settings.seed)
    population = build_population(random.Random(master.getrandbits(64)), settings.orgs, settings.users_per_org, salt)
    orgs = {o.org_id: o for o in population.orgs}
    profile = profile_for(policy_version, profiles)
    t = settings.start_ms or DEFAULT_START_MS
    out: list[Emission] = []
    for i in range(settings.trajectories):
        if i:
            t += max(1, round(master.expovariate(1.0 / arrival_mean_ms)))
        content, delivery = random.Random(master.getrandbits(64)), random.Random(master.getrandbits(64))
        user = population.pick_user(content)
        tr = _Trajectory(content, t, user, policy_version, arm)
        # drawn apart from the master generator, so short trajectories are the same whatever the share
        if (
            settings.long_task_share > 0
            and random.Random(f"{settings.seed}:long:{i}").random() < settings.long_task_share
        ):
            _background(tr, user, orgs[user.org_id], profile, settings)
        else:
            _simulate(tr, user, orgs[user.org_id], profile, settings.late_check_rate)
        out.extend(_deliver(delivery, tr.events, tr.checks, settings))
    out.sort(key=lambda e: e.at_ms)
    return out


def stats(emissions: list[Emission]) -> dict[str, Any]:
    """Summary of a generated run, counted over distinct events in delivery order.

    ``reordered`` counts first deliveries whose event time is earlier than an event of the same
    trajectory already delivered; ``late_checks`` counts persistence checks made later than the
    normal check window.
    """
    seen: set[str] = set()
    latest: dict[str, int] = {}
    by_type: Counter[str] = Counter()
    status: Counter[str] = Counter()
    clarified: set[str] = set()
    edited: set[str] = set()
    dups = reordered = broken = late = 0
    fractions: list[float] = []
    for em in sorted(emissions, key=lambda e: e.at_ms):
        ev = em.event
        if ev.event_id in seen:
            dups += 1
            continue
        seen.add(ev.event_id)
        tid = ev.trajectory_id
        if tid in latest and ev.ts < latest[tid]:
            reordered += 1
        latest[tid] = max(ev.ts, latest.get(tid, ev.ts))
        kind = event_type(ev)
        by_type[kind] += 1
        if isinstance(ev, ToolCall) and not ev.valid:
            broken += 1
        elif isinstance(ev, ClarifyingQuestion):
            clarified.add(tid)
        elif isinstance(ev, EditProposed):
            edited.add(tid)
        elif isinstance(ev, EditPersisted):
            fractions.append(ev.fraction)
            late += ev.checked_after_s * 1000 > CHECK_AFTER_MS[1]
        elif isinstance(ev, TrajectoryEnded):
            status[ev.status] += 1
    n_traj = by_type["trajectory_started"]

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    return {
        "trajectories": n_traj,
        "emissions": len(emissions),
        "events": len(seen),
        "duplicates": dups,
        "reordered": reordered,
        "late_checks": late,
        "by_type": dict(sorted(by_type.items())),
        "status": dict(sorted(status.items())),
        "broken_tool_call_rate": ratio(broken, by_type["tool_call"]),
        "clarification_rate": ratio(len(clarified), n_traj),
        "edit_rate": ratio(len(edited), n_traj),
        "accept_rate": ratio(by_type["edit_accepted"], by_type["edit_proposed"]),
        "mean_persisted_fraction": ratio(sum(fractions), len(fractions)),
    }
