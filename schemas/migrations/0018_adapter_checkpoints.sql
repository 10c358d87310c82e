-- Per-organisation LoRA adapters (issue 17) are gated, promoted and rolled back per org: each decision on
-- rtrl.deployments names the org, the adapter version and the shared (base) version it runs on. Adapter decisions
-- live in their own table, keyed by (org, version), so every query on checkpoints keeps meaning the shared policy;
-- checkpoints gets the same two columns (always '' and NULL there) so both tables hold the same record.
ALTER TABLE {db}.checkpoints ADD COLUMN IF NOT EXISTS org LowCardinality(String) AFTER reward_checksum;
ALTER TABLE {db}.checkpoints ADD COLUMN IF NOT EXISTS base_version Nullable(Int64) AFTER org;

CREATE TABLE IF NOT EXISTS {db}.adapter_checkpoints AS {db}.checkpoints
ENGINE = ReplacingMergeTree(created_at)
ORDER BY (org, version);
