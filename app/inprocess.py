"""The loop's production pieces in-process on simulated event time: what the experiments share.

An experiment (:mod:`app.long_loop`, :mod:`app.per_org`) runs cycles of the loop without Kafka, ClickHouse or
Bytewax, so that its arms see identical, seeded input. Each cycle uses the same pieces, here:

* :meth:`InProcessLoop.serve`: the served completions become rollouts, and the simulated users' events are
  recorded through the SDK's trajectory handle (:class:`client.sdk.Trajectory` over a :class:`Recorder`), each
  user's reaction by the experiment's own ``react`` (short tasks, background tasks ...);
* :meth:`InProcessLoop.deliver`: the rollouts and every event due by the cycle's end, in event-time order,
  through the reward flow's processor (:class:`flows.processor.RewardProcessor`) and the batch flow's builders
  (:class:`flows.batching.BatchBuilder`, one per cohort, configured by :func:`flows.batch_flow.batch_config`);
  events due later (a verdict hours on) wait for their cycle;
* :meth:`InProcessLoop.train` (the shared policy's stream) and :func:`train_steps` (any stream, an adapter's):
  the cycle's micro-batches through the Arrow wire format (:func:`schemas.codec.encode_batch`,
  :func:`trainer.batch.to_batch`) to the trainer (:func:`trainer.train.train`, configured by
  :meth:`rtrl.sections.trainer.TrainConfig.from_settings`), in whole steps; a remainder waits for the next cycle.

The flows' handling of the same records against the real broker and engine is tested elsewhere
(tests/test_delayed_path.py, tests/test_long_loop.py, tests/test_per_org.py).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from client.hashing import hash_user
from client.sdk import Trajectory
from flows.batch_flow import batch_config, cohort_of
from flows.batching import BatchBuilder
from flows.processor import Message, RewardProcessor
from flows.reward_flow import verdict_kinds
from flows.windowing import WindowConfig
from rtrl.sections.trainer import TrainConfig
from rtrl.settings import Settings
from schemas.codec import encode_batch, event_codec
from schemas.records import EventBase, MicroBatch, Rollout, TaskVerdict, TrainStep, TrajectoryStarted
from simulator.tasks import COMPLETION_LEN, Outcome, Task, outcome
from trainer.batch import Batch, to_batch
from trainer.dedup import TrainedSet
from trainer.factory import Policy
from trainer.train import Hooks, MemorySource, train

MINUTE = 60_000
T0 = 1_767_225_600_000
"""The first cycle's start: 2026-01-01, simulated."""

React = Callable[[Trajectory, Task, Outcome, int, str], object]
"""How a simulated user reacts to one served completion: ``react(trajectory, task, outcome, t_ms, user)`` records
the user's events through the trajectory handle."""


@dataclass
class Recorder:
    """Stands in for the SDK client under :class:`client.sdk.Trajectory`: keeps each recorded event."""

    events: list[EventBase] = field(default_factory=list)

    def record(self, event: EventBase) -> bool:
        self.events.append(event)
        return True


