"""The main job's per-organisation adapters (issue 17): trained from each org's stream, gated and promoted per org.

With ``adapters.orgs`` set, the batch flow routes each wanted org's micro-batches, once it passed
``adapters.min_samples``, to ``<prefix>adapter-batches`` (:mod:`flows.adapters`). After each cycle of the shared
policy, :class:`OrgAdapters` (owned by :class:`app.loop.Loop`):

1. follows the serving base: when the base was promoted since the last cycle, every adapter that serves an org is
   **re-validated** on the new base (the gate below, against the new base alone) and announced as a new adapter
   version over that base, or refused. A refused one is judged again with its effect scaled by each of
   ``adapters.revalidate_scales`` in turn (:func:`trainer.lora.scale_adapter`; saved as a new version): under
   ``shared_traffic = "served"`` the base learns through the adapter and can amplify what it does, until the
   adapter overshoots its org's habit on the org's other tasks (bench/RESULTS.md, "Per-org adapters", ninth round).
   None passes: the org is served the base alone until its adapter retrains. Every decision is recorded, in
   ``adapter_checkpoints`` and on ``rtrl.deployments``;
2. reads the adapter stream from where it left off and groups the batches by org; an org with at least one step's
   worth of micro-batches trains its adapter (:class:`rtrl.sections.trainer.TrainConfig` ``adapter``: the base frozen, the
   base alone the KL reference) from what serves it, else from the weights of its retired version (its
   re-validation was refused), else a fresh, zero-effect adapter (:meth:`evalgate.adapters.AdapterLedger.start`),
   on the serving base. A sample another policy served than those starting weights (``Rollout.adapter_version``:
   e.g. the base alone served the retired org) is marked delayed (:func:`off_policy_delayed`): truncated
   importance weights instead of the PPO clip;
3. gates each new adapter version (:func:`evalgate.adapters.decide_adapter`): the org's held-out tasks against what
   serves the org and against the base alone, plus the global regression guard against the base alone, and
   announces candidate and decision with ``org``, the adapter version and ``base_version``. A promoted adapter of a
   Hugging Face model is exported in PEFT format (:func:`trainer.registry.export_adapter`) for a vLLM fleet.

Exactly once: the adapter stream's offsets, each org's record of trained micro-batches and samples
(:class:`trainer.dedup.TrainedSet`) and the ledger of versions are part of the loop's state file, written before
each announcement; batches read but left for a later step (fewer than a step's worth) are read again from their
offsets, and what was trained is skipped by the org's trained set. A rollback of an org's adapter
(``rtrl rollback N --org ORG``) is read back from ``adapter_checkpoints`` at the start of each adapter cycle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from app.loop_config import adapter_run_id
from evalgate.adapters import AdapterLedger, AdapterVersion, decide_adapter
from evalgate.gate import Decision, GateRules
from rtrl import clickhouse
from rtrl.errors import ConfigError
from rtrl.sections.trainer import ModelSettings, PrecisionSettings, TrainConfig
from rtrl.settings import Settings
from schemas.records import Checkpoint, CheckpointStatus, TrainStep
from simulator.evalsuite import OrgHeldOutTasks
from simulator.tasks import Conventions
from trainer import checkpoint, lora
from trainer.batch import Batch, BatchLimits
from trainer.data import BatchStream
from trainer.dedup import TrainedSet
from trainer.factory import Policy, build
from trainer.registry import export_adapter
from trainer.train import Hooks, MemorySource, train

log = logging.getLogger(__name__)


def off_policy_delayed(batch: Batch, ledger: AdapterLedger, org: str, start: AdapterVersion | None) -> Batch:
    """``batch`` with each sample that another policy than the weights ``org``'s candidate starts from
    (``start``; None: a fresh adapter, the base alone) sampled marked delayed (``Batch.delayed``): the trainer
    then corrects it with a truncated importance weight instead of the PPO clip (:mod:`trainer.loss`), as its
    behaviour log-probs are not the starting policy's (e.g. the base alone served a retired org, whose candidate
    starts from the retired weights). Which policy served a sample: ``Batch.adapter_versions``
    (:meth:`evalgate.adapters.AdapterLedger.same_weights`). With ``train.max_delayed_lag`` 0 the trainer masks
    delayed samples: then these are not trained."""
    served = batch.adapter_versions
    if served is None:
        served = np.zeros(len(batch.sample_ids), np.int64)
    same = {a: ledger.same_weights(org, a, start) for a in set(served.tolist())}
    off = np.array([not same[a] for a in served.tolist()], bool)
    if not off.any():
        return batch
    return dataclasses.replace(batch, delayed=off if batch.delayed is None else batch.delayed | off)


class ServedThrough:
    """The main job's shared-policy trainer under ``adapters.shared_traffic = "served"``: the adapter versions that
    may have served trainable samples loaded, frozen, into the trainer's ``model`` (:meth:`sync`), and, called with
    a micro-batch, the name of the one that served it (``Hooks.served_by``; None: the base alone).

    Names are stable per weights (``served-`` and a hash of the version's path): a re-validated version shares its
    parent's. The batch flow splits a micro-batch whose samples several versions served under this setting, for
    every org (:func:`flows.adapters.split_by_adapter_version`, :func:`flows.adapters.unrouted`); a mixed batch
    from a producer of its own trains through the base alone, with a warning, as does a version the ledger does
    not hold (or no longer loads: older than the lag window, so its samples are masked as stale). Bad data
    never stops the trainer."""

    def __init__(self, model: Any):
        self.model = model
        self.loaded: dict[str, str] = {}  # adapter path -> its name on the model
        self.names: dict[tuple[str, int], str] = {}  # (org, adapter version) -> its name on the model
        self._warned: set[tuple[str, int]] = set()

    @staticmethod
    def name(path: str) -> str:
        return "served-" + hashlib.sha1(path.encode()).hexdigest()[:16]

    def sync(self, ledger: AdapterLedger, oldest_base: int) -> None:
        """Load every version of ``ledger`` that served (promoted, or rolled back since) on a base version from
        ``oldest_base`` on, and unload the others. Not collective (each rank loads its slices)."""
        want: dict[tuple[str, int], str] = {}
        for org, versions in ledger.versions.items():
            for v in versions.values():
                if v.status in ("promoted", "rolled_back") and v.base_version >= oldest_base:
                    want[(org, v.version)] = v.path
        for path in set(self.loaded) - set(want.values()):
            lora.remove_adapter(self.model, self.loaded.pop(path))
        for path in sorted(set(want.values()) - set(self.loaded)):
            name = self.name(path)
            lora.load_adapter(path, self.model, name, restore_rng=False)
            self.loaded[path] = name
        self.names = {key: self.loaded[path] for key, path in want.items()}

    def __call__(self, batch: Batch) -> str | None:
        if batch.adapter_versions is None:
            return None
        versions = sorted(set(batch.adapter_versions.tolist()))
        if len(versions) > 1:
            # the batch flow splits such batches (every org's); a producer of its own may still send one: never
            # stop on data
            key = (batch.served_org, -1)
            if key not in self._warned and len(self._warned) < 1000:
                self._warned.add(key)
                log.warning(
                    "micro-batch %s holds samples that several adapter versions of org %r served (%s; a0 = the base "
                    "alone): trained through the base alone (the batch flow splits such batches per version)",
                    batch.batch_id,
                    batch.served_org,
                    ", ".join(f"a{v}" for v in versions),
                )
            return None
        if versions[0] == 0:
            return None
        key = (batch.served_org, versions[0])
        name = self.names.get(key)
        if name is None and key not in self._warned and len(self._warned) < 1000:
            self._warned.add(key)
            log.warning(
                "org %s adapter a%d served samples of micro-batch %s but is not loaded (not in the ledger, or older "
                "than the lag window): trained through the base alone",
                *key,
                batch.batch_id,
            )
        return name


@dataclass
class AdapterDecision:
    """One org's decision of a cycle (for the progress line and the report)."""

    org: str
    version: int
    base_version: int
    status: str
    reason: str
    revalidation: bool = False
    steps: int = 0


def describe(a: AdapterDecision, markup: bool = False) -> str:
    """One line for a decision (the reason only when it was not promoted), with rich colour markup or without."""
    what = "re-validated" if a.revalidation else f"trained {a.steps} steps"
    status = a.status
    if markup:
        status = f"[{'green' if a.status == 'promoted' else 'red'}]{a.status}[/]"
    return f"  {a.org} adapter a{a.version} on v{a.base_version} ({what}): {status}" + (
        "" if a.status == "promoted" else f": {a.reason}"
    )


@dataclass
class _OrgState:
    trained: TrainedSet = field(default_factory=TrainedSet)


class OrgAdapters:
    """See the module docstring. ``announce`` records and publishes a decision; ``save`` writes the loop's state
    (this object's :meth:`state` in it) with the announcements not yet confirmed; ``on_step`` records a
    train_metrics row."""

    def __init__(
        self,
        settings: Settings,
        bootstrap: str,
        ch: Any,
        cfg: ModelSettings,
        precision: PrecisionSettings,
        root: Path,
        conventions: Conventions,
        rules: GateRules,
        announce: Callable[[Checkpoint], None],
        save: Callable[[list[Checkpoint]], None],
        on_step: Callable[[TrainStep], object],
    ):
        self.settings, self.bootstrap, self.ch, self.cfg = settings, bootstrap, ch, cfg
        self.root, self.conventions, self.rules = root, conventions, rules
        self.announce_one, self.save, self.on_step = announce, save, on_step
        self.model = build(cfg, precision)  # the serving base, with the adapters on it
        self.lora = settings.adapters.shape()
        self.ledger = AdapterLedger()
        self.offsets: dict[str, int] = {}
        self.orgs: dict[str, _OrgState] = {}
        self.base_version: int | None = None  # the base the model holds
        self.base_scores: dict[tuple[str, int], dict[str, float]] = {}  # (org or "guard:org", base) -> scores
        self.suites: dict[str, OrgHeldOutTasks] = {}
        self.deny = clickhouse.deny_watch(settings)  # samples of an erased subject are refused (`rtrl erase`)

    # ------------------------------------------------------------ state

    def state(self) -> dict:
        return {
            "ledger": self.ledger.state(),
            "offsets": self.offsets,
            "trained": {org: st.trained.state() for org, st in sorted(self.orgs.items())},
        }

    def restore(self, st: dict) -> None:
        self.ledger = AdapterLedger.from_state(st.get("ledger", {}))
        self.offsets = dict(st.get("offsets", {}))
        self.orgs = {org: _OrgState(TrainedSet(t)) for org, t in st.get("trained", {}).items()}

    # ------------------------------------------------------------ evaluation

    def suite(self, org: str) -> OrgHeldOutTasks:
        if org not in self.suites:
            ls = self.settings.loop
            self.suites[org] = OrgHeldOutTasks(org, self.conventions, ls.eval_tasks, ls.seed)
        return self.suites[org]

    def _scores(self, org: str, adapter: str | None) -> tuple[dict[str, float], dict[str, float]]:
        """(org suite, guard) scores of the base with ``adapter`` active (None: the base alone, cached per base)."""
        assert self.base_version is not None
        key = (org, self.base_version)
        if adapter is None and key in self.base_scores:
            return self.base_scores[key], self.base_scores[(f"guard:{org}", self.base_version)]
        suite = self.suite(org)
        with lora.activate(self.model, adapter):
            scores = (suite.evaluate(self.model), suite.guard().evaluate(self.model))
        if adapter is None:
            self.base_scores[key], self.base_scores[(f"guard:{org}", self.base_version)] = scores
        return scores

    def _judge(self, org: str, name: str, serving: dict[str, float], training: list[TrainStep]):
        cand, guard = self._scores(org, name)
        base, guard_base = self._scores(org, None)
        suite = self.suite(org)
        verdict = decide_adapter(
            cand, serving, base, suite.samples, guard, guard_base, suite.guard().samples, self.rules, None, training
        )
        results = (
            cand
            | {f"base_{k}": v for k, v in base.items()}
            | {f"guard_{k}": v for k, v in guard.items()}
            | {f"guard_base_{k}": v for k, v in guard_base.items()}
            | {"eval_samples": float(suite.samples)}
        )
        return results, verdict

    # ------------------------------------------------------------ the cycle

    def _sync_rollbacks(self) -> None:
        """Apply rollbacks made outside the loop (``rtrl rollback N --org ORG``) to the ledger."""
        db = self.settings.clickhouse.database
        for ck in clickhouse.select(self.ch, db, "adapter_checkpoints", "WHERE status = 'rolled_back'"):
            chain = self.ledger.promoted.get(ck.org, [])
            if ck.version in chain:
                chain.remove(ck.version)
                self.ledger.versions[ck.org][ck.version].status = "rolled_back"

    def _load_base(self, serving: int, path: Path) -> None:
        if self.base_version != serving:
            checkpoint.load(path, self.model, restore_rng=False)  # adapters are not part of a base checkpoint
            self.base_version = serving

    def _put(self, org: str, v: AdapterVersion | None) -> str:
        """Adapter ``org`` on the model holding ``v``'s weights (None: a fresh one, B = 0). Returns its name."""
        if org in lora.adapter_names(self.model):
            lora.remove_adapter(self.model, org)
        if v is None:
            lora.add_adapter(self.model, org, self.lora, seed=self.settings.loop.seed)
        else:
            lora.load_adapter(v.path, self.model, org, restore_rng=False)
        return org

    def _decision(
        self, v: AdapterVersion, status: CheckpointStatus, reason: str, ev: dict[str, float], steps: list[TrainStep]
    ) -> Checkpoint:
        return Checkpoint(
            version=v.version,
            parent=v.parent,
            created_at=time.time_ns() // 1_000_000,
            steps=len(steps),
            samples=sum(sum(s.lag_histogram.values()) for s in steps),
            tokens=sum(s.tokens for s in steps),
            eval_results=ev,
            status=status,
            reason=reason,
            kafka_offsets=self.offsets,
            path=v.path,
            reward_version=self.settings.rewards.train_version,
            org=v.org,
            base_version=v.base_version,
        )

    def _announce(self, cks: list[Checkpoint]) -> None:
        self.save(cks)
        for ck in cks:
            self.announce_one(ck)
        self.save([])

    def _decide(
        self,
        v: AdapterVersion,
        ev: dict[str, float],
        verdict: Decision,
        steps: list[TrainStep],
        also: list[Checkpoint] | None = None,
    ) -> Checkpoint:
        """Record ``v``'s gate verdict in the ledger, export a promoted one, and announce candidate and decision
        (then ``also``)."""
        self.ledger.decide(v.org, v.version, verdict.promote, ev)
        candidate = self._decision(v, "candidate", "trained", ev, steps)
        status: CheckpointStatus = "promoted" if verdict.promote else "rejected"
        # the decision is newer than the candidate (the table keeps each version's newest status)
        decision = msgspec.structs.replace(
            self._decision(v, status, verdict.reason, ev, steps), created_at=candidate.created_at + 1
        )
        if verdict.promote:
            decision = export_adapter(self.settings, self.model, self.cfg, v.org, decision)
        self._announce(
            [
                candidate,
                decision,
                *(msgspec.structs.replace(c, created_at=candidate.created_at + 2) for c in also or []),
            ]
        )
        return decision

    def revalidate(self) -> list[AdapterDecision]:
        """Judge each adapter serving an org on another base again on the current base (module docstring, 1): as
        it is, then (each refused) with its effect scaled by each of ``adapters.revalidate_scales`` in turn, a new
        version saved with the scaled weights; the first that passes serves. All refused: the org is retired."""
        assert self.base_version is not None
        out = []
        for old in self.ledger.stale(self.base_version):
            base, _ = self._scores(old.org, None)  # what serves the org now: the new base alone
            factors = [1.0, *self.settings.adapters.revalidate_scales]
            # tries already decided on this base (a restart after a kill mid-way): not judged again
            tried = sum(
                1
                for v in self.ledger.versions.get(old.org, {}).values()
                if v.parent == old.version and v.base_version == self.base_version and v.status == "rejected"
            )
            if tried >= len(factors):  # every try refused, the retirement not yet recorded
                why = f"stale: every re-validation on base v{self.base_version} was refused"
                self._announce([self._retire(old.org, why)])
                continue
            for i, factor in enumerate(factors):
                if i < tried:
                    continue
                name = self._put(old.org, old)
                if factor != 1.0:
                    lora.scale_adapter(self.model, name, factor)
                ev, verdict = self._judge(old.org, name, base, [])
                if factor == 1.0:
                    v = self.ledger.revalidate(old, self.base_version)
                    what = "re-validated"
                else:
                    version = self.ledger.next_version(old.org)
                    folder = self.root / old.org / f"a{version}"
                    path = lora.save_adapter(folder, self.model, name, 0, f"v{self.base_version}")
                    v = self.ledger.add(old.org, self.base_version, str(path), parent=old.version)
                    what = f"re-validated at {factor:g} times a{old.version}'s effect"
                reason = f"{what} on base v{self.base_version}: {verdict.reason}"
                also = []
                if not verdict.promote:
                    reason = f"{what.replace('re-validated', 'refused')} on base v{self.base_version}: {verdict.reason}"
                    if i + 1 < len(factors):
                        reason += f"; next: {factors[i + 1]:g} times its effect"
                    else:
                        why = (
                            f"stale: its re-validation on base v{self.base_version} (a{v.version}) was refused; the "
                            f"base alone serves {old.org} until its adapter retrains"
                        )
                        also.append(self._retire(old.org, why))
                decision = self._decide(v, ev, Decision(verdict.promote, reason, verdict.problems), [], also)
                out.append(
                    AdapterDecision(v.org, v.version, v.base_version, decision.status, reason, revalidation=True)
                )
                if verdict.promote:
                    break
        return out

    def _retire(self, org: str, why: str) -> Checkpoint:
        """Retire ``org``'s serving adapter in the ledger (the base alone serves it); its roll-back, to announce."""
        gone = self.ledger.retire(org)
        assert gone is not None
        return self._decision(gone, "rolled_back", why, gone.scores, [])

    def _read(self) -> dict[str, list[Batch]]:
        """The adapter stream's new micro-batches by org (everything there is now)."""
        s = self.settings
        stream = BatchStream(
            self.bootstrap,
            s.topic("adapter-batches"),
            s.topic("dead_letters"),
            start=self.offsets,
            timeout_s=s.kafka.timeout_s,
            limits=BatchLimits.from_settings(s),
            deny=self.deny,
        )
        by_org: dict[str, list[Batch]] = {}
        try:
            while (b := stream.get(1.0)) is not None:
                by_org.setdefault(b.adapter, []).append(b)
            self.offsets = stream.position()
        finally:
            stream.close()
        return by_org

    def cycle(self, serving: int, serving_path: Path) -> list[AdapterDecision]:
        """One adapter cycle on the serving base (the module docstring's steps 1-3)."""
        ls, mbps = self.settings.loop, self.settings.train.micro_batches_per_step
        self._sync_rollbacks()
        self._load_base(serving, serving_path)
        out = self.revalidate()
        by_org = self._read()
        keep: dict[str, int] = {}  # per partition: the first offset of a batch left for a later step
        for org in sorted(by_org):
            batches = by_org[org]
            n = len(batches) // mbps * mbps
            for b in batches[n:]:
                key = f"{self.settings.topic('adapter-batches')}/{b.partition}"
                keep[key] = min(keep.get(key, b.offset), b.offset)
            if not n or not self.settings.adapters.wants(org):
                continue
            st = self.orgs.setdefault(org, _OrgState())
            current = self.ledger.serving(org)
            if current is not None and current.base_version != serving:
                current = None  # not valid on this base (its re-validation was refused)
            start = self.ledger.start(org, serving)  # the serving weights, else the retired ones, else fresh
            name = self._put(org, start)
            mine = [off_policy_delayed(b, self.ledger, org, start) for b in batches[:n]]
            version = self.ledger.next_version(org)
            tc = TrainConfig.from_settings(
                self.settings,
                run_id=adapter_run_id(ls.seed, org, version),
                steps=n // mbps,
                checkpoint_dir="",
                idle_timeout_s=0.01,
                adapter=name,
                adapter_base=f"v{serving}",
                resume=False,
            )
            steps = train(
                Policy(self.model, None, version=serving, trained=st.trained),
                lambda _o, batches=mine: MemorySource(batches),  # type: ignore[misc]
                tc,
                Hooks(on_step=self.on_step),
            )
            st.trained.prune(serving - max(self.settings.train.max_policy_lag, self.settings.train.max_delayed_lag))
            if not steps:
                continue
            folder = self.root / org / f"a{version}"
            path = lora.save_adapter(folder, self.model, name, len(steps), f"v{serving}")
            v = self.ledger.add(org, serving, str(path), parent=start.version if start is not None else None)
            serving_scores = current.scores if current is not None else self._scores(org, None)[0]
            ev, verdict = self._judge(org, name, serving_scores, steps)
            decision = self._decide(v, ev, verdict, steps)
            out.append(AdapterDecision(org, v.version, serving, decision.status, decision.reason, steps=len(steps)))
        for key, off in keep.items():
            self.offsets[key] = min(self.offsets.get(key, off), off)
        self.save([])
        return out


def rollback_adapter(settings: Settings, bootstrap: str, ch: Any, org: str, version: int, reason: str) -> Checkpoint:
    """Mark ``org``'s adapter version ``version`` rolled back (``rtrl rollback N --org ORG``): the policy server
    then serves the org its previous promoted adapter on the serving base, or the base alone; the loop's next
    adapter cycle trains from that."""
    from confluent_kafka import Producer

    from app.deployments import announce
    from rtrl.kafka import connection, producer_config

    db = settings.clickhouse.database
    rows = {c.version: c for c in clickhouse.select(ch, db, "adapter_checkpoints", f"WHERE org = {_sql_str(org)}")}
    if version not in rows:
        known = ", ".join(f"a{v} ({rows[v].status})" for v in sorted(rows)) or "none"
        raise ConfigError(f"no adapter version {version} of org {org!r} in {db}.adapter_checkpoints; known: {known}")
    if rows[version].status != "promoted":
        raise ConfigError(
            f"adapter version {version} of org {org!r} is {rows[version].status}, not promoted: nothing to roll back"
        )
    back = msgspec.structs.replace(
        rows[version], status="rolled_back", reason=reason, created_at=time.time_ns() // 1_000_000
    )
    announce(
        settings, ch, Producer(producer_config(connection(settings.kafka, bootstrap), settings.kafka.compression)), back
    )
    return back


def _sql_str(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
