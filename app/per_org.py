"""The per-org specialisation experiment (issue 17): does an org's own LoRA adapter pay where its users differ?

The world: the loop's orgs ``org-0`` .. ``org-{n-1}``; the last ``specialised`` of them follow a convention of
their own (:func:`simulator.tasks.conventions_for`): on two task kinds their reviewers accept an edit only after a
given tool ran (with the defaults, 4 orgs: org-2 wants the tests run, org-3 a search for callers), where every
other org's reviewers want the file read first (:data:`simulator.tasks.GLOBAL_HABIT`). Every org has the same
share of the traffic (``specialised_share`` gives the specialised orgs another). The prompt does not carry the
org, so one policy for everyone follows the majority's habit there. Two arms see the same seeded traffic from the
same warm start:

* ``shared``: the shared policy alone, trained on all traffic (no adapters);
* ``adapters``: the same shared policy, trained on the same traffic (``adapters.shared_traffic``, "served" by
  default: every adapted org's batches also train the base, through the adapter that served them; "all": the
  base alone on them; "unadapted": only the other orgs'), plus one LoRA
  adapter per specialised org (:mod:`trainer.lora`). The batch flow's router (:class:`flows.adapters.OrgRouter`)
  sends an org's micro-batches to its adapter stream once it has sent ``min_samples`` samples. Each cycle, as
  the main job does (:mod:`app.adapters`), the shared policy trains and is promoted first; every serving adapter
  is judged again on the new base against the new base alone (``AdapterLedger.revalidate``: it keeps serving;
  else at ``adapters.revalidate_scales`` of its effect, "rescaled"; else it is retired); then the org's adapter
  trains on the cycle's adapter stream (:class:`rtrl.sections.trainer.TrainConfig` ``adapter=org``: the base frozen, the
  KL reference the base alone) on that new base, continuing from the weights of its last promoted version (a
  refused candidate is dropped: its noise would otherwise accumulate).
  A retired org keeps those weights too, while the base alone serves it: its samples then come from another
  policy than the adapter that trains on them, so they take the trainer's delayed path (``MicroBatch.delayed``:
  truncated importance weights, no PPO clip, :mod:`trainer.loss`). Under the clip, every convention task's
  base-habit token the adapter had already made rarer was dropped (ratio below 1 - eps with a negative
  advantage), only the base's rewarded habit trained, and the adapter fell back to the base within a cycle
  (bench/RESULTS.md, eighth round). The main job (:mod:`app.adapters`) does the same from the serving adapter
  version each rollout records (``Rollout.adapter_version``, :func:`app.adapters.off_policy_delayed`);
  the candidate is gated (:func:`evalgate.adapters.decide_adapter`) on the org's held-out suite
  (:class:`simulator.evalsuite.OrgHeldOutTasks`) against what serves the org and the base alone, and on the
  suite's global guard against the base alone; promoted or refused in the org's
  :class:`evalgate.adapters.AdapterLedger`. A promoted adapter serves its org: the org's tasks are sampled from
  the base with that adapter active.

In both arms the shared policy is promoted every cycle without a gate (as in :mod:`app.long_loop`: the arms must
stay comparable). Until the first adapter serves, the two arms are the same computation (the shared policy's
weights are equal). The shared policy's and each adapter's optimizer moments carry over from cycle to cycle
(``keep_optimizer``), as the main job's trainer keeps them in its checkpoints. The initial agent
(``warm_conventions``) has seen every org's convention; with the tool conventions it picks its tool the same way
for every org, and training (one policy, or a policy per org) decides which habit it keeps.

Each cycle runs the production pieces in-process on simulated event time (:mod:`app.inprocess`: rollouts and the
SDK's recorded events, the reward flow's processor, the batch flow's builders, the Arrow wire format, the
trainer). Per cycle and org it records, on held-out tasks of that org the gate never sees (a stream of their
own, so choosing a version on the gate's suite does not bias the figure): the greedy solve rate and the exact
P(solve) (:func:`simulator.policy.solve_probability`) of the shared policy alone and of what serves the org (its
adapter when one is promoted, else the shared policy), apart on the org's convention kinds and its general ones;
the gate's decisions; KL and steps of the shared run and of the adapter's. ``bench/per_org.py`` runs both arms
and writes a per-org table and a PNG; tests/test_per_org_experiment.py asserts the direction on a short seeded
run.
"""

