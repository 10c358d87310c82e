-- The batch flow's running counters per cohort (cumulative; the row with the newest clock is current).
CREATE TABLE IF NOT EXISTS {db}.batch_stats
(
    cohort LowCardinality(String),
    samples UInt64,
    batches UInt64,
    counts Map(LowCardinality(String), UInt32),
    lag_accepted Map(LowCardinality(String), UInt32),
    lag_dropped Map(LowCardinality(String), UInt32),
    clock DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(clock)
ORDER BY cohort;
