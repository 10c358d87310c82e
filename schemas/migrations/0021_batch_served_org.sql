-- adapters.shared_traffic = "served" (issue 17): a micro-batch names the org whose adapter versions its
-- adapter_versions count, so the shared-policy trainer can train it through the adapter that served it. Rows
-- written before this migration hold '' (no sample served by an adapter).
ALTER TABLE {db}.batches ADD COLUMN IF NOT EXISTS served_org LowCardinality(String) DEFAULT '' AFTER adapter_versions;
