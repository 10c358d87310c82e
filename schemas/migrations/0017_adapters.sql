-- Per-organisation LoRA adapters (issue 17): a micro-batch names the org whose adapter it trains (the
-- adapter-batches topic), and each trainer step the adapter it trained. Rows written before this migration, and
-- everything the shared policy trains, hold '' (the shared policy).
ALTER TABLE {db}.batches ADD COLUMN IF NOT EXISTS adapter LowCardinality(String) DEFAULT '' AFTER delayed;
ALTER TABLE {db}.train_metrics ADD COLUMN IF NOT EXISTS adapter LowCardinality(String) DEFAULT '' AFTER delayed_truncated_fraction;
