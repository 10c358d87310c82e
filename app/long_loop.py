"""The long-loop experiment (issue 16): does training delayed rewards, with correction, beat dropping them?

A share of the loop's tasks are background tasks (:data:`simulator.tasks.BACKGROUND`): their user reacts to
check-ins while the task runs (a provisional reward, weak) and judges the whole outcome with a verdict about
``verdict_cycles`` cycles later (the final reward, sharp). By then the policy that served them has been
replaced ``verdict_cycles`` times, so their samples are that many versions old. Three arms see the same traffic
and differ only in what the batch flow and the trainer do with those samples:

* ``drop``: today's behaviour (``train.max_delayed_lag = 0``): samples over ``train.max_policy_lag`` are dropped;
* ``corrected``: the delayed path (``train.max_delayed_lag``), trained with a truncated importance weight from
  the stored behaviour log-probs to the current policy (``loss.delayed_correction = "truncated_is"``);
* ``uncorrected``: the same samples without any correction (``loss.delayed_correction = "none"``).

Each cycle runs the production pieces in-process on simulated event time (one cycle = ``cycle_minutes`` of it):
the policy samples completions (:func:`simulator.policy.sample`), the simulated users' events are recorded
through the SDK's trajectory handle (:func:`simulator.world.react`, :func:`simulator.world.react_background`),
the reward flow's processor windows and scores them (:class:`flows.processor.RewardProcessor`, provisional until
the verdict), the batch flow's builders join and pack them (:class:`flows.batching.BatchBuilder`, one per
cohort, configured by :func:`flows.batch_flow.batch_config`), the micro-batches go through the Arrow wire format
(:func:`schemas.codec.encode_batch`, :func:`trainer.batch.to_batch`) to the trainer
(:func:`trainer.train.train`, configured by :meth:`rtrl.sections.trainer.TrainConfig.from_settings`), and the candidate
is promoted (no gate: the arms must stay comparable). Kafka, ClickHouse and Bytewax are left out so the three
arms see identical, seeded input; the flows' handling of the same records is tested against the real broker
and engine elsewhere (tests/test_delayed_path.py, tests/test_long_loop.py).

Per cycle it reports the held-out success (greedy solve rate) on background and on short tasks, the KL to the
reference and the gradient norms of the cycle's steps, and how many delayed samples were trained and dropped.
``bench/long_loop.py`` runs all three arms and writes a table and a PNG; tests/test_long_loop.py asserts the
direction on a short seeded run.
"""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from app.inprocess import MINUTE, InProcessLoop
from app.loop_config import loop_settings
from app.serving import loop_model_config
from client.sdk import Trajectory
from rtrl.settings import Settings, as_env, load_settings
from simulator.policy import greedy, sample, solve_probability, warm_start
from simulator.tasks import BACKGROUND, KINDS, Outcome, Task, held_out, outcome, sample_task, score
from simulator.world import LONG_WORLD, LongWorld, react, react_background
from trainer.factory import build_policy

#: the arms: name -> (train.max_delayed_lag, loss.delayed_correction)
ARMS: dict[str, tuple[int, str]] = {
    "drop": (0, "truncated_is"),
    "corrected": (-1, "truncated_is"),  # -1: the experiment's max_delayed_lag
    "uncorrected": (-1, "none"),
}


@dataclass(frozen=True)
class Experiment:
    """The experiment's world and size (defaults: bench/long_loop.py's)."""

    cycles: int = 12
    tasks_per_cycle: int = 512  # prompts served per cycle, each sampled group_size times (the loop's 2,048 samples)
    group_size: int = 4
    long_share: float = 0.2  # share of the prompts that are background tasks
    verdict_cycles: int = 3  # the verdict arrives about this many cycles after the rollout
    max_delayed_lag: int = 5  # the corrected and uncorrected arms' train.max_delayed_lag
    cycle_minutes: int = 60  # simulated event time per cycle
    rate: float = 100.0  # tasks served per second of event time (loop.rate), each group_size times
    eval_tasks: int = 200  # held-out tasks of each kind
    orgs: int = 3
    seed: int = 0
    warm_start_steps: int = 300
    world: LongWorld = LONG_WORLD


