"""The policy server of the simulator: serves the promoted checkpoint to simulated users.

It follows ``rtrl.deployments``: the newest ``promoted`` announcement wins (a ``rolled_back`` one
is never served; a rollback is announced as the re-promotion of the version to go back to), and
its weights are loaded from the checkpoint's path. It samples the way a production fleet integration
does: over HTTP from an OpenAI-compatible completions server, with the rollout collector
(:mod:`client.rollouts`) - by default the project's own server (:mod:`simulator.openai_server`) over this
policy, in-process on a free loopback port; with ``url`` an external vLLM or SGLang server, which must serve
the promoted version itself (nothing is loaded here then). Each burst of tasks is one request (the prompts
as a list, ``n = group_size``); it publishes one :class:`Rollout` per completion on ``rtrl.rollouts``
through the client SDK, which applies the trajectory's data-use class (keyed by trajectory), and lets the
simulated user react through the SDK too
(:func:`simulator.world.react`; an accepted edit's persistence check is delivered later, as in production). Each
task is asked by a user of its org (``users_per_org``, from a stream of their own), under the org's convention
when ``conventions`` gives it one (:class:`simulator.tasks.Convention`: on some kinds its users accept an edit only
after a given tool ran, or another answer; not in the prompt). In A/B mode the users whose
hash for the experiment (:func:`ab_bucket`) falls below ``candidate_share`` are served by a candidate version
instead (the server's ``candidate_name`` model), with ``arm="candidate"`` on their events: a user sees one arm for
the whole experiment. An :class:`~schemas.records.Experiment` announced on ``rtrl.experiments`` does the same outside
the deployment protocol (the main job's final A/B of its final version against v0), with its own arm labels.

Per-org adapters (issue 17): an announcement with an ``org`` is that org's adapter decision. The serving arm answers
each org with its newest promoted adapter validated on the serving base (:meth:`PolicyServer.adapter_target`),
loaded into the completions server under its own model name through vLLM's runtime LoRA API (the project's own
server speaks it too), and the base alone for orgs without one; a burst is then one request per model name.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
import uuid
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition

from client.fleet import adapter_model_name
from client.rollouts import CompletionsClient, RolloutCollector
from client.sdk import RtrlClient
from rtrl import metrics
from rtrl.kafka import base_config
from schemas.codec import Invalid, JsonCodec
from schemas.data_use import trains_shared
from schemas.records import Checkpoint, Experiment
from simulator.openai_server import CompletionServer
from simulator.tasks import COMPLETION_LEN, Conventions, outcome, sample_task
from simulator.world import Mailbox, react

log = logging.getLogger(__name__)


@dataclass
class Served:
    trajectories: int = 0
    broken: int = 0
    correct: int = 0
    asked: int = 0
    trainable: int = 0  # trajectories whose data-use class lets them train the shared policy (schemas.data_use)


def ab_bucket(user_id: str, experiment: str) -> float:
    """A user's place in [0, 1) for one experiment: a hash of the experiment's key and the user id, so a user
    stays in one arm for the whole experiment and each experiment splits users afresh (no carry-over)."""
    digest = hashlib.sha256(f"{experiment}:{user_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class PolicyServer:
    def __init__(
        self,
        bootstrap: str,
        prefix: str,
        client: RtrlClient,
        model,
        orgs: list[str],
        seed: int = 0,
        hard_share: float = 0.5,
        compression: str = "zstd",
        candidate_model=None,
        *,
        url: str = "",
        model_name: str = "rtrl-policy",
        candidate_name: str = "rtrl-candidate",
        timeout_s: float = 30.0,
        retries: int = 3,
        api_key: str | None = None,
        ab: bool | None = None,
        model_config=None,
        users_per_org: int = 200,
        conventions: Conventions | None = None,
        max_adapters: int = 64,
    ):
        self.client, self.model, self.orgs, self.hard_share = client, model, orgs, hard_share
        self.conventions: Conventions = dict(conventions or {})  # orgs with a convention of their own
        self.candidate_model = candidate_model  # A/B mode: where an announced candidate is loaded
        self.ab = candidate_model is not None if ab is None else ab  # A/B mode: serve announced candidates
        self.model_name, self.candidate_name = model_name, candidate_name
        self.api: CompletionServer | None = None
        if not url:  # the project's own completions server over this policy: the same HTTP path as vLLM's
            if model is None:
                raise ValueError("the policy server's own completions server needs a model (or give url)")
            models = {model_name: model} | ({candidate_name: candidate_model} if candidate_model is not None else {})
            # with the ModelSettings of a Hugging Face model, its server reloads exports (/update_weights_from_disk)
            configs = {name: model_config for name in models} if model_config is not None else None
            self.api = CompletionServer(models, seed=seed, configs=configs, max_loras=max_adapters).start()
            url = self.api.url
        self.url = url
        self.collector = RolloutCollector(
            CompletionsClient(url, model_name, timeout_s=timeout_s, retries=retries, api_key=api_key)
        )
        try:
            self.collector.client.check()  # reachable, and serving the model: one line naming the URL otherwise
        except Exception:
            if self.api is not None:
                self.api.close()
            raise
        self.rollouts_topic = prefix + "rollouts"
        # decisions made before this server started are re-read on rtrl.deployments, not new to the metrics
        self.started_ms = time.time_ns() // 1_000_000
        self.deployments = Consumer(
            base_config(bootstrap) | {"group.id": f"policy-server-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False}
        )
        # both from their start, one partition each, so in order: decisions, and live A/Bs outside them
        self.deployments_topic, self.experiments_topic = prefix + "deployments", prefix + "experiments"
        self.deployments.assign(
            [TopicPartition(self.deployments_topic, 0, 0), TopicPartition(self.experiments_topic, 0, 0)]
        )
        self.codec: JsonCodec[Checkpoint] = JsonCodec(Checkpoint)
        self.experiment_codec: JsonCodec[Experiment] = JsonCodec(Experiment)
        self.rng = random.Random(seed)
        # who asks: a user of the task's org, from its own stream so the tasks' stream does not depend on it
        self.users_per_org = users_per_org
        self.user_rng = random.Random(f"users-{seed}")
        self.version: int | None = None
        self.path: str | None = None
        self.candidate: tuple[int, str] | None = None  # (version, model name) served to a share in A/B mode
        self.candidate_path: str | None = None  # that candidate's checkpoint
        self.candidate_loaded: str | None = None  # the checkpoint the candidate model holds now
        self.totals: dict[tuple[int, str], Served] = {}  # what each (version, arm) served so far
        self.window_base = 0  # what the serving version had served at the last decision (backpressure)
        self.mailbox = Mailbox()  # what the users send later: persistence checks
        self.announced: dict[str, Experiment] = {}  # the newest announcement of each experiment on rtrl.experiments
        self.experiment: Experiment | None = None  # the one being served
        # per-org adapters (issue 17): each org's promotions in order, the newest status of each (org, version), and
        # what serves each org now: (adapter version, the model name the server serves it under)
        self.adapter_promotions: dict[str, list[Checkpoint]] = {}
        self.adapter_status: dict[tuple[str, int], str] = {}
        self.adapters: dict[str, tuple[int, str]] = {}

    def _follow_experiments(self, load) -> None:
        """What the candidate model holds and serves. An experiment is served while its newest announcement says
        ``running`` and its serving version is the one loaded (the promotion and the experiment come on two topics,
        so the experiment may be read first; one left running for an older version does not take over); the
        newest such wins. Otherwise an A/B candidate awaiting its decision. The weights are loaded whenever they
        are not what should be served: a candidate announcement read while an experiment runs (a restarted server
        replays both topics from their start) cannot overwrite the experiment's version. A server without its own
        completions server and a candidate model serves the promoted version only."""
        want = None
        if self.candidate_model is not None and self.api is not None:
            running = [
                e for e in self.announced.values() if e.status == "running" and e.serving_version == self.version
            ]
            want = max(running, key=lambda e: e.created_at) if running else None
        path = want.candidate_path if want is not None else (self.candidate_path if self.candidate else None)
        if path is not None and path != self.candidate_loaded:
            self._load(load, self.candidate_model, path)
            self.candidate_loaded = path
        self.experiment = want

    def _load(self, load, model, path: str) -> None:
        """``load(model, path)`` while no request samples from it; nothing with an external server (it loads
        the promoted version itself)."""
        if model is None or self.api is None:
            return
        with self.api.lock:
            load(model, path)

    def refresh(self, load, timeout_s: float = 0.5) -> int | None:
        """Read new announcements: a newer promotion is loaded into the serving model with
        ``load(model, path)``; in A/B mode (a ``candidate_model`` was given, or ``ab``) a ``candidate``
        announcement is loaded into it and served to a share of the traffic until its decision
        (promoted, rejected, rolled back) arrives; an experiment on ``rtrl.experiments`` is followed as
        :meth:`_follow_experiments` says. Returns the serving version."""
        deadline = time.monotonic() + timeout_s
        latest, decided = None, False
        while time.monotonic() < deadline:
            msg = self.deployments.poll(0.05)
            if msg is None:
                if latest is not None or self.version is not None:
                    break
                continue
            if msg.error():
                continue
            if msg.topic() == self.experiments_topic:
                try:
                    exp = self.experiment_codec.decode(msg.value())
                except Invalid:
                    continue
                self.announced[exp.key] = exp
                continue
            try:
                ck = self.codec.decode(msg.value())
            except Invalid:
                continue
            if ck.created_at >= self.started_ms:  # a rollback by `rtrl rollback` is seen here, in a long-lived part
                metrics.observe_decision(ck.status, ck.org, ck.version, "serve")
            if ck.org:  # an org's adapter decision: followed apart from the shared policy's
                self.adapter_status[(ck.org, ck.version)] = ck.status
                if ck.status == "promoted":
                    self.adapter_promotions.setdefault(ck.org, []).append(ck)
                continue
            if ck.status == "promoted":
                latest = ck
            elif ck.status == "candidate" and self.ab:
                self.candidate, self.candidate_path = (ck.version, self.candidate_name), ck.path  # loaded below
            if ck.status != "candidate":
                decided = True
                if self.candidate is not None and self.candidate[0] == ck.version:
                    self.candidate = None  # decided: the candidate arm ends
        if latest is not None and (latest.version, latest.path) != (self.version, self.path):
            self._load(load, self.model, latest.path)
            self.version, self.path = latest.version, latest.path
            metrics.SERVING_VERSION.labels(part="serve").set(latest.version)
        if decided:  # a new cycle: the serving version (new, or the same after a rejection) gets a new quota
            self.window_base = self.served_by(self.version)
        self._follow_experiments(load)
        self._follow_adapters()
        return self.version

    def adapter_target(self, org: str) -> Checkpoint | None:
        """The adapter decision that should serve ``org``: its newest promotion not rolled back since, if it was
        validated on the serving base version (after a base promotion the org is served the base alone until its
        adapter is re-validated on the new base)."""
        for ck in reversed(self.adapter_promotions.get(org, [])):
            if self.adapter_status.get((org, ck.version)) == "promoted":
                return ck if ck.base_version == self.version else None
        return None

    def _follow_adapters(self) -> None:
        """Load each org's target adapter into the completions server under its own model name, then unload what it
        replaces (vLLM's runtime LoRA API; the project's own server the same way). An external server loads the
        PEFT export (``export_path``); the own server the adapter checkpoint."""
        client = self.collector.client
        for org in sorted(set(self.adapter_promotions) | set(self.adapters)):
            ck = self.adapter_target(org)
            have = self.adapters.get(org)
            if ck is not None and (have is None or have[0] != ck.version):
                path = ck.path if self.api is not None else ck.export_path
                if not path:
                    log.warning(
                        "org %s adapter v%d has no PEFT export for %s: the base serves it", org, ck.version, self.url
                    )
                    continue
                name = adapter_model_name(self.model_name, org, ck.version)
                client.load_lora_adapter(name, path)
                self.adapters[org] = (ck.version, name)
                if have is not None:
                    client.unload_lora_adapter(have[1])
            elif ck is None and have is not None:
                client.unload_lora_adapter(have[1])
                del self.adapters[org]

    def model_for(self, org: str) -> str:
        """The model name a request for ``org`` names: its adapter, else the shared policy."""
        have = self.adapters.get(org)
        return have[1] if have is not None else self.model_name

    def may_serve(self, quota: int | None) -> bool:
        """Backpressure: after each decision the serving version serves about ``quota`` samples the shared policy
        may train on, what the trainer's next cycle uses (None = no limit); while an A/B candidate waits for its
        verdict, no limit. Trajectories whose data-use class keeps them from the shared policy do not count."""
        if quota is None or self.candidate is not None or self.experiment is not None:
            return True
        return self.served_by(self.version) - self.window_base < quota

    def served_by(self, version: int | None) -> int:
        """Completions the control arm of ``version`` has served so far that may train the shared policy."""
        if version is None:  # nothing served yet
            return 0
        t = self.totals.get((version, "control"))
        return 0 if t is None else t.trainable

    def serve(self, tasks: int, group_size: int, candidate_share: float = 0.0) -> dict[str, Served]:
        """Serve ``tasks`` tasks (``group_size`` samples each) now; per arm what happened."""
        if self.version is None:
            raise RuntimeError("nothing promoted yet: announce a version on rtrl.deployments first")
        self.mailbox.deliver()
        exp = self.experiment  # read once: refresh() may start or end one between two bursts
        if exp is not None:
            candidate: tuple[int, str] | None = (exp.candidate_version, self.candidate_name)
            key, share = exp.key, exp.share
            labels = {"control": exp.serving_arm, "candidate": exp.candidate_arm}
        else:
            candidate, share = self.candidate, candidate_share
            key = f"ab-v{candidate[0]}" if candidate is not None else ""
            labels = {"control": "control", "candidate": "candidate"}
        arms: dict[str, list] = {"control": [], "candidate": []}
        for _ in range(tasks):
            task = sample_task(self.rng, self.rng.choice(self.orgs), self.hard_share, conventions=self.conventions)
            user = f"{task.org_id}-user-{self.user_rng.randrange(self.users_per_org)}"
            arm = "control"
            if candidate is not None and ab_bucket(user, key) < share:
                arm = "candidate"  # randomised by user: a user sees one arm for the whole experiment
            arms[arm].append((task, user))
        served = {}
        for arm, batch in arms.items():
            if not batch:
                continue
            if arm == "control":
                version, name = self.version, self.model_name
            else:
                assert candidate is not None  # the candidate arm gets tasks only while there is one
                version, name = candidate
            label = labels[arm]
            # the serving arm answers each org with its adapter, if it has one; each rollout records which
            by_model: dict[tuple[str, int], list] = {}
            for task, user in batch:
                have = self.adapters.get(task.org_id) if arm == "control" else None
                served_as = (have[1], have[0]) if have is not None else (name, 0)
                by_model.setdefault(served_as, []).append((task, user))
            served[label] = Served()
            for (model_name, adapter_version), asks in by_model.items():
                part = self._serve(asks, group_size, version, model_name, label, adapter_version)
                for k in vars(part):
                    setattr(served[label], k, getattr(served[label], k) + getattr(part, k))
            total = self.totals.setdefault((version, label), Served())
            for k in vars(total):
                setattr(total, k, getattr(total, k) + getattr(served[label], k))
        return served

    def _serve(
        self, asks: list, group_size: int, version: int, model_name: str, arm: str, adapter_version: int = 0
    ) -> Served:
        """One completions request for ``tasks`` (``n = group_size``; EOS ignored: a completion is always its
        two tokens), one rollout per completion as the collector builds it, and the users' reactions.
        ``adapter_version``: the org adapter version ``model_name`` serves (0: the shared policy alone), recorded
        on each rollout.

        No ``seed`` is sent: vLLM gives every prompt of a request its own generator seeded with the request's
        seed, so the tasks of one burst would share their random draws (correlated exploration). The engine's
        own stream samples them independently; the loop's own server seeds that stream with ``seed``, so a run
        depends on the seed and the order of the requests only, as before the HTTP path."""
        tasks = [t for t, _ in asks]
        groups = self.collector.start(
            [t.prompt for t in tasks],
            group_size,
            COMPLETION_LEN,
            ignore_eos=True,
            model=model_name,
        )
        out = Served()
        now = time.time_ns() // 1_000_000
        for (task, user), group in zip(asks, groups):
            group_id = uuid.uuid4().hex
            for sampled in group:
                o = outcome(task, sampled.completion_ids)
                traj = self.client.start_trajectory(
                    org_id=task.org_id,
                    user_id=user,
                    task_kind=task.kind,
                    policy_version=version,
                    arm=arm,
                    ts=now,
                )
                ro = sampled.rollout(
                    trajectory_id=traj.trajectory_id,
                    policy_version=version,
                    group_id=group_id,
                    group_size=group_size,
                    org_id=task.org_id,
                    task_kind=task.kind,
                    created_at=now,
                    adapter_version=adapter_version,
                )
                # through the SDK, which applies the trajectory's data-use class
                published = traj.rollout(ro, topic=self.rollouts_topic)
                react(traj, task, o, self.rng, now, user=user, later=self.mailbox.later)
                out.trajectories += 1
                out.trainable += published and trains_shared(traj.data_use)
                out.broken += o.broken
                out.correct += o.correct
                out.asked += o.asked
        return out

    def run(
        self,
        stop,
        load,
        rate: float,
        group_size: int,
        burst_s: float = 0.1,
        candidate_share: float = 0.0,
        quota: int | None = None,
        trickle_s: float = 2.0,
    ) -> None:
        """Serve continuously until ``stop`` is set: ``rate`` tasks per second in bursts of ``burst_s``,
        switching to each new promotion as it is announced (continuous traffic keeps every
        partition's event-time clock moving, so reward windows close). Once this version has served
        ``quota`` samples since the last decision (:meth:`may_serve`) it serves one task every
        ``trickle_s`` only: traffic never stops, but little is left for a later version's trainer."""
        per_burst = max(1, round(rate * burst_s))
        last_trickle = 0.0
        while not stop.is_set():
            t = time.monotonic()
            self.mailbox.deliver()
            if self.refresh(load, timeout_s=0.01) is not None:
                n = per_burst if self.may_serve(quota) else int(t - last_trickle >= trickle_s)
                last_trickle = t if n == 1 else last_trickle
                if n:
                    self.serve(n, group_size, candidate_share)
            stop.wait(max(0.0, burst_s - (time.monotonic() - t)))

    def close(self) -> None:
        # the users' persistence checks still due: sent now, with their event times
        self.mailbox.deliver(everything=True)
        self.client.flush(30)
        self.deployments.close()
        self.collector.client.close()
        if self.api is not None:
            self.api.close()
