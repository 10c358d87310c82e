-- Rewards by user (issue 14): the final A/B's reward row, from the same place an analyst reads it.
-- user_rewards_between(reward_version = .., since_ms = .., until_ms = ..) gives per (policy_version, arm, org_id,
-- user_hash) the number of rewarded trajectories and their reward sum under one reward version, over trajectories
-- whose first event lies in [since_ms, until_ms) (milliseconds since the epoch):
--   reward_mean = reward_sum / rewarded.
-- Rewards carry no user; the trajectory's user_hash comes from trajectories (one row per trajectory_id).
CREATE VIEW IF NOT EXISTS {db}.user_rewards_between AS
SELECT
    r.policy_version AS policy_version,
    r.arm AS arm,
    toString(r.org_id) AS org_id,
    t.user_hash AS user_hash,
    toFloat64(count()) AS rewarded,
    sum(r.reward) AS reward_sum
FROM {db}.rewards AS r FINAL
INNER JOIN
(
    SELECT trajectory_id, any(user_hash) AS user_hash
    FROM {db}.trajectories FINAL
    GROUP BY trajectory_id
) AS t ON r.trajectory_id = t.trajectory_id
WHERE r.reward_version = {reward_version:String}
  AND r.first_event_ts >= fromUnixTimestamp64Milli({since_ms:Int64})
  AND r.first_event_ts < fromUnixTimestamp64Milli({until_ms:Int64})
GROUP BY policy_version, arm, org_id, user_hash;
