-- rtrl's ClickHouse schema for database rtrl on cluster rtrl_cluster: what `rtrl migrate` runs on an empty database
-- (generated from schemas/migrations by rtrl.clickhouse.ddl; a migration already applied is skipped).
CREATE DATABASE IF NOT EXISTS rtrl ON CLUSTER rtrl_cluster;
CREATE TABLE IF NOT EXISTS rtrl.schema_migrations_local ON CLUSTER rtrl_cluster
(version UInt32, name String, checksum String, applied_at DateTime64(3, 'UTC'))
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
ORDER BY version;
CREATE TABLE IF NOT EXISTS rtrl.schema_migrations ON CLUSTER rtrl_cluster AS rtrl.schema_migrations_local
ENGINE = Distributed(rtrl_cluster, rtrl, schema_migrations_local, cityHash64(version));

-- 0001_init.sql
CREATE TABLE IF NOT EXISTS rtrl.events_local ON CLUSTER rtrl_cluster
(
    event_id String,
    trajectory_id String,
    ts DateTime64(3, 'UTC'),
    org_id LowCardinality(String),
    user_hash String,
    policy_version Int64,
    arm LowCardinality(String),
    type LowCardinality(String),
    task_kind LowCardinality(Nullable(String)),
    tool LowCardinality(Nullable(String)),
    valid Nullable(Bool),
    error Nullable(String),
    edit_id Nullable(String),
    lines Nullable(UInt32),
    fraction Nullable(Float64),
    checked_after_s Nullable(Float64),
    sentiment LowCardinality(Nullable(String)),
    question_needed Nullable(Bool),
    ttft_ms Nullable(Float64),
    total_ms Nullable(Float64),
    status LowCardinality(Nullable(String))
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(ts)
ORDER BY (trajectory_id, event_id);
CREATE TABLE IF NOT EXISTS rtrl.events ON CLUSTER rtrl_cluster AS rtrl.events_local
ENGINE = Distributed(rtrl_cluster, rtrl, events_local, cityHash64(trajectory_id));
CREATE TABLE IF NOT EXISTS rtrl.rollouts_local ON CLUSTER rtrl_cluster
(
    trajectory_id String,
    policy_version Int64,
    group_id String,
    org_id LowCardinality(String),
    task_kind LowCardinality(String),
    prompt_ids Array(Int32),
    completion_ids Array(Int32),
    behaviour_logprobs Array(Float32),
    loss_mask Array(UInt8),
    created_at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
ORDER BY trajectory_id;
CREATE TABLE IF NOT EXISTS rtrl.rollouts ON CLUSTER rtrl_cluster AS rtrl.rollouts_local
ENGINE = Distributed(rtrl_cluster, rtrl, rollouts_local, cityHash64(trajectory_id));
CREATE TABLE IF NOT EXISTS rtrl.rewards_local ON CLUSTER rtrl_cluster
(
    trajectory_id String,
    policy_version Int64,
    reward_version LowCardinality(String),
    revision UInt32,
    reward Float64,
    components Map(LowCardinality(String), Float64),
    flags Array(LowCardinality(String)),
    close_reason LowCardinality(String),
    org_id LowCardinality(String),
    arm LowCardinality(String),
    task_kind LowCardinality(String),
    n_events UInt32,
    event_counts Map(LowCardinality(String), UInt32),
    first_event_ts DateTime64(3, 'UTC'),
    last_event_ts DateTime64(3, 'UTC'),
    emitted_at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', revision)
ORDER BY (trajectory_id, reward_version);
CREATE TABLE IF NOT EXISTS rtrl.rewards ON CLUSTER rtrl_cluster AS rtrl.rewards_local
ENGINE = Distributed(rtrl_cluster, rtrl, rewards_local, cityHash64(trajectory_id));
CREATE TABLE IF NOT EXISTS rtrl.batches_local ON CLUSTER rtrl_cluster
(
    batch_id String,
    created_at DateTime64(3, 'UTC'),
    seq_len Int32,
    token_ids Array(Array(Int32)),
    loss_mask Array(Array(UInt8)),
    advantages Array(Array(Float32)),
    behaviour_logprobs Array(Array(Float32)),
    segment_ids Array(Array(Int32)),
    sample_ids Array(String),
    policy_versions Array(Int64)
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
ORDER BY batch_id;
CREATE TABLE IF NOT EXISTS rtrl.batches ON CLUSTER rtrl_cluster AS rtrl.batches_local
ENGINE = Distributed(rtrl_cluster, rtrl, batches_local, cityHash64(batch_id));
CREATE TABLE IF NOT EXISTS rtrl.checkpoints_local ON CLUSTER rtrl_cluster
(
    version Int64,
    parent Nullable(Int64),
    created_at DateTime64(3, 'UTC'),
    steps UInt64,
    samples UInt64,
    tokens UInt64,
    eval_results Map(LowCardinality(String), Float64),
    status LowCardinality(String),
    reason String,
    kafka_offsets Map(LowCardinality(String), Int64),
    path String
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', created_at)
ORDER BY version;
CREATE TABLE IF NOT EXISTS rtrl.checkpoints ON CLUSTER rtrl_cluster AS rtrl.checkpoints_local
ENGINE = Distributed(rtrl_cluster, rtrl, checkpoints_local, cityHash64(version));
CREATE TABLE IF NOT EXISTS rtrl.dead_letters_local ON CLUSTER rtrl_cluster
(
    kind LowCardinality(String),
    source LowCardinality(String),
    partition Int32,
    offset Int64,
    key Nullable(String),
    field String,
    reason String,
    payload String,
    at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
ORDER BY (source, partition, offset, kind);
CREATE TABLE IF NOT EXISTS rtrl.dead_letters ON CLUSTER rtrl_cluster AS rtrl.dead_letters_local
ENGINE = Distributed(rtrl_cluster, rtrl, dead_letters_local, cityHash64(source, partition, offset));
CREATE TABLE IF NOT EXISTS rtrl.trajectories_local ON CLUSTER rtrl_cluster
(
    trajectory_id String,
    policy_version Int64,
    org_id LowCardinality(String),
    arm LowCardinality(String),
    task_kind LowCardinality(String),
    revision UInt32,
    close_reason LowCardinality(String),
    status LowCardinality(String),
    n_events UInt32,
    tool_calls UInt32,
    broken_tool_calls UInt32,
    clarifying_questions UInt32,
    unneeded_questions UInt32,
    edits_proposed UInt32,
    edits_accepted UInt32,
    persistence_checks UInt32,
    persisted_fraction_sum Float64,
    followups UInt32,
    dissatisfied_followups UInt32,
    latency_ms Nullable(Float64),
    ttft_ms Nullable(Float64),
    first_event_ts DateTime64(3, 'UTC'),
    last_event_ts DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', revision)
ORDER BY trajectory_id;
CREATE TABLE IF NOT EXISTS rtrl.trajectories ON CLUSTER rtrl_cluster AS rtrl.trajectories_local
ENGINE = Distributed(rtrl_cluster, rtrl, trajectories_local, cityHash64(trajectory_id));
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (1, '0001_init.sql', '2a57690b1f633a7f88d2ca32cc3ac30993114a2282fc8bf4ef930ae312b496a3', now64(3));

-- 0002_monitors.sql
CREATE VIEW IF NOT EXISTS rtrl.behaviour ON CLUSTER rtrl_cluster AS WITH
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
    FROM rtrl.trajectories FINAL
)
GROUP BY GROUPING SETS ((policy_version, org), (policy_version));
CREATE VIEW IF NOT EXISTS rtrl.reward_stats ON CLUSTER rtrl_cluster AS SELECT
    policy_version,
    if(grouping(org) = 1, '*', org) AS org_id,
    count() AS trajectories,
    avg(reward) AS reward_mean,
    if(trajectories > 1, varSamp(reward), NULL) AS reward_var
FROM
(
    SELECT policy_version, toString(org_id) AS org, reward
    FROM rtrl.rewards FINAL
    WHERE reward_version = {rv:String}
)
GROUP BY GROUPING SETS ((policy_version, org), (policy_version));
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (2, '0002_monitors.sql', '164c3a6b4fb60c2b4b20dfd41617fe7bdd1b200278e4e02b86d9dd55b00b0f6c', now64(3));

-- 0003_train_metrics.sql
CREATE TABLE IF NOT EXISTS rtrl.train_metrics_local ON CLUSTER rtrl_cluster
(
    run_id LowCardinality(String),
    step UInt64,
    policy_version Int64,
    loss Float64,
    pg_loss Float64,
    kl Float64,
    clip_fraction Float64,
    is_truncated_fraction Float64,
    tokens UInt64,
    on_policy_fraction Float64,
    lag_histogram Map(LowCardinality(String), UInt32),
    tokens_per_s Float64,
    batch_ids Array(String),
    at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
ORDER BY (run_id, step);
CREATE TABLE IF NOT EXISTS rtrl.train_metrics ON CLUSTER rtrl_cluster AS rtrl.train_metrics_local
ENGINE = Distributed(rtrl_cluster, rtrl, train_metrics_local, cityHash64(run_id, step));
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (3, '0003_train_metrics.sql', '60f6d26eca999a2155923ceb70fd4268c928ea38dd2a8a3d181c6348206db2fc', now64(3));

-- 0004_rollout_group_size.sql
ALTER TABLE rtrl.rollouts_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS group_size UInt32 DEFAULT 1 AFTER group_id;
ALTER TABLE rtrl.rollouts ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS group_size UInt32 DEFAULT 1 AFTER group_id;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (4, '0004_rollout_group_size.sql', '0bf1bf5fd66114d5c298c9cf851bb7775869f9f6033b0f30a3606f0414cbcb0a', now64(3));

-- 0005_batch_stats.sql
CREATE TABLE IF NOT EXISTS rtrl.batch_stats_local ON CLUSTER rtrl_cluster
(
    cohort LowCardinality(String),
    samples UInt64,
    batches UInt64,
    counts Map(LowCardinality(String), UInt32),
    lag_accepted Map(LowCardinality(String), UInt32),
    lag_dropped Map(LowCardinality(String), UInt32),
    clock DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', clock)
ORDER BY cohort;
CREATE TABLE IF NOT EXISTS rtrl.batch_stats ON CLUSTER rtrl_cluster AS rtrl.batch_stats_local
ENGINE = Distributed(rtrl_cluster, rtrl, batch_stats_local, cityHash64(cohort));
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (5, '0005_batch_stats.sql', 'e1a395b611fe8f972beaf95a3e5babf018969201205a6adda73c7e70545277f8', now64(3));

-- 0006_train_metrics_samples.sql
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS sample_ids Array(String) AFTER at;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS sample_ids Array(String) AFTER at;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (6, '0006_train_metrics_samples.sql', 'bc1dc23871b82f2aa7593f408eb23ba417c353a6127ca8693c4c49d8885b635c', now64(3));

-- 0007_train_safety.sql
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS grad_norm Float64 AFTER sample_ids;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS grad_norm Float64 AFTER sample_ids;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS dual_clip_fraction Float64 AFTER grad_norm;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS dual_clip_fraction Float64 AFTER grad_norm;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS seq_guarded_tokens UInt64 AFTER dual_clip_fraction;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS seq_guarded_tokens UInt64 AFTER dual_clip_fraction;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS mismatch_k3 Float64 AFTER seq_guarded_tokens;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS mismatch_k3 Float64 AFTER seq_guarded_tokens;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS mismatch_max_abs_log_ratio Float64 AFTER mismatch_k3;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS mismatch_max_abs_log_ratio Float64 AFTER mismatch_k3;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (7, '0007_train_safety.sql', '59a25fbe6672d480d803c3db3727efd2665c5b28d9ce6ef169f13b069b698e85', now64(3));

-- 0008_checkpoint_export.sql
ALTER TABLE rtrl.checkpoints_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS export_path String AFTER path;
ALTER TABLE rtrl.checkpoints ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS export_path String AFTER path;
ALTER TABLE rtrl.checkpoints_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS export_sha256 String AFTER export_path;
ALTER TABLE rtrl.checkpoints ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS export_sha256 String AFTER export_path;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (8, '0008_checkpoint_export.sql', 'f6034e00dbdc9c1a736281355e1eb1a4886d82e6c334d5e3a4982e84c6453d5e', now64(3));

-- 0009_user_behaviour.sql
ALTER TABLE rtrl.trajectories_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS user_hash String DEFAULT '';
ALTER TABLE rtrl.trajectories ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS user_hash String DEFAULT '';
CREATE VIEW IF NOT EXISTS rtrl.user_behaviour_between ON CLUSTER rtrl_cluster AS SELECT
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
FROM rtrl.trajectories FINAL
WHERE first_event_ts >= fromUnixTimestamp64Milli({since_ms:Int64})
  AND first_event_ts < fromUnixTimestamp64Milli({until_ms:Int64})
GROUP BY policy_version, arm, org_id, user_hash;
CREATE VIEW IF NOT EXISTS rtrl.user_behaviour ON CLUSTER rtrl_cluster AS SELECT * FROM rtrl.user_behaviour_between(since_ms = 0, until_ms = 10413792000000);
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (9, '0009_user_behaviour.sql', 'f6969a0d66b9dad49948e42a8e773edf6f6d6284ec87bf1cb6fde62b3a39572c', now64(3));

-- 0010_user_rewards.sql
CREATE VIEW IF NOT EXISTS rtrl.user_rewards_between ON CLUSTER rtrl_cluster AS SELECT
    r.policy_version AS policy_version,
    r.arm AS arm,
    toString(r.org_id) AS org_id,
    t.user_hash AS user_hash,
    toFloat64(count()) AS rewarded,
    sum(r.reward) AS reward_sum
FROM rtrl.rewards AS r FINAL
GLOBAL INNER JOIN
(
    SELECT trajectory_id, any(user_hash) AS user_hash
    FROM rtrl.trajectories FINAL
    GROUP BY trajectory_id
) AS t ON r.trajectory_id = t.trajectory_id
WHERE r.reward_version = {reward_version:String}
  AND r.first_event_ts >= fromUnixTimestamp64Milli({since_ms:Int64})
  AND r.first_event_ts < fromUnixTimestamp64Milli({until_ms:Int64})
GROUP BY policy_version, arm, org_id, user_hash;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (10, '0010_user_rewards.sql', '266efa63f5a23e1edaf8e9ea3c007cfb894a5e66bf7367b722c94637d143be7a', now64(3));

-- 0011_reward_versions.sql
CREATE TABLE IF NOT EXISTS rtrl.reward_versions_local ON CLUSTER rtrl_cluster
(
    name LowCardinality(String),
    checksum String,
    weights String,
    parent String,
    reason String,
    author String,
    builtin Bool,
    registered_at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', registered_at)
ORDER BY name;
CREATE TABLE IF NOT EXISTS rtrl.reward_versions ON CLUSTER rtrl_cluster AS rtrl.reward_versions_local
ENGINE = Distributed(rtrl_cluster, rtrl, reward_versions_local, cityHash64(name));
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (11, '0011_reward_versions.sql', 'f27a9dc7558ca57fe55bb33b940b300a27970ea755da059cb751503ab432f43f', now64(3));

-- 0012_reward_pairs.sql
CREATE VIEW IF NOT EXISTS rtrl.reward_pairs ON CLUSTER rtrl_cluster AS SELECT
    t.trajectory_id AS trajectory_id,
    t.policy_version AS policy_version,
    toString(t.org_id) AS org_id,
    toString(t.task_kind) AS task_kind,
    t.first_event_ts AS first_event_ts,
    t.broken_tool_calls AS broken_tool_calls,
    t.clarifying_questions AS clarifying_questions,
    ra.scored AS scored_a,
    if(ra.scored = 1, ra.reward, NULL) AS reward_a,
    ra.flags AS flags_a,
    rb.scored AS scored_b,
    if(rb.scored = 1, rb.reward, NULL) AS reward_b,
    rb.flags AS flags_b
FROM (SELECT * FROM rtrl.trajectories FINAL) AS t
GLOBAL LEFT JOIN
(
    SELECT trajectory_id, toUInt8(1) AS scored, reward, flags
    FROM rtrl.rewards FINAL
    WHERE reward_version = {a:String}
) AS ra ON ra.trajectory_id = t.trajectory_id
GLOBAL LEFT JOIN
(
    SELECT trajectory_id, toUInt8(1) AS scored, reward, flags
    FROM rtrl.rewards FINAL
    WHERE reward_version = {b:String}
) AS rb ON rb.trajectory_id = t.trajectory_id;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (12, '0012_reward_pairs.sql', '3bd9f3c6ce2dec722562f8872b351d4c5b2c44b09f13c295323849e6e1d71476', now64(3));

-- 0013_reward_version_trained.sql
ALTER TABLE rtrl.batches_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS reward_version LowCardinality(String) AFTER policy_versions;
ALTER TABLE rtrl.batches ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS reward_version LowCardinality(String) AFTER policy_versions;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS reward_version LowCardinality(String) AFTER mismatch_max_abs_log_ratio;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS reward_version LowCardinality(String) AFTER mismatch_max_abs_log_ratio;
ALTER TABLE rtrl.checkpoints_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS reward_version LowCardinality(String) AFTER export_sha256;
ALTER TABLE rtrl.checkpoints ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS reward_version LowCardinality(String) AFTER export_sha256;
ALTER TABLE rtrl.checkpoints_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS reward_checksum String AFTER reward_version;
ALTER TABLE rtrl.checkpoints ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS reward_checksum String AFTER reward_version;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (13, '0013_reward_version_trained.sql', '2d623027eeb4048dbc48261dab20df8a095e76239f0044cdb5934eb56d095f9b', now64(3));

-- 0014_long_tasks.sql
ALTER TABLE rtrl.events_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS progress Nullable(Float64) AFTER status;
ALTER TABLE rtrl.events ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS progress Nullable(Float64) AFTER status;
ALTER TABLE rtrl.events_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS verdict LowCardinality(Nullable(String)) AFTER progress;
ALTER TABLE rtrl.events ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS verdict LowCardinality(Nullable(String)) AFTER progress;
ALTER TABLE rtrl.events_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS verdict_after_s Nullable(Float64) AFTER verdict;
ALTER TABLE rtrl.events ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS verdict_after_s Nullable(Float64) AFTER verdict;
ALTER TABLE rtrl.rewards_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS provisional Bool DEFAULT false AFTER emitted_at;
ALTER TABLE rtrl.rewards ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS provisional Bool DEFAULT false AFTER emitted_at;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (14, '0014_long_tasks.sql', '9e53af88ae43754059d2928d1fb8f116118801e65765a716ae4f6e930db5ebf3', now64(3));

-- 0015_delayed_samples.sql
ALTER TABLE rtrl.batches_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed Array(Bool) AFTER reward_version;
ALTER TABLE rtrl.batches ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed Array(Bool) AFTER reward_version;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS near_policy_fraction Float64 AFTER reward_version;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS near_policy_fraction Float64 AFTER reward_version;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_fraction Float64 AFTER near_policy_fraction;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_fraction Float64 AFTER near_policy_fraction;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_tokens UInt64 AFTER delayed_fraction;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_tokens UInt64 AFTER delayed_fraction;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_mean_lag Float64 AFTER delayed_tokens;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_mean_lag Float64 AFTER delayed_tokens;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_lag_histogram Map(LowCardinality(String), UInt32) AFTER delayed_mean_lag;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_lag_histogram Map(LowCardinality(String), UInt32) AFTER delayed_mean_lag;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_truncated_fraction Float64 AFTER delayed_lag_histogram;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS delayed_truncated_fraction Float64 AFTER delayed_lag_histogram;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (15, '0015_delayed_samples.sql', '996e1216a04175bff0101b3b5f4e674a9f993b82e4e33d558fcb38b848126ff4', now64(3));

-- 0016_long_loop_views.sql
CREATE TABLE IF NOT EXISTS rtrl.provisional_rewards_local ON CLUSTER rtrl_cluster
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
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', revision)
ORDER BY (trajectory_id, reward_version);
CREATE TABLE IF NOT EXISTS rtrl.provisional_rewards ON CLUSTER rtrl_cluster AS rtrl.provisional_rewards_local
ENGINE = Distributed(rtrl_cluster, rtrl, provisional_rewards_local, cityHash64(trajectory_id));
CREATE MATERIALIZED VIEW IF NOT EXISTS rtrl.provisional_rewards_mv ON CLUSTER rtrl_cluster TO rtrl.provisional_rewards_local AS SELECT trajectory_id, reward_version, policy_version, org_id, task_kind, revision, reward, components, emitted_at
FROM rtrl.rewards_local
WHERE provisional;
CREATE TABLE IF NOT EXISTS rtrl.promotions_local ON CLUSTER rtrl_cluster
(
    version Int64,
    promoted_at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
ORDER BY version;
CREATE TABLE IF NOT EXISTS rtrl.promotions ON CLUSTER rtrl_cluster AS rtrl.promotions_local
ENGINE = Distributed(rtrl_cluster, rtrl, promotions_local, cityHash64(version));
CREATE MATERIALIZED VIEW IF NOT EXISTS rtrl.promotions_mv ON CLUSTER rtrl_cluster TO rtrl.promotions_local AS SELECT version, created_at AS promoted_at FROM rtrl.checkpoints_local WHERE status = 'promoted';
INSERT INTO rtrl.promotions SETTINGS insert_distributed_sync = 1 SELECT version, created_at FROM rtrl.checkpoints FINAL WHERE status = 'promoted';
CREATE VIEW IF NOT EXISTS rtrl.verdict_delays ON CLUSTER rtrl_cluster AS SELECT
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
    FROM rtrl.rewards FINAL
    GROUP BY trajectory_id
)
GROUP BY task_kind, judged;
CREATE VIEW IF NOT EXISTS rtrl.reward_arrival ON CLUSTER rtrl_cluster AS SELECT
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
                        (SELECT groupArray(tuple(version, promoted_at)) FROM rtrl.promotions FINAL)
                    )
                )
            ) - r.policy_version
        ) AS versions_behind
    FROM rtrl.rewards AS r FINAL
    WHERE NOT r.provisional
)
GROUP BY reward_version, task_kind;
CREATE VIEW IF NOT EXISTS rtrl.provisional_vs_final ON CLUSTER rtrl_cluster AS SELECT
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
FROM (SELECT * FROM rtrl.rewards FINAL) AS f
GLOBAL LEFT JOIN (SELECT * FROM rtrl.provisional_rewards FINAL) AS p
    ON p.trajectory_id = f.trajectory_id AND p.reward_version = f.reward_version
GROUP BY reward_version, task_kind;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (16, '0016_long_loop_views.sql', '72f55532533c6bb7749007713b446fbec6ac07994726787fe88da55e731f921a', now64(3));

-- 0017_adapters.sql
ALTER TABLE rtrl.batches_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS adapter LowCardinality(String) DEFAULT '' AFTER delayed;
ALTER TABLE rtrl.batches ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS adapter LowCardinality(String) DEFAULT '' AFTER delayed;
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS adapter LowCardinality(String) DEFAULT '' AFTER delayed_truncated_fraction;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS adapter LowCardinality(String) DEFAULT '' AFTER delayed_truncated_fraction;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (17, '0017_adapters.sql', 'c085071df34bf089ad1234f86abfd1f9b59b6f471afcf1d4b44ac032406c5d08', now64(3));

-- 0018_adapter_checkpoints.sql
ALTER TABLE rtrl.checkpoints_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS org LowCardinality(String) AFTER reward_checksum;
ALTER TABLE rtrl.checkpoints ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS org LowCardinality(String) AFTER reward_checksum;
ALTER TABLE rtrl.checkpoints_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS base_version Nullable(Int64) AFTER org;
ALTER TABLE rtrl.checkpoints ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS base_version Nullable(Int64) AFTER org;
CREATE TABLE IF NOT EXISTS rtrl.adapter_checkpoints_local ON CLUSTER rtrl_cluster
AS rtrl.checkpoints_local
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', created_at)
ORDER BY (org, version);
CREATE TABLE IF NOT EXISTS rtrl.adapter_checkpoints ON CLUSTER rtrl_cluster AS rtrl.adapter_checkpoints_local
ENGINE = Distributed(rtrl_cluster, rtrl, adapter_checkpoints_local, cityHash64(org, version));
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (18, '0018_adapter_checkpoints.sql', '98b39566fe3f41fc6fb168a5f519bfe7ecb96fb7e1b34bc05e96a9dbabe5a9f3', now64(3));

-- 0019_rollout_adapter_version.sql
ALTER TABLE rtrl.rollouts_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS adapter_version Int64 DEFAULT 0 AFTER created_at;
ALTER TABLE rtrl.rollouts ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS adapter_version Int64 DEFAULT 0 AFTER created_at;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (19, '0019_rollout_adapter_version.sql', '246795af1a36d256008f64de074d946e9810a6b62df73cebc9553ed8115dc869', now64(3));

-- 0020_batch_adapter_versions.sql
ALTER TABLE rtrl.batches_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS adapter_versions Array(Int64) AFTER adapter;
ALTER TABLE rtrl.batches ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS adapter_versions Array(Int64) AFTER adapter;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (20, '0020_batch_adapter_versions.sql', 'f18adf3174c39a32f84463b719b5f9692174bedd6a95c5f6afcf2a1aa88865b8', now64(3));

-- 0021_batch_served_org.sql
ALTER TABLE rtrl.batches_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS served_org LowCardinality(String) DEFAULT '' AFTER adapter_versions;
ALTER TABLE rtrl.batches ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS served_org LowCardinality(String) DEFAULT '' AFTER adapter_versions;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (21, '0021_batch_served_org.sql', 'c3abfc5538f5907596f026a2867836d64afabfdb2856d1ab5c901ddbe9f2f3e3', now64(3));

-- 0022_train_served_through.sql
ALTER TABLE rtrl.train_metrics_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS served_through_tokens UInt64 DEFAULT 0 AFTER adapter;
ALTER TABLE rtrl.train_metrics ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS served_through_tokens UInt64 DEFAULT 0 AFTER adapter;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (22, '0022_train_served_through.sql', '5a93e708746a94064f50b8d6a9442cbdfb185478dd6a9d1adb2d0ee70d5fcfc3', now64(3));

-- 0023_data_use.sql
ALTER TABLE rtrl.events_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use LowCardinality(Nullable(String)) AFTER task_kind;
ALTER TABLE rtrl.events ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use LowCardinality(Nullable(String)) AFTER task_kind;
ALTER TABLE rtrl.rollouts_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use LowCardinality(String) DEFAULT 'train' AFTER adapter_version;
ALTER TABLE rtrl.rollouts ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use LowCardinality(String) DEFAULT 'train' AFTER adapter_version;
ALTER TABLE rtrl.rewards_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use LowCardinality(String) DEFAULT 'train' AFTER provisional;
ALTER TABLE rtrl.rewards ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use LowCardinality(String) DEFAULT 'train' AFTER provisional;
ALTER TABLE rtrl.trajectories_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use LowCardinality(String) DEFAULT 'train' AFTER user_hash;
ALTER TABLE rtrl.trajectories ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use LowCardinality(String) DEFAULT 'train' AFTER user_hash;
ALTER TABLE rtrl.batches_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use Array(LowCardinality(String)) AFTER served_org;
ALTER TABLE rtrl.batches ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS data_use Array(LowCardinality(String)) AFTER served_org;
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (23, '0023_data_use.sql', '19e939986d3f1b289cf9b2c0da57c34b315c23f38ed622ce848b1e4438651e12', now64(3));

-- 0024_erasures.sql
CREATE TABLE IF NOT EXISTS rtrl.erasures_local ON CLUSTER rtrl_cluster
(
    erasure_id LowCardinality(String),
    subject_kind LowCardinality(String),
    subject LowCardinality(String),
    status LowCardinality(String),
    counts Map(LowCardinality(String), UInt64),
    lineage Array(LowCardinality(String)),
    at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
ORDER BY (erasure_id, at);
CREATE TABLE IF NOT EXISTS rtrl.erasures ON CLUSTER rtrl_cluster AS rtrl.erasures_local
ENGINE = Distributed(rtrl_cluster, rtrl, erasures_local, cityHash64(erasure_id));
CREATE TABLE IF NOT EXISTS rtrl.erased_trajectories_local ON CLUSTER rtrl_cluster
(
    erasure_id LowCardinality(String),
    trajectory_id String
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
ORDER BY (erasure_id, trajectory_id);
CREATE TABLE IF NOT EXISTS rtrl.erased_trajectories ON CLUSTER rtrl_cluster AS rtrl.erased_trajectories_local
ENGINE = Distributed(rtrl_cluster, rtrl, erased_trajectories_local, cityHash64(erasure_id, trajectory_id));
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (24, '0024_erasures.sql', '2dc95c5ea40cd310e33f2156905656fcdb0221baefb650c679d5d6cce06a0b1e', now64(3));

-- 0025_secret_findings.sql
ALTER TABLE rtrl.events_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS detector LowCardinality(Nullable(String));
ALTER TABLE rtrl.events ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS detector LowCardinality(Nullable(String));
ALTER TABLE rtrl.events_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS location LowCardinality(Nullable(String));
ALTER TABLE rtrl.events ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS location LowCardinality(Nullable(String));
ALTER TABLE rtrl.events_local ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS char_offset Nullable(UInt32);
ALTER TABLE rtrl.events ON CLUSTER rtrl_cluster ADD COLUMN IF NOT EXISTS char_offset Nullable(UInt32);
CREATE VIEW IF NOT EXISTS rtrl.secret_findings ON CLUSTER rtrl_cluster AS SELECT ts, trajectory_id, org_id, policy_version, detector, location, char_offset
FROM rtrl.events
WHERE type = 'secret_found';
INSERT INTO rtrl.schema_migrations SETTINGS insert_distributed_sync = 1 VALUES (25, '0025_secret_findings.sql', '23bd6ff5c629d30c01f5508de5d2c0156bbfddf5eebc74c0caa0daa845e46fcb', now64(3));