class InProcessLoop:
    """One arm's loop state: the reward flow's processor and the batch flow's per-cohort builders, fed in
    event-time order, the seeded streams of the traffic (``serve_rng``: tasks, ``world_rng``: users,
    ``gen``: sampling), and the shared policy's training state (its trained set, its remainder, the version).

    ``window`` is a cycle's event time; ``serve`` adds a cycle's rollouts and records their users' events;
    ``deliver`` hands them, and every event due by the cycle's end, to the processor and the builders, and
    returns the micro-batches made; ``train`` trains the shared policy on whole steps of them; ``promote`` makes
    the next version the serving one (what the builders count a sample's policy lag from)."""

    def __init__(self, settings: Settings, name: str, seed: int, group_size: int, rate: float, cycle_minutes: int):
        self.settings, self.name = settings, name
        self.group_size, self.rate, self.cycle_minutes = group_size, rate, cycle_minutes
        self.serve_rng, self.world_rng = random.Random(f"serve-{seed}"), random.Random(f"world-{seed}")
        self.gen = torch.Generator().manual_seed(seed)
        self.trained = TrainedSet()
        self.leftover: list[MicroBatch] = []
        self.processor = RewardProcessor(
            name, WindowConfig(settings.flow), [settings.rewards.train_version], verdict_kinds=verdict_kinds(settings)
        )
        self.bcfg = batch_config(settings)
        self.builders: dict[str, BatchBuilder] = {}
        self.cohort_org: dict[str, str] = {}  # each cohort's org
        self.codec = event_codec()
        self.version = 0
        self.pending: list[tuple[int, int, EventBase]] = []  # events not yet delivered, by event time (verdicts)
        self.timeline: list[tuple[int, int, object]] = []  # this cycle's (time, order, rollout or event)
        self.order = 0
        self.offset = 0

    def builder(self, org: str, kind: str) -> BatchBuilder:
        """The cohort's builder (made on the cohort's first record, at the serving version)."""
        key = cohort_of(org, kind)
        if key not in self.builders:
            self.builders[key] = BatchBuilder(self.bcfg, serving_version=self.version)
            self.cohort_org[key] = org
        return self.builders[key]

    def window(self, cycle: int) -> tuple[int, int]:
        """Cycle ``cycle``'s event time: (start, end) in ms."""
        start = T0 + (cycle - 1) * self.cycle_minutes * MINUTE
        return start, start + self.cycle_minutes * MINUTE

    def serve(
        self,
        cycle: int,
        tasks: Sequence[Task],
        completions: Sequence[list[int]],
        logps: Sequence[list[float]],
        react: React,
    ) -> None:
        """Rollouts of ``tasks`` (``group_size`` consecutive samples of one prompt each) served by the current
        version in a burst at the cycle's start, at ``rate`` prompts a second; each sample's user (one of 50 of
        its org, drawn from ``world_rng`` in sample order) reacts through ``react``, its events waiting in
        event-time order for :meth:`deliver`."""
        group_size, (start, _) = self.group_size, self.window(cycle)
        gap = max(1, round(1000 / (self.rate * group_size)))
        rec = Recorder()
        for i, (task, comp, lp) in enumerate(zip(tasks, completions, logps)):
            t = start + i * gap
            tid = f"c{cycle}-{i}"
            ro = Rollout(
                trajectory_id=tid,
                policy_version=self.version,
                group_id=f"c{cycle}-g{i // group_size}",
                group_size=group_size,
                org_id=task.org_id,
                task_kind=task.kind,
                prompt_ids=task.prompt,
                completion_ids=comp,
                behaviour_logprobs=lp,
                loss_mask=[1] * COMPLETION_LEN,
                created_at=t,
            )
            self.timeline.append((t, self.order, ro))
            self.order += 1
            user = f"{task.org_id}-u{self.world_rng.randrange(50)}"
            user_hash = hash_user(user, self.settings.sdk.salt)
            rec.record(
                TrajectoryStarted(
                    event_id=f"{tid}-start",
                    trajectory_id=tid,
                    ts=t,
                    org_id=task.org_id,
                    user_hash=user_hash,
                    policy_version=self.version,
                    arm="control",
                    task_kind=task.kind,
                )
            )
            # the recorder stands in for the SDK client: the handle records the user's events through it
            traj = Trajectory(rec, tid, task.org_id, user_hash, self.version, "control")  # type: ignore[arg-type]
            react(traj, task, outcome(task, comp), t, user)
        for ev in rec.events:
            heapq.heappush(self.pending, (ev.ts, self.order, ev))
            self.order += 1

    def deliver(self, end: int) -> tuple[list[tuple[str, MicroBatch]], int]:
        """This cycle's rollouts and the events due before ``end``, in event-time order, through the processor and
        the builders; then every builder advanced to ``end``. Returns (the micro-batches made, each with its
        cohort's org, in the order made; how many verdicts arrived)."""
        verdicts = 0
        timeline, self.timeline = self.timeline, []
        while self.pending and self.pending[0][0] < end:
            ts, o, ev = heapq.heappop(self.pending)
            verdicts += type(ev) is TaskVerdict
            timeline.append((ts, o, ev))
        timeline.sort(key=lambda x: (x[0], x[1]))
        batches: list[tuple[str, MicroBatch]] = []
        for ts, _, item in timeline:
            if isinstance(item, Rollout):
                batches += [(item.org_id, b) for b in self.builder(item.org_id, item.task_kind).add_rollout(item)]
                continue
            assert isinstance(item, EventBase)
            msg = Message(item.trajectory_id.encode(), self.codec.encode(item), 0, self.offset)
            out = self.processor.process([msg], now_ms=ts)
            self.offset += 1
            for r in out.rewards:
                batches += [(r.org_id, b) for b in self.builder(r.org_id, r.task_kind).add_reward(r)]
        for key, builder in self.builders.items():
            org = self.cohort_org[key]
            batches += [(org, b) for b in builder.advance_to(end)]
            batches += [(org, b) for b in builder.flush_ready()]
        return batches, verdicts

    def train(
        self,
        model: object,
        reference: object,
        batches: list[MicroBatch],
        run_id: str,
        optimizer: torch.optim.Optimizer | None = None,
        served_by: Callable[[Batch], str | None] | None = None,
    ) -> list[TrainStep]:
        """The shared policy's whole steps on this cycle's ``batches`` (and the last remainder), at the serving
        version (:func:`train_steps`; ``optimizer``: one kept across cycles, None = a new one each cycle;
        ``served_by``: :func:`trainer.train.train`'s)."""
        steps, self.leftover = train_steps(
            model,
            reference,
            self.settings,
            batches,
            self.leftover,
            run_id,
            self.version,
            self.trained,
            optimizer=optimizer,
            served_by=served_by,
        )
        return steps

    def promote(self) -> int:
        """The trained policy is the next version and serves (no gate): the builders count policy lags from it.
        Returns the new version."""
        self.version += 1
        for b in self.builders.values():
            b.set_serving_version(self.version)
        return self.version

    @property
    def dropped(self) -> int:
        """Samples the builders dropped as too old, so far."""
        return sum(sum(b.dropped_lag.values()) for b in self.builders.values())


