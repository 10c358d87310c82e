"""The batch flow's logic for one cohort, free of Bytewax and I/O: rollouts + rewards -> micro-batches.

A cohort is ``(org_id, task_kind)``. Rollouts and rewards both carry it, and the samples of one
group (completions of the same prompt) always share it, so one :class:`BatchBuilder` per cohort can
join, group and baseline without talking to any other. Steps, in order:

1. **Join** a rollout with the reward of the same ``trajectory_id`` (only ``reward_version``). Either
   side waits at most ``join_wait_ms``; what is still unmatched then is counted and dropped.

   - Ordinary task kinds join revision 0 only: later revisions come after the sample may have
     been trained (counted ``later_revision_or_duplicate``).
   - Task kinds that await the user's verdict (``verdict_wait_ms`` lists them: settings
     ``flow.task_kinds.NAME.awaits_verdict``) join the *final* reward, the first one with
     ``provisional`` False, whatever its revision: a provisional reward (interim signals, before the
     verdict) is never joined (counted ``provisional_reward``), and the rollout waits for the final
     one up to the kind's ``verdict_wait_ms`` (its deadline + allowed lateness + ``join_wait_ms``)
     instead of ``join_wait_ms``. A trajectory joins at most once (later copies and revisions are
     counted ``later_revision_or_duplicate``), so it is trained at most once: never a provisional
     reward and its revision as two samples.
2. **Staleness**: a joined sample's lag is the serving version (the newest promotion seen)
   minus its ``policy_version``. Lag <= ``train.max_policy_lag``: a normal (on- or near-on-policy) sample.
   ``train.max_policy_lag`` < lag <= ``train.max_delayed_lag``: a **delayed** sample (``MicroBatch.delayed``), which the
   trainer corrects with a truncated importance weight (``trainer.loss``). Over both (or over
   ``train.max_policy_lag`` with ``train.max_delayed_lag`` = 0: no delayed path; it defaults to 4): dropped and
   counted per lag.
3. **Advantages** (Dr. GRPO, no std normalisation), separately for the normal and the delayed samples
   of a group: two or more of one kind use ``reward - mean(their rewards)``; a single one uses
   ``reward - baseline`` with its kind's running mean, which it then updates. The delayed samples have
   their own running mean (``delayed_baseline``), never the normal samples' one: a delayed sample's
   reward comes from another regime (a long task, a verdict hours later) and a short-task baseline
   would bias its advantage. A group waits ``group_wait_ms`` after its first join for its
   ``group_size`` members; verdict-kind members whose final rewards arrive further apart than that
   become groups of one (the group is not held for hours: it would go stale).
4. **Data use** (issue 38): a joined sample's class is the strictest of its rollout's, its reward's (from the
   trajectory's start) and its org's policy (the settings ``governance``). A
   ``monitor_only`` or ``none`` one is never a sample (counted ``data_use:monitor_only``, ``data_use:none``); an
   ``adapter_only`` one is kept only for an org that may have an adapter (``adapters.orgs``; else counted
   ``data_use:adapter_only_without_adapter``). A rollout or reward whose own class already rules it out is
   counted when it arrives, once per trajectory, and does not wait for its other half: the SDK publishes no
   rollout of a ``monitor_only`` trajectory, so its reward would otherwise wait and count as unmatched. A micro-batch holds samples of one class, so an org's router can
   send an ``adapter_only`` batch to the org's adapter alone (:mod:`flows.adapters`).
5. **Packing**: samples (prompt + completion tokens) are packed first-fit into rows of ``batching.seq_len``
   tokens; a micro-batch is emitted when ``batching.rows`` rows cannot take the next sample, or when its
   oldest sample has waited ``flush_ms``. Prompt tokens and padding have loss mask 0.

The clock is the cohort's event time: the largest ``created_at`` of its rollouts and
``emitted_at`` of its rewards. Nothing reads the wall clock, so a replay of the same input in the
same order emits the same micro-batches with the same ids.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

from flows.windowing import WindowConfig
from rtrl.sections.client import GovernanceSettings
from rtrl.sections.flows import BatchingSettings, FlowSettings
from rtrl.sections.trainer import AdapterSettings, TrainSettings
from schemas.data_use import DataUse
from schemas.records import MicroBatch, Reward, Rollout


@dataclass(frozen=True)
class BatchConfig:
    """One builder's rules: the sections it reads and the reward version it makes micro-batches for.

    ``batching`` gives the waits and the packing, ``train`` the policy-lag limits, ``governance`` each org's data
    use, ``adapters`` the orgs that may have an adapter. ``flow`` gives the kinds that await a verdict.
    The waits in milliseconds are computed once, on first use, and kept.
    """

    reward_version: str = "v2"
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    flow: FlowSettings = field(default_factory=FlowSettings)
    governance: GovernanceSettings = field(default_factory=GovernanceSettings)
    adapters: AdapterSettings = field(default_factory=AdapterSettings)

    def __post_init__(self) -> None:
        if self.batching.seq_len < 2:
            raise ValueError("batching.seq_len must be >= 2")

    @cached_property
    def join_wait_ms(self) -> int:
        return int(self.batching.join_wait_s * 1000)

    @cached_property
    def group_wait_ms(self) -> int:
        return int(self.batching.group_wait_s * 1000)

    @cached_property
    def flush_ms(self) -> int:
        return int(self.batching.flush_s * 1000)

    @cached_property
    def verdict_wait_ms(self) -> tuple[tuple[str, int], ...]:
        """(task kind, ms) for each kind that awaits the user's verdict: its rollouts wait this long for the final
        reward (its deadline + allowed lateness + the join wait); other kinds join revision 0 within join_wait_ms."""
        kinds = WindowConfig(self.flow).kinds
        return tuple((kind, rules.retention_ms + self.join_wait_ms) for kind, rules in kinds if rules.awaits_verdict)

    @cached_property
    def _verdict_waits(self) -> dict[str, int]:
        return dict(self.verdict_wait_ms)

    def data_use(self, org: str, *classes: DataUse) -> DataUse:
        """The class of a sample of ``org`` whose records say ``classes``: the strictest with the org's policy."""
        return self.governance.effective(org, *classes)

    def has_adapter(self, org: str) -> bool:
        return self.adapters.wants(org)

    def verdict_wait(self, task_kind: str) -> int | None:
        """How long a rollout of ``task_kind`` waits for its final reward; None = the kind awaits no verdict."""
        return self._verdict_waits.get(task_kind)