from __future__ import annotations

import copy
import random
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
import torch

from app.inprocess import InProcessLoop, train_steps
from app.loop_config import loop_settings
from app.serving import loop_model_config
from client.sdk import Trajectory
from evalgate.adapters import AdapterLedger, decide_adapter
from flows.adapters import OrgRouter, unrouted
from rtrl.sections.trainer import TrainConfig
from rtrl.settings import Settings, as_env, load_settings
from schemas.records import MicroBatch, TrainStep
from simulator.evalsuite import OrgHeldOutTasks
from simulator.policy import greedy, sample, solve_probability, warm_start
from simulator.tasks import (
    KINDS,
    Convention,
    Conventions,
    Outcome,
    Task,
    conventions_for,
    held_out,
    outcome,
    sample_task,
)
from simulator.world import react
from trainer import lora
from trainer.batch import Batch
from trainer.dedup import TrainedSet
from trainer.factory import build_policy, optimizer

ARMS = ("shared", "adapters")
REPORT_SEED = 1000
"""The report's held-out tasks of an org: ``held_out(eval_tasks, seed=REPORT_SEED + seed, org=...)``, a stream
the gate's suite (seed ``7 + seed``) and the traffic never draw from."""


@dataclass(frozen=True)
class Experiment:
    """The experiment's world and size (defaults: bench/per_org.py's)."""

    cycles: int = 16  # an adapter moves its org's habit a little each cycle (RESULTS.md: 8 were not enough)
    tasks_per_cycle: int = 128  # prompts served per cycle, each sampled group_size times (the loop's 2,048 samples)
    group_size: int = 16  # 16, not the loop's 4: a habit the base rarely follows needs hits in a group
    orgs: int = 4  # org-0 and org-1 keep the global habit (read the file first)
    specialised: int = 2  # the last ones: org-2 wants the tests run before refactor + test edits, org-3 a search
    specialised_share: float = 0.5
    """The specialised orgs' share of the traffic, split evenly among them; the other orgs share the rest evenly
    (0.5 with 2 of 4 orgs: every org the same share). Adapters go to the orgs with the traffic
    (``adapters.min_samples``), so large specialised orgs are the likely case; with 0.75 their adapters learned
    their habits, but the shared policy then followed one big org's habit in some seeds, and over 3 seeds the
    claim did not hold (bench/RESULTS.md, "Per-org adapters")."""
    min_samples: int = 256  # adapters.min_samples: an org's samples before its adapter stream starts
    rank: int = 8  # adapters.rank
    alpha: float = 16.0  # adapters.alpha
    adapter_lr: float = 0.002  # adapters.lr (0 = train.lr, 1e-3); 6e-3 and up raised broken calls (RESULTS.md)
    adapter_kl: float = 0.3  # adapters.kl_coef (0 = loss.kl_coef, 0.01)
    adapter_updates: int = 4
    """adapters.updates_per_step: optimizer updates on each step of an adapter's micro-batches (1: each trains
    once). An org's adapter sees a quarter of the traffic; with one update a step it moved its org's tool by a
    few points a cycle while the base drifted away (bench/RESULTS.md, "Per-org adapters", seventh round)."""
    adapter_targets: tuple[str, ...] = ()
    """adapters.targets; empty = the settings' default (every layer's four linears and the output layer, without
    which an adapter cannot raise its org's tool alone: bench/RESULTS.md, seventh round)."""
    adapter_kl_estimator: str = "full"
    """adapters.kl_estimator: "full" (the exact KL to the base over the vocabulary), "k3" (on the sampled token) or
    "" (loss.kl_estimator). With k3 the candidates that raised P(solve) also raised broken tool calls, and the gate
    refused them; the full KL holds the broken-call rate (bench/RESULTS.md, "Per-org adapters")."""
    shared_traffic: str = "served"
    """adapters.shared_traffic: "served": all traffic, an adapted org's micro-batches through the adapter that
    served them, frozen (:func:`trainer.train.train`'s ``served_by``; in the main job
    :class:`app.adapters.ServedThrough`), so the base learns what serves each org and is not pulled towards an
    org's own habit where its adapter already follows it; "all" (the base alone on every batch: the global orgs
    lost about 0.03, bench/RESULTS.md, eighth round) or "unadapted" (the shared policy skips adapted orgs)."""
    revalidate_scales: tuple[float, ...] = (0.5,)
    """adapters.revalidate_scales: a serving adapter refused at re-validation on a new base is judged again at these
    fractions of its effect before it is retired. Under "served" the base learns through the frozen adapter and
    amplified it in one seed until the adapter picked its org's tool on the org's other tasks too, and the global
    guard retired it (bench/RESULTS.md, eighth and ninth rounds); empty: retire at once."""
    cycle_minutes: int = 60  # simulated event time per cycle
    rate: float = 100.0  # tasks served per second of event time, each group_size times
    eval_tasks: int = 200  # held-out tasks per org: the gate's suite, and the report's own
    repeats: int = 8  # the gate suite's sampled completions per task
    seed: int = 0
    warm_start_steps: int = 300
    warm_conventions: bool = True
    """The initial agent imitates every org's users under that org's convention (a pretrained model has seen
    all of them, as a real one knows several code styles); False: the global convention only (the loop's)."""
    keep_optimizer: bool = True
    """The shared policy's and each adapter's AdamW moments carry over from cycle to cycle, as the main job's
    trainer keeps them in its checkpoints (False: a new optimizer every cycle, whose first steps are sign steps
    on every parameter: noise an adapter's small updates drown in)."""
    warm_right_easy: float = 0.8
    """How often the initial agent gives the accepted answer on easy tasks (``loop.warm_right_easy``; hard tasks:
    :func:`simulator.tasks.warm_start_completion`'s 0.35); negative: as often as on hard ones."""

    def __post_init__(self) -> None:
        if self.shared_traffic not in ("all", "unadapted", "served"):
            raise ValueError(
                f"Experiment.shared_traffic = {self.shared_traffic!r}: one of 'all', 'unadapted', 'served'"
            )
        if 0 < self.specialised < self.orgs and not 0 < self.specialised_share < 1:
            raise ValueError(
                f"Experiment.specialised_share = {self.specialised_share!r}: the specialised orgs' share of the "
                "traffic must be between 0 and 1 (exclusive) when some orgs are specialised and some are not"
            )

    @property
    def conventions(self) -> dict[str, Convention]:
        """The specialised orgs' conventions (:func:`simulator.tasks.conventions_for`)."""
        return conventions_for(self.orgs, self.specialised)

    def traffic(self) -> list[float]:
        """Each org's share of the traffic, ``org-0`` first (:attr:`specialised_share`)."""
        spec = self.specialised
        if spec in (0, self.orgs):
            return [1.0 / self.orgs] * self.orgs
        rest = self.orgs - spec
        return [(1.0 - self.specialised_share) / rest] * rest + [self.specialised_share / spec] * spec


