"""The closed loop: serve -> events and rollouts -> rewards -> micro-batches -> train -> eval gate -> promote.

By default one process runs every part: the reward flow and the batch flow as in-process Bytewax
runs (threads, stopped cleanly at the end), the policy server (:mod:`simulator.serve`) and the
trainer (:func:`trainer.train.train`) on the main thread. With ``loop.processes`` each part is its
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
   candidate's weights are dropped unless ``loop.reset_on_reject`` is off. :func:`rollback` (``rtrl rollback``)
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
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch
from bytewax.testing import run_main
from confluent_kafka import Producer
from rich.console import Console

from app.adapters import AdapterDecision, OrgAdapters, ServedThrough, describe
from app.loop_config import (  # noqa: F401  # re-exported: app.loop is where callers found them
    LOOP_FIXED,
    LOOP_OWNS,
    MICRO_BATCHES_PER_STEP,
    ROWS,
    SAMPLES_PER_STEP,
    SEQ_LEN,
    cycle_run_id,
    loop_settings,
)
from client.screening import screen_for
from client.sdk import RtrlClient
from evalgate import EvalSuite, GateRules, run_gate
from flows.batch_flow import build_flow as batch_flow
from flows.batch_flow import summary as batch_summary
from flows.counts import FlowCounts
from flows.reward_flow import build_flow as reward_flow
from flows.reward_flow import summary as reward_summary
from flows.reward_versions import register_settings
from monitors.alerts import MismatchRule
from monitors.queries import ABRow, Side, cohort_users, live_ab, user_sums, users_of
from monitors.stats import CohortMonitor, Sequential
from rewards.versions import registry
from rtrl import clickhouse, metrics
from rtrl.errors import ConfigError, ServiceUnavailable
from rtrl.files import RUN_PARTS, check_cleanable, data_folder, private_dir, write_private
from rtrl.kafka import connection, producer_config, read_topic
from rtrl.settings import Settings
from schemas.codec import Invalid, JsonCodec
from schemas.records import Checkpoint, CheckpointStatus, Experiment, TrainStep
from simulator.evalsuite import HeldOutTasks
from simulator.policy import warm_start
from simulator.serve import PolicyServer
from simulator.tasks import VOCAB, conventions_for, sample_task
from simulator.tasks import decode as decode_tokens
from trainer import checkpoint
from trainer.batch import BatchLimits
from trainer.config import ModelConfig, PrecisionConfig, TrainConfig
from trainer.data import BatchStream
from trainer.dedup import TrainedSet
from trainer.factory import Policy, build, build_policy, model_config
from trainer.registry import export_checkpoint
from trainer.train import Hooks, train

if TYPE_CHECKING:
    from app.services import Services

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


def loop_model_config(settings: Settings) -> tuple[ModelConfig, PrecisionConfig]:
    """The policy every part of the loop builds (trainer, reference, policy server): the settings'
    ``model`` and ``precision`` sections (the tiny fp32 CPU model by default) over the simulator's
    vocabulary."""
    cfg, precision = model_config(loop_settings(settings, trains=False))  # train.* is not the model's
    if cfg.vocab_size != VOCAB:  # only with model.hf_path: otherwise LOOP_FIXED set it
        raise ConfigError(
            f"model.hf_path {settings.model.hf_path} has a vocabulary of {cfg.vocab_size:,} tokens; the closed loop's "
            f"tasks use the simulator's {VOCAB}-token vocabulary; fix: give a checkpoint with vocab_size {VOCAB} "
            "(`rtrl model init DIR` writes one), or train other models with rtrl train"
        )
    return replace(cfg, seed=cfg.seed + settings.loop.seed), precision


def policy_server(settings: Settings, bootstrap: str, client: RtrlClient, seed: int) -> PolicyServer:
    """The loop's policy server (a candidate arm's model too in A/B mode). It samples over HTTP from
    ``serving.url`` (vLLM, SGLang), or with that empty from the project's own completions server over the
    policy built here (:mod:`simulator.openai_server`)."""
    ls, sv = settings.loop, settings.serving
    cfg, precision = loop_model_config(settings)
    if client.screen is None:  # its rollouts are screened for secrets in the tokens the model reads
        client.screen = screen_for(settings.governance.secret_scanner, settings.model.hf_path, decode_tokens)
    own = not sv.url  # an external server holds the weights: nothing to build here
    api_key = None
    if sv.api_key_file:
        try:
            api_key = Path(sv.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(
                f"serving.api_key_file {sv.api_key_file} cannot be read ({e.strerror or e}); fix: name a readable "
                "file holding the server's API key, or leave serving.api_key_file empty"
            ) from None
    return PolicyServer(
        connection(settings.kafka, bootstrap),
        settings.kafka.topic_prefix,
        client,
        build(cfg, precision) if own else None,
        [f"org-{i}" for i in range(ls.orgs)],
        seed=seed,
        users_per_org=ls.users_per_org,
        conventions=conventions_for(ls.orgs, ls.specialised_orgs),  # orgs whose reviewers have habits of their own
        max_adapters=settings.adapters.max_loaded,
        hard_share=ls.hard_share,
        compression=settings.kafka.compression,
        # A/B mode's candidates, and the final A/B's v0
        candidate_model=build(cfg, precision) if own and (ls.ab_share > 0 or ls.final_ab_trajectories) else None,
        model_config=cfg if own and cfg.hf_config is not None else None,  # its server reloads registry exports
        url=sv.url,
        model_name=sv.model,
        candidate_name=sv.candidate_model,
        timeout_s=sv.timeout_s,
        retries=sv.retries,
        api_key=api_key,
        ab=ls.ab_share > 0,
    )


def serve_until(server: PolicyServer, ls, stop: threading.Event) -> None:
    """Serve ``loop.rate`` tasks/s with a quota of ``loop.samples_per_cycle`` per decision until ``stop``."""
    server.run(
        stop,
        lambda m, p: checkpoint.load(p, m, restore_rng=False),
        ls.rate,
        ls.group_size,
        quota=ls.samples_per_cycle,
        candidate_share=ls.ab_share,
    )


def cycle_progress(console: Console, label: str = "cycles"):
    """The main job's progress bar: over cycles (``info`` says what serves), or ``label`` (the final A/B's
    trajectories per arm)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
    )


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


