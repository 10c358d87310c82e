-- The reward version each piece of training used (issue 15): micro-batches carry it, each trainer step records
-- it, and each checkpoint records it with its checksum (table reward_versions). It changes only between cycles.
-- Rows written before this migration hold ''.
ALTER TABLE {db}.batches ADD COLUMN IF NOT EXISTS reward_version LowCardinality(String) AFTER policy_versions;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS reward_version LowCardinality(String) AFTER mismatch_max_abs_log_ratio;
ALTER TABLE {db}.checkpoints ADD COLUMN IF NOT EXISTS reward_version LowCardinality(String) AFTER export_sha256;
ALTER TABLE {db}.checkpoints ADD COLUMN IF NOT EXISTS reward_checksum String AFTER reward_version;