@dataclass
class OrgRow:
    """One org after one cycle of one arm (the base version it serves on is ``cycle``)."""

    arm: str
    cycle: int
    org: str
    specialised: bool
    served_by: str  # "shared" or "adapter v<n>" (the org's ledger version)
    shared_success: float  # greedy solve rate of the shared policy alone on the org's report tasks
    served_success: float  # the same of what serves the org
    shared_expected: float  # mean P(solve) of the shared policy alone
    served_expected: float
    shared_convention: float  # greedy solve rate on the org's convention kinds (nan: the org has none)
    served_convention: float
    shared_general: float  # greedy solve rate on the org's other kinds
    served_general: float
    decisions: tuple[str, ...]  # the gate's decisions on this org's adapter this cycle
    adapter_steps: int  # steps the org's adapter trained this cycle
    adapter_kl: float  # their mean KL to the base alone
    adapter_samples: int
    adapter_sample_orgs: tuple[str, ...]  # the orgs of the samples the adapter trained (only its own)
    kl: float  # mean KL of the shared policy's steps this cycle (to the warm start)
    steps: int  # the shared policy's steps this cycle
    convention_task: tuple[bool, ...] = ()  # per report task: of a convention kind
    shared_solved: tuple[bool, ...] = ()  # per report task: solved greedily by the shared policy alone
    served_solved: tuple[bool, ...] = ()
    shared_probs: tuple[float, ...] = ()  # per report task: P(solve) of the shared policy alone
    served_probs: tuple[float, ...] = ()