@dataclass
class FinalAB:
    """The main job's final live A/B (:meth:`Loop.final_ab`): the final version against v0, users split by hash."""

    final: int
    since_ms: int
    trajectories: dict[str, int]
    """trajectories per arm ('ab-v0', 'ab-final') in ClickHouse when it ended"""
    rows: list[ABRow]
    seconds: float
    wanted: int


#: the final A/B's arms: v0 (the baseline) and the final version
FINAL_ARMS = {"baseline": "ab-v0", "treatment": "ab-final"}


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
        self.flow_counts = {"rewards": FlowCounts(), "batches": FlowCounts()}  # what the in-process flows moved
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

    def start_flows(self) -> None:
        """Both flows as threads, with Bytewax recovery in ``<data_dir>/recovery/<name>`` (what ``--resume``
        continues from after a crash)."""
        from app.flow_state import recovery_config

        for name, make in (("rewards", reward_flow), ("batches", batch_flow)):
            flow = make(self.settings, bootstrap=self.bootstrap, stop=self.stop, counts=self.flow_counts[name])
            # snapshots at Bytewax's default 10 s, not flow.snapshot_s: each one pickles the partition's
            # windows, closed ones included until allowed_lateness, so on two shared cores a 2 s epoch made
            # the main job's cycles grow from ~15 s to ~100 s by cycle 9 (bench/RESULTS.md); a crash
            # replays at most 10 s of events from Kafka, exactly once either way
            kwargs = {
                "recovery_config": recovery_config(self.settings, name),
                "epoch_interval": timedelta(seconds=max(10.0, self.settings.flow.snapshot_s)),
            }
            t = threading.Thread(target=run_main, args=(flow,), kwargs=kwargs, name=f"{name}-flow", daemon=True)
            t.start()
            self.threads.append(t)

    def stop_flows(self, timeout_s: float = 30.0) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout_s)

    def flow_summaries(self) -> list[str]:
        """One line per in-process flow: what it read and wrote in this process (after :meth:`stop_flows`; a flow
        that did not stop within its wait is said to be counted so far)."""
        partial = " (still stopping: counted so far)" if any(t.is_alive() for t in self.threads) else ""
        return [
            reward_summary(self.flow_counts["rewards"], self.settings.rewards.versions) + partial,
            batch_summary(self.flow_counts["batches"]) + partial,
        ]

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
            max_steps=10**9,
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
        """The main job's ending (:func:`final_ab`) with this loop's producer, its final version and stop event."""
        return final_ab(self.settings, self.ch, self.producer, console, self.serving, self.stop)

    def close(self) -> None:
        self.stop_flows()
        if self.server is not None:
            self.server.close()
            self.client.close()
        self.producer.flush(10)


