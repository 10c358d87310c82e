-- rtrl behaviour monitors, version 2. {db} is replaced by the clickhouse.database setting.
--
-- These are plain (non-materialized) views: they compute at query time from the tables read
-- with FINAL, so they are always current (a trajectory re-closed by late events shows its
-- latest revision at once) and a replayed row, which FINAL collapses onto the row it
-- replaces, is never counted twice. Nothing is stored, so there is nothing to backfill or
-- rebuild when the underlying rows change.
--
-- Every view gives one row per (policy_version, org_id) plus an overall row per
-- policy_version with org_id = '*' (GROUPING SETS; grouping(org) = 1 marks the overall row).
--
-- Confidence intervals: for each metric m the view gives the figures that make its standard
-- error se(m) = sqrt(m_var / m_n), with m_n the metric's sample count:
--   rates over trajectories (edit_rate, clarification_rate, trajectories_with_broken_rate,
--     dissatisfied_rate): m_var = varSamp of the per-trajectory 0/1 indicator, m_n = trajectories;
--   ratio metrics (broken_tool_call_rate = sum broken / sum calls over trajectories;
--     edit_persistence = sum persisted fraction / sum checks over trajectories with a check):
--     m_var = delta-method (linearised) variance varSamp(x - R y) / avg(y)^2, expanded as
--     (varSamp(x) - 2 R covarSamp(x, y) + R^2 varSamp(y)) / avg(y)^2, with m_n = trajectories
--     and edit_persistence_n respectively;
--   latency mean: latency_var = varSamp(latency_ms), m_n = latency_n;
--   latency quantiles p50/p95: no variance; the view gives the distribution-free 95% interval
--     of each quantile from order statistics: ranks floor(n p - 1.96 sqrt(n p (1 - p))) and
--     ceil(n p + 1.96 sqrt(n p (1 - p))) + 1 of the sorted latencies, clamped to [1, n]
--     (se is about (high - low) / (2 * 1.96)).
-- A variance is NULL when it is undefined (fewer than two samples); a metric is NULL when it
-- has no sample at all (e.g. edit_persistence with no persistence check).
-- Quantiles are exact (quantileExactInclusive, numpy's default 'linear' method); like the
-- order-statistic intervals they hold a group's latencies in memory, 8 bytes per trajectory.

CREATE VIEW IF NOT EXISTS {db}.behaviour AS
WITH
    sum(broken) / greatest(sum(calls), 1) AS broken_ratio,
    sumIf(persisted, checks > 0) / nullIf(sumIf(checks, checks > 0), 0) AS persisted_ratio,
    arraySort(groupArray(latency_ms)) AS latencies,
    count(latency_ms) AS n_latency,
    1.96 * sqrt(n_latency * 0.5 * 0.5) AS half50,
    1.96 * sqrt(n_latency * 0.95 * 0.05) AS half95
SELECT
    policy_version,
    if(grouping(org) = 1, '*', org) AS org_id,
    count() AS trajectories,
    avg(edited) AS edit_rate,
    if(trajectories > 1, varSamp(edited), NULL) AS edit_rate_var,
    avg(clarified) AS clarification_rate,
    if(trajectories > 1, varSamp(clarified), NULL) AS clarification_rate_var,
    toUInt64(sum(calls)) AS tool_calls,
    broken_ratio AS broken_tool_call_rate,
    if(trajectories > 1 AND avg(calls) > 0,
       greatest(varSamp(broken) - 2 * broken_ratio * covarSamp(broken, calls)
                + broken_ratio * broken_ratio * varSamp(calls), 0) / (avg(calls) * avg(calls)),
       NULL) AS broken_tool_call_rate_var,
    avg(with_broken) AS trajectories_with_broken_rate,
    if(trajectories > 1, varSamp(with_broken), NULL) AS trajectories_with_broken_rate_var,
    toUInt64(sum(checks)) AS persistence_checks,
    countIf(checks > 0) AS edit_persistence_n,
    persisted_ratio AS edit_persistence,
    if(edit_persistence_n > 1,
       greatest(varSampIf(persisted, checks > 0) - 2 * persisted_ratio * covarSampIf(persisted, checks, checks > 0)
                + persisted_ratio * persisted_ratio * varSampIf(checks, checks > 0), 0)
       / (avgIf(checks, checks > 0) * avgIf(checks, checks > 0)),
       NULL) AS edit_persistence_var,
    avg(dissatisfied) AS dissatisfied_rate,
    if(trajectories > 1, varSamp(dissatisfied), NULL) AS dissatisfied_rate_var,
    n_latency AS latency_n,
    if(n_latency > 0, avg(latency_ms), NULL) AS latency_mean_ms,
    if(n_latency > 1, varSamp(latency_ms), NULL) AS latency_var,
    if(n_latency > 0, quantileExactInclusive(0.5)(latency_ms), NULL) AS latency_p50_ms,
    if(n_latency > 0, quantileExactInclusive(0.95)(latency_ms), NULL) AS latency_p95_ms,
    if(n_latency > 0, latencies[toUInt64(greatest(1, floor(n_latency * 0.5 - half50)))], NULL) AS latency_p50_ci_low_ms,
    if(n_latency > 0, latencies[toUInt64(least(toFloat64(n_latency), ceil(n_latency * 0.5 + half50) + 1))], NULL) AS latency_p50_ci_high_ms,
    if(n_latency > 0, latencies[toUInt64(greatest(1, floor(n_latency * 0.95 - half95)))], NULL) AS latency_p95_ci_low_ms,
    if(n_latency > 0, latencies[toUInt64(least(toFloat64(n_latency), ceil(n_latency * 0.95 + half95) + 1))], NULL) AS latency_p95_ci_high_ms
FROM
(
    SELECT
        policy_version,
        toString(org_id) AS org,
        toFloat64(edits_proposed > 0) AS edited,
        toFloat64(clarifying_questions > 0) AS clarified,
        toFloat64(broken_tool_calls > 0) AS with_broken,
        toFloat64(dissatisfied_followups > 0) AS dissatisfied,
        toFloat64(broken_tool_calls) AS broken,
        toFloat64(tool_calls) AS calls,
        persisted_fraction_sum AS persisted,
        toFloat64(persistence_checks) AS checks,
        latency_ms
    FROM {db}.trajectories FINAL
)
GROUP BY GROUPING SETS ((policy_version, org), (policy_version));

-- Reward per policy version (and org) under one reward version, e.g.
--   SELECT * FROM rtrl.reward_stats(rv = 'v2') WHERE org_id = '*'
-- Reads rewards FINAL, so a re-emitted reward (higher revision) replaces the earlier one and
-- counts once. reward_version is part of the table's sorting key, so filtering on it does not
-- interfere with FINAL's replacement. se(reward_mean) = sqrt(reward_var / trajectories).
CREATE VIEW IF NOT EXISTS {db}.reward_stats AS
SELECT
    policy_version,
    if(grouping(org) = 1, '*', org) AS org_id,
    count() AS trajectories,
    avg(reward) AS reward_mean,
    if(trajectories > 1, varSamp(reward), NULL) AS reward_var
FROM
(
    SELECT policy_version, toString(org_id) AS org, reward
    FROM {db}.rewards FINAL
    WHERE reward_version = {rv:String}
)
GROUP BY GROUPING SETS ((policy_version, org), (policy_version));
