"""The loop's default eval suite (:class:`evalgate.suite.EvalSuite`): the simulator's held-out tasks.

Scores are greedy solve/behaviour rates prefixed ``greedy_``, plus the same rates of sampled
completions over every task ``repeats`` times (``samples = repeats * len(tasks)``; 16 by default: with 200 tasks
the gate's exact test then detects a broken-call rise at its rule's 25% threshold from a rate of ~0.09 with ~75%
power at the Holm-adjusted level; 8 let a +29% v1 rise through as noise), sampled with a generator seeded by ``seed``
so every model is judged on the same draws and the same model always scores the same.

:class:`OrgHeldOutTasks` is the suite of one org's adapter (issue 17): the org's own held-out tasks under its
convention (:class:`simulator.tasks.Convention`), scored like :class:`HeldOutTasks` so the gate's rules apply
unchanged; its :meth:`~OrgHeldOutTasks.guard` is the global regression guard: the shared policy's held-out tasks
of the kinds where the org follows the global convention (an adapter must learn its org's convention without
forgetting what the shared policy knows). The gate (:mod:`evalgate.adapters`) scores an adapter on both.
"""

from __future__ import annotations

import torch

from simulator.policy import greedy, sample
from simulator.tasks import Conventions, Task, held_out, score


class HeldOutTasks:
    """``n_tasks`` held-out tasks (``held_out(n_tasks, seed=7 + seed)``, a seed no training round uses); those of
    ``exclude_kinds`` left out (an org adapter's guard, :meth:`OrgHeldOutTasks.guard`)."""

    name = "held-out-tasks"

    def __init__(self, n_tasks: int, seed: int, repeats: int = 16, exclude_kinds: tuple[str, ...] = ()):
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1 (sampled completions per task), got {repeats!r}")
        self.seed, self.repeats = seed, repeats
        self.tasks: list[Task] = [t for t in held_out(n_tasks, seed=7 + seed) if t.kind not in exclude_kinds]
        self.samples = repeats * len(self.tasks)

    def evaluate(self, model) -> dict[str, float]:
        """Greedy solve rates plus the behaviour of sampled completions (same seed for every model)."""
        out = {f"greedy_{k}": v for k, v in score(self.tasks, greedy(model, self.tasks)).items()}
        comps, _ = sample(model, self.tasks * self.repeats, torch.Generator().manual_seed(self.seed))
        out |= score(self.tasks * self.repeats, comps)
        return out

    def __repr__(self) -> str:
        return f"HeldOutTasks(n_tasks={len(self.tasks)}, seed={self.seed})"


class OrgHeldOutTasks:
    """The held-out suite of ``org``'s adapter: ``n_tasks`` of the org's own held-out tasks
    (``held_out(n_tasks, seed=7 + seed, org=org, conventions=conventions)``, a stream of their own) under its
    convention, scored like :class:`HeldOutTasks` (same metric names, so the gate's rules apply unchanged), with the
    greedy solve rates on the org's convention kinds and on its other kinds apart (``greedy_solve_rate_convention``,
    ``greedy_solve_rate_general``). :meth:`guard` is its global regression guard."""

    def __init__(self, org: str, conventions: Conventions | None, n_tasks: int, seed: int, repeats: int = 16):
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1 (sampled completions per task), got {repeats!r}")
        self.org, self.n_tasks, self.seed, self.repeats = org, n_tasks, seed, repeats
        self.name = f"held-out-tasks-{org}"
        convention = (conventions or {}).get(org)
        self.convention_kinds: tuple[str, ...] = convention.kinds if convention is not None else ()
        self.tasks: list[Task] = held_out(n_tasks, seed=7 + seed, org=org, conventions=conventions)
        self.samples = repeats * len(self.tasks)

    def evaluate(self, model) -> dict[str, float]:
        """The org's greedy and sampled rates (as :meth:`HeldOutTasks.evaluate`) and its convention / general
        split (same seed for every model)."""
        completions = greedy(model, self.tasks)
        out = {f"greedy_{k}": v for k, v in score(self.tasks, completions).items()}
        for part, keep in (("convention", True), ("general", False)):
            pairs = [(t, c) for t, c in zip(self.tasks, completions) if (t.kind in self.convention_kinds) == keep]
            out[f"greedy_solve_rate_{part}"] = score([t for t, _ in pairs], [c for _, c in pairs])["solve_rate"]
        comps, _ = sample(model, self.tasks * self.repeats, torch.Generator().manual_seed(self.seed))
        out |= score(self.tasks * self.repeats, comps)
        return out

    def guard(self) -> HeldOutTasks:
        """The global regression guard of this org's adapter: the shared policy's held-out tasks
        (:class:`HeldOutTasks` of the same size and seed) but those of the org's convention kinds, where the
        adapter is meant to answer differently; on the rest it must not lose what the shared policy knows."""
        return HeldOutTasks(self.n_tasks, self.seed, self.repeats, exclude_kinds=self.convention_kinds)

    def __repr__(self) -> str:
        return f"OrgHeldOutTasks(org={self.org!r}, n_tasks={len(self.tasks)}, seed={self.seed})"