def final_ab(
    settings: Settings,
    ch,
    producer: Producer,
    console: Console,
    final: int,
    stop: threading.Event | None = None,
) -> FinalAB | str:
    """The main job's ending: the final version (what serves) and v0 serve side by side as a live A/B, each user in
    one arm by the hash of the user id and the experiment's key (:func:`simulator.serve.ab_bucket`, 50/50), until
    each arm has ``loop.final_ab_trajectories`` trajectories in ClickHouse (or ``loop.final_ab_max_s`` passed);
    then per metric the relative change, its 95% interval and p-value over users, from the analyst views
    (:func:`monitors.queries.live_ab`). The experiment is announced on ``rtrl.experiments`` (running, then ended),
    so a policy server in its own process (``loop.processes``) serves it as one in this process does. A line
    saying why when it cannot run."""
    ls, rv, db = settings.loop, settings.rewards.train_version, settings.clickhouse.database
    if not ls.final_ab_trajectories:
        return "no final A/B (loop.final_ab_trajectories = 0)"
    if final == 0:
        return "no final A/B: no candidate was promoted, v0 still serves"
    if settings.serving.url:
        return "no final A/B: serving.url names an external server, which serves one version (run it yourself)"
    since = time.time_ns() // 1_000_000
    running = Experiment(
        key=f"final-ab-{ls.seed}-v{final}-v0",
        status="running",
        created_at=since,
        share=0.5,
        serving_version=final,
        serving_arm=FINAL_ARMS["treatment"],
        candidate_version=0,
        candidate_path=str(settings.data_path / "loop" / "checkpoints" / "v0"),
        candidate_arm=FINAL_ARMS["baseline"],
    )

    t0, wanted = time.monotonic(), ls.final_ab_trajectories
    counts = dict.fromkeys(FINAL_ARMS.values(), 0)
    try:
        announce_experiments(settings, producer, [running])
        with cycle_progress(console, f"final A/B v{final} vs v0") as bar:
            task = bar.add_task("ab", total=wanted, info="trajectories in the smaller arm")
            while time.monotonic() < t0 + ls.final_ab_max_s and not (stop is not None and stop.is_set()):
                got = ch.query(
                    f"SELECT arm, count() FROM {db}.trajectories FINAL WHERE arm IN {{arms:Array(String)}} "
                    "AND first_event_ts >= fromUnixTimestamp64Milli({since:Int64}) GROUP BY arm",
                    parameters={"arms": list(FINAL_ARMS.values()), "since": since},
                ).result_rows
                counts |= {str(a): int(n) for a, n in got}
                bar.update(task, completed=min(wanted, min(counts.values())))
                if min(counts.values()) >= wanted:
                    break
                time.sleep(1.0)
    finally:  # whatever ended it; a failure to say so must not hide why (the next run ends it)
        try:
            ended = msgspec.structs.replace(running, status="ended", created_at=time.time_ns() // 10**6)
            announce_experiments(settings, producer, [ended])
        except ServiceUnavailable as e:
            console.print(f"warning: {e}; the next `rtrl run` ends it", markup=False, highlight=False)
    rows = live_ab(ch, db, Side(0, FINAL_ARMS["baseline"]), Side(final, FINAL_ARMS["treatment"]), rv, since_ms=since)
    return FinalAB(final, since, counts, rows, time.monotonic() - t0, wanted)


def end_running_experiments(settings: Settings, bootstrap: str, producer: Producer) -> list[str]:
    """Announce ``ended`` for every experiment ``rtrl.experiments`` still has as running: a run stopped during its
    final A/B (kill -9, a lost broker) leaves one, which a policy server would serve again once its serving
    version serves. The main job calls it before it serves anything; returns the keys it ended."""
    codec: JsonCodec[Experiment] = JsonCodec(Experiment)
    newest: dict[str, Experiment] = {}
    for msg in read_topic(
        connection(settings.kafka, bootstrap), settings.topic("experiments"), timeout_s=settings.kafka.timeout_s
    ):
        try:
            exp = codec.decode(msg.value())
        except Invalid:
            continue
        newest[exp.key] = exp
    stale = [e for e in newest.values() if e.status == "running"]
    now = time.time_ns() // 1_000_000
    ended = [msgspec.structs.replace(e, status="ended", created_at=max(now, e.created_at)) for e in stale]
    announce_experiments(settings, producer, ended)
    return [e.key for e in stale]


def announce_experiments(settings: Settings, producer: Producer, experiments: list[Experiment]) -> None:
    """Publish ``experiments`` on ``rtrl.experiments`` (keyed by experiment) and wait for the broker's
    acknowledgement; ServiceUnavailable naming the topic when it does not come within 30 s."""
    if not experiments:
        return
    topic = settings.topic("experiments")
    codec: JsonCodec[Experiment] = JsonCodec(Experiment)
    for exp in experiments:
        producer.produce(topic, key=exp.key.encode(), value=codec.encode(exp))
    if producer.flush(30):
        raise ServiceUnavailable(f"announcing {len(experiments)} experiment(s) on {topic} did not finish within 30s")


def rollback(settings: Settings, bootstrap: str, ch, version: int, reason: str) -> Checkpoint:
    """Mark ``version`` rolled back and re-promote its parent (what ``rtrl rollback`` does)."""
    db = settings.clickhouse.database
    rows = {c.version: c for c in clickhouse.select(ch, db, "checkpoints")}
    if version not in rows:
        known = ", ".join(f"v{v}" for v in sorted(rows)) or "none (run `rtrl run` first)"
        raise ConfigError(f"no checkpoint v{version} in {db}.checkpoints; known versions: {known}")
    bad = rows[version]
    if bad.parent is None:
        raise ConfigError(f"v{version} has no parent to roll back to (it is the warm start)")
    parent = rows[bad.parent]
    producer = Producer(producer_config(connection(settings.kafka, bootstrap), settings.kafka.compression))
    now = time.time_ns() // 1_000_000
    back = msgspec.structs.replace(bad, status="rolled_back", reason=reason, created_at=now)
    announce(settings, ch, producer, back)
    announce(
        settings,
        ch,
        producer,
        msgspec.structs.replace(
            parent, status="promoted", reason=f"re-promoted: rollback of v{version}", created_at=now + 1
        ),
    )
    return back


def announce(settings: Settings, ch, producer: Producer, ck: Checkpoint) -> None:
    """Record a checkpoint decision in ClickHouse ``checkpoints`` (an org's adapter: ``adapter_checkpoints``) and
    publish it on ``rtrl.deployments``, keyed by version (an adapter: by org and version)."""
    clickhouse.insert(ch, settings.clickhouse.database, "adapter_checkpoints" if ck.org else "checkpoints", [ck])
    codec: JsonCodec[Checkpoint] = JsonCodec(Checkpoint)
    key = f"{ck.org}/{ck.version}" if ck.org else str(ck.version)
    producer.produce(settings.topic("deployments"), key=key.encode(), value=codec.encode(ck))
    if producer.flush(30):
        raise RuntimeError("deployment announcement not acknowledged")
    metrics.observe_decision(ck.status, ck.org, ck.version, "train")


def run_loop(settings: Settings, console: Console | None = None, resume: bool = False) -> list[dict]:
    """The main job: ``loop.cycles`` cycles on the configured services, then the table and plots
    (with ``loop.processes``, every part in its own process: :func:`app.supervisor.run_processes`).
    Without ``resume`` it starts afresh (:func:`fresh_start`); with it, it continues the run the data
    folder holds - its decisions, the flows' recovery state, the topics and tables - up to ``loop.cycles``."""
    from app.services import Services

    console = console or Console()
    settings = loop_settings(settings)  # refuses settings the loop cannot honour before anything starts
    if settings.loop.processes:
        from app.supervisor import run_processes

        return run_processes(settings, console, resume=resume)
    console.rule("[bold]rtrl main job: the closed loop")
    if resume:
        preflight(settings)
    else:
        fresh_start(settings)
    torch.set_num_threads(1)  # the policy server, the flows and the broker share the cores
    t0 = time.monotonic()
    services = Services(settings)
    try:  # the local broker stops whatever ends the run (Ctrl-C included, a metrics port in use too)
        with metrics.serve_part(settings, "run") as endpoint:  # one process: every part's metrics on one endpoint
            endpoint.ready()
            return _run_in_process(settings, services, console, resume, t0)
    finally:
        services.close()


def _run_in_process(settings: Settings, services: Services, console: Console, resume: bool, t0: float) -> list[dict]:
    loop = Loop(settings, services.bootstrap, services.ch)
    ls, rv = loop.settings.loop, loop.settings.rewards.train_version
    try:
        console.print(
            f"broker {services.bootstrap} · ClickHouse {clickhouse.redact(settings.clickhouse_dsn)} · "
            f"training on reward {rv} · {ls.cycles} cycles of {ls.samples_per_cycle:,} samples"
            + (f" · model from {loop.settings.model.hf_path}" if loop.settings.model.hf_path else "")
        )
        # before anything serves (the policy server reads the experiments once its thread starts)
        for key in end_running_experiments(loop.settings, services.bootstrap, loop.producer):
            console.print(f"ended experiment {key}, left running by an earlier run", highlight=False)
        if resume and loop.resume():
            console.print(f"resumed: {loop.version} decisions made, serving v{loop.serving}")
        else:
            loop.initial()
            console.print(
                f"v0 (warm start): held-out solve rate {loop.evals[0]['solve_rate']:.3f}, broken calls "
                f"{loop.evals[0]['broken_tool_call_rate']:.3f}"
            )
        loop.start_flows()
        loop.start_server()
        with cycle_progress(console) as bar:
            task = bar.add_task("loop", total=ls.cycles, completed=loop.version, info="")
            while loop.version < ls.cycles:
                r = loop.cycle()
                colour = "green" if r.status == "promoted" else "red"
                bar.console.print(
                    f"v{r.version} <- v{r.parent}: [{colour}]{r.status}[/] after {len(r.steps)} steps "
                    f"({r.seconds['train']:.0f}s): {r.reason}"
                )
                for a in r.adapters:
                    bar.console.print(describe(a, markup=True), highlight=False)
                bar.update(
                    task,
                    advance=1,
                    info=f"serving v{loop.serving}, held-out solve {loop.evals[loop.serving]['solve_rate']:.3f}",
                )
        ab = loop.final_ab(console)  # the seed's table: the final version against v0, live
    finally:
        loop.close()
    if loop.threads:  # the flows ran (and have stopped): what they moved
        for line in loop.flow_summaries():
            console.print(line, highlight=False, soft_wrap=True)
    return final_report(settings, services.ch, console, t0, ab)


def preflight(settings: Settings, trains: bool = True) -> None:
    """Refuse (ConfigError, one line) what would stop the main job, before anything is deleted or started.

    It checks the settings (:func:`loop_settings`; ``trains`` as there) and the model. With ``model.hf_path`` the
    checkpoint's family, vocabulary, shape settings and parallel layout are checked, and its tensors' shapes from
    the files' headers. It checks the data folder too: rtrl's own, and a folder."""
    cfg, _ = loop_model_config(loop_settings(settings, trains=trains))
    if cfg.hf_path:
        from trainer.hf.load import check_hf

        check_hf(cfg)
    check_cleanable(settings.data_path)


def fresh_start_plan(settings: Settings, trains: bool = True) -> list[Path]:
    """The folders :func:`fresh_start` deletes (those that exist): a previous run's loop state, flow recovery
    and logs; on the embedded defaults its broker, ClickHouse and event archive too (with a cluster and a server
    configured, those are theirs; the archive's Kafka offsets belong to the broker's history, which a backfill
    replays, so it goes with the broker). First :func:`preflight`: a run that cannot start deletes nothing."""
    preflight(settings, trains)
    embedded = not settings.kafka.bootstrap and not settings.clickhouse.dsn
    parts = [p for p in RUN_PARTS if embedded or p not in ("broker", "clickhouse", "archive")]
    return [settings.data_path / p for p in parts if (settings.data_path / p).exists()]


def fresh_start(settings: Settings, trains: bool = True) -> list[Path]:
    """The main job starts afresh: deletes :func:`fresh_start_plan`'s folders, returned."""
    doomed = fresh_start_plan(settings, trains)
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    data_folder(settings.data_path)
    return doomed


def final_report(settings: Settings, ch, console: Console, t0: float, ab: FinalAB | str | None = None) -> list[dict]:
    """How the main job ends: three summary lines (v0 -> the final version, promotions and refusals), the seed's
    table (the final live A/B, :meth:`Loop.final_ab`), the table per checkpoint from ClickHouse and the PNG plots."""
    from app import report

    rv = settings.rewards.train_version
    rows = report.checkpoint_rows(ch, settings.clickhouse.database, rv)
    final_ab = ab if isinstance(ab, FinalAB) else None
    for line in report.summary_lines(ch, settings.clickhouse.database, rows, rv, ab=final_ab):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if final_ab is not None:
        console.print(report.final_ab_table(final_ab, rv))
        png = report.final_ab_plot(final_ab, settings.data_path / "reports" / "final_ab.png", rv)
        console.print(f"final A/B plot: {png}")
    elif isinstance(ab, str):
        console.print(ab, markup=False, highlight=False)
    console.print(
        report.checkpoint_table(
            rows, f"Checkpoints (reward {rv}): eval gate, live behaviour from ClickHouse, change vs v0"
        )
    )
    png = report.checkpoint_plot(rows, settings.data_path / "reports" / "loop.png", f"The closed loop (reward {rv})")
    console.print(f"plots: {png}")
    adapters = report.adapter_rows(ch, settings.clickhouse.database)
    if adapters:  # per-org adapters (adapters.orgs): what serves each org, against the base alone
        console.print(report.adapter_table(adapters))
        png = report.adapter_plot(adapters, settings.data_path / "reports" / "adapters.png")
        console.print(f"per-org plot: {png}")
    console.print(f"done in {time.monotonic() - t0:.0f}s")
    return rows
