"""The closed loop: serve -> events and rollouts -> rewards -> micro-batches -> train -> eval gate -> promote.

By default one process runs every part: each flow part as an in-process Bytewax run (a thread,
stopped cleanly at the end), the policy server (:mod:`simulator.serve`) and the trainer
(:func:`trainer.train.train`) on the main thread. The flows come from the caller
(:meth:`Loop.start_flows`), which takes them from ``app.parts.PART_LIST``. With ``loop.processes`` each part is its
own process (:mod:`app.parts`) under :mod:`app.supervisor`; :class:`Loop` is then the trainer's.
A cycle:

1. the policy server (a thread) serves ``loop.rate`` tasks per second without pause,
   ``loop.group_size`` samples each, with the newest promotion announced on ``rtrl.deployments``:
   rollouts to ``rtrl.rollouts``, the simulated users' events through the SDK to ``rtrl.events``;
2. the reward flow turns the events into rewards, the batch flow joins them with the rollouts into
   micro-batches on ``rtrl.batches``;
3. the trainer trains on them until it has used ``loop.samples_per_cycle`` samples (trigger:
   samples) or ``loop.cycle_max_s`` passed (trigger: wall time), then writes a checkpoint: the
   candidate;
4. the eval gate scores the candidate on held-out tasks against the serving version and the first
   one (solve rate may not drop beyond ``loop.solve_tolerance``; the behaviour of sampled
   completions - broken tool calls, clarifying questions, edits - is judged by the monitors' alert
   rules; a move counts only when Fisher's exact test finds it at ``loop.gate_alpha``, Holm-corrected; a candidate trained by a step whose training-inference mismatch fired the mismatch alert,
   ``loop.mismatch_log_ratio_max`` / ``loop.mismatch_k3_max``, is refused). In A/B mode (``loop.ab_share``) a candidate that passes then serves a share of the
   traffic until the monitors can compare its live behaviour with the serving version's in
   ClickHouse; an alert rejects it. Promotion or rejection, with the reason, goes to ClickHouse
   ``checkpoints`` and ``rtrl.deployments`` (a promoted Hugging Face model is first exported to the model
   registry, :mod:`trainer.registry`, and the announcement names the export and its hash); a rejected
   candidate's weights are dropped unless ``loop.reset_on_reject`` is off. :func:`app.deployments.rollback` (``rtrl rollback``)
   undoes a promotion.

The trainer checkpoints every ``loop.checkpoint_every`` steps within a cycle and writes
``loop/state.json`` before announcing each decision, so a trainer killed at any point resumes
without losing a decision or training a micro-batch twice (:mod:`trainer.dedup`).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import torch
from bytewax.testing import run_main
from confluent_kafka import Producer
from rich.console import Console

from app.adapters import AdapterDecision, OrgAdapters, ServedThrough, describe
from app.deployments import announce
from app.flow_state import Flow, recovery_config
from app.job import FinalAB, final_ab
from app.loop_config import (
    SAMPLES_PER_STEP,
    cycle_run_id,
    loop_settings,
)
from app.serving import loop_model_config, policy_server, serve_until
from client.sdk import RtrlClient
from evalgate import EvalSuite, GateRules, run_gate
from flows.counts import FlowCounts
from flows.reward_versions import register_settings
from monitors.alerts import MismatchRule
from monitors.queries import Side, cohort_users, user_sums, users_of
from monitors.stats import CohortMonitor, Sequential
from rewards.versions import registry
from rtrl import clickhouse, metrics
from rtrl.errors import ConfigError
from rtrl.files import private_dir, write_private
from rtrl.kafka import connection, producer_config
from rtrl.sections.trainer import TrainConfig
from rtrl.settings import Settings
from schemas.codec import JsonCodec
from schemas.records import Checkpoint, CheckpointStatus, TrainStep
from simulator.evalsuite import HeldOutTasks
from simulator.policy import warm_start
from simulator.serve import PolicyServer
from simulator.tasks import conventions_for, sample_task
from trainer import checkpoint
from trainer.batch import BatchLimits
from trainer.data import BatchStream
from trainer.dedup import TrainedSet
from trainer.factory import Policy, build_policy
from trainer.registry import export_checkpoint
from trainer.train import Hooks, train

log = logging.getLogger("rtrl.loop")


def reward_switch_path(settings: Settings) -> Path:
    """Where `rtrl rewards train V` leaves its request for the trainer (read at each cycle's start)."""
    return settings.data_path / "loop" / "reward_switch.json"


def request_reward_switch(settings: Settings, version: str) -> Path:
    """Ask the loop's trainer to train on reward version ``version`` from its next cycle on (the cycle in
    progress keeps its version) until another request: it overrides ``rewards.train_schedule``; a fresh
    ``rtrl run`` forgets it. The batch flow must make micro-batches for it (``rewards.trainable()``)."""
    registry(settings).check([version], "rtrl rewards train")
    if version not in settings.rewards.trainable():
        raise ConfigError(
            f"the batch flow makes micro-batches for {settings.rewards.trainable()} only, not {version!r}: the "
            f"trainer would get nothing to train; fix: add {version!r} to rewards.versions and "
            "rewards.batch_versions (RTRL_REWARDS__BATCH_VERSIONS) and restart the flows, then ask again"
        )
    path = reward_switch_path(settings)
    if not (path.parent / "state.json").exists():
        raise ConfigError(
            f"no loop has run in data_dir {settings.data_path} (no {path.parent / 'state.json'}): nothing to switch; "
            "fix: run this where the loop's trainer runs (the same data_dir), or, for a run not started yet, set "
            "rewards.train_version or rewards.train_schedule"
        )
    return write_private(
        path, json.dumps({"reward_version": version, "requested_at": time.time_ns() // 1_000_000}).encode()
    )


def requested_reward(settings: Settings, cycle: int) -> str:
    """The reward version cycle ``cycle`` should train on: the last `rtrl rewards train` request (the file
    :func:`request_reward_switch` writes), else ``rewards.train_schedule``, else ``rewards.train_version``.
    A request for a version the batch flow makes no micro-batches for is ignored, with a warning."""
    rs = settings.rewards
    wanted = rs.scheduled(cycle)
    path = reward_switch_path(settings)
    if path.exists():
        try:
            request = json.loads(path.read_text())
            asked = str(request.get("reward_version", "")) if isinstance(request, dict) else ""
        except (OSError, UnicodeDecodeError, ValueError) as e:
            log.warning("ignoring %s: not a request rtrl wrote (%s); fix: run `rtrl rewards train V` again", path, e)
            return wanted
        if asked in rs.trainable():
            wanted = asked
        else:
            log.warning(
                "ignoring the request to train on reward version %r (%s): the batch flow makes micro-batches for %s "
                "only; fix: add it to rewards.batch_versions and restart the batch flow",
                asked,
                path,
                rs.trainable(),
            )
    return wanted


class Stopped(Exception):
    """The loop was asked to stop (SIGTERM/SIGINT) mid-cycle: the trainer saved what it trained (its step
    checkpoint, with the offsets and what it has seen) and made no decision; a restart resumes there."""


class _StoppableSource:
    """The trainer's micro-batch source, ending its waits when the loop stops. Its ``position`` is the
    committed one: a checkpoint taken after a step left half-read never skips what that step had read."""

    def __init__(self, source: BatchStream, stop: threading.Event):
        self.source, self.stop = source, stop

    def get(self, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set():
            b = self.source.get(max(0.0, min(0.5, deadline - time.monotonic())))
            if b is not None or time.monotonic() >= deadline:
                return b
        return None

    def position(self) -> dict[str, int]:
        return self.source.committed_position()

    def __getattr__(self, name: str):
        return getattr(self.source, name)


@dataclass
class CycleResult:
    version: int
    parent: int
    status: str
    reason: str
    eval: dict[str, float]
    steps: list[TrainStep] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    adapters: list[AdapterDecision] = field(default_factory=list)  # the cycle's per-org adapter decisions

    def lines(self, markup: bool = False) -> list[str]:
        """What every runner prints for the cycle: its decision, then each org adapter's (rich markup or plain)."""
        status = f"[{'green' if self.status == 'promoted' else 'red'}]{self.status}[/]" if markup else self.status
        head = (
            f"v{self.version} <- v{self.parent}: {status} after {len(self.steps)} steps "
            f"({self.seconds['train']:.0f}s): {self.reason}"
        )
        return [head] + [describe(a, markup=markup) for a in self.adapters]


#: what the A/B mode guards live, per user, with the direction that is bad (the monitors' default rules' metrics
#: that are ratios of per-user sums)
AB_GUARDS: dict[str, str] = {
    "broken_tool_call_rate": "increase",
    "edit_rate": "decrease",
    "clarification_rate": "increase",
    "edit_persistence": "decrease",
    "dissatisfied_rate": "increase",
    "latency_mean_ms": "increase",
}


def loop_gate_rules(settings: Settings) -> GateRules:
    """The loop's default gate: ``loop.solve_tolerance``, the test's ``loop.gate_alpha`` and the training-inference
    mismatch limits (``loop.mismatch_k3_max``, ``loop.mismatch_log_ratio_max``) on the candidate's training steps."""
    ls = settings.loop
    return GateRules(
        solve_tolerance=ls.solve_tolerance,
        alpha=ls.gate_alpha or None,
        mismatch=MismatchRule(k3=ls.mismatch_k3_max, max_abs_log_ratio=ls.mismatch_log_ratio_max),
    )


class Loop:
    """The loop's trainer and eval gate; in one process (``serve=True``) also the flows and the policy server.

    :meth:`initial` or :meth:`resume`, then :meth:`cycle` as often as wanted. Its state
    (``loop/state.json``: versions, evaluations, offsets, what was trained, an announcement not yet
    confirmed) is written at every decision and the trainer checkpoints every
    ``loop.checkpoint_every`` steps within a cycle, so a trainer killed at any point resumes where its
    last checkpoint left off.

    ``suite`` scores candidates (default: :class:`simulator.evalsuite.HeldOutTasks` of ``loop.eval_tasks``
    tasks) and ``rules`` judge the scores and the candidate's training steps (default: :func:`loop_gate_rules`)."""

    def __init__(
        self,
        settings: Settings,
        bootstrap: str,
        ch,
        serve: bool = True,
        suite: EvalSuite | None = None,
        rules: GateRules | None = None,
    ):
        self.settings, self.bootstrap, self.ch = loop_settings(settings), bootstrap, ch
        s, ls = self.settings, self.settings.loop
        self.db = s.clickhouse.database
        self.deny = clickhouse.deny_watch(s)  # the trainer refuses samples of an erased subject (`rtrl erase`)
        self.ckpt_root = s.data_path / "loop" / "checkpoints"
        private_dir(self.ckpt_root)
        self.state_path = s.data_path / "loop" / "state.json"
        cfg, precision = loop_model_config(s)
        self.cfg = cfg  # what a promotion is exported as (trainer.registry)
        torch.manual_seed(ls.seed)
        policy = build_policy(cfg, precision)
        self.model, self.reference = policy.model, policy.reference
        self.suite: EvalSuite = suite if suite is not None else HeldOutTasks(ls.eval_tasks, ls.seed)
        self.rules = rules if rules is not None else loop_gate_rules(self.settings)
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.flows: list[Flow] = []  # the flows on threads here (start_flows)
        self.flow_counts: dict[str, FlowCounts] = {}  # what each of them moved
        self.offsets: dict[str, int] | None = None
        self.producer = Producer(producer_config(connection(s.kafka, bootstrap), s.kafka.compression))
        self.server: PolicyServer | None = None
        if serve:
            self.client = RtrlClient.from_settings(s, bootstrap=bootstrap)
            self.server = policy_server(s, bootstrap, self.client, seed=ls.seed)
        self.version = self.serving = 0
        self.weights = self.ckpt_root / "v0"  # what the next cycle starts from
        self.trained = TrainedSet()  # micro-batches and samples already trained (replays are skipped)
        self.cycle_reward: str | None = None  # the reward version of the cycle in progress (fixed at its start)
        self.cycle_reward_checksum = ""  # its checksum then (what the checkpoint records)
        self.cycle_on_policy = 0  # samples of the serving version this cycle has trained on
        self.evals: dict[int, dict[str, float]] = {}
        self.adapters: OrgAdapters | None = None  # per-org adapters (adapters.orgs), trained after each cycle
        if s.adapters.orgs:
            self.adapters = OrgAdapters(
                s,
                bootstrap,
                ch,
                cfg,
                precision,
                self.ckpt_root / "adapters",
                conventions_for(ls.orgs, ls.specialised_orgs),
                self.rules,
                self.announce,
                self._save_state,
                lambda st: clickhouse.insert(self.ch, self.db, "train_metrics", [st]),
            )
        # adapters.shared_traffic = "served": the shared policy trains an adapted org's samples through the adapter
        # version that served them (loaded, frozen, into its model before each cycle)
        self.served: ServedThrough | None = None
        if self.adapters is not None and s.adapters.shared_traffic == "served":
            if s.parallel.pp > 1:
                raise ConfigError(
                    f"adapters.shared_traffic = 'served' trains the shared policy through LoRA adapters, which need "
                    f"parallel.pp = 1 (it is {s.parallel.pp}); fix: set parallel.pp = 1, or adapters.shared_traffic "
                    "= 'all'"
                )
            self.served = ServedThrough(self.model)

    # ------------------------------------------------------------ parts

    def _flows(self, settings: Settings, stop: threading.Event) -> list[tuple[str, Any, dict[str, Any]]]:
        """(name, dataflow, ``run_main``'s keyword arguments) of each flow :meth:`start_flows` was given, with
        Bytewax recovery in ``<data_dir>/recovery/<name>`` (what ``--resume`` continues from after a crash)."""
        out = []
        for f in self.flows:
            flow = f.build(settings, self.bootstrap, stop, self.flow_counts[f.name], None)
            # snapshots at Bytewax's default 10 s, not flow.snapshot_s: each one pickles the partition's
            # windows, closed ones included until allowed_lateness, so on two shared cores a 2 s epoch made
            # the main job's cycles grow from ~15 s to ~100 s by cycle 9 (bench/RESULTS.md); a crash
            # replays at most 10 s of events from Kafka, exactly once either way
            kwargs = {
                "recovery_config": recovery_config(settings, f),
                "epoch_interval": timedelta(seconds=max(10.0, settings.flow.snapshot_s)),
            }
            out.append((f.name, flow, kwargs))
        return out

    def start_flows(self, flows: Sequence[Flow]) -> None:
        """Each flow as a thread (:meth:`_flows`), in the order given: the parts' (``app.parts.PART_LIST``)."""
        self.flows = list(flows)
        self.flow_counts = {f.name: FlowCounts() for f in self.flows}
        for name, flow, kwargs in self._flows(self.settings, self.stop):
            t = threading.Thread(target=run_main, args=(flow,), kwargs=kwargs, name=f"{name}-flow", daemon=True)
            t.start()
            self.threads.append(t)

    def stop_flows(self, timeout_s: float = 30.0) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout_s)

    def drain_flows(self) -> None:
        """How a run ends: the policy server stops first and sends what it still holds, then each flow runs from
        its recovery state to the end of its topics and closes every window still open. Afterwards every
        event served has its reward in ClickHouse, so what reads the rewards at the end reads the whole run."""
        self.stop_flows()  # the server's thread and the flows' threads: every one of them stops at a snapshot
        if self.server is not None:  # the users' persistence checks still due go out now
            self.server.close()
            self.client.close()
            self.server = None
        if any(t.is_alive() for t in self.threads):
            log.warning("a flow did not stop within its wait: the flows are not drained, rewards may be missing")
            return
        drained = self.settings.updated({f.tail: False for f in self.flows})
        for _, flow, kwargs in self._flows(drained, threading.Event()):  # one after the other, to their ends
            run_main(flow, **kwargs)

    def flow_summaries(self) -> list[str]:
        """One line per in-process flow: what it read and wrote in this process (after :meth:`stop_flows`; a flow
        that did not stop within its wait is said to be counted so far)."""
        partial = " (still stopping: counted so far)" if any(t.is_alive() for t in self.threads) else ""
        return [f.summary(self.flow_counts[f.name], self.settings, None) + partial for f in self.flows]

    def announce(self, ck: Checkpoint) -> None:
        announce(self.settings, self.ch, self.producer, ck)

    def _checkpoint(
        self,
        version: int,
        parent: int | None,
        steps: list[TrainStep],
        status: CheckpointStatus,
        reason: str,
        ev: dict[str, float],
        path: Path,
        reward: str = "",
    ) -> Checkpoint:
        tokens = sum(s.tokens for s in steps)
        ev = ev | {"eval_samples": float(self.suite.samples)}  # what the eval's rates are over (their intervals)
        if tokens:
            ev = ev | {"on_policy_fraction": sum(s.on_policy_fraction * s.tokens for s in steps) / tokens}
        return Checkpoint(
            version=version,
            parent=parent,
            created_at=time.time_ns() // 1_000_000,
            steps=len(steps),
            samples=sum(sum(s.lag_histogram.values()) for s in steps),
            tokens=tokens,
            eval_results=ev,
            status=status,
            reason=reason,
            kafka_offsets=self.offsets or {},
            path=str(path),
            reward_version=reward,
            reward_checksum=self.cycle_reward_checksum if reward else "",
        )

    # ------------------------------------------------------------ the trained reward version

    def _start_cycle_reward(self, cycle: int) -> str:
        """Fix the cycle's reward version at its start (kept by a resumed cycle: the version changes only at a
        cycle boundary), registered in ClickHouse before anything trains on it."""
        rs = self.settings.rewards
        if self.cycle_reward is None:
            self.cycle_reward = requested_reward(self.settings, cycle)
            reg = register_settings(self.settings, [self.cycle_reward], client=self.ch)
            self.cycle_reward_checksum = reg[self.cycle_reward].checksum
            self._save_state([])
        elif self.cycle_reward not in rs.trainable() or self.cycle_reward not in registry(self.settings):
            raise ConfigError(
                f"the cycle in progress (v{cycle}) trains on reward version {self.cycle_reward!r}, which the settings "
                f"no longer define or make micro-batches for ({rs.trainable()}); its version changes only at a cycle "
                "boundary; fix: list it in rewards.versions and rewards.batch_versions until this cycle ends, or "
                "start afresh (rtrl run without --resume)"
            )
        return self.cycle_reward

    def begin(self, resume: bool = True) -> str:
        """Continue the run the data folder holds (``resume``) or make the warm start; the line that says which."""
        if resume and self.resume():
            return f"resumed: {self.version} decisions made, serving v{self.serving}"
        self.initial()
        return (
            f"v0 (warm start): held-out solve rate {self.evals[0]['solve_rate']:.3f}, broken calls "
            f"{self.evals[0]['broken_tool_call_rate']:.3f}"
        )

    def run_cycles(self, report: Callable[[CycleResult], object], stop: threading.Event | None = None) -> None:
        """The one driver loop of the main job, whichever runner runs it: a cycle at a time, each reported, until
        ``loop.cycles`` decisions exist or ``stop`` is set."""
        while self.version < self.settings.loop.cycles and not (stop is not None and stop.is_set()):
            report(self.cycle())

    def initial(self) -> None:
        """Version 0: the warm-started policy, promoted without a gate."""
        ls = self.settings.loop
        path = self.ckpt_root / "v0"
        if checkpoint.is_complete(path):  # made before a crash that came ahead of the state file
            checkpoint.load(path, self.model, restore_rng=False)
        else:
            rng = random.Random(ls.seed)
            warm_start(
                self.model,
                [sample_task(rng, "warm", ls.hard_share) for _ in range(500)],
                steps=ls.warm_start_steps,
                seed=ls.seed,
                right_easy=ls.warm_right_easy if ls.warm_right_easy >= 0 else None,
            )
            checkpoint.save(path, self.model, extra={"version": 0})
        self.reference.load_state_dict(self.model.state_dict())  # the KL reference: version 0
        self.evals[0] = self.suite.evaluate(self.model)
        v0 = self._checkpoint(0, None, [], "promoted", "initial policy (warm start)", self.evals[0], path)
        self._decide([export_checkpoint(self.settings, self.model, self.cfg, v0)])

    # ------------------------------------------------------------ state (what a restarted trainer resumes)

    def _save_state(self, pending: list[Checkpoint]) -> None:
        codec: JsonCodec[Checkpoint] = JsonCodec(Checkpoint)
        state = {
            "version": self.version,
            "serving": self.serving,
            "weights": str(self.weights),
            "offsets": self.offsets,
            "evals": {str(v): e for v, e in self.evals.items()},
            "trained": self.trained.state(),
            "cycle_reward": self.cycle_reward,
            "cycle_reward_checksum": self.cycle_reward_checksum,
            "pending": [json.loads(codec.encode(c)) for c in pending],
            "adapters": self.adapters.state() if self.adapters is not None else {},
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)

    def _decide(self, announcements: list[Checkpoint]) -> None:
        """Record the decision in the state file first, then announce it: a crash in between re-announces
        it on resume (announcements are idempotent), so no decision is lost or taken twice."""
        self._save_state(announcements)
        for ck in announcements:
            self.announce(ck)
        self._save_state([])

    def resume(self) -> bool:
        """Continue a loop this data folder already ran (False when there is none)."""
        if not self.state_path.exists():
            return False
        st = json.loads(self.state_path.read_text())
        checkpoint.load(self.ckpt_root / "v0", self.reference, restore_rng=False)
        self.weights = Path(st["weights"])
        checkpoint.load(self.weights, self.model, restore_rng=False)
        self.version, self.serving, self.offsets = st["version"], st["serving"], st["offsets"]
        metrics.SERVING_VERSION.labels(part="train").set(self.serving)
        self.evals = {int(v): e for v, e in st["evals"].items()}
        self.trained = TrainedSet(st["trained"])
        self.cycle_reward = st.get("cycle_reward")
        self.cycle_reward_checksum = st.get("cycle_reward_checksum", "")
        if self.adapters is not None:
            self.adapters.restore(st.get("adapters", {}))
        pending = [msgspec.convert(c, Checkpoint) for c in st["pending"]]
        for ck in pending:
            self.announce(ck)
        self._save_state([])
        return True

    def _cycle_done(self, wanted: int, deadline: float) -> bool:
        """Samples trigger (``wanted`` samples of the serving version), wall-time trigger, or the
        serving version's samples have dried up after at least half of ``wanted`` (samples that never
        get a reward - e.g. broken calls under v1-discard-broken - never arrive)."""
        if self.stop.is_set():
            return True
        now, done = time.monotonic(), self.cycle_on_policy
        self._progress.append((now, done))
        while len(self._progress) > 1 and self._progress[1][0] <= now - 3.0:
            self._progress.popleft()  # keep the newest point at least 3 s old (steps may be further apart)
        dried_up = now - self._progress[0][0] >= 2.0 and done - self._progress[0][1] < SAMPLES_PER_STEP // 2
        return done >= wanted or now > deadline or (dried_up and done >= wanted // 2)

    def _on_step(self, st: TrainStep) -> None:
        self.cycle_on_policy += st.lag_histogram.get("0", 0)
        clickhouse.insert(self.ch, self.db, "train_metrics", [st])

    def start_server(self) -> None:
        if self.server is None:
            raise RuntimeError("this Loop was made with serve=False: the policy server runs elsewhere")
        t = threading.Thread(
            target=serve_until, name="policy-server", daemon=True, args=(self.server, self.settings.loop, self.stop)
        )
        t.start()
        self.threads.append(t)

    def cycle(self) -> CycleResult:
        """Train on the cycle's samples (or until the wall-time trigger), then gate the candidate.
        Resumes a cycle a killed trainer left half done from its newest step checkpoint."""
        s, ls = self.settings, self.settings.loop
        times: dict[str, float] = {}
        t = time.monotonic()
        serving, version = self.serving, self.version + 1
        reward = self._start_cycle_reward(version)
        run_id, cycle_dir = cycle_run_id(ls.seed, version), self.ckpt_root / "train" / f"v{version}"
        last = checkpoint.latest(cycle_dir)
        resumed = checkpoint.read_extra(last)["step"] if last is not None else 0
        # steps after the checkpoint being resumed never reached weights that survive: forget them
        self.ch.command(f"DELETE FROM {self.db}.train_metrics WHERE run_id = '{run_id}' AND step > {int(resumed)}")
        self.cycle_on_policy = int(
            self.ch.query(
                f"SELECT sum(lag_histogram['0']) FROM {self.db}.train_metrics FINAL WHERE run_id = '{run_id}'"
            ).result_rows[0][0]
            or 0
        )
        streams: list[BatchStream] = []

        def make_source(offsets):
            streams.append(
                BatchStream(
                    self.bootstrap,
                    s.topic("batches"),
                    s.topic("dead_letters"),
                    start=offsets,
                    timeout_s=s.kafka.timeout_s,
                    limits=BatchLimits.from_settings(s),
                    deny=self.deny,
                )
            )
            return _StoppableSource(streams[-1], self.stop)

        # the samples trigger: most of what this version serves (the policy server serves about
        # samples_per_cycle per version and decision; some never get a reward, e.g. the broken
        # trajectories v1-discard-broken drops), counting only samples of the serving version; older
        # ones met on the way are trained too (one version late, importance-corrected)
        wanted = int(0.98 * ls.samples_per_cycle)
        self._progress: collections.deque[tuple[float, int]] = collections.deque()  # (monotonic s, samples done)
        tc = TrainConfig.from_settings(
            s,
            run_id=run_id,
            steps=10**9,
            checkpoint_every=ls.checkpoint_every,
            # step checkpoints make a killed trainer resumable: only where it is its
            # own process
            checkpoint_dir=str(cycle_dir) if self.server is None else "",
            idle_timeout_s=min(30.0, ls.cycle_max_s),
            reward_version=reward,
        )
        deadline = time.monotonic() + ls.cycle_max_s
        if self.served is not None and self.adapters is not None:
            self.served.sync(self.adapters.ledger, serving - max(s.train.max_policy_lag, s.train.max_delayed_lag))
        train(
            Policy(self.model, self.reference, version=serving, trained=self.trained),
            lambda offsets: make_source(offsets if offsets is not None else self.offsets),
            tc,
            Hooks(self._on_step, lambda: self._cycle_done(wanted, deadline), self.served),
        )
        for st in streams:
            st.close()
        if self.stop.is_set():  # the step checkpoint holds what was trained; no decision without the whole cycle
            raise Stopped(f"stopped during cycle {version}")
        self.offsets = streams[-1].committed_position()
        steps = clickhouse.select(self.ch, self.db, "train_metrics", f"WHERE run_id = '{run_id}' ORDER BY step")
        times["train"] = time.monotonic() - t
        t = time.monotonic()
        path = self.ckpt_root / f"v{version}"
        if not checkpoint.is_complete(path):  # (a resumed cycle may have written it before the crash)
            checkpoint.save(path, self.model, extra={"version": version, "offsets": self.offsets})
        ev, verdict = run_gate(self.suite, self.model, self.evals[serving], self.evals[0], self.rules, training=steps)
        ok, reason = verdict.promote, verdict.reason
        if not steps:
            ok, reason = False, "no micro-batch arrived within the cycle's wall time"
        candidate = self._checkpoint(version, serving, steps, "candidate", "trained", ev, path, reward)
        self.announce(candidate)
        if ok and ls.ab_share > 0:
            ok, reason = self.ab_test(version, serving, reason)
        status: CheckpointStatus = "promoted" if ok else "rejected"
        self.version, self.evals[version] = version, ev
        if ok:
            self.serving, self.weights = version, path
        elif ls.reset_on_reject:  # back to the serving weights: the next candidate starts from what serves
            checkpoint.load(self.ckpt_root / f"v{serving}", self.model, restore_rng=False)
            self.weights = self.ckpt_root / f"v{serving}"
        else:
            self.weights = path
        self.trained.prune(self.serving - max(s.train.max_policy_lag, s.train.max_delayed_lag))  # delayed too
        decision = self._checkpoint(version, serving, steps, status, reason, ev, path, reward)
        if ok:  # the promoted weights go to the model registry, which the announcement names (trainer.registry)
            decision = export_checkpoint(s, self.model, self.cfg, decision)
        self.cycle_reward = None  # the next cycle chooses again (saved with the decision)
        self._decide([candidate, decision])
        shutil.rmtree(cycle_dir, ignore_errors=True)  # decided: the cycle's step checkpoints are not needed
        times["eval"] = time.monotonic() - t
        adapters: list[AdapterDecision] = []
        if self.adapters is not None:  # each org's adapter, on the base that serves now (app.adapters)
            t = time.monotonic()
            adapters = self.adapters.cycle(self.serving, self.ckpt_root / f"v{self.serving}")
            times["adapters"] = time.monotonic() - t
        return CycleResult(version, serving, status, reason, ev, steps, times, adapters)

    def ab_test(self, candidate: int, serving: int, offline: str) -> tuple[bool, str]:
        """A/B mode: the announced candidate serves ``loop.ab_share`` of the users (randomised by user) while an
        always-valid sequential test per guarded metric (:data:`AB_GUARDS`; mSPRT on the relative change, per-user
        figures from ClickHouse, ``loop.ab_alpha`` split over the metrics, CUPED with each user's pre-period on the
        serving version when ``loop.ab_cuped``) looks every half second. The experiment starts at the candidate
        arm's first trajectory (before it the policy server had not loaded it); a user seen in both arms (served
        before the switch) is left out of the control arm. A metric found worse at any look rolls the candidate
        back at once; so does one found worse within a single org (:class:`monitors.stats.CohortMonitor`, a hack
        confined to one org's users); it is promoted after ``loop.ab_trajectories`` candidate trajectories once every
        metric has been judged (enough users per arm) and none found worse. Half of ``loop.ab_alpha`` goes to the
        arms overall, half to the orgs; looking this often keeps the false-alarm rate of all of them at
        ``loop.ab_alpha``."""
        ls = self.settings.loop
        each = ls.ab_alpha / 2 / len(AB_GUARDS)  # half of alpha for the arms overall, half for the orgs
        tests = {m: Sequential(tau=ls.ab_tau, alpha=each, min_users=20, cuped=ls.ab_cuped) for m in AB_GUARDS}
        orgs = [f"org-{i}" for i in range(ls.orgs)]
        cohorts = CohortMonitor(orgs, AB_GUARDS, alpha=ls.ab_alpha / 2, min_users=20)
        treatment, control = Side(candidate, "candidate"), Side(serving, "control")
        deadline = time.monotonic() + ls.cycle_max_s
        n, looks, since = 0, 0, None
        pre: dict[str, dict[str, float]] | None = None
        judged: dict[str, bool] = dict.fromkeys(AB_GUARDS, False)
        while time.monotonic() < deadline:
            if since is None:  # the experiment starts with the candidate arm's first trajectory
                first = self.ch.query(
                    f"SELECT toUnixTimestamp64Milli(min(first_event_ts)), count() FROM {self.db}.trajectories FINAL "
                    f"WHERE policy_version = {int(candidate)} AND arm = 'candidate'"
                ).result_rows[0]
                if not first[1]:
                    time.sleep(0.5)
                    continue
                since = int(first[0])
                # CUPED's covariate: each user's behaviour on the serving version before the experiment
                pre = user_sums(self.ch, self.db, control, until_ms=since) if ls.ab_cuped else None
            cand = user_sums(self.ch, self.db, treatment, since_ms=since)
            ctrl = {u: v for u, v in user_sums(self.ch, self.db, control, since_ms=since).items() if u not in cand}
            n = int(sum(u["trajectories"] for u in cand.values()))
            looks += 1
            # a hack confined to one org (a few % of users) drowns overall: each org has its own tests
            per_org = cohort_users(self.ch, self.db, control, treatment, list(AB_GUARDS), since_ms=since)
            known = {org: by for org, by in per_org.items() if org in cohorts.cohorts}
            alarms = cohorts.look(known)
            if alarms:
                return False, f"A/B alarm at look {looks} ({n} candidate trajectories), rolled back: " + "; ".join(
                    a.message for a in alarms
                )
            for metric, bad in AB_GUARDS.items():
                c, t = users_of(ctrl, metric, pre), users_of(cand, metric, pre)
                if min(c.n, t.n) < 2:
                    continue
                if c.mean == 0 and t.mean == 0:  # nothing in either arm yet (a rate of 0): no move to see
                    judged[metric] = min(c.n, t.n) >= tests[metric].min_users
                    continue
                try:
                    look = tests[metric].look(c, t)
                except ValueError:  # a control at 0 (no relative change yet), or CUPED pushed it there
                    continue
                judged[metric] = look.judged
                worse = look.low > 0 if bad == "increase" else look.high < 0
                if look.judged and look.decided and worse:
                    return False, (
                        f"A/B alarm at look {looks} ({n} candidate trajectories), rolled back: {metric} "
                        f"{look.comparison.relative:+.1%}, always-valid {1 - tests[metric].alpha:.1%} sequence "
                        f"[{look.low:+.1%}, {look.high:+.1%}], p = {look.p_value:.2g} < {tests[metric].alpha:.3g}"
                    )
            if n >= ls.ab_trajectories and all(judged.values()):
                break
            time.sleep(0.5)
        else:
            if n < ls.ab_trajectories:
                return False, f"A/B: only {n} candidate trajectories within {ls.cycle_max_s:g}s"
            waiting = ", ".join(m for m, ok in judged.items() if not ok)
            return (
                False,
                f"A/B: {n} candidate trajectories within {ls.cycle_max_s:g}s, too few users to judge {waiting}",
            )
        seen = ", ".join(
            f"{m} {t.looks[-1].comparison.relative:+.1%} [{t.looks[-1].low:+.1%}, {t.looks[-1].high:+.1%}]"
            for m, t in tests.items()
            if t.looks
        )
        return True, f"{offline}; A/B on {n} trajectories, {looks} looks, no metric worse ({seen})"

    def final_ab(self, console: Console) -> FinalAB | str:
        """The main job's ending (:func:`app.job.final_ab`) with this loop's producer, its final version and stop event."""
        return final_ab(self.settings, self.ch, self.producer, console, self.serving, self.stop)

    def close(self) -> None:
        self.stop_flows()
        if self.server is not None:
            self.server.close()
            self.client.close()
        self.producer.flush(10)
