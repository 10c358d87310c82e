"""Monitor reads from ClickHouse: behaviour rows, the promotion check and the A/B table.

Every figure comes from the views of ``schemas/migrations/0002_monitors.sql`` (``behaviour``,
``reward_stats``), which compute at query time over the tables read with FINAL: always current,
and a replayed row never counts twice. The decisions themselves are the pure functions of
:mod:`monitors.alerts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from monitors.alerts import (
    DEFAULT_RULES,
    Alert,
    AlertRule,
    Evaluation,
    MismatchRule,
    Skipped,
    StepAlert,
    evaluate,
    mismatch_alerts,
    relative_change_ci,
    standard_error,
)
from monitors.reward_compare import Pair
from monitors.stats import Comparison, Users, compare
from rtrl.clickhouse import _check_name

#: the metrics of the seed post's A/B table
AB_METRICS: tuple[str, ...] = ("edit_persistence", "dissatisfied_rate", "latency_p50_ms", "latency_p95_ms")


def _rows(ch: Any, sql: str, parameters: dict | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    # Arrow keeps the column names when no row matches (a plain query's result does not)
    data = ch.query_arrow(sql, parameters=parameters or {})
    return list(data.schema.names), data.to_pylist()


def _empty(names: Sequence[str], policy_version: int, org_id: str) -> dict[str, Any]:
    """The row of a version with no trajectory: counts 0, metrics None (rules on it are skipped)."""
    row: dict[str, Any] = {n: None for n in names}
    row.update(policy_version=policy_version, org_id=org_id, trajectories=0, edit_persistence_n=0, latency_n=0)
    row.update(tool_calls=0, persistence_checks=0)
    return row


def behaviour_rows(ch: Any, db: str, versions: Sequence[int], org_id: str = "*") -> dict[int, dict[str, Any]]:
    """Behaviour rows of ``versions`` for one org ('*' = all orgs), keyed by version; missing versions get an empty row."""
    names, rows = _rows(
        ch,
        f"SELECT * FROM {_check_name(db)}.behaviour WHERE org_id = {{org:String}} "
        "AND policy_version IN {versions:Array(Int64)}",
        {"org": org_id, "versions": [int(v) for v in versions]},
    )
    by_version = {int(r["policy_version"]): r for r in rows}
    return {int(v): by_version.get(int(v)) or _empty(names, int(v), org_id) for v in versions}


def behaviour(ch: Any, db: str, policy_version: int, org_id: str = "*") -> dict[str, Any]:
    """One row of the ``behaviour`` view as a dict (column -> value; see the migration for the columns).

    A version with no closed trajectory gives ``trajectories == 0`` and None metrics.
    """
    return behaviour_rows(ch, db, [policy_version], org_id)[int(policy_version)]


def reward_stats(ch: Any, db: str, reward_version: str, org_id: str = "*") -> dict[int, dict[str, Any]]:
    """Reward mean, variance and count per policy version under ``reward_version`` (view ``reward_stats``)."""
    _, rows = _rows(
        ch,
        f"SELECT * FROM {_check_name(db)}.reward_stats(rv = {{rv:String}}) WHERE org_id = {{org:String}} "
        "ORDER BY policy_version",
        {"rv": reward_version, "org": org_id},
    )
    return {int(r["policy_version"]): r for r in rows}


def reward_pairs(
    ch: Any, db: str, a: str, b: str, since_ms: int | None = None, until_ms: int | None = None
) -> list[Pair]:
    """Every closed trajectory starting in ``[since_ms, until_ms)`` (None: unbounded) with its reward under
    versions ``a`` and ``b`` (view ``reward_pairs``; None where a version has none), for
    :mod:`monitors.reward_compare`."""
    where: list[str] = []
    params: dict[str, Any] = {"a": a, "b": b}
    if since_ms is not None:
        where.append("toUnixTimestamp64Milli(first_event_ts) >= {since:Int64}")
        params["since"] = int(since_ms)
    if until_ms is not None:
        where.append("toUnixTimestamp64Milli(first_event_ts) < {until:Int64}")
        params["until"] = int(until_ms)
    _, rows = _rows(
        ch,
        f"SELECT * FROM {_check_name(db)}.reward_pairs(a = {{a:String}}, b = {{b:String}})"
        + (" WHERE " + " AND ".join(where) if where else "")
        + " ORDER BY trajectory_id",
        params,
    )
    return [
        Pair(
            trajectory_id=r["trajectory_id"],
            policy_version=int(r["policy_version"]),
            org_id=r["org_id"],
            task_kind=r["task_kind"],
            reward_a=r["reward_a"] if r["scored_a"] else None,
            reward_b=r["reward_b"] if r["scored_b"] else None,
            flags_a=tuple(r["flags_a"] or ()),
            flags_b=tuple(r["flags_b"] or ()),
            broken_tool_calls=int(r["broken_tool_calls"]),
            clarifying_questions=int(r["clarifying_questions"]),
        )
        for r in rows
    ]


# ---------------------------------------------------------------- promotion gate


@dataclass(frozen=True)
class GateReport:
    """What the behaviour monitors say about promoting ``candidate_version`` over ``parent_version``.

    ``ok`` is the strict verdict (every rule judged, none fired); ``alerts`` lists what fired and
    ``skipped`` what could not be judged (too few samples or no value), so a gate can choose to
    wait for data rather than promote blind. ``reason`` is one line for ``Checkpoint.reason``.
    """

    candidate_version: int
    parent_version: int
    org_id: str
    candidate: dict[str, Any]
    parent: dict[str, Any]
    evaluation: Evaluation

    @property
    def alerts(self) -> tuple[Alert, ...]:
        return self.evaluation.alerts

    @property
    def skipped(self) -> tuple[Skipped, ...]:
        return self.evaluation.skipped

    @property
    def passed(self) -> tuple[str, ...]:
        return self.evaluation.passed

    @property
    def insufficient(self) -> bool:
        return self.evaluation.insufficient

    @property
    def ok(self) -> bool:
        return self.evaluation.ok

    @property
    def reason(self) -> str:
        return f"v{self.candidate_version} vs v{self.parent_version} ({self.org_id}): {self.evaluation.summary()}"


def check_promotion(
    ch: Any,
    db: str,
    candidate_version: int,
    parent_version: int,
    rules: Sequence[AlertRule] = DEFAULT_RULES,
    org_id: str = "*",
) -> GateReport:
    """Read both versions' behaviour rows and judge the candidate with ``rules``."""
    rows = behaviour_rows(ch, db, [candidate_version, parent_version], org_id)
    cand, par = rows[int(candidate_version)], rows[int(parent_version)]
    return GateReport(int(candidate_version), int(parent_version), org_id, cand, par, evaluate(cand, par, rules))