@dataclass
class Sample:
    """A rollout joined with its reward, with its advantage once known."""

    rollout: Rollout
    reward: float
    joined_at: int
    advantage: float = 0.0
    delayed: bool = False  # lag over max_policy_lag, within max_delayed_lag
    data_use: DataUse = "train"  # train or adapter_only: what it may train (schemas.data_use)

    @property
    def tokens(self) -> int:
        return len(self.rollout.prompt_ids) + len(self.rollout.completion_ids)


@dataclass
class _Group:
    size: int
    first_ts: int
    samples: list[Sample] = field(default_factory=list)


def group_advantages(rewards: list[float]) -> list[float]:
    """Dr. GRPO: each reward minus the group mean (no division by the standard deviation)."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def first_fit(token_counts: list[int], seq_len: int) -> list[int]:
    """The row each sample goes to when packed first-fit in order into rows of ``seq_len`` tokens."""
    free: list[int] = []
    rows = []
    for n in token_counts:
        for r, left in enumerate(free):
            if left >= n:
                free[r] -= n
                rows.append(r)
                break
        else:
            free.append(seq_len - n)
            rows.append(len(free) - 1)
    return rows


def rows_needed(token_counts: list[int], seq_len: int) -> int:
    """How many rows first-fit packing uses for these sample lengths (each <= seq_len)."""
    return max(first_fit(token_counts, seq_len), default=-1) + 1


def pack(samples: list[Sample], seq_len: int, created_at: int, reward_version: str = "") -> MicroBatch:
    """Samples into rows of ``seq_len`` tokens, first fit in the given order (all must fit). The batch id hashes
    the sample ids and the reward version: the same samples under two versions make two batches."""
    for s in samples:
        if s.tokens > seq_len:
            raise ValueError(f"sample {s.rollout.trajectory_id} has {s.tokens} tokens > seq_len {seq_len}")
    rows: list[list[tuple[int, Sample]]] = []
    for i, (s, r) in enumerate(zip(samples, first_fit([s.tokens for s in samples], seq_len))):
        if r == len(rows):
            rows.append([])
        rows[r].append((i, s))
    tok, mask, adv, blp, seg = [], [], [], [], []
    for row in rows:
        t, m, a, b, g = [], [], [], [], []
        for i, s in row:
            ro = s.rollout
            np_, nc = len(ro.prompt_ids), len(ro.completion_ids)
            t += ro.prompt_ids + ro.completion_ids
            m += [0] * np_ + list(ro.loss_mask)
            a += [0.0] * np_ + [s.advantage] * nc
            b += [0.0] * np_ + list(ro.behaviour_logprobs)
            g += [i] * (np_ + nc)
        pad = seq_len - len(t)
        tok.append(t + [0] * pad)
        mask.append(m + [0] * pad)
        adv.append(a + [0.0] * pad)
        blp.append(b + [0.0] * pad)
        seg.append(g + [-1] * pad)
    ids = [s.rollout.trajectory_id for s in samples]
    # adapter versions count per org, so a batch names one org's (a cohort is one org's; cohort keys that collide,
    # org "a/b" kind "c" and org "a" kind "b/c", could mix two): another org's adapter-served samples keep no
    # version and train on the delayed path (truncated importance weights), never as the base alone's samples
    served_orgs = sorted({s.rollout.org_id for s in samples if s.rollout.adapter_version})
    org = served_orgs[0] if served_orgs else ""
    versions = [s.rollout.adapter_version if s.rollout.org_id == org else 0 for s in samples]
    delayed = [s.delayed or (s.rollout.adapter_version != 0 and s.rollout.org_id != org) for s in samples]
    uses = [s.data_use for s in samples]
    digest = hashlib.sha1("\n".join(ids + ([f"reward:{reward_version}"] if reward_version else [])).encode())
    batch_id = digest.hexdigest()[:32]
    return MicroBatch(
        batch_id=batch_id,
        created_at=created_at,
        seq_len=seq_len,
        token_ids=tok,
        loss_mask=mask,
        advantages=adv,
        behaviour_logprobs=blp,
        segment_ids=seg,
        sample_ids=ids,
        policy_versions=[s.rollout.policy_version for s in samples],
        reward_version=reward_version,
        delayed=delayed if any(delayed) else [],
        adapter_versions=versions if any(versions) else [],
        served_org=org,
        data_use=list(uses) if any(u != "train" for u in uses) else [],
    )


class BatchBuilder:
    """Join, staleness filter, advantages and packing for one cohort; see the module docstring."""

    delayed_baseline: float | None = None  # the delayed samples' running mean (a class default: older snapshots)
    #: trajectory ids counted as not for training by their data-use class (None in a builder from an older snapshot)
    governed: set[str] | None = None
    #: (wait end, 0 rollout / 1 reward, trajectory id) of what is held unmatched; None in a builder from an older
    #: snapshot until first used
    _waits: list[tuple[int, int, str]] | None = None

    def __init__(self, config: BatchConfig, serving_version: int = 0):
        self.config = config
        self.serving_version = serving_version
        self.clock = 0
        self.rollouts: dict[str, Rollout] = {}
        self.rewards: dict[str, Reward] = {}
        self.joined: set[str] = set()  # trajectory ids already joined: later copies are duplicates
        self.governed = set()
        self.groups: dict[str, _Group] = {}
        self.ready: list[Sample] = []
        self.baseline: float | None = None
        self.counts: Counter[str] = Counter()
        self.lag_counts: Counter[int] = Counter()  # accepted samples by lag
        self.dropped_lag: Counter[int] = Counter()  # dropped samples by lag
        self._waits = []

    # ------------------------------------------------------------ input

    def add_rollout(self, r: Rollout) -> list[MicroBatch]:
        self._tick(r.created_at)
        tid = r.trajectory_id
        if self.governed is not None and tid in self.governed:
            pass  # counted once for its trajectory
        elif tid in self.joined or tid in self.rollouts:
            self.counts["duplicate_rollout"] += 1
        elif self._govern(tid, r.org_id, r.data_use):
            self.rewards.pop(tid, None)
        elif self.config.batching.seq_len < len(r.prompt_ids) + len(r.completion_ids):
            self.counts["too_long"] += 1
        elif tid in self.rewards:
            self._join(r, self.rewards.pop(tid))
        else:
            self._hold(self.rollouts, tid, r)
        return self._advance()

    def add_reward(self, rw: Reward) -> list[MicroBatch]:
        self._tick(rw.emitted_at)
        tid = rw.trajectory_id
        verdict = self.config.verdict_wait(rw.task_kind) is not None
        if rw.reward_version != self.config.reward_version:
            self.counts["other_reward_version"] += 1
        elif self.governed is not None and tid in self.governed:
            pass  # counted once for its trajectory
        elif tid not in self.joined and self._govern(tid, rw.org_id, rw.data_use):
            self.rollouts.pop(tid, None)
            self.rewards.pop(tid, None)
        elif verdict and rw.provisional:  # the final reward (the verdict's revision) is the one trained
            self.counts["provisional_reward"] += 1
        elif (rw.revision > 0 and not verdict) or tid in self.joined or tid in self.rewards:
            self.counts["later_revision_or_duplicate"] += 1
        elif tid in self.rollouts:
            self._join(self.rollouts.pop(tid), rw)
        else:
            self._hold(self.rewards, tid, rw)
        return self._advance()

    def set_serving_version(self, version: int) -> None:
        """A promotion was announced: lags are measured against the newest one."""
        self.serving_version = max(self.serving_version, version)

    def advance_to(self, ts: int) -> list[MicroBatch]:
        """Move the clock (e.g. from another cohort's data) and emit what timed out."""
        self._tick(ts)
        return self._advance()

    def flush_ready(self) -> list[MicroBatch]:
        """Pack every sample that is ready now, in partial micro-batches if need be."""
        out = []
        while self.ready:
            out.append(self._emit())
        return out

    def flush(self) -> list[MicroBatch]:
        """End of input: close every group, count what never joined, pack the rest."""
        self.counts["unmatched_rollout"] += len(self.rollouts)
        self.counts["unmatched_reward"] += len(self.rewards)
        self.rollouts.clear()
        self.rewards.clear()
        self._waits = []
        for gid in sorted(self.groups, key=lambda g: (self.groups[g].first_ts, g)):
            self._close_group(gid)
        return self.flush_ready()

    # ------------------------------------------------------------ internals

    def _tick(self, ts: int) -> None:
        self.clock = max(self.clock, ts)

    def _govern(self, tid: str, org: str, *classes: DataUse) -> bool:
        """Count ``tid`` once and return True when its data-use class, with its org's policy, trains nothing here."""
        use = self.config.data_use(org, *classes)
        reason: str
        if use in ("monitor_only", "none"):
            reason = use
        elif use == "adapter_only" and not self.config.has_adapter(org):
            reason = "adapter_only_without_adapter"
        else:
            return False
        self.counts[f"data_use:{reason}"] += 1
        if self.governed is None:  # a builder from an older snapshot
            self.governed = set()
        self.governed.add(tid)
        return True

    def _join(self, r: Rollout, rw: Reward) -> None:
        if self._govern(r.trajectory_id, r.org_id, r.data_use, rw.data_use):
            return
        self.joined.add(r.trajectory_id)
        use = self.config.data_use(r.org_id, r.data_use, rw.data_use)
        s = Sample(r, rw.reward, self.clock, data_use=use)
        g = self.groups.get(r.group_id)
        if g is None:
            g = self.groups[r.group_id] = _Group(r.group_size, self.clock)
        g.samples.append(s)
        if len(g.samples) >= g.size:
            self._close_group(r.group_id)

    def _close_group(self, gid: str) -> None:
        g = self.groups.pop(gid)
        cfg = self.config
        kept, normal, delayed = [], [], []
        for s in g.samples:
            lag = self.serving_version - s.rollout.policy_version
            if lag <= cfg.train.max_policy_lag:
                normal.append(s)
            elif lag <= cfg.train.max_delayed_lag:
                s.delayed = True
                delayed.append(s)
            else:
                self.dropped_lag[lag] += 1
                continue
            kept.append(s)
        if normal:
            self.baseline = self._advantages(normal, self.baseline)
        if delayed:
            self.delayed_baseline = self._advantages(delayed, self.delayed_baseline)
        for s in kept:
            self.lag_counts[self.serving_version - s.rollout.policy_version] += 1
        self.ready.extend(kept)

    def _advantages(self, samples: list[Sample], baseline: float | None) -> float | None:
        """Set the advantages of a group's samples of one kind (normal or delayed) with that kind's running
        ``baseline``; return the baseline afterwards (a group of two or more is its own baseline)."""
        if len(samples) >= 2:
            for s, a in zip(samples, group_advantages([s.reward for s in samples])):
                s.advantage = a
            return baseline
        s = samples[0]
        base = s.reward if baseline is None else baseline
        s.advantage = s.reward - base
        return base + self.config.batching.baseline_alpha * (s.reward - base)

    def _advance(self) -> list[MicroBatch]:
        cfg, now = self.config, self.clock
        if self._waits is None:  # a builder from an older snapshot: index what it holds
            held: list[tuple[int, dict[str, Rollout] | dict[str, Reward]]] = [(0, self.rollouts), (1, self.rewards)]
            self._waits = [(self._waits_until(x), kind, tid) for kind, table in held for tid, x in table.items()]
            heapq.heapify(self._waits)
        # what waited too long, in the order it expires: a heap, so a cohort holding days of verdict-kind rollouts
        # does not scan them all on every event
        while self._waits and self._waits[0][0] < now:
            until, kind, tid = heapq.heappop(self._waits)
            table = self._tables()[kind]
            x = table.get(tid)
            if x is None:  # joined (or counted) since
                continue
            due = self._waits_until(x)
            if due < now:
                del table[tid]
                self.counts["unmatched_rollout" if kind == 0 else "unmatched_reward"] += 1
            elif due != until:  # the config changed on a resume: wait by the new rule
                heapq.heappush(self._waits, (due, kind, tid))
        for gid in [gid for gid, g in self.groups.items() if g.first_ts + cfg.group_wait_ms < now]:
            self._close_group(gid)
        out = []
        while self.ready and (self._full() or self.ready[0].joined_at + cfg.flush_ms <= now):
            out.append(self._emit())
        return out

    def _tables(self) -> tuple[dict[str, Rollout], dict[str, Reward]]:
        return self.rollouts, self.rewards  # index 0 and 1 of the waits heap

    def _hold(self, table: dict, tid: str, x: Rollout | Reward) -> None:
        """Keep an unmatched rollout or reward until its other half comes or its wait ends."""
        table[tid] = x
        if self._waits is not None:
            heapq.heappush(self._waits, (self._waits_until(x), 0 if isinstance(x, Rollout) else 1, tid))

    def _waits_until(self, x: Rollout | Reward) -> int:
        """The cohort time until which an unmatched rollout or reward waits for its other half."""
        if isinstance(x, Reward):
            return x.emitted_at + self.config.join_wait_ms
        verdict = self.config.verdict_wait(x.task_kind)
        return x.created_at + (self.config.join_wait_ms if verdict is None else verdict)

    def _full(self) -> bool:
        """Whether the ready samples of one data-use class fill more than ``rows`` rows."""
        for use in {s.data_use for s in self.ready}:
            same = [s.tokens for s in self.ready if s.data_use == use]
            if rows_needed(same, self.config.batching.seq_len) > self.config.batching.rows:
                return True
        return False

    def _emit(self) -> MicroBatch:
        """Pack the longest prefix of the ready samples of the oldest one's data-use class that fits in ``rows``
        rows: a micro-batch holds one class."""
        cfg, n, use = self.config, 1, self.ready[0].data_use
        same = [s for s in self.ready if s.data_use == use]
        while (
            n < len(same) and rows_needed([s.tokens for s in same[: n + 1]], cfg.batching.seq_len) <= cfg.batching.rows
        ):
            n += 1
        take = same[:n]
        if len(same) == len(self.ready):
            self.ready = self.ready[n:]
        else:
            taken = {id(s) for s in take}
            self.ready = [s for s in self.ready if id(s) not in taken]
        return pack(take, cfg.batching.seq_len, self.clock, cfg.reward_version)
