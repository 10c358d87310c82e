-- Trainer metrics, one row per optimizer step; a step replayed after a resume replaces itself.
CREATE TABLE IF NOT EXISTS {db}.train_metrics
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
ENGINE = ReplacingMergeTree
ORDER BY (run_id, step);
