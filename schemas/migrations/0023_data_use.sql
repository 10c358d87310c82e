-- Data-use classes (issue 38): every trajectory carries what rtrl may do with it (schemas.data_use). The SDK sets
-- it on trajectory_started, the reward flow carries it to the trajectory's rewards and summary, the SDK to its
-- rollouts, and the batch flow records per sample what it decided. Rows written before this migration read as
-- train, what rtrl did with every trajectory before.
ALTER TABLE {db}.events ADD COLUMN IF NOT EXISTS data_use LowCardinality(Nullable(String)) AFTER task_kind;
ALTER TABLE {db}.rollouts ADD COLUMN IF NOT EXISTS data_use LowCardinality(String) DEFAULT 'train' AFTER adapter_version;
ALTER TABLE {db}.rewards ADD COLUMN IF NOT EXISTS data_use LowCardinality(String) DEFAULT 'train' AFTER provisional;
ALTER TABLE {db}.trajectories ADD COLUMN IF NOT EXISTS data_use LowCardinality(String) DEFAULT 'train' AFTER user_hash;
ALTER TABLE {db}.batches ADD COLUMN IF NOT EXISTS data_use Array(LowCardinality(String)) AFTER served_org;