# ---------------------------------------------------------------- training-inference mismatch


def train_mismatch(ch: Any, db: str, run_id: str, rule: MismatchRule = MismatchRule()) -> tuple[StepAlert, ...]:
    """The steps of training run ``run_id`` (``train_metrics`` FINAL) whose mismatch fired ``rule``."""
    _, rows = _rows(
        ch,
        f"SELECT run_id, step, mismatch_k3, mismatch_max_abs_log_ratio FROM {_check_name(db)}.train_metrics FINAL "
        "WHERE run_id = {run:String} ORDER BY step",
        {"run": run_id},
    )
    return mismatch_alerts(rows, rule)


# ---------------------------------------------------------------- A/B table


def ab_table(
    ch: Any,
    db: str,
    versions: Sequence[int],
    baseline: int,
    metrics: Sequence[str] = AB_METRICS,
    org_id: str = "*",
) -> list[dict[str, Any]]:
    """The seed post's A/B table: per version each metric, and its change against ``baseline``.

    One dict per version in ``versions`` order with ``policy_version``, ``trajectories``, each metric
    and, per metric, ``<metric>_rel`` (m/m_baseline - 1), ``<metric>_ci_low`` / ``<metric>_ci_high``
    (95% delta-method interval of that relative change; see :func:`monitors.alerts.relative_change_ci`).
    The baseline's own change columns are None, as are those of a metric without data.
    """
    rows = behaviour_rows(ch, db, list(dict.fromkeys([baseline, *versions])), org_id)
    base = rows[int(baseline)]
    out = []
    for v in versions:
        row = rows[int(v)]
        rec: dict[str, Any] = {"policy_version": int(v), "trajectories": row["trajectories"]}
        for m in metrics:
            rec[m] = row[m]
            change = None
            if int(v) != int(baseline):
                change = relative_change_ci(base[m], standard_error(base, m), row[m], standard_error(row, m))
            rec[f"{m}_rel"] = change.relative if change else None
            rec[f"{m}_ci_low"] = change.low if change else None
            rec[f"{m}_ci_high"] = change.high if change else None
        out.append(rec)
    return out


