"""How simulated users react to the closed loop's completions: a world where every headline metric depends
on what the policy does.

Pure and seeded: :func:`react` draws every random number from the ``rng`` it is given and each user's trait
from a generator seeded by the user id, so the same arguments always record the same events. The model
(:class:`World` holds its numbers; the defaults are the main job's world):

* **Users** differ in *strictness* ``s`` ~ Beta(2, 4) (most are lenient), fixed per user id
  (:func:`strictness`).
* **Edits and persistence.** A right edit is accepted, except that a strict user rejects one now and then
  (``reject_right * s``); an accepted right edit is partly rewritten by the user with chance
  ``rewrite_right + rewrite_strict * s`` (the kept fraction ~ U(0.5, 0.95)), else it persists whole. A
  wrong edit is usually rejected, but a lenient user accepts it with chance ``accept_wrong * (1 - s)`` and
  reverts it later: fully with chance ``revert_fully`` (fraction 0), else partly (fraction ~ U(0.1, 0.6)).
  Edit persistence (kept fraction over checked edits) therefore rises as the policy gets edits right.
* **Persistence arrives late**, as in production, where a check runs minutes to hours after the edit:
  the ``edit_persisted`` event's time is ``persist_delay_ms`` (uniform) after the trajectory ended, and it
  is handed to ``later(delay_ms, send)`` so a caller with a clock (the policy server) delivers it then. The
  reward windows wait for it (:mod:`flows.windowing`).
* **Latency** is what the policy's actions cost: time to first token ~ U(250, 350) ms, the tool's run time
  (:data:`TOOL_MS`, log-normal noise sigma 0.25), ``retry_ms`` (plus U(0, 300) ms and the tool again) per
  retry after a broken call (one retry, a second with chance ``second_retry``), and ``ms_per_line`` per
  line of the answer: a right edit touches ``1 + b`` lines, a wrong one 1 to 6 lines more (an agent that
  does not know the fix rewrites more), a question or an answer without an edit one line.
* **Dissatisfied follow-ups** depend on the outcome: a right edit kept whole rarely annoys
  (``dissatisfied_right``), one the user had to rewrite more (``dissatisfied_rewritten``), a rejected right
  edit more still (``dissatisfied_rejected_right``); a rejected wrong edit usually does
  (``dissatisfied_wrong + dissatisfied_wrong_strict * s``), an accepted one the user reverts does when the
  revert is full (``dissatisfied_reverted``) and less when partial (``dissatisfied_partly_reverted``); an
  unneeded question annoys some users (``dissatisfied_question + dissatisfied_question_strict * s``, else a
  neutral follow-up) and no edit and no question nearly all (``dissatisfied_nothing``). On top, a broken
  call adds ``dissatisfied_broken`` and a slow answer up to ``dissatisfied_slow`` (linear from
  ``slow_from_ms`` over ``slow_span_ms``). A follow-up that is not dissatisfied is satisfied after a right
  edit and neutral otherwise.

Under reward v2 these move together: a right edit earns its persistence and a satisfied follow-up, a
wrong one a rejection or a revert and usually a dissatisfied follow-up, a broken call its penalty, its
retries' latency and some annoyance. Training on v2 therefore raises persistence and lowers dissatisfied
follow-ups and latency, without any of the three being rewarded directly beyond what users do
(``bench/RESULTS.md`` records the main job's figures).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simulator.tasks import Outcome, Task

TOOL_MS: dict[str, float] = {"read_file": 150.0, "search": 300.0, "run_tests": 700.0}
"""Median run time of each valid tool (ms): running the tests costs most."""


@dataclass(frozen=True)
class World:
    """The numbers of the users' model (see the module docstring); probabilities are in [0, 1]."""

    reject_right: float = 0.08
    rewrite_right: float = 0.15
    rewrite_strict: float = 0.3
    accept_wrong: float = 0.35
    revert_fully: float = 0.6
    persist_delay_ms: tuple[int, int] = (200, 800)
    retry_ms: float = 400.0
    second_retry: float = 0.3
    ms_per_line: float = 60.0
    dissatisfied_right: float = 0.02
    dissatisfied_rewritten: float = 0.10
    dissatisfied_rejected_right: float = 0.3
    dissatisfied_wrong: float = 0.7
    dissatisfied_wrong_strict: float = 0.25
    dissatisfied_reverted: float = 0.6
    dissatisfied_partly_reverted: float = 0.4
    dissatisfied_question: float = 0.25
    dissatisfied_question_strict: float = 0.3
    dissatisfied_nothing: float = 0.9
    dissatisfied_broken: float = 0.1
    dissatisfied_slow: float = 0.2
    slow_from_ms: float = 1000.0
    slow_span_ms: float = 2000.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                if not (len(v) == 2 and 0 <= v[0] <= v[1]):
                    raise ValueError(f"World.{f.name} = {v!r} must be (low, high) with 0 <= low <= high")
            elif not math.isfinite(v) or v < 0:
                raise ValueError(f"World.{f.name} = {v!r} must be a finite number >= 0")
            elif not f.name.endswith(("_ms", "_line")) and v > 1:
                raise ValueError(f"World.{f.name} = {v!r} must be a probability between 0 and 1")


