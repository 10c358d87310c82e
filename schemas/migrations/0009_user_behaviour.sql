-- A/B statistics by user (issue 14): the user is the unit an A/B randomises, so it is the unit of analysis.
-- Trajectories carry their user's salted hash ('' for rows written before this migration), and the view
-- user_behaviour gives per (policy_version, arm, org_id, user_hash) the sums each metric's ratio is built from
-- (trajectories counts the user's trajectories):
--   edit_rate = edited / trajectories, clarification_rate = clarified / trajectories,
--   dissatisfied_rate = dissatisfied / trajectories, trajectories_with_broken_rate = with_broken / trajectories,
--   broken_tool_call_rate = broken_calls / tool_calls, edit_persistence = persisted / checks,
--   latency_mean_ms = latency_sum_ms / latency_n.
-- monitors/stats.py turns them into a metric with its delta-method variance over users (monitors.queries.user_sums,
-- users_of).
ALTER TABLE {db}.trajectories ADD COLUMN IF NOT EXISTS user_hash String DEFAULT '';

-- user_behaviour_between(since_ms = .., until_ms = ..): the same over trajectories whose first event lies in
-- [since_ms, until_ms) (milliseconds since the epoch): an experiment's window, or a user's pre-period.
CREATE VIEW IF NOT EXISTS {db}.user_behaviour_between AS
SELECT
    policy_version,
    arm,
    toString(org_id) AS org_id,
    user_hash,
    toFloat64(count()) AS trajectories,
    toFloat64(countIf(edits_proposed > 0)) AS edited,
    toFloat64(countIf(clarifying_questions > 0)) AS clarified,
    toFloat64(countIf(dissatisfied_followups > 0)) AS dissatisfied,
    toFloat64(countIf(broken_tool_calls > 0)) AS with_broken,
    toFloat64(sum(broken_tool_calls)) AS broken_calls,
    toFloat64(sum(tool_calls)) AS tool_calls,
    sum(persisted_fraction_sum) AS persisted,
    toFloat64(sum(persistence_checks)) AS checks,
    sum(ifNull(latency_ms, 0)) AS latency_sum_ms,
    toFloat64(count(latency_ms)) AS latency_n,
    min(first_event_ts) AS first_seen,
    max(last_event_ts) AS last_seen
FROM {db}.trajectories FINAL
WHERE first_event_ts >= fromUnixTimestamp64Milli({since_ms:Int64})
  AND first_event_ts < fromUnixTimestamp64Milli({until_ms:Int64})
GROUP BY policy_version, arm, org_id, user_hash;

-- All time (until 2300-01-01, DateTime64's range).
CREATE VIEW IF NOT EXISTS {db}.user_behaviour AS
SELECT * FROM {db}.user_behaviour_between(since_ms = 0, until_ms = 10413792000000);
