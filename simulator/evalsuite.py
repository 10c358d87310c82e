"""The loop's default eval suite (:class:`evalgate.suite.EvalSuite`): the simulator's held-out tasks.

Scores are greedy solve/behaviour rates prefixed ``greedy_``, plus the same rates of sampled
completions over every task ``repeats`` times (``samples = repeats * len(tasks)``; 16 by default: with 200 tasks
the gate's exact test then detects a broken-call rise at its rule's 25% threshold from a rate of ~0.09 with ~75%
power at the Holm-adjusted level; 8 let a +29% v1 rise through as noise), sampled with a generator seeded by ``seed``
so every model is judged on the same draws and the same model always scores the same.
"""

from __future__ import annotations

import torch

from simulator.policy import greedy, sample
from simulator.tasks import Task, held_out, score


class HeldOutTasks:
    """``n_tasks`` held-out tasks (``held_out(n_tasks, seed=7 + seed)``, a seed no training round uses)."""

    name = "held-out-tasks"

    def __init__(self, n_tasks: int, seed: int, repeats: int = 16):
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1 (sampled completions per task), got {repeats!r}")
        self.seed, self.repeats = seed, repeats
        self.tasks: list[Task] = held_out(n_tasks, seed=7 + seed)
        self.samples = repeats * len(self.tasks)

    def evaluate(self, model) -> dict[str, float]:
        """Greedy solve rates plus the behaviour of sampled completions (same seed for every model)."""
        out = {f"greedy_{k}": v for k, v in score(self.tasks, greedy(model, self.tasks)).items()}
        comps, _ = sample(model, self.tasks * self.repeats, torch.Generator().manual_seed(self.seed))
        out |= score(self.tasks * self.repeats, comps)
        return out

    def __repr__(self) -> str:
        return f"HeldOutTasks(n_tasks={len(self.tasks)}, seed={self.seed})"