WORLD = World()
"""The main job's world."""


@lru_cache(maxsize=65536)
def strictness(user: str) -> float:
    """A user's strictness, Beta(2, 4), fixed by the user id (the same in every run and process)."""
    seed = int.from_bytes(hashlib.sha256(f"strictness:{user}".encode()).digest()[:8], "big")
    return random.Random(seed).betavariate(2.0, 4.0)


@dataclass(frozen=True)
class Reaction:
    """What the user did with one completion (what :func:`react` records)."""

    accepted: bool | None  # None: no edit
    kept: float | None  # persisted fraction of an accepted edit
    sentiment: str
    latency_ms: float
    ttft_ms: float
    tools_ms: float  # time to first token, the tool's run and the retries: when the (last) call returned
    lines: int


def reaction(task: Task, out: Outcome, rng: random.Random, user: str = "", world: World = WORLD) -> Reaction:
    """The user's reaction to one completion, drawn from ``rng`` (the model in the module docstring)."""
    w, s = world, strictness(user)
    ttft = 250.0 + 100.0 * rng.random()
    tool = out.tool or rng.choice(list(TOOL_MS))  # a broken call meant some tool; its retry runs it
    run = TOOL_MS[tool] * math.exp(rng.gauss(0.0, 0.25))
    retries = 0.0
    if out.broken:
        for _ in range(1 + (rng.random() < w.second_retry)):
            retries += w.retry_ms + 300.0 * rng.random()
    accepted: bool | None = None
    kept: float | None = None
    if out.edit is not None:
        lines = 1 + task.b + (0 if out.correct else rng.randint(1, 6))
        if out.correct:
            accepted = rng.random() >= w.reject_right * s
            if accepted:
                rewritten = rng.random() < w.rewrite_right + w.rewrite_strict * s
                kept = rng.uniform(0.5, 0.95) if rewritten else 1.0
                p = w.dissatisfied_rewritten if rewritten else w.dissatisfied_right
            else:
                p = w.dissatisfied_rejected_right
        else:
            accepted = rng.random() < w.accept_wrong * (1.0 - s)
            if accepted:
                full = rng.random() < w.revert_fully
                kept = 0.0 if full else rng.uniform(0.1, 0.6)
                p = w.dissatisfied_reverted if full else w.dissatisfied_partly_reverted
            else:
                p = w.dissatisfied_wrong + w.dissatisfied_wrong_strict * s
    elif out.asked:
        lines, p = 1, w.dissatisfied_question + w.dissatisfied_question_strict * s
    else:
        lines, p = 1, w.dissatisfied_nothing
    total = ttft + run + retries + w.ms_per_line * lines
    p += w.dissatisfied_broken * out.broken
    p += w.dissatisfied_slow * min(max((total - w.slow_from_ms) / w.slow_span_ms, 0.0), 1.0)
    if rng.random() < min(p, 1.0):
        sentiment = "dissatisfied"
    else:
        sentiment = "satisfied" if out.correct and out.edit is not None else "neutral"
    return Reaction(accepted, kept, sentiment, total, ttft, ttft + run + retries, lines)


def _now(delay_ms: int, send: Callable[[], object]) -> None:
    send()


class Mailbox:
    """Events users send later (an accepted edit's persistence check): :meth:`later` keeps one, :meth:`deliver`
    sends those due by the caller's monotonic clock (``time.monotonic`` unless given)."""

    def __init__(self, clock: Callable[[], float] | None = None):
        import time

        self.clock = clock or time.monotonic
        self.pending: list[tuple[float, int, Callable[[], object]]] = []
        self._order = itertools.count()

    def later(self, delay_ms: int, send: Callable[[], object]) -> None:
        """Send ``send()`` ``delay_ms`` from now."""
        heapq.heappush(self.pending, (self.clock() + delay_ms / 1000, next(self._order), send))

    def deliver(self, everything: bool = False) -> int:
        """Send what is due (``everything``: all, e.g. at close, with the event times they were given); how many."""
        now, sent = self.clock(), 0
        while self.pending and (everything or self.pending[0][0] <= now):
            heapq.heappop(self.pending)[2]()
            sent += 1
        return sent