def arm_settings(base: Settings, exp: Experiment) -> Settings:
    """The base settings with the experiment's adapters: one per specialised org, its threshold and shape, and the
    shared policy trained on all traffic."""
    env = (
        as_env(base)
        | {
            "RTRL_ADAPTERS__ORGS": ",".join(exp.conventions),
            "RTRL_ADAPTERS__MIN_SAMPLES": str(exp.min_samples),
            "RTRL_ADAPTERS__SHARED_TRAFFIC": "all" if exp.shared_traffic == "served" else exp.shared_traffic,
            "RTRL_ADAPTERS__RANK": str(exp.rank),
            "RTRL_ADAPTERS__ALPHA": str(exp.alpha),
            "RTRL_ADAPTERS__LR": str(exp.adapter_lr),
            "RTRL_ADAPTERS__KL_COEF": str(exp.adapter_kl),
            "RTRL_ADAPTERS__KL_ESTIMATOR": exp.adapter_kl_estimator,
            "RTRL_ADAPTERS__UPDATES_PER_STEP": str(exp.adapter_updates),
            "RTRL_ADAPTERS__REVALIDATE_SCALES": ",".join(str(x) for x in exp.revalidate_scales),
        }
        | ({"RTRL_ADAPTERS__TARGETS": ",".join(exp.adapter_targets)} if exp.adapter_targets else {})
    )
    return load_settings(env=env)


def _settings(base: Settings | None) -> Settings:
    s = base if base is not None else load_settings(env={"RTRL_SDK__SALT": "per-org-experiment"})
    return loop_settings(s)


def _serving_slot(org: str) -> str:
    """The adapter that holds the promoted weights of ``org``'s adapter (the one named ``org`` trains)."""
    return f"{org}-serving"


def _train_base_only(model: torch.nn.Module) -> None:
    """Make the base trainable again and every adapter frozen (an adapter's run froze the base)."""
    base = {id(p) for p in lora.base_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in base)


def _adamw(params: Iterable[torch.nn.Parameter], s: Settings) -> torch.optim.AdamW:
    """An AdamW as the trainer builds one (:func:`trainer.factory.optimizer`)."""
    return optimizer(params, TrainConfig.from_settings(s))


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else float("nan")