def format_ab_table(rows: Sequence[dict[str, Any]], metrics: Sequence[str] = AB_METRICS) -> str:
    """Plain-text rendering: one line per version, each metric as ``value  +x.xx% [lo%, hi%]``."""
    lines = ["version  trajectories  " + "  ".join(f"{m:>36}" for m in metrics)]
    for r in rows:
        cells = []
        for m in metrics:
            v = r[m]
            text = "-" if v is None else (f"{v:,.0f}" if m.endswith("_ms") else f"{v:.4f}")
            if r[f"{m}_rel"] is not None:
                text += f" {r[f'{m}_rel']:+.2%} [{r[f'{m}_ci_low']:+.2%}, {r[f'{m}_ci_high']:+.2%}]"
            cells.append(f"{text:>36}")
        lines.append(f"{r['policy_version']:>7}  {r['trajectories']:>12,}  " + "  ".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- per-user figures (the A/B's unit)

#: behaviour-view metric -> (numerator, denominator) sums per user (the ``user_behaviour`` view's columns)
USER_SUMS: dict[str, tuple[str, str]] = {
    "edit_rate": ("edited", "trajectories"),
    "clarification_rate": ("clarified", "trajectories"),
    "dissatisfied_rate": ("dissatisfied", "trajectories"),
    "trajectories_with_broken_rate": ("with_broken", "trajectories"),
    "broken_tool_call_rate": ("broken_calls", "tool_calls"),
    "edit_persistence": ("persisted", "checks"),
    "latency_mean_ms": ("latency_sum_ms", "latency_n"),
}

#: reward metric -> (numerator, denominator) sums per user (the ``user_rewards_between`` view's columns)
REWARD_SUMS: dict[str, tuple[str, str]] = {"reward_mean": ("reward_sum", "rewarded")}

#: the per-user sums of the ``user_behaviour_between`` view (schemas/migrations/0009_user_behaviour.sql)
USER_COLUMNS: tuple[str, ...] = tuple(dict.fromkeys(c for pair in USER_SUMS.values() for c in pair))

#: the end of DateTime64(3)'s range (2300-01-01): "until the end" for the windowed view
_END_MS = 10_413_792_000_000


@dataclass(frozen=True)
class Side:
    """One arm of an A/B in ClickHouse: trajectories of ``policy_version`` served under ``arm``."""

    policy_version: int
    arm: str


def _window_sql(db: str, side: Side, since_ms: int | None, until_ms: int | None, org_id: str) -> tuple[str, dict]:
    """FROM/WHERE over ``user_behaviour_between`` for one side, window and org, with its parameters."""
    params: dict[str, Any] = {
        "since": int(since_ms or 0),
        "until": int(_END_MS if until_ms is None else until_ms),
        "v": int(side.policy_version),
        "arm": side.arm,
    }
    where = "policy_version = {v:Int64} AND arm = {arm:String}"
    if org_id != "*":
        where += " AND org_id = {org:String}"
        params["org"] = org_id
    source = f"{_check_name(db)}.user_behaviour_between(since_ms = {{since:Int64}}, until_ms = {{until:Int64}})"
    return f"FROM {source} WHERE {where}", params


def user_sums(
    ch: Any, db: str, side: Side, since_ms: int | None = None, until_ms: int | None = None, org_id: str = "*"
) -> dict[str, dict[str, float]]:
    """Per user (salted hash) the sums of :data:`USER_SUMS` over the trajectories of ``side`` whose first event
    lies in [since_ms, until_ms), from the ``user_behaviour_between`` view (what an analyst queries)."""
    clause, params = _window_sql(db, side, since_ms, until_ms, org_id)
    sums = ", ".join(f"sum({c}) AS {c}" for c in USER_COLUMNS)
    _, rows = _rows(ch, f"SELECT user_hash, {sums} {clause} GROUP BY user_hash ORDER BY user_hash", params)
    return {r.pop("user_hash"): r for r in rows}


def user_rewards(
    ch: Any, db: str, side: Side, reward_version: str, since_ms: int | None = None, until_ms: int | None = None
) -> dict[str, dict[str, float]]:
    """Per user (salted hash) the sums of :data:`REWARD_SUMS` under ``reward_version`` over the trajectories of
    ``side`` whose first event lies in [since_ms, until_ms), from the ``user_rewards_between`` view."""
    params: dict[str, Any] = {
        "rv": reward_version,
        "since": int(since_ms or 0),
        "until": int(_END_MS if until_ms is None else until_ms),
        "v": int(side.policy_version),
        "arm": side.arm,
    }
    source = (
        f"{_check_name(db)}.user_rewards_between(reward_version = {{rv:String}}, since_ms = {{since:Int64}}, "
        "until_ms = {until:Int64})"
    )
    _, rows = _rows(
        ch,
        f"SELECT user_hash, sum(reward_sum) AS reward_sum, sum(rewarded) AS rewarded FROM {source} "
        "WHERE policy_version = {v:Int64} AND arm = {arm:String} GROUP BY user_hash ORDER BY user_hash",
        params,
    )
    return {r.pop("user_hash"): r for r in rows}


def users_of(sums: dict[str, dict[str, float]], metric: str, pre: dict[str, dict[str, float]] | None = None) -> Users:
    """:class:`monitors.stats.Users` of one metric from :func:`user_sums`; with ``pre`` (the same users' figures
    before the experiment) the CUPED covariate (0 / 0 for a user without pre-period traffic)."""
    known = USER_SUMS | REWARD_SUMS
    if metric not in known:
        raise KeyError(f"no per-user figures for {metric!r}; known: {sorted(known)}")
    num_col, den_col = known[metric]
    users = list(sums)
    num = np.array([sums[u][num_col] for u in users], dtype=np.float64)
    den = np.array([sums[u][den_col] for u in users], dtype=np.float64)
    if pre is None:
        return Users(num, den)
    empty = {num_col: 0.0, den_col: 0.0}
    pn = np.array([pre.get(u, empty)[num_col] for u in users], dtype=np.float64)
    pd = np.array([pre.get(u, empty)[den_col] for u in users], dtype=np.float64)
    return Users(num, den, pn, pd)


def cohort_users(
    ch: Any, db: str, control: Side, treatment: Side, metrics: Sequence[str], since_ms: int | None = None
) -> dict[str, dict[str, tuple[Users, Users]]]:
    """Per org and metric the A/B's (control, treatment) :class:`monitors.stats.Users` since ``since_ms``: the input
    of :class:`monitors.stats.CohortMonitor` (a hack confined to one org)."""
    sides: list[dict[str, dict[str, dict[str, float]]]] = []
    for side in (control, treatment):
        clause, params = _window_sql(db, side, since_ms, None, "*")
        cols = ", ".join(USER_COLUMNS)
        _, rows = _rows(ch, f"SELECT org_id AS org, user_hash, {cols} {clause} ORDER BY org, user_hash", params)
        by_org: dict[str, dict[str, dict[str, float]]] = {}
        for r in rows:
            by_org.setdefault(r.pop("org"), {})[r.pop("user_hash")] = r
        sides.append(by_org)
    out: dict[str, dict[str, tuple[Users, Users]]] = {}
    for org in sorted(set(sides[0]) & set(sides[1])):
        out[org] = {m: (users_of(sides[0][org], m), users_of(sides[1][org], m)) for m in metrics}
    return out


# ---------------------------------------------------------------- the seed's table: a live A/B of two versions

#: (metric, label, the better direction) of the seed post's A/B table, in its order
LIVE_AB_METRICS: tuple[tuple[str, str, str], ...] = (
    ("edit_persistence", "edit persistence", "up"),
    ("dissatisfied_rate", "dissatisfied follow-ups", "down"),
    ("latency_mean_ms", "latency (mean ms)", "down"),
    ("broken_tool_call_rate", "broken tool calls", "down"),
    ("clarification_rate", "clarifying questions", "down"),
    ("reward_mean", "reward", "up"),
)


@dataclass(frozen=True)
class ABRow:
    """One metric of an A/B: the comparison (None with ``reason`` when it cannot be made)."""

    metric: str
    label: str
    better: str
    comparison: Comparison | None
    reason: str = ""


def live_ab(
    ch: Any,
    db: str,
    baseline: Side,
    treatment: Side,
    reward_version: str,
    since_ms: int | None = None,
    until_ms: int | None = None,
    alpha: float = 0.05,
) -> list[ABRow]:
    """Per metric of :data:`LIVE_AB_METRICS` the fixed-horizon comparison of ``treatment`` against ``baseline`` (relative
    change, its 1 - alpha interval, p-value; users are the unit) over trajectories whose first event lies in
    [since_ms, until_ms), from the analyst views ``user_behaviour_between`` and ``user_rewards_between``."""
    sides = [user_sums(ch, db, side, since_ms, until_ms) for side in (baseline, treatment)]
    rewards = [user_rewards(ch, db, side, reward_version, since_ms, until_ms) for side in (baseline, treatment)]
    out = []
    for metric, label, better in LIVE_AB_METRICS:
        b, t = rewards if metric in REWARD_SUMS else sides
        try:
            c = compare(users_of(b, metric), users_of(t, metric), alpha=alpha)
        except ValueError as e:
            out.append(ABRow(metric, label, better, None, str(e)))
            continue
        out.append(ABRow(metric, label, better, c))
    return out