def react(
    trajectory,
    task: Task,
    out: Outcome,
    rng: random.Random,
    t0_ms: int,
    user: str = "",
    later: Callable[[int, Callable[[], object]], None] = _now,
    world: World = WORLD,
) -> Reaction:
    """Record the user's side of one trajectory through the SDK (``client.sdk.Trajectory``), with event times
    from ``t0_ms``: the tool call, the edit (proposed, accepted or rejected) or the question, the follow-up,
    the latency and the end; an accepted edit's persistence check ``persist_delay_ms`` after the end, through
    ``later(delay_ms, send)`` (default: sent at once, with its later event time)."""
    r = reaction(task, out, rng, user, world)
    t, done = t0_ms, t0_ms + round(r.latency_ms)  # event times follow the latency: the answer is done at `done`
    trajectory.tool_call(
        out.tool or "malformed",
        valid=not out.broken,
        error=None if not out.broken else "malformed tool call arguments",
        ts=t + round(r.tools_ms),
    )
    status = "completed"
    if out.edit is not None:
        edit_id = trajectory.edit_proposed(lines=r.lines, ts=done)
        trajectory.latency(ttft_ms=r.ttft_ms, total_ms=r.latency_ms, ts=done)
        if r.accepted:
            trajectory.edit_accepted(edit_id, ts=done + 100)
            delay = rng.randint(*world.persist_delay_ms)
            kept = r.kept if r.kept is not None else 1.0
            later(
                delay,
                lambda: trajectory.edit_persisted(
                    edit_id, fraction=kept, checked_after_s=delay / 1000, ts=done + 250 + delay
                ),
            )
        else:
            trajectory.edit_rejected(edit_id, ts=done + 100)
        trajectory.followup(r.sentiment, ts=done + 200)  # type: ignore[arg-type]
    elif out.asked:
        trajectory.clarifying_question(ts=done)
        trajectory.latency(ttft_ms=r.ttft_ms, total_ms=r.latency_ms, ts=done)
        trajectory.followup(r.sentiment, question_needed=False, ts=done + 200)  # type: ignore[arg-type]
    else:
        trajectory.latency(ttft_ms=r.ttft_ms, total_ms=r.latency_ms, ts=done)
        trajectory.followup(r.sentiment, ts=done + 200)  # type: ignore[arg-type]
        status = "error"
    trajectory.end(status, ts=done + 250)
    return r


@dataclass(frozen=True)
class LongWorld:
    """How users judge the loop's background tasks (:func:`react_background`); probabilities in [0, 1].

    While the task runs, each of ``checkins`` check-ins draws a reaction that leans only a little toward the
    truth (``checkin_lean``): satisfied with chance 0.5 + lean for a right edit, 0.5 - lean for a wrong one,
    otherwise dissatisfied or neutral. The verdict, cycles later, follows the outcome closely: a right edit is
    merged (chance ``merge_right``, else partly kept, fraction ~ U(0.6, 0.9)), a wrong one discarded (chance
    ``discard_wrong``, else partly kept, fraction ~ U(0.1, 0.4)); no edit is discarded. So the provisional
    reward (from the check-ins) is a weak signal and the final one (from the verdict) a sharp one.
    """

    checkins: int = 3
    checkin_lean: float = 0.1
    merge_right: float = 0.9
    discard_wrong: float = 0.85
    step_ms: int = 600_000  # event time between two check-ins (the task runs for checkins x step_ms)


LONG_WORLD = LongWorld()


def react_background(
    trajectory,
    task: Task,
    out: Outcome,
    rng: random.Random,
    t0_ms: int,
    verdict_after_ms: int,
    later: Callable[[int, Callable[[], object]], None] = _now,
    world: LongWorld = LONG_WORLD,
) -> str:
    """Record the user's side of one background task through the SDK: the tool call, the check-ins with their
    reactions, the delivered edit, the latency and the end; then the verdict ``verdict_after_ms`` after the end
    through ``later`` (the caller's clock decides when it is sent, e.g. some cycles later). Returns the verdict."""
    t = t0_ms + 300
    trajectory.tool_call(
        out.tool or "malformed", valid=not out.broken, error=None if not out.broken else "malformed arguments", ts=t
    )
    lean = world.checkin_lean if out.correct else -world.checkin_lean
    for k in range(1, world.checkins + 1):
        u = rng.random()
        sentiment = "satisfied" if u < 0.5 + lean else "dissatisfied" if u < 0.85 + lean / 2 else "neutral"
        trajectory.checkin(round(k / (world.checkins + 1), 3), sentiment, ts=t + k * world.step_ms)  # type: ignore[arg-type]
    done = t + (world.checkins + 1) * world.step_ms
    if out.edit is not None:
        trajectory.edit_proposed(lines=1 + task.b, ts=done - 1000)
    elif out.asked:
        trajectory.clarifying_question(ts=done - 1000)
    trajectory.latency(ttft_ms=300.0, total_ms=float(done - t0_ms), ts=done)
    trajectory.end("completed" if out.edit is not None or out.asked else "error", ts=done + 1)
    if out.edit is None:
        verdict, fraction = "discarded", 0.0
    elif out.correct:
        merged = rng.random() < world.merge_right
        verdict, fraction = ("merged", 1.0) if merged else ("partly_kept", rng.uniform(0.6, 0.9))
    else:
        dropped = rng.random() < world.discard_wrong
        verdict, fraction = ("discarded", 0.0) if dropped else ("partly_kept", rng.uniform(0.1, 0.4))
    at = done + 1 + verdict_after_ms
    later(
        verdict_after_ms,
        lambda: trajectory.verdict(verdict, round(fraction, 4), verdict_after_ms / 1000, ts=at),  # type: ignore[arg-type]
    )
    return verdict