class _Adapters:
    """The adapters arm's per-org state: routers, adapter streams, the ledger, and the gate's cached scores."""

    def __init__(self, model: torch.nn.Module, s: Settings, exp: Experiment, conventions: Conventions):
        self.model, self.s, self.exp = model, s, exp
        self.orgs = [org for org in conventions if s.adapters.wants(org)]
        cfg = s.adapters.shape()
        for org in self.orgs:
            lora.add_adapter(model, org, cfg, seed=exp.seed)
            lora.add_adapter(model, _serving_slot(org), cfg, seed=exp.seed)
        ad = s.adapters
        self.routers = {
            org: OrgRouter(org, ad.min_samples, ad.shared_traffic, s.rewards.train_version) for org in self.orgs
        }
        self.suites = {
            org: OrgHeldOutTasks(org, conventions, exp.eval_tasks, exp.seed, exp.repeats) for org in self.orgs
        }
        self.guards = {org: suite.guard() for org, suite in self.suites.items()}
        self.leftover: dict[str, list[MicroBatch]] = {org: [] for org in self.orgs}
        self.trained = {org: TrainedSet() for org in self.orgs}
        self.ledger = AdapterLedger()
        self.weights = dict.fromkeys(self.orgs, 0)  # which promoted weights the serving slot holds (0: none yet)
        self.initial = {org: lora.adapter_state_dict(model, org) for org in self.orgs}
        # each adapter's optimizer (exp.keep_optimizer), and its state when the serving weights were promoted
        self.opts = {org: _adamw(lora.adapter_parameters(model, org), s) for org in self.orgs if exp.keep_optimizer}
        self.opt_promoted = {org: opt.state_dict() for org, opt in self.opts.items()}
        self._cache: dict[tuple[str, str, int, int], dict[str, float]] = {}

    def serving(self, org: str) -> str | None:
        """The adapter that serves ``org`` now (None: the shared policy alone)."""
        return _serving_slot(org) if org in self.orgs and self.ledger.serving(org) is not None else None

    def route(self, made: list[tuple[str, MicroBatch]]) -> tuple[list[MicroBatch], dict[str, list[MicroBatch]]]:
        """The cycle's micro-batches by stream: (the shared policy's, each adapted org's). Called before the cycle's
        re-validation, so :meth:`serving` is what served the batches: an adapted org's batches the base alone
        served while its adapter holds trained weights (retired) are marked delayed (the module docstring)."""
        shared: list[MicroBatch] = []
        adapter: dict[str, list[MicroBatch]] = {org: [] for org in self.orgs}
        for org, mb in made:
            routed = (
                self.routers[org].route(mb) if org in self.routers else unrouted(mb, self.s.adapters.shared_traffic)
            )
            for out in routed:
                if out.adapter and self.weights[out.adapter] and self.serving(out.adapter) is None:
                    out = msgspec.structs.replace(out, delayed=[True] * len(out.sample_ids))
                (adapter[out.adapter] if out.adapter else shared).append(out)
        return shared, adapter

    def scores(self, org: str, which: str, version: int, guard: bool = False) -> dict[str, float]:
        """The org suite's (or its guard's) scores of ``which`` (``base``: the base alone; ``serving``: the
        promoted weights; ``candidate``: the adapter just trained) on base ``version``; cached but the candidate's."""
        tag = self.weights[org] if which == "serving" else 0
        key = (org, f"{which}{'-guard' if guard else ''}", tag, version)
        if which == "candidate" or key not in self._cache:
            name = {"base": None, "serving": _serving_slot(org), "candidate": org}[which]
            with lora.activate(self.model, name):
                out = (self.guards[org] if guard else self.suites[org]).evaluate(self.model)
            if which == "candidate":
                return out
            self._cache[key] = out
        return self._cache[key]

    def decide(self, org: str, candidate: str, serving: str, version: int, training: list[TrainStep]):
        """decide_adapter for ``org``'s ``candidate`` (``candidate`` or ``serving``) against ``serving``."""
        suite, guard = self.suites[org], self.guards[org]
        return decide_adapter(
            self.scores(org, candidate, version),
            self.scores(org, serving, version),
            self.scores(org, "base", version),
            suite.samples,
            self.scores(org, candidate, version, guard=True),
            self.scores(org, "base", version, guard=True),
            guard.samples,
            training=training,
        )

    def train_and_gate(
        self, org: str, batches: list[MicroBatch], cycle: int, version: int
    ) -> tuple[list[TrainStep], str | None]:
        """Train ``org``'s adapter on its stream's whole steps on base ``version`` (the one that served them),
        then gate and promote or refuse the candidate. Returns (the steps, the decision; None: nothing trained)."""
        steps, self.leftover[org] = train_steps(
            self.model,
            None,
            self.s,
            batches,
            self.leftover[org],
            f"per-org-{org}-{cycle}",
            version,
            self.trained[org],
            adapter=org,
            adapter_base=f"v{version}",
            optimizer=self.opts.get(org),
        )
        if not steps:
            return steps, None
        current = self.ledger.serving(org)
        cand = self.ledger.add(org, version, f"memory:{org}/{cycle}", parent=current.version if current else None)
        d = self.decide(org, "candidate", "serving" if current is not None else "base", version, steps)
        self.ledger.decide(org, cand.version, d.promote, self.scores(org, "candidate", version))
        if d.promote:
            lora.load_adapter_state_dict(self.model, _serving_slot(org), lora.adapter_state_dict(self.model, org))
            self.weights[org] += 1
            if org in self.opts:
                self.opt_promoted[org] = copy.deepcopy(self.opts[org].state_dict())
            return steps, f"v{cand.version} promoted"
        # a refused candidate is dropped: the next version trains on from the last promoted weights (those the
        # serving slot holds, even if retired since; none yet: a new adapter)
        last = lora.adapter_state_dict(self.model, _serving_slot(org)) if self.weights[org] else self.initial[org]
        lora.load_adapter_state_dict(self.model, org, last)
        if org in self.opts:
            # and so do the optimizer's moments; a copy, as load_state_dict keeps the tensors it is given and the
            # next steps update them in place (a second refusal would restore those, not the promoted ones)
            self.opts[org].load_state_dict(copy.deepcopy(self.opt_promoted[org]))
        return steps, f"v{cand.version} refused ({d.reason})"

    def revalidate(self, version: int) -> dict[str, list[str]]:
        """Judge every serving adapter again on the new base ``version`` against the new base alone: it keeps
        serving (a new ledger version); else, as the main job does (:meth:`app.adapters.OrgAdapters.revalidate`),
        its effect scaled by each of ``adapters.revalidate_scales`` in turn is judged (the first that passes serves
        and is what the org's next candidate trains on from: "rescaled"); else it is retired. Returns each org's
        decisions, in order."""
        out = {}
        for old in self.ledger.stale(version):
            slot = _serving_slot(old.org)
            kept = lora.adapter_state_dict(self.model, slot)
            said = []
            for factor in [1.0, *self.s.adapters.revalidate_scales]:
                if factor != 1.0:
                    lora.load_adapter_state_dict(self.model, slot, kept)
                    lora.scale_adapter(self.model, slot, factor)
                    self.weights[old.org] += 1  # other serving weights: the cached scores are not theirs
                new = self.ledger.revalidate(old, version)
                d = self.decide(old.org, "serving", "base", version, [])
                self.ledger.decide(old.org, new.version, d.promote, self.scores(old.org, "serving", version))
                if d.promote:
                    if factor != 1.0:  # the org's next candidate trains on from the scaled weights
                        lora.load_adapter_state_dict(self.model, old.org, lora.adapter_state_dict(self.model, slot))
                        said.append(f"v{old.version} -> v{new.version} rescaled to {factor:g} on base v{version}")
                    else:
                        said.append(f"v{old.version} -> v{new.version} revalidated on base v{version}")
                    break
                at = "" if factor == 1.0 else f" at {factor:g} times its effect"
                said.append(f"v{new.version} refused at re-validation{at} on base v{version} ({d.reason})")
            else:
                lora.load_adapter_state_dict(self.model, slot, kept)  # the retired weights, as they were
                self.weights[old.org] += 1
                self.ledger.retire(old.org)
                said.append(f"v{old.version} retired on base v{version}")
            out[old.org] = said
        return out