def train_steps(
    model: object,
    reference: object,
    settings: Settings,
    batches: list[MicroBatch],
    leftover: list[MicroBatch],
    run_id: str,
    policy_version: int,
    trained: TrainedSet,
    adapter: str = "",
    adapter_base: str = "",
    optimizer: torch.optim.Optimizer | None = None,
    served_by: Callable[[Batch], str | None] | None = None,
) -> tuple[list[TrainStep], list[MicroBatch]]:
    """Train ``leftover + batches`` in whole steps (``train.micro_batches_per_step``) through the wire format;
    returns (the steps' train_metrics, the remainder that waits for the next cycle). ``adapter``: train that
    org's adapter (its batches only, the base frozen; ``reference`` None = the base alone). ``optimizer``: one kept
    across calls (``Policy.optimizer``); None = a new one each call. ``served_by``: the adapter that
    served a batch's samples, active in its forward pass (``Hooks.served_by``; shared-policy runs)."""
    todo = leftover + batches
    mbps = settings.train.micro_batches_per_step
    n = len(todo) // mbps * mbps
    todo, rest = todo[:n], todo[n:]
    wire = [to_batch(encode_batch(mb), 0, k) for k, mb in enumerate(todo)]
    run = {"adapter": adapter, "adapter_base": adapter_base} if adapter else {}
    tc = TrainConfig.from_settings(
        settings, run_id=run_id, steps=10**9, checkpoint_dir="", idle_timeout_s=0.01, resume=False, **run
    )
    source = MemorySource(wire)
    policy = Policy(model, reference, optimizer, policy_version, trained)
    steps = train(policy, lambda _offsets: source, tc, Hooks(served_by=served_by))
    return steps, rest