@dataclass
class CycleRow:
    """What one cycle of one arm did and scored (the version it promoted is ``cycle``)."""

    arm: str
    cycle: int
    long_success: float  # greedy solve rate on held-out background tasks
    short_success: float  # greedy solve rate on held-out short tasks
    long_sampled: float  # solve rate of sampled completions on held-out background tasks
    long_expected: float  # mean probability that a sampled completion solves a held-out background task
    short_expected: float  # the same on held-out short tasks
    kl: float  # mean KL to the reference over the cycle's steps
    grad_norm: float  # mean gradient norm (before clipping) over the cycle's steps
    grad_norm_max: float
    steps: int
    samples: int  # samples trained (the trainer's train_metrics)
    delayed_samples: int  # of which the delayed path brought (train_metrics' delayed_lag_histogram)
    delayed_lag: float  # their mean policy lag
    dropped: int  # samples the builders dropped as too old (total so far)
    verdicts: int  # verdicts that arrived this cycle
    long_solved: tuple[bool, ...] = ()  # per held-out background task: solved greedily (for paired intervals)
    short_solved: tuple[bool, ...] = ()
    long_probs: tuple[float, ...] = ()  # per held-out background task: probability a sample solves it
    short_probs: tuple[float, ...] = ()


def arm_settings(base: Settings, arm: str, exp: Experiment) -> Settings:
    """The base settings with the arm's delayed path, and windows for the experiment's event time: a background
    task's window stays open long enough for its verdict (``verdict_cycles`` cycles and two more)."""
    lag, correction = ARMS[arm]
    horizon_s = (exp.verdict_cycles + 2) * exp.cycle_minutes * 60
    env = as_env(base) | {
        "RTRL_TRAIN__MAX_DELAYED_LAG": str(exp.max_delayed_lag if lag < 0 else lag),
        "RTRL_LOSS__DELAYED_CORRECTION": correction,
        "RTRL_FLOW__TASK_KINDS": json.dumps(
            {
                BACKGROUND: {
                    "deadline_s": exp.cycle_minutes * 60,
                    "allowed_lateness_s": horizon_s,
                    "awaits_verdict": True,
                }
            }
        ),
    }
    return load_settings(env=env)


def _settings(base: Settings | None) -> Settings:
    s = base if base is not None else load_settings(env={"RTRL_SDK__SALT": "long-loop-experiment"})
    return loop_settings(s)