def run_arm(
    arm: str,
    exp: Experiment,
    base: Settings | None = None,
    progress: Callable[[list[OrgRow]], None] | None = None,
) -> list[OrgRow]:
    """One arm of the experiment: ``exp.cycles`` cycles from the same warm start and the same traffic. Returns
    one row per cycle and org."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}: one of {', '.join(ARMS)}")
    s = arm_settings(_settings(base), exp)
    conventions = exp.conventions
    cfg, precision = loop_model_config(s)
    torch.manual_seed(exp.seed)
    policy = build_policy(cfg, precision)
    model, reference = policy.model, policy.reference
    rng = random.Random(exp.seed)
    orgs = [f"org-{i}" for i in range(exp.orgs)]
    if exp.warm_conventions:
        warm = [sample_task(rng, rng.choice(orgs), 0.5, conventions=conventions) for _ in range(600)]
    else:
        warm = [sample_task(rng, "warm", 0.5, kinds=tuple(KINDS)) for _ in range(600)]
    right_easy = exp.warm_right_easy if exp.warm_right_easy >= 0 else None
    warm_start(model, warm, steps=exp.warm_start_steps, seed=exp.seed, right_easy=right_easy)
    reference.load_state_dict(model.state_dict())
    report = {
        org: held_out(exp.eval_tasks, seed=REPORT_SEED + exp.seed, org=org, conventions=conventions) for org in orgs
    }
    adapters = _Adapters(model, s, exp, conventions) if arm == "adapters" else None

    # the base's parameters only (what trainer.train.train trains in a run of the shared policy)
    base_opt = _adamw(lora.base_parameters(model), s) if exp.keep_optimizer else None
    loop = InProcessLoop(s, "per-org", exp.seed, exp.group_size, exp.rate, exp.cycle_minutes)
    rows: list[OrgRow] = []
    org_of: dict[str, str] = {}  # each trajectory's org (what the adapters' train_metrics are checked against)

    def react_one(traj: Trajectory, task: Task, out: Outcome, t: int, user: str) -> None:
        react(traj, task, out, loop.world_rng, t, user)

    weights = exp.traffic()

    def draw_org() -> str:  # equal shares: the same draws as before the shares were a setting
        rng = loop.serve_rng
        return rng.choice(orgs) if len(set(weights)) == 1 else rng.choices(orgs, weights)[0]

    for cycle in range(1, exp.cycles + 1):
        tasks = [
            sample_task(loop.serve_rng, draw_org(), 0.5, conventions=conventions) for _ in range(exp.tasks_per_cycle)
        ]
        flat = [t for t in tasks for _ in range(exp.group_size)]
        # serve each org's tasks with what serves it (org by org in both arms, so both draw the same numbers)
        completions: list[list[int]] = [[] for _ in flat]
        logps: list[list[float]] = [[] for _ in flat]
        for org in orgs:
            idx = [i for i, t in enumerate(flat) if t.org_id == org]
            if not idx:
                continue
            with lora.activate(model, adapters.serving(org) if adapters else None):
                comps, lps = sample(model, [flat[i] for i in idx], loop.gen)
            for i, c, lp in zip(idx, comps, lps):
                completions[i], logps[i] = c, lp
        loop.serve(cycle, flat, completions, logps, react_one)
        made, _ = loop.deliver(loop.window(cycle)[1])
        org_of.update({f"c{cycle}-{i}": t.org_id for i, t in enumerate(flat)})  # leftover batches: earlier ids
        decisions: dict[str, list[str]] = {org: [] for org in orgs}
        adapter_steps: dict[str, list[TrainStep]] = {org: [] for org in orgs}
        streams: dict[str, list[MicroBatch]] = {}
        if adapters is not None:
            shared, streams = adapters.route(made)
            _train_base_only(model)
        else:
            shared = [b for _, b in made]
        served_by = None
        if adapters is not None and exp.shared_traffic == "served":

            def served_by(b: Batch, adapters: _Adapters = adapters) -> str | None:  # one org per micro-batch
                return adapters.serving(org_of[b.sample_ids[0]]) if b.sample_ids else None

        steps = loop.train(model, reference, shared, f"per-org-{arm}-{cycle}", base_opt, served_by)
        version = loop.promote()  # the arms must stay comparable, so no gate
        if adapters is not None:  # as the main job does (app.adapters): re-validate, then train on the new base
            for org, judged in adapters.revalidate(version).items():
                decisions[org] += judged
            for org, batches in streams.items():
                adapter_steps[org], decision = adapters.train_and_gate(org, batches, cycle, version)
                if decision is not None:
                    decisions[org].append(decision)
        for org in orgs:
            rows.append(
                _measure(
                    model,
                    report[org],
                    conventions,
                    arm,
                    cycle,
                    org,
                    adapters.serving(org) if adapters else None,
                    adapters.ledger if adapters else None,
                    decisions[org],
                    adapter_steps[org],
                    steps,
                    org_of,
                )
            )
        if progress is not None:
            progress(rows[-len(orgs) :])
    return rows


def _measure(
    model: torch.nn.Module,
    tasks: list[Task],
    conventions: Conventions,
    arm: str,
    cycle: int,
    org: str,
    serving: str | None,
    ledger: AdapterLedger | None,
    decisions: list[str],
    adapter_steps: list[TrainStep],
    steps: list[TrainStep],
    org_of: dict[str, str],
) -> OrgRow:
    """One org's row: the shared policy alone and what serves the org, on the org's report tasks."""
    convention = conventions.get(org)
    kinds = convention.kinds if convention is not None else ()
    on_convention = tuple(t.kind in kinds for t in tasks)

    def solved_and_probs(name: str | None) -> tuple[tuple[bool, ...], tuple[float, ...]]:
        with lora.activate(model, name):
            solved = tuple(outcome(t, c).correct for t, c in zip(tasks, greedy(model, tasks)))
            return solved, tuple(solve_probability(model, tasks))

    shared_solved, shared_probs = solved_and_probs(None)
    served_solved, served_probs = solved_and_probs(serving) if serving else (shared_solved, shared_probs)

    def part(solved: tuple[bool, ...], keep: bool) -> float:
        return _mean(float(x) for x, c in zip(solved, on_convention) if c == keep)

    served_version = ledger.serving(org) if ledger is not None and serving else None
    return OrgRow(
        arm=arm,
        cycle=cycle,
        org=org,
        specialised=convention is not None,
        served_by=f"adapter v{served_version.version}" if served_version is not None else "shared",
        shared_success=_mean(map(float, shared_solved)),
        served_success=_mean(map(float, served_solved)),
        shared_expected=_mean(shared_probs),
        served_expected=_mean(served_probs),
        shared_convention=part(shared_solved, True),
        served_convention=part(served_solved, True),
        shared_general=part(shared_solved, False),
        served_general=part(served_solved, False),
        decisions=tuple(decisions),
        adapter_steps=len(adapter_steps),
        adapter_kl=_mean(st.kl for st in adapter_steps) if adapter_steps else 0.0,
        adapter_samples=sum(len(st.sample_ids) for st in adapter_steps),
        adapter_sample_orgs=tuple(sorted({org_of.get(i, "?") for st in adapter_steps for i in st.sample_ids})),
        kl=_mean(st.kl for st in steps) if steps else 0.0,
        steps=len(steps),
        convention_task=on_convention,
        shared_solved=shared_solved,
        served_solved=served_solved,
        shared_probs=shared_probs,
        served_probs=served_probs,
    )


def run(
    exp: Experiment,
    arms: Iterable[str] = ARMS,
    base: Settings | None = None,
    progress: Callable[[list[OrgRow]], None] | None = None,
) -> dict[str, list[OrgRow]]:
    """Both arms of the experiment, one after the other, from the same warm start and traffic."""
    return {arm: run_arm(arm, exp, base, progress) for arm in arms}


def summary(results: dict[str, list[OrgRow]], last: int = 3) -> dict[str, dict[str, dict[str, float]]]:
    """Per arm and org, the means over the last ``last`` cycles of the figures the experiment compares."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for arm, rows in results.items():
        cycles = sorted({r.cycle for r in rows})[-last:]
        for org in sorted({r.org for r in rows}):
            tail = [r for r in rows if r.org == org and r.cycle in cycles]
            out.setdefault(arm, {})[org] = {
                "shared_success": _mean(r.shared_success for r in tail),
                "served_success": _mean(r.served_success for r in tail),
                "shared_expected": _mean(r.shared_expected for r in tail),
                "served_expected": _mean(r.served_expected for r in tail),
                "served_convention": _mean(r.served_convention for r in tail),
                "served_general": _mean(r.served_general for r in tail),
            }
    return out
