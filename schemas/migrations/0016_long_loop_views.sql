-- What analysts need to see the delay of long-loop feedback (issue 16).
--
-- provisional_rewards keeps the last provisional reward of each (trajectory, reward version): the rewards table
-- keeps only the highest revision, so without it the provisional reward a verdict replaced would be gone.
-- promotions keeps when each policy version was promoted: checkpoints keeps only each version's latest status.
-- Both fill through materialized views from inserts after this migration; promotions is also seeded from the
-- promoted checkpoints already there.
CREATE TABLE IF NOT EXISTS {db}.provisional_rewards
(
    trajectory_id String,
    reward_version LowCardinality(String),
    policy_version Int64,
    org_id LowCardinality(String),
    task_kind LowCardinality(String),
    revision UInt32,
    reward Float64,
    components Map(LowCardinality(String), Float64),
    emitted_at DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(revision)
ORDER BY (trajectory_id, reward_version);

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.provisional_rewards_mv TO {db}.provisional_rewards AS
SELECT trajectory_id, reward_version, policy_version, org_id, task_kind, revision, reward, components, emitted_at
FROM {db}.rewards
WHERE provisional;

CREATE TABLE IF NOT EXISTS {db}.promotions
(
    version Int64,
    promoted_at DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree
ORDER BY version;

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.promotions_mv TO {db}.promotions AS
SELECT version, created_at AS promoted_at FROM {db}.checkpoints WHERE status = 'promoted';

INSERT INTO {db}.promotions SELECT version, created_at FROM {db}.checkpoints FINAL WHERE status = 'promoted';

-- Time from a trajectory's first event to its final signal, per task kind: for a background task the user
-- judged, that is the time to its verdict. judged = 1: the trajectory's final reward carries a task_verdict.
CREATE VIEW IF NOT EXISTS {db}.verdict_delays AS
SELECT
    task_kind,
    judged,
    count() AS trajectories,
    quantile(0.5)(span_ms) / 3600000 AS hours_p50,
    quantile(0.9)(span_ms) / 3600000 AS hours_p90,
    quantile(0.99)(span_ms) / 3600000 AS hours_p99,
    max(span_ms) / 3600000 AS hours_max
FROM
(
    SELECT
        trajectory_id,
        toString(any(task_kind)) AS task_kind,
        toUInt8(max(event_counts['task_verdict']) > 0) AS judged,
        toFloat64(max(toUnixTimestamp64Milli(last_event_ts)) - min(toUnixTimestamp64Milli(first_event_ts))) AS span_ms
    FROM {db}.rewards FINAL
    GROUP BY trajectory_id
)
GROUP BY task_kind, judged;

-- Whether each final reward arrived after its policy version was replaced: versions_behind is the newest version
-- promoted before the reward was computed (emitted_at) minus the trajectory's, the policy lag the batch flow
-- measures (rejected candidates use up version numbers too). One row per (reward version, task kind).
CREATE VIEW IF NOT EXISTS {db}.reward_arrival AS
SELECT
    reward_version,
    task_kind,
    count() AS rewards,
    countIf(versions_behind > 0) AS after_replacement,
    countIf(versions_behind > 0) / count() AS share_after_replacement,
    avg(versions_behind) AS versions_behind_mean,
    max(versions_behind) AS versions_behind_max,
    countIf(versions_behind > 1) AS more_than_one_version_behind
FROM
(
    SELECT
        toString(r.reward_version) AS reward_version,
        toString(r.task_kind) AS task_kind,
        greatest(
            toInt64(0),
            arrayMax(
                arrayMap(
                    p -> (p.1),
                    arrayFilter(
                        p -> ((p.2) <= r.emitted_at),
                        (SELECT groupArray(tuple(version, promoted_at)) FROM {db}.promotions FINAL)
                    )
                )
            ) - r.policy_version
        ) AS versions_behind
    FROM {db}.rewards AS r FINAL
    WHERE NOT r.provisional
)
GROUP BY reward_version, task_kind;

-- How provisional rewards compare with the final ones that replaced them, per (reward version, task kind): of
-- the final rewards, how many had a provisional one, their means, the mean revision, the correlation, the
-- share whose sign held, and how many trajectories are still provisional (no verdict yet).
CREATE VIEW IF NOT EXISTS {db}.provisional_vs_final AS
SELECT
    toString(f.reward_version) AS reward_version,
    toString(f.task_kind) AS task_kind,
    countIf(NOT f.provisional) AS final_rewards,
    countIf(f.provisional) AS still_provisional,
    countIf(NOT f.provisional AND p.trajectory_id != '') AS revised_from_provisional,
    avgIf(p.reward, NOT f.provisional AND p.trajectory_id != '') AS provisional_mean,
    avgIf(f.reward, NOT f.provisional AND p.trajectory_id != '') AS final_mean,
    avgIf(f.reward - p.reward, NOT f.provisional AND p.trajectory_id != '') AS revision_mean,
    avgIf(abs(f.reward - p.reward), NOT f.provisional AND p.trajectory_id != '') AS revision_abs_mean,
    corrIf(p.reward, f.reward, NOT f.provisional AND p.trajectory_id != '') AS correlation,
    avgIf(sign(p.reward) = sign(f.reward), NOT f.provisional AND p.trajectory_id != '') AS sign_held
FROM (SELECT * FROM {db}.rewards FINAL) AS f
LEFT JOIN (SELECT * FROM {db}.provisional_rewards FINAL) AS p
    ON p.trajectory_id = f.trajectory_id AND p.reward_version = f.reward_version
GROUP BY reward_version, task_kind;
