-- Delayed rewards train, with correction, instead of being dropped (issue 16): a micro-batch marks its delayed
-- samples (policy lag over train.max_policy_lag, within train.max_delayed_lag), and each trainer step separates
-- on-policy, near-on-policy and delayed tokens and records the delayed ones' lags. Rows written before this
-- migration hold [] / 0 / {} (no sample delayed).
ALTER TABLE {db}.batches ADD COLUMN IF NOT EXISTS delayed Array(Bool) AFTER reward_version;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS near_policy_fraction Float64 AFTER reward_version;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS delayed_fraction Float64 AFTER near_policy_fraction;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS delayed_tokens UInt64 AFTER delayed_fraction;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS delayed_mean_lag Float64 AFTER delayed_tokens;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS delayed_lag_histogram Map(LowCardinality(String), UInt32) AFTER delayed_mean_lag;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS delayed_truncated_fraction Float64 AFTER delayed_lag_histogram;
