"""The synthetic world the simulator samples from: orgs, users, task kinds and policy behaviour.

Everything here is plain data plus seeded sampling; nothing does I/O. The distributions are
chosen to reproduce the shapes seen in real coding-agent telemetry rather than exact numbers:

* user activity is heavy-tailed (Pareto weights): a few power users produce most trajectories;
* org difficulty is log-normal around 1 (multiplicative: legacy code bases make everything harder);
* user strictness is Beta(2, 4) (most users are lenient, a minority rejects and rewrites a lot);
* task kinds differ in how often a clarifying question is genuinely needed.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from client.hashing import hash_user  # noqa: F401  (re-exported for simulator users)

TASK_KINDS: dict[str, float] = {
    "bugfix": 0.15,
    "feature": 0.40,
    "refactor": 0.25,
    "explain": 0.20,
    "test": 0.10,
}
"""Task kind -> ambiguity: probability that a clarifying question is genuinely needed.

Feature requests are often under-specified; test-writing tasks rarely are."""

TASK_MIX: dict[str, float] = {"bugfix": 0.35, "feature": 0.25, "refactor": 0.15, "explain": 0.15, "test": 0.10}
"""Relative frequency of each task kind (bug fixing dominates real usage)."""

EDIT_PROPENSITY: dict[str, float] = {"bugfix": 1.0, "feature": 1.0, "refactor": 1.0, "explain": 0.25, "test": 1.0}
"""Multiplier on ``PolicyProfile.p_edit`` per task kind: explanations mostly need no edit."""


@dataclass(frozen=True)
class User:
    """One simulated user: raw id (never sent), its salted hash, and behaviour traits."""

    user_id: str
    user_hash: str
    org_id: str
    strictness: float
    """0..1, Beta(2, 4): higher rejects more edits, keeps less of them, and is more easily annoyed."""
    activity: float
    """Pareto(1.5) weight: relative chance that the next trajectory is this user's."""


@dataclass(frozen=True)
class Org:
    """One organisation and how hard its code base is for the agent."""

    org_id: str
    difficulty: float
    """Log-normal(0, 0.25), median 1: >1 means more broken tool calls and worse edits."""
    users: tuple[User, ...]


@dataclass(frozen=True)
class Population:
    """All orgs and users, with cumulative activity weights for sampling a trajectory's user."""

    orgs: tuple[Org, ...]
    users: tuple[User, ...]
    cum_activity: tuple[float, ...]

    def org(self, org_id: str) -> Org:
        """The org with this id."""
        return next(o for o in self.orgs if o.org_id == org_id)

    def pick_user(self, rng: random.Random) -> User:
        """A user drawn in proportion to activity (heavy-tailed)."""
        return rng.choices(self.users, cum_weights=self.cum_activity)[0]


def build_population(rng: random.Random, orgs: int, users_per_org: int, salt: str) -> Population:
    """Orgs ``org-00``.., users ``user-00-007``.. with hashed ids and sampled traits."""
    ow = max(2, len(str(orgs - 1)))
    uw = max(3, len(str(users_per_org - 1)))
    out: list[Org] = []
    for i in range(orgs):
        org_id = f"org-{i:0{ow}d}"
        difficulty = math.exp(rng.gauss(0.0, 0.25))
        users = []
        for j in range(users_per_org):
            uid = f"user-{i:0{ow}d}-{j:0{uw}d}"
            users.append(
                User(
                    user_id=uid,
                    user_hash=hash_user(uid, salt),
                    org_id=org_id,
                    strictness=rng.betavariate(2.0, 4.0),
                    activity=rng.paretovariate(1.5),
                )
            )
        out.append(Org(org_id=org_id, difficulty=difficulty, users=tuple(users)))
    all_users = tuple(u for o in out for u in o.users)
    cum = tuple(itertools.accumulate(u.activity for u in all_users))
    return Population(orgs=tuple(out), users=all_users, cum_activity=cum)


def pick_task_kind(rng: random.Random) -> str:
    """A task kind drawn from :data:`TASK_MIX`."""
    return rng.choices(list(TASK_MIX), weights=list(TASK_MIX.values()))[0]


@dataclass(frozen=True)
class PolicyProfile:
    """How one policy version behaves; the simulator's ground truth for what training should improve.

    Latencies are log-normal (right-skewed with a long tail, as LLM serving latencies are):
    time to first token ~ LogNormal(ln ttft_median_ms, ttft_sigma), and total time =
    ttft + LogNormal(ln gen_median_ms, gen_sigma). Tool calls per step ~ Poisson(mean_tool_calls).
    """

    p_broken_tool_call: float = 0.08
    """Chance that a tool call is malformed or fails (scaled up by org difficulty)."""
    p_clarify: float = 0.6
    """Chance of asking a clarifying question when the task is genuinely ambiguous."""
    p_clarify_unneeded: float = 0.08
    """Chance of asking anyway when the task is clear (an unneeded question annoys the user)."""
    p_edit: float = 0.85
    """Chance of proposing an edit at all (times the task kind's :data:`EDIT_PROPENSITY`)."""
    p_extra_edit: float = 0.3
    """After each edit, chance of proposing another one (geometric number of edits)."""
    max_edits: int = 5
    edit_quality: float = 0.6
    """0..1: drives the chance an edit is accepted and how much of it persists."""
    mean_tool_calls: float = 3.0
    ttft_median_ms: float = 800.0
    ttft_sigma: float = 0.5
    gen_median_ms: float = 5000.0
    gen_sigma: float = 0.7

    def __post_init__(self) -> None:
        for name in ("p_broken_tool_call", "p_clarify", "p_clarify_unneeded", "p_edit", "p_extra_edit", "edit_quality"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"PolicyProfile.{name} = {v!r} must be a probability between 0 and 1")
        if self.max_edits < 1 or self.mean_tool_calls < 0:
            raise ValueError("PolicyProfile.max_edits must be >= 1 and mean_tool_calls >= 0")


def default_profile(policy_version: int) -> PolicyProfile:
    """A policy that gets gradually better with each version, so the loop has a signal to find.

    Broken tool calls fall 15% per version, unneeded questions 10% per version, and edit
    quality rises by 0.03 per version up to 0.9.
    """
    v = max(0, policy_version)
    return PolicyProfile(
        p_broken_tool_call=0.08 * 0.85**v,
        p_clarify_unneeded=0.08 * 0.9**v,
        edit_quality=min(0.9, 0.6 + 0.03 * v),
    )


def profile_for(policy_version: int, profiles: Mapping[int, PolicyProfile] | None = None) -> PolicyProfile:
    """``profiles[policy_version]`` when given, else :func:`default_profile`."""
    if profiles and policy_version in profiles:
        return profiles[policy_version]
    return default_profile(policy_version)