def run_arm(
    arm: str, exp: Experiment, base: Settings | None = None, progress: Callable[[CycleRow], None] | None = None
) -> list[CycleRow]:
    """One arm of the experiment: ``exp.cycles`` cycles from the same warm start and the same traffic."""
    s = arm_settings(_settings(base), arm, exp)
    cfg, precision = loop_model_config(s)
    torch.manual_seed(exp.seed)
    policy = build_policy(cfg, precision)
    model, reference = policy.model, policy.reference
    rng = random.Random(exp.seed)
    warm = [sample_task(rng, "warm", 0.5, kinds=(*KINDS, BACKGROUND)) for _ in range(600)]
    warm_start(model, warm, steps=exp.warm_start_steps, seed=exp.seed)
    reference.load_state_dict(model.state_dict())
    short_eval = held_out(exp.eval_tasks, seed=7 + exp.seed)
    long_eval = held_out(exp.eval_tasks, seed=7 + exp.seed, kinds=(BACKGROUND,))

    loop = InProcessLoop(s, "long-loop", exp.seed, exp.group_size, exp.rate, exp.cycle_minutes)
    rows: list[CycleRow] = []
    orgs = [f"org-{i}" for i in range(exp.orgs)]

    def react_one(traj: Trajectory, task: Task, out: Outcome, t: int, user: str) -> None:
        if task.kind == BACKGROUND:
            delay = exp.verdict_cycles * exp.cycle_minutes * MINUTE
            react_background(traj, task, out, loop.world_rng, t, delay, world=exp.world)
        else:
            react(traj, task, out, loop.world_rng, t, user)

    for cycle in range(1, exp.cycles + 1):
        # serve: the prompts of this cycle, group_size samples each, by the serving version
        tasks = [
            sample_task(
                loop.serve_rng,
                loop.serve_rng.choice(orgs),
                0.5,
                kinds=(BACKGROUND,) if loop.serve_rng.random() < exp.long_share else tuple(KINDS),
            )
            for _ in range(exp.tasks_per_cycle)
        ]
        flat = [t for t in tasks for _ in range(exp.group_size)]
        completions, logps = sample(model, flat, loop.gen)
        loop.serve(cycle, flat, completions, logps, react_one)
        made, verdicts = loop.deliver(loop.window(cycle)[1])
        # train on whole steps of micro-batches; a remainder waits for the next cycle
        steps = loop.train(model, reference, [b for _, b in made], f"long-loop-{arm}-{cycle}")
        loop.promote()  # the arms must stay comparable, so no gate
        long_solved = tuple(outcome(t, c).correct for t, c in zip(long_eval, greedy(model, long_eval)))
        short_solved = tuple(outcome(t, c).correct for t, c in zip(short_eval, greedy(model, short_eval)))
        long_greedy, short_greedy = sum(long_solved) / len(long_solved), sum(short_solved) / len(short_solved)
        long_comps, _ = sample(model, long_eval, torch.Generator().manual_seed(exp.seed + 99))
        long_probs, short_probs = (
            tuple(solve_probability(model, long_eval)),
            tuple(solve_probability(model, short_eval)),
        )
        delayed: Counter[int] = (
            Counter()
        )  # the delayed samples the trainer trained, by lag (its own count, train_metrics')
        for st in steps:
            delayed.update({int(lag): n for lag, n in st.delayed_lag_histogram.items()})
        dropped = loop.dropped
        row = CycleRow(
            arm=arm,
            cycle=cycle,
            long_success=long_greedy,
            short_success=short_greedy,
            long_sampled=score(long_eval, long_comps)["solve_rate"],
            long_expected=statistics.fmean(long_probs),
            short_expected=statistics.fmean(short_probs),
            kl=statistics.fmean([st.kl for st in steps]) if steps else 0.0,
            grad_norm=statistics.fmean([st.grad_norm for st in steps]) if steps else 0.0,
            grad_norm_max=max((st.grad_norm for st in steps), default=0.0),
            steps=len(steps),
            samples=sum(len(st.sample_ids) for st in steps),
            delayed_samples=sum(delayed.values()),
            delayed_lag=sum(lag * n for lag, n in delayed.items()) / max(1, sum(delayed.values())),
            dropped=dropped,
            verdicts=verdicts,
            long_solved=long_solved,
            short_solved=short_solved,
            long_probs=long_probs,
            short_probs=short_probs,
        )
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def run(
    exp: Experiment,
    arms: Iterable[str] = tuple(ARMS),
    base: Settings | None = None,
    progress: Callable[[CycleRow], None] | None = None,
) -> dict[str, list[CycleRow]]:
    """Every arm of the experiment, one after the other, from the same warm start and traffic."""
    return {arm: run_arm(arm, exp, base, progress) for arm in arms}


def summary(results: dict[str, list[CycleRow]], last: int = 3) -> dict[str, dict[str, float]]:
    """Per arm, the means over the last ``last`` cycles of the figures the experiment compares."""
    out = {}
    for arm, rows in results.items():
        tail = rows[-last:]
        out[arm] = {
            "long_success": statistics.fmean(r.long_success for r in tail),
            "short_success": statistics.fmean(r.short_success for r in tail),
            "long_sampled": statistics.fmean(r.long_sampled for r in tail),
            "kl": statistics.fmean(r.kl for r in tail),
            "grad_norm": statistics.fmean(r.grad_norm for r in tail),
            "delayed_samples": float(sum(r.delayed_samples for r in rows)),
            "dropped": float(rows[-1].dropped),
        }
    return out
