-- rtrl tables, version 1. {db} is replaced by the clickhouse.database setting.
-- Replayed rows replace themselves: each table is a ReplacingMergeTree on its natural key,
-- so at-least-once sinks give exactly-once results when read with FINAL.

-- Raw events for analysts and backfill; a duplicate event_id replaces itself.
CREATE TABLE IF NOT EXISTS {db}.events
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
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (trajectory_id, event_id);

-- Rollouts sampled by the policy server.
CREATE TABLE IF NOT EXISTS {db}.rollouts
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
ENGINE = ReplacingMergeTree
ORDER BY trajectory_id;

-- One row per (trajectory, reward version); the highest revision wins.
CREATE TABLE IF NOT EXISTS {db}.rewards
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
ENGINE = ReplacingMergeTree(revision)
ORDER BY (trajectory_id, reward_version);

-- Audit log of the micro-batches published to the trainer.
CREATE TABLE IF NOT EXISTS {db}.batches
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
ENGINE = ReplacingMergeTree
ORDER BY batch_id;

-- Checkpoint lifecycle; the latest status of a version wins.
CREATE TABLE IF NOT EXISTS {db}.checkpoints
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
ENGINE = ReplacingMergeTree(created_at)
ORDER BY version;

-- Rejected input with the reason; never silently dropped.
CREATE TABLE IF NOT EXISTS {db}.dead_letters
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
ENGINE = ReplacingMergeTree
ORDER BY (source, partition, offset, kind);

-- Behaviour of each closed trajectory (any reward version); the highest revision wins.
CREATE TABLE IF NOT EXISTS {db}.trajectories
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
ENGINE = ReplacingMergeTree(revision)
ORDER BY trajectory_id;
