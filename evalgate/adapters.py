"""Per-organisation adapters' gate and ledger (issue 17): pure functions and state, no I/O, no models.

An org's adapter version is judged on its own, twice:

1. on the org's held-out tasks (what its users accept), against what serves the org now (its current adapter
   over the base, or the base alone), and against the base alone as the "first version" (slow drift of many
   adapter versions that each stayed within the limits of their parent): :func:`evalgate.gate.decide`;
2. on a global regression guard (a suite every org shares: the adapter may specialise, not forget), against the
   base alone on that suite, with its own rules (by default the same solve tolerance and behaviour rules).

Both must pass. :class:`AdapterLedger` keeps, per org, which adapter version serves on which base version, the
history a per-org rollback goes back through, and which adapters must be judged again when the base is promoted.
A version is a (weights, base) pair: an adapter re-validated on a new base gets a new version number whose parent
is the one it was trained as, so every row of ``adapter_checkpoints`` stays a decision that was taken.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from evalgate.gate import Decision, GateRules, decide


def decide_adapter(
    candidate: Mapping[str, float],
    serving: Mapping[str, float],
    base: Mapping[str, float],
    samples: int,
    guard_candidate: Mapping[str, float],
    guard_base: Mapping[str, float],
    guard_samples: int,
    rules: GateRules = GateRules(),
    guard: GateRules | None = None,
    training: Iterable[object] = (),
) -> Decision:
    """Promote an org's adapter version when it is not worse on the org's held-out tasks than what serves the org
    (``serving``: the current adapter's scores there, or the base's when none serves) nor drifted from the base
    alone (``base``), and the global guard finds no regression against the base (``guard_*``; ``guard`` rules,
    default ``rules`` without the first-version comparison). ``training``: the adapter's train_metrics rows,
    judged by ``rules.mismatch``. The reason says which side refused."""
    on_org = decide(candidate, serving, base, samples, rules, training)
    guard_rules = replace(guard or rules, compare_with_first=False, mismatch=None)
    on_guard = decide(guard_candidate, guard_base, guard_base, guard_samples, guard_rules)
    problems = tuple(f"org: {p}" for p in on_org.problems) + tuple(f"global guard: {p}" for p in on_guard.problems)
    if problems:
        return Decision(False, "; ".join(problems), problems)
    return Decision(True, f"org: {on_org.reason}; global guard: {on_guard.reason}")


@dataclass
class AdapterVersion:
    """One decision-worthy adapter: its weights (``path``) over base ``base_version``."""

    org: str
    version: int
    base_version: int
    path: str
    parent: int | None = None
    status: str = "candidate"
    scores: dict[str, float] = field(default_factory=dict)


@dataclass
class AdapterLedger:
    """Per org: every adapter version and its status, which one serves, and the order they were promoted in (what
    a rollback goes back through). Versions count per org from 1; 0 means "the base alone"."""

    versions: dict[str, dict[int, AdapterVersion]] = field(default_factory=dict)
    promoted: dict[str, list[int]] = field(default_factory=dict)
    """Per org, the versions in the order they were promoted (rolled back ones removed)."""
    retired: dict[str, int] = field(default_factory=dict)
    """Per org, the version whose re-validation on a new base was refused (:meth:`retire`) while no adapter has
    been promoted since: its weights are where the org's next candidate starts (:meth:`start`)."""

    def next_version(self, org: str) -> int:
        return max(self.versions.get(org, {}).keys(), default=0) + 1

    def add(self, org: str, base_version: int, path: str, parent: int | None = None) -> AdapterVersion:
        """A new candidate version of ``org``'s adapter."""
        v = AdapterVersion(org, self.next_version(org), base_version, path, parent)
        self.versions.setdefault(org, {})[v.version] = v
        return v

    def serving(self, org: str) -> AdapterVersion | None:
        """The adapter version serving ``org`` now (None: the base alone)."""
        chain = self.promoted.get(org, [])
        return self.versions[org][chain[-1]] if chain else None

    def decide(self, org: str, version: int, promote: bool, scores: Mapping[str, float] | None = None) -> None:
        v = self.versions[org][version]
        v.status = "promoted" if promote else "rejected"
        v.scores = dict(scores or {})
        if promote:
            self.promoted.setdefault(org, []).append(version)
            self.retired.pop(org, None)

    def start(self, org: str, base_version: int) -> AdapterVersion | None:
        """The version whose weights ``org``'s next candidate on base ``base_version`` trains from: the one serving
        the org, if it is valid on that base; else the retired one (its re-validation on a new base was refused:
        the weights the org's adapter had learnt, not worth losing to a base change); else None (a fresh
        adapter). A rollback by hand empties the chain without retiring: the org starts fresh."""
        v = self.serving(org)
        if v is not None:
            return v if v.base_version == base_version else None
        gone = self.retired.get(org)
        return self.versions[org][gone] if gone is not None else None

    def same_weights(self, org: str, served: int, start: AdapterVersion | None) -> bool:
        """Whether a sample of ``org`` that adapter version ``served`` sampled (0: the base alone;
        ``Rollout.adapter_version``) came from the weights ``start`` holds (None: a fresh adapter, which adds
        nothing to the base). A re-validated version holds its parent's weights (the same ``path``); a version
        this ledger does not know is another policy."""
        if served == 0 or start is None:
            return served == 0 and start is None
        v = self.versions.get(org, {}).get(served)
        return v is not None and v.path == start.path

    def rollback(self, org: str) -> tuple[AdapterVersion, AdapterVersion | None]:
        """Undo ``org``'s newest promotion: (the version rolled back, what serves the org now: the previous promoted
        version, or None for the base alone). Raises ValueError when no adapter serves the org."""
        chain = self.promoted.get(org, [])
        if not chain:
            raise ValueError(f"no adapter serves org {org!r}: nothing to roll back (it is served the base)")
        gone = self.versions[org][chain.pop()]
        gone.status = "rolled_back"
        return gone, self.serving(org)

    def stale(self, base_version: int) -> list[AdapterVersion]:
        """The serving adapters trained or validated on another base than ``base_version`` (just promoted): each
        must be judged again on the new base (or retrained), and the decision recorded."""
        out = []
        for org in sorted(self.promoted):
            v = self.serving(org)
            if v is not None and v.base_version != base_version:
                out.append(v)
        return out

    def revalidate(self, old: AdapterVersion, base_version: int) -> AdapterVersion:
        """A candidate version holding ``old``'s weights over base ``base_version`` (its parent: ``old``)."""
        return self.add(old.org, base_version, old.path, parent=old.version)

    def retire(self, org: str) -> AdapterVersion | None:
        """The serving adapter failed its re-validation on a new base: ``org`` is served the base alone until its
        adapter retrains. Returns the version that stopped serving (its status: rolled_back)."""
        chain = self.promoted.get(org, [])
        if not chain:
            return None
        gone = self.versions[org][chain[-1]]
        self.promoted[org] = []
        self.retired[org] = gone.version
        gone.status = "rolled_back"
        return gone

    def state(self) -> dict:
        """JSON-able state (what a restarted loop resumes)."""
        return {
            "versions": {org: {str(n): vars(v) for n, v in vs.items()} for org, vs in sorted(self.versions.items())},
            "promoted": {org: list(chain) for org, chain in sorted(self.promoted.items())},
            "retired": dict(sorted(self.retired.items())),
        }

    @classmethod
    def from_state(cls, st: Mapping) -> AdapterLedger:
        return cls(
            versions={
                org: {int(n): AdapterVersion(**v) for n, v in vs.items()} for org, vs in st.get("versions", {}).items()
            },
            promoted={org: list(chain) for org, chain in st.get("promoted", {}).items()},
            retired={org: int(v) for org, v in st.get("retired", {}).items()},  # absent in older state files
        )
